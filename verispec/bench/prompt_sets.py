"""Benchmark prompts: Spec-Bench's JSONL format, or a small built-in set written for verispec."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    question_id: str
    category: str
    text: str  # the user message; the chat template is applied when encoding
    prediction: str | None = None  # Predicted Outputs: the expected output (edit sets)


# Prompt sets shipped with verispec, by name (`verispec bench --prompts code`): code written
# for the Qwen2.5-Coder pair (functions, fixes, tests, explanations in several languages), and
# code edits whose prediction is the file being edited.
BUILTIN_SETS = {name: Path(__file__).parent / "data" / f"{name}.jsonl"
                for name in ("code", "edits")}


def prompts_path(name_or_path: str | Path) -> Path:
    """A shipped set's name, or a Spec-Bench-format JSONL path."""
    return BUILTIN_SETS.get(str(name_or_path), Path(name_or_path))


def load_jsonl(path: Path, per_category: int, seed: int, limit: int | None = None
               ) -> list[BenchPrompt]:
    """Spec-Bench format: one {"question_id", "category", "turns": [...]} per line; turns[0] is
    the user message. Samples `per_category` questions per category with `seed`, categories in
    order of first appearance."""
    by_category: dict[str, list[BenchPrompt]] = defaultdict(list)
    with Path(path).open("rb") as file:  # decoded line by line: an error names its line
        for line_number, raw in enumerate(file, 1):
            if not raw.strip():
                continue
            try:
                prompt = _question(json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_number}: not UTF-8 ({err.reason} at byte "
                                 f"{err.start} of the line)") from None
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
                raise ValueError(f"{path}:{line_number}: not a Spec-Bench question ({err})"
                                 ) from None
            by_category[prompt.category].append(prompt)
    if not by_category:
        raise ValueError(f"{path}: no questions in it")
    rng = random.Random(seed)
    chosen = []
    for rows in by_category.values():
        chosen.extend(rng.sample(rows, min(per_category, len(rows))))
    return chosen[:limit] if limit else chosen


def _question(row) -> BenchPrompt:
    """One Spec-Bench line's question: an object whose turns are a list of strings, the first
    not empty (the user message), and whose prediction, if any, is a string."""
    if not isinstance(row, dict):
        raise TypeError(f"a line is an object, got {type(row).__name__}")
    turns, prediction = row["turns"], row.get("prediction")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise TypeError("turns must be a list of strings")
    if not turns[0].strip():
        raise ValueError("its first turn is empty")
    if prediction is not None and not isinstance(prediction, str):
        raise TypeError("prediction must be a string")
    return BenchPrompt(str(row["question_id"]), str(row["category"]), turns[0], prediction)


def builtin_prompts(per_category: int = 2, limit: int | None = None) -> list[BenchPrompt]:
    """A small prompt set written for verispec (not Spec-Bench), one or two per category."""
    chosen = []
    for category, texts in BUILTIN.items():
        for i, text in enumerate(texts[:per_category]):
            chosen.append(BenchPrompt(f"builtin-{category}-{i}", category, text))
    return chosen[:limit] if limit else chosen


_PASSAGE = (
    "The town council met on Monday to discuss the new cycling lanes on Market Street. "
    "Residents said the lanes made the street safer for children walking to school, but shop "
    "owners worried that removing parking spaces would reduce the number of customers. The "
    "council agreed to run a six-month trial, to count visitors to the shops every week, and "
    "to vote again in the spring once the numbers are in."
)

BUILTIN: dict[str, list[str]] = {
    "summarization": [
        f"Summarize the following text in two sentences.\n\n{_PASSAGE}",
        "Summarize: The library will close for renovation from June to August. During that "
        "time, books can be returned at the community centre, and the online catalogue stays "
        "open. The reopened library will have a larger children's section and a quiet study "
        "room on the second floor.",
    ],
    "rag": [
        f"Answer the question using only the document.\n\nDocument: {_PASSAGE}\n\nQuestion: "
        "How long is the trial, and what will the council count during it?",
        "Context: Mount Kilimanjaro is a dormant volcano in Tanzania. Its highest peak, Uhuru, "
        "is 5,895 metres above sea level. Most climbers take five to eight days to reach the "
        "summit.\n\nQuestion: How high is Uhuru, and in which country is the mountain?",
    ],
    "extraction": [
        "Extract every person's name and age from this text as a JSON list: Alice is 31 and "
        "works as a nurse, Bob is 27 and studies law, and Carol, who is 45, teaches music.",
        "List the dates and events in this note as bullet points: On March 3 the team "
        "kicked off the project. On April 10 the first prototype was shown. On May 22 the "
        "product was released.",
    ],
    "translation": ["Translate into French: The weather is nice today, so we will walk to "
                    "the park after lunch.",
                    "Translate into German: Where is the train station?"],
    "coding": ["Write a Python function that checks whether a string is a palindrome.",
               "Write a SQL query that returns the ten most recent orders from a table "
               "named orders."],
    "math": ["What is 17 multiplied by 23? Show your working.",
             "Solve for x: 3x + 7 = 22."],
    "qa": ["What is the capital of Australia?", "Why is the sky blue?"],
    "writing": ["Write a short, friendly email inviting a colleague to lunch on Friday.",
                "Write a four-line poem about autumn leaves."],
}
