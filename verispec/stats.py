"""Acceptance metrics of one generation, returned to the caller as data."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from verispec.theory import expected_tokens


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What a generation cost and how well the draft agreed with the target.

    checked counts the draft tokens actually compared with the target: those after the first
    rejection of a round are dropped unseen. tokens_per_forward (tau) is new tokens per
    verification round (the first round's pass holds the prompt's last chunk; a long prompt's
    earlier chunks verify nothing and are not counted); expected_tokens is the formula
    (1 - a^(k+1)) / (1 - a) at the measured acceptance rate a and the configured k.
    """

    k: int
    new_tokens: int
    target_forwards: int
    drafted: int
    checked: int
    accepted: int
    acceptance_rate: float
    per_position_acceptance: list[float]
    per_position_accepted: list[int]  # the counts behind per_position_acceptance
    per_position_checked: list[int]
    tokens_per_forward: float
    expected_tokens: float
    mean_k: float  # draft tokens per round
    ttft_s: float
    wall_s: float
    tokens_per_s: float
    verify: str = "greedy"  # what verified the drafts: greedy, block, token or invariant
    # Predicted Outputs: the prediction's length, and how many of its tokens the output copied
    # (appeared in it, each once: `prediction.copied_tokens`); the rest:
    # rejected_prediction_tokens, as OpenAI counts them
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0
    # prompt tokens whose keys and values a cache already held (an earlier request's on the
    # same runner: `verispec.scheduler`), not computed again; OpenAI's cached_tokens
    cached_prompt_tokens: int = 0
    # By kind of proposal ("model", "lookup", "prediction"): the rounds it drafted, its tokens
    # verified (a tree: its depth) and accepted
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def rejected_prediction_tokens(self) -> int:
        return self.prediction_tokens - self.accepted_prediction_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "rejected_prediction_tokens": self.rejected_prediction_tokens}


@dataclass(slots=True)
class StatsRecorder:
    """Accumulates per-round counts during a generation."""

    k: int | str
    verify: str = "greedy"
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0
    cached_prompt_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    new_tokens: int = 0
    target_forwards: int = 0
    rounds_by_draft_length: dict[int, int] = field(default_factory=dict)
    position_checked: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    def record_source(self, source: int, num_drafted: int, num_accepted: int) -> None:
        """A verified draft's kind (Draft.source: 0 a draft model, > 0 a lookup, < 0 a
        prediction) and its counts."""
        if not num_drafted:
            return
        kind = "model" if source == 0 else "lookup" if source > 0 else "prediction"
        counts = self.sources.setdefault(kind, {"rounds": 0, "drafted": 0, "accepted": 0})
        counts["rounds"] += 1
        counts["drafted"] += num_drafted
        counts["accepted"] += num_accepted

    def record_round(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """One verification round: num_drafted proposed, num_accepted passed, num_emitted kept
        (num_accepted + 1, or fewer when EOS or the token budget cut the round short)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.target_forwards += 1
        lengths = self.rounds_by_draft_length
        lengths[num_drafted] = lengths.get(num_drafted, 0) + 1
        self.new_tokens += num_emitted
        num_checked = min(num_accepted + 1, num_drafted)
        while len(self.position_checked) < num_checked:
            self.position_checked.append(0)
            self.position_accepted.append(0)
        for position in range(num_checked):
            self.position_checked[position] += 1
            self.position_accepted[position] += int(position < num_accepted)

    def finish(self) -> GenerationStats:
        wall_s = time.perf_counter() - self.started
        checked = sum(self.position_checked)
        accepted = sum(self.position_accepted)
        rate = accepted / checked if checked else 0.0
        rounds = max(self.target_forwards, 1)
        drafted = sum(k * n for k, n in self.rounds_by_draft_length.items())
        return GenerationStats(
            k=self.k,
            new_tokens=self.new_tokens,
            target_forwards=self.target_forwards,
            drafted=drafted,
            checked=checked,
            accepted=accepted,
            acceptance_rate=rate,
            per_position_acceptance=[
                a / c for a, c in zip(self.position_accepted, self.position_checked, strict=True)
            ],
            per_position_accepted=list(self.position_accepted),
            per_position_checked=list(self.position_checked),
            tokens_per_forward=self.new_tokens / rounds,
            expected_tokens=sum(expected_tokens(rate, k) * n
                                for k, n in self.rounds_by_draft_length.items()) / rounds,
            mean_k=drafted / rounds,
            ttft_s=(self.first_token_at or time.perf_counter()) - self.started,
            wall_s=wall_s,
            tokens_per_s=self.new_tokens / wall_s if wall_s > 0 else 0.0,
            verify=self.verify,
            prediction_tokens=self.prediction_tokens,
            accepted_prediction_tokens=min(self.accepted_prediction_tokens,
                                           self.prediction_tokens),
            cached_prompt_tokens=self.cached_prompt_tokens,
            sources={kind: dict(counts) for kind, counts in self.sources.items()},
        )
