"""Aggregate benchmark records into per-method metrics; write results.json, report.md, plots.

Every written record carries its provenance (verispec.bench.provenance: the machine, the commit,
the command line) in results.json and at the head of report.md."""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from pathlib import Path

from verispec.bench.provenance import markdown_lines, provenance
from verispec.theory import expected_tokens

log = logging.getLogger("verispec")

REFERENCE = {"verispec": "baseline", "hf": "hf-baseline", "llama.cpp": "llama.cpp"}


def summarise(records: list[dict], methods, ks) -> dict:
    """Per method, overall and per category: tokens/s, speedup over the same runtime's
    baseline (aggregate, and the median of per-prompt ratios), acceptance, tau, formula."""
    categories = list(dict.fromkeys(r["category"] for r in records))
    out = {"methods": {}, "categories": categories}
    for method in methods:
        mine = [r for r in records if r["method"] == method.name]
        reference = REFERENCE[method.runtime]
        ref = [r for r in records if r["method"] == reference]
        entry = {"runtime": method.runtime, "k": getattr(getattr(method, "decoder", None), "k",
                                                         None),
                 "overall": metrics(mine, ref),
                 "by_category": {c: metrics([r for r in mine if r["category"] == c],
                                            [r for r in ref if r["category"] == c])
                                 for c in categories}}
        equal = [r["equal_to_baseline"] for r in mine if r["equal_to_baseline"] is not None]
        if equal:
            entry["greedy_equal_to_baseline"] = f"{sum(equal)}/{len(equal)}"
        out["methods"][method.name] = entry
    out["prompts"] = records
    return out


def metrics(rows: list[dict], reference_rows: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    result = dict(prompts=len(rows), new_tokens=tokens, wall_s=wall,
                  tokens_per_s=tokens / wall if wall else 0.0,
                  tokens_per_forward=tokens / forwards if forwards else None,
                  speedup=None, median_speedup=None, acceptance_rate=None,
                  expected_tokens=None, per_position_acceptance=None, mean_k=None)
    ref_by_prompt = {r["question_id"]: r for r in reference_rows}
    if reference_rows:
        ref_tokens = sum(r["new_tokens"] for r in reference_rows)
        ref_wall = sum(r["wall_s"] for r in reference_rows)
        result["speedup"] = result["tokens_per_s"] / (ref_tokens / ref_wall)
        ratios = [(r["new_tokens"] / r["wall_s"])
                  / (ref_by_prompt[r["question_id"]]["new_tokens"]
                     / ref_by_prompt[r["question_id"]]["wall_s"])
                  for r in rows if r["question_id"] in ref_by_prompt]
        result["median_speedup"] = statistics.median(ratios) if ratios else None
    checked_rows = [r for r in rows if r.get("checked") is not None]
    if checked_rows:
        checked = sum(r["checked"] for r in checked_rows)
        accepted = sum(r["accepted"] for r in checked_rows)
        gamma = accepted / checked if checked else 0.0
        result["acceptance_rate"] = gamma
        # The formula per prompt at the pooled gamma, weighted by each prompt's rounds.
        result["expected_tokens"] = (sum(expected_at(r, gamma) * r["target_forwards"]
                                         for r in checked_rows) / forwards if forwards else None)
        result["mean_k"] = (sum(r["mean_k"] * r["target_forwards"] for r in checked_rows)
                            / forwards if forwards else None)
        result["per_position_acceptance"] = pooled_positions(checked_rows)
    decode_rate = _decode_rate(rows)
    if decode_rate is not None:  # after the first token: what drafting changes
        result["decode_tokens_per_s"] = decode_rate
        reference_rate = _decode_rate(reference_rows)
        result["decode_speedup"] = decode_rate / reference_rate if reference_rate else None
    sources: dict[str, dict[str, int]] = {}
    for r in rows:
        for kind, counts in (r.get("sources") or {}).items():
            pooled = sources.setdefault(kind, {"rounds": 0, "drafted": 0, "accepted": 0})
            for name in pooled:
                pooled[name] += counts[name]
    if sources:
        result["sources"] = sources
    predicted = [r for r in rows if r.get("accepted_prediction") is not None]
    if predicted:
        result["accepted_prediction_tokens"] = sum(r["accepted_prediction"] for r in predicted)
        result["rejected_prediction_tokens"] = sum(r["rejected_prediction"] for r in predicted)
    return result


def _decode_rate(rows: list[dict]) -> float | None:
    """Tokens a second after each prompt's first token (rows that timed it), pooled."""
    timed = [r for r in rows if r.get("ttft_s") is not None]
    if not timed or len(timed) < len(rows):
        return None
    seconds = sum(r["wall_s"] - r["ttft_s"] for r in timed)
    tokens = sum(max(0, r["new_tokens"] - 1) for r in timed)
    return tokens / seconds if seconds > 0 else None


def expected_at(row: dict, gamma: float) -> float:
    """The formula at gamma for a prompt whose rounds drafted mean_k tokens on average,
    interpolating between the neighbouring integers."""
    k = row["mean_k"] or 0.0
    low = int(k)
    frac = k - low
    return (1 - frac) * expected_tokens(gamma, low) + frac * expected_tokens(gamma, low + 1)


def pooled_positions(rows: list[dict]) -> list[float]:
    accepted, checked = defaultdict(int), defaultdict(int)
    for r in rows:
        for i, (a, c) in enumerate(zip(r["per_position_accepted"], r["per_position_checked"],
                                       strict=True)):
            accepted[i] += a
            checked[i] += c
    return [accepted[i] / checked[i] for i in sorted(checked) if checked[i]]


def write_outputs(results: dict, out: Path) -> None:
    """results.json, report.md and the plots into `out`; adds results["provenance"] (this
    process's machine, commit and command line) unless the caller recorded it already."""
    results.setdefault("provenance", provenance())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "report.md").write_text(render_markdown(results))
    try:
        from verispec.bench.plots import write_plots
    except ImportError:
        log.warning("matplotlib is not installed: plots skipped (pip install 'verispec[bench]')")
        return
    write_plots(results, out)


