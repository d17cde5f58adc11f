"""Batched throughput: verispec's speculative methods against its own plain batched decoding.

For each batch size B the prompts are cut into chunks of Q*B (Q = `queue`); every chunk is
decoded by every method with the engine at max_batch=B (`SpeculativeDecoder.generate(list,
max_batch=B)`), methods rotated chunk by chunk so machine noise hits them alike. Q = 1 gives
static batches, where a batch runs until its slowest row ends (speculative rows end at
different rounds, so a batch pays for its slowest one); Q > 1 is continuous batching, where a
row that ends is replaced from the queue, as in the server. Throughput is all generated tokens
over all wall time; with static batches also after each batch's first token (decode), where
long prompts' passes would otherwise hide what the methods change in decoding.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from verispec.bench.interleave import rotated
from verispec.params import SamplingParams


def run_batch_bench(methods, prompt_ids: list[list[int]], batch_sizes: tuple[int, ...],
                    params: SamplingParams, progress: bool = True, queue: int = 1) -> dict:
    """methods: VerispecMethod objects (their decoders), baseline first -> results by B."""
    results: dict = {"batch_sizes": list(batch_sizes), "queue": queue, "by_batch": {}}
    total = sum(len(range(0, len(prompt_ids), b * queue)) for b in batch_sizes) * len(methods)
    bar = tqdm(total=total, desc="batch bench", unit="batch", disable=not progress,
               file=sys.stderr)
    for batch in batch_sizes:
        size = batch * queue
        chunks = [prompt_ids[i:i + size] for i in range(0, len(prompt_ids), size)]
        # 1. Warm-up at this batch size, and the cost models of every batch size a shrinking
        #    batch passes through (measured once per size, and once for the verify modes of
        #    a method and K, which share them), outside the timed runs.
        for method in methods:
            decoder = method.decoder
            if decoder.k == "auto" and decoder.drafter is not None:
                for size in decoder.config.cost_batch_sizes:
                    if size <= batch:
                        decoder.cost_table.measure(size)
            decoder.generate(chunks[0][:batch], SamplingParams(max_new_tokens=8,
                                                                ignore_eos=True),
                             max_batch=batch)
            # what the warm-up and the smaller batches wrote for these very prompts is not
            # proposed to the timed runs (a suffix lookup would copy the answers)
            method.forget_text()
        totals = {m.name: dict(new_tokens=0, wall_s=0.0, accepted=0, checked=0, equal=0,
                               compared=0, decode_tokens=0, decode_s=0.0) for m in methods}
        # 2. Every chunk by every method, rotated.
        for c, chunk in enumerate(chunks):
            outputs = {}
            for method in rotated(methods, c):
                bar.set_postfix_str(f"B={batch}: {method.name}")
                start = time.perf_counter()
                outputs[method.name] = method.decoder.generate(chunk, method.params(params),
                                                               max_batch=batch)
                wall = time.perf_counter() - start
                entry = totals[method.name]
                entry["wall_s"] += wall
                entry["new_tokens"] += sum(len(o.token_ids) for o in outputs[method.name])
                entry["accepted"] += sum(o.stats.accepted for o in outputs[method.name])
                entry["checked"] += sum(o.stats.checked for o in outputs[method.name])
                # after the first token: from the batch's first first token (every row joined
                # at the start), so no token is counted whose time is not; a longer prompt's
                # last chunks fall inside the window, alike for every method
                entry["decode_s"] += wall - min(o.stats.ttft_s for o in outputs[method.name])
                entry["decode_tokens"] += sum(max(0, len(o.token_ids) - 1)
                                              for o in outputs[method.name])
                bar.update()
            reference = [o.token_ids for o in outputs[methods[0].name]]
            for method in methods[1:]:
                got = [o.token_ids for o in outputs[method.name]]
                totals[method.name]["equal"] += sum(a == b for a, b in zip(got, reference,
                                                                          strict=True))
                totals[method.name]["compared"] += len(chunk)
        # 3. Throughput and its ratio to plain batched decoding at this batch size.
        base = totals[methods[0].name]
        base_rate = base["new_tokens"] / base["wall_s"]
        decoded = {name: _decode_rate(e, queue) for name, e in totals.items()}
        base_decode = decoded[methods[0].name]
        results["by_batch"][batch] = {
            name: dict(new_tokens=e["new_tokens"], wall_s=e["wall_s"],
                       tokens_per_s=e["new_tokens"] / e["wall_s"],
                       speedup=e["new_tokens"] / e["wall_s"] / base_rate,
                       decode_tokens_per_s=decoded[name],
                       decode_speedup=None if not base_decode or decoded[name] is None
                       else decoded[name] / base_decode,
                       acceptance_rate=e["accepted"] / e["checked"] if e["checked"] else None,
                       greedy_equal_to_baseline=(f"{e['equal']}/{e['compared']}"
                                                 if e["compared"] and params.greedy else None))
            for name, e in totals.items()}
    bar.close()
    return results


def _decode_rate(totals: dict, queue: int) -> float | None:
    """Tokens a second after each static batch's first token; None under continuous batching
    (rows join mid-run: no single point where prompts end and decoding begins)."""
    if queue != 1 or totals["decode_s"] <= 0.0:
        return None
    return totals["decode_tokens"] / totals["decode_s"]


def write_batch_outputs(results: dict, out) -> None:
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    cfg, machine = results["config"], results["machine"]
    header = [
        "# verispec bench: batched",
        "",
        f"{results['prompts_count']} prompts, {cfg['max_new_tokens']} new tokens, temperature "
        f"{cfg['temperature']}, K {', '.join(map(str, cfg['ks']))}, verispec on "
        f"{machine['runtime']}, {machine['torch_threads']} threads, torch {machine['torch']}, "
        f"{machine['processor']} x{machine['cpu_count']}."]
    notes = [f"\nNote: {note}" for note in results.get("notes", [])]
    text = "\n".join(header + render_batch_markdown(results["batch"]) + notes) + "\n"
    (out / "report.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    by_batch = results["batch"]["by_batch"]
    sizes = list(by_batch)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in by_batch[sizes[0]]:
        ax.plot(sizes, [by_batch[b][name]["tokens_per_s"] for b in sizes], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s (all rows)")
    ax.set_title("Throughput against batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_by_batch.png", dpi=120)
    plt.close(fig)


def render_batch_markdown(batch: dict) -> list[str]:
    queue = batch.get("queue", 1)
    how = ("each chunk of B prompts decoded as one static batch" if queue == 1 else
           f"continuous batching: chunks of {queue}*B prompts queued, B rows at a time, a row "
           "that ends replaced from the queue")
    decode = any(e.get("decode_tokens_per_s") is not None  # static batches only
                 for methods in batch["by_batch"].values() for e in methods.values())
    lines = ["", "## Batched throughput", "",
             f"Total generated tokens/s, {how}; speedup over verispec's plain batched decoding "
             "at the same batch size B."
             + (" Decode: tokens/s after each batch's first token (the prompts' passes before "
                "it left out)." if decode else ""), "",
             "| batch size | method | tokens/s | speedup | "
             + ("decode tokens/s | decode speedup | " if decode else "")
             + "acceptance | greedy = baseline |",
             "|---|---|---|---|---|---|" + ("---|---|" if decode else "")]
    for size, methods in batch["by_batch"].items():
        for name, e in methods.items():
            acceptance = "–" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.2f}"
            decoded = ""
            if decode:
                rate, ratio = e.get("decode_tokens_per_s"), e.get("decode_speedup")
                decoded = (f"{'–' if rate is None else f'{rate:.1f}'} | "
                           f"{'–' if ratio is None else f'{ratio:.2f}'} | ")
            lines.append(f"| {size} | {name} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f} | "
                         f"{decoded}{acceptance} | {e['greedy_equal_to_baseline'] or '–'} |")
    return lines
