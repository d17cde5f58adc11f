"""The benchmark's figures (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from verispec.theory import expected_tokens  # noqa: E402


def write_plots(results: dict, out: Path) -> None:
    speculative = {n: e for n, e in results["methods"].items()
                   if n not in ("baseline", "hf-baseline")}
    _speedup_by_category(results["categories"], speculative, out / "speedup_by_category.png")
    _acceptance_by_position(speculative, out / "acceptance_by_position.png")
    _tau_vs_gamma(results["prompts"], speculative, out / "tokens_per_forward_vs_gamma.png")


def _speedup_by_category(categories, methods, path) -> None:
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * 1.1), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, (name, entry) in enumerate(methods.items()):
        values = [entry["by_category"][c]["speedup"] or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))])
    ax.set_xticklabels(categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over the runtime's plain decoding")
    _legend(ax, 8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _acceptance_by_position(methods, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entry in methods.items():
        rates = entry["overall"]["per_position_acceptance"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / checked)")
    ax.set_ylim(0, 1.02)
    _legend(ax, 8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tau_vs_gamma(records, methods, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    grid = [i / 100 for i in range(101)]
    for k in (1, 3, 5, 8):
        ax.plot(grid, [expected_tokens(g, k) for g in grid], linestyle="--", linewidth=0.8,
                label=f"formula, K={k}")
    for name in methods:
        points = [(r["accepted"] / r["checked"], r["new_tokens"] / r["target_forwards"])
                  # llama.cpp's speculative runs report no pass count (0): not plotted
                  for r in records if r["method"] == name and r.get("checked")
                  and r.get("target_forwards")]
        if points:
            ax.scatter(*zip(*points, strict=True), s=14, label=f"{name} (per prompt)")
    ax.set_xlabel("measured acceptance rate γ")
    ax.set_ylabel("tokens per target forward τ")
    _legend(ax, 7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend(ax, fontsize: int) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)