def _fmt(value, spec=".2f") -> str:
    return "–" if value is None else format(value, spec)


def render_markdown(results: dict) -> str:
    cfg, machine = results["config"], results["machine"]
    lines = ["# verispec bench", ""]
    if results.get("provenance"):
        lines += [*markdown_lines(results["provenance"]), ""]
    lines += [
        f"{len({r['question_id'] for r in results['prompts']})} prompts "
        f"({', '.join(results['categories'])}), {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}, K {', '.join(map(str, cfg['ks']))}, "
        f"verispec on {machine.get('runtime', machine['dtype'])}, "
        + (f"transformers (hf-*) on {machine.get('hf_dtype', machine['dtype'])}, "
           if any(name.startswith("hf-") for name in results["methods"]) else "")
        + f"{machine['torch_threads']} threads, "
        f"torch {machine['torch']}, transformers {machine['transformers']}, "
        f"{machine['processor']} x{machine['cpu_count']}. Methods ran interleaved prompt by "
        "prompt after one warm-up each; speedup is tokens/s over the same runtime's baseline "
        "(aggregate, and the median of per-prompt ratios).",
        "",
        "| method | tokens/s | speedup | median speedup | acceptance | tokens/forward | "
        "formula | mean K | greedy = baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["methods"].items():
        o = entry["overall"]
        lines.append(
            f"| {name} | {o['tokens_per_s']:.1f} | {_fmt(o['speedup'])} | "
            f"{_fmt(o['median_speedup'])} | {_fmt(o['acceptance_rate'])} | "
            f"{_fmt(o['tokens_per_forward'])} | {_fmt(o['expected_tokens'])} | "
            f"{_fmt(o['mean_k'], '.1f')} | {entry.get('greedy_equal_to_baseline', '–')} |")
    decoded = {name: e["overall"] for name, e in results["methods"].items()
               if e["overall"].get("decode_tokens_per_s") is not None}
    if decoded:
        kinds = ("model", "lookup", "prediction")
        lines += ["", "## Decoding after the first token, and each kind of proposal", "",
                  "Acceptance by kind: accepted / verified draft tokens (rounds it drafted).",
                  "", "| method | decode tokens/s | decode speedup | "
                  + " | ".join(kinds) + " |", "|---|---|---|" + "---|" * len(kinds)]
        for name, o in decoded.items():
            cells = []
            for kind in kinds:
                counts = (o.get("sources") or {}).get(kind)
                cells.append("–" if not counts else
                             f"{counts['accepted'] / counts['drafted']:.2f} "
                             f"({counts['rounds']})")
            lines.append(f"| {name} | {o['decode_tokens_per_s']:.1f} | "
                         f"{_fmt(o.get('decode_speedup'))} | " + " | ".join(cells) + " |")
    lines += ["", "## Speedup by category", "",
              "| category | " + " | ".join(results["methods"]) + " |",
              "|---|" + "---|" * len(results["methods"])]
    for category in results["categories"]:
        cells = [_fmt(e["by_category"][category]["speedup"]) for e in results["methods"].values()]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines += ["", "## Tokens/s by category", "",
              "| category | " + " | ".join(results["methods"]) + " |",
              "|---|" + "---|" * len(results["methods"])]
    for category in results["categories"]:
        cells = [f"{e['by_category'][category]['tokens_per_s']:.1f}"
                 for e in results["methods"].values()]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    if results.get("costs"):
        lines += ["", "## Measured cost model", ""]
        for name, cost in results["costs"].items():
            curve = " ".join(f"{v:.2f}" for v in cost["verify"])
            short, long = cost.get("contexts", (128, None))
            at_long = ""
            if cost.get("long_verify"):
                at_long = (f"; after {long} tokens "
                           + " ".join(f"{v:.2f}" for v in cost["long_verify"]))
            if cost.get("long_draft_step") is not None:
                at_long += f" (c = {cost['long_draft_step']:.3f})"
            if cost.get("sampling_step"):
                at_long += f"; sampled rows +{cost['sampling_step']:.3f} a drafted token"
            if cost.get("draft_catch_up_s"):
                at_long += (f"; the draft reads a token it lags by in "
                            f"{cost['draft_catch_up_s'] * 1e3:.2f} ms")
            shared = cost.get("methods", [name])
            if shared != [name]:  # the verify modes of one method and K price rounds alike
                name = f"{name} (shared by {', '.join(shared)})"
            lines.append(f"- {name}: draft step c = {cost['draft_step']:.3f}; verify v(1..n) = "
                         f"{curve} after {short} tokens{at_long}; one target step = "
                         f"{cost['target_step_s'] * 1e3:.1f} ms")
    for note in results.get("notes", []):
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"
