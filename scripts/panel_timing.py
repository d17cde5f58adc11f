"""Time the panel products alone, by activation row count, on a model's real weights.

    VERISPEC_KERNELS=avx2 python scripts/panel_timing.py [MODEL] [--rows 1,2,3,4,5,8,9] [--reps 30]

One thread, each weight kind of the first layer (and the head) multiplied into R rows, the
fastest of --reps calls: what a kernel change moves, apart from the rest of a pass. Compare two
builds by running this from each checkout in turn, several times, and quote the fastest times.
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from verispec.loading import load  # noqa: E402
from verispec.runtime.native.gguf_model import gguf_runner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a model name or .gguf file "
                        "(default: the embedded SmolLM2-135M)")
    parser.add_argument("--rows", default="1,2,3,4,5,8,9")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load(args.model, dtype="auto", dequantize="auto")
    gguf_runner(model)  # builds the native model (its panels) where the kernels run
    layer = model.native.layers[0]
    linears = {"qkv": layer.qkv, "out": layer.out, "gate_up": layer.gate_up, "down": layer.down,
               "head": model.native.lm_head}
    print(f"{'rows':>4} " + " ".join(f"{name:>14}" for name in linears) + "   (ms, fastest)")
    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        for linear in linears.values():
            x = torch.randn(rows, linear.in_features)
            linear(x)
            times = []
            for _ in range(args.reps):
                began = time.perf_counter()
                linear(x)
                times.append(time.perf_counter() - began)
            cells.append(f"{min(times) * 1e3:14.3f}")
        print(f"{rows:>4} " + " ".join(cells))


if __name__ == "__main__":
    main()
