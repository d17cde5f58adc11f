"""The native runtime's linear layers over plain weight tensors (bfloat16, int8 or float), each
giving output rows that are bitwise independent of how many rows a call holds, and one decoder
layer's weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verispec.runtime.native import bf16_kernels
from verispec.runtime.native.attention import INVARIANT_MAX

log = logging.getLogger("verispec")


class Linear:
    """y = x W^T + b, in one of these forms, each giving output rows that are bitwise
    independent of how many rows the call holds:
    - on a CPU with AVX512-BF16 (bfloat16 activations): verispec's own kernel (kernels.cpp,
      on AMX tiles where the CPU has them), weights packed once into tile order, bfloat16 or
      int8 (`int8=True`: one fp32 scale per output channel, widened to bfloat16 tile by tile),
      as fast for 16 rows as for one;
    - bfloat16 on other CPUs: prepacked once into oneDNN's blocked layout (faster than
      F.linear re-packing the weights every call, and nearly flat in the row count);
    - int8 on other CPUs: torch's weight-only int8 kernel, which goes row by row (pays for
      1-row steps, loses for wide verification passes);
    - anything else: F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.packed, self.scales = weight, bias, None, None
        self.tiles = None  # [ceil(N/32), K/2, 32, 2]: the AMX kernel's layout
        self.tile_scales = torch.empty(0)  # [N] fp32 for int8 tiles
        cpu_bf16 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        if int8 and not cpu_bf16:
            raise ValueError("int8 weights need bfloat16 activations on the CPU")
        self.kernels = bf16_kernels.load() if cpu_bf16 and weight.shape[1] % 32 == 0 else None
        if int8:
            scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
            self.weight = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(
                torch.int8)
            self.scales = scales.to(torch.bfloat16)
            if self.kernels is not None:
                self.tile_scales = scales.contiguous()
        if self.kernels is not None:
            self.tiles = self.kernels.pack(self.weight)
            self.bias = torch.empty(0) if bias is None else bias.float().contiguous()
            self.weight = None
        elif cpu_bf16 and not int8:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.weight = None  # the packed copy replaces it
            except (RuntimeError, AttributeError):
                self.packed = None
        # Calls of fewer rows are padded to this many (see _fewest_rows); the kernel's rows
        # are independent by construction, and there is no bitwise promise outside bf16.
        self.min_rows = _fewest_rows(self) if cpu_bf16 and self.tiles is None else 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:  # [M, K] -> [min_rows, K], zero rows after
            padded = x.new_zeros(self.min_rows, x.shape[1])
            padded[:x.shape[0]] = x
            return self._product(padded)[:x.shape[0]]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return self.kernels.linear(x, self.tiles, self.bias, self.tile_scales,
                                       self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


_ROWS_PROBED: dict[tuple, int] = {}


def _fewest_rows(linear: Linear) -> int:
    """Probe (once per kind and shape of layer): the fewest rows from which every call gives a
    row the same bits whatever the other rows are, checked up to INVARIANT_MAX rows and at a few
    wider batches; calls of fewer rows are then padded to it. Which kernel oneDNN picks can
    depend on the row count: on an AMD EPYC (Zen 5) a bf16 layer with K = 1536 rounds a lone
    row differently from 2..256 rows, which made a decode step and a verification pass disagree
    on greedy tokens. For bf16 layers on the CPU outside verispec's kernels."""
    kind = "packed" if linear.packed is not None else "int8" if linear.scales is not None else "F"
    key = (kind, linear.out_features, linear.in_features, linear.bias is not None)
    if key not in _ROWS_PROBED:
        generator = torch.Generator().manual_seed(0)
        widest = 64
        x = torch.randn(widest, linear.in_features, generator=generator).to(torch.bfloat16)
        counts = [*range(1, INVARIANT_MAX + 1), 24, 32, widest]
        with torch.inference_mode():
            together = linear._product(x)
            # every row, in calls of m rows: a differing sum shows only where it crosses a
            # bfloat16 rounding boundary, so one row is too few to see it
            same = [all(torch.equal(linear._product(x[first:first + m]),
                                    together[first:first + m])
                        for first in range(0, widest - m + 1, m)) for m in counts]
        fewest = next((counts[i] for i in range(len(counts)) if all(same[i:])), None)
        if fewest is None or fewest > INVARIANT_MAX:
            log.warning("native runtime: a %s layer [%d x %d] rounds rows differently with the "
                        "row count; greedy speculative output may differ from plain decoding",
                        kind, linear.out_features, linear.in_features)
            fewest = 1
        _ROWS_PROBED[key] = fewest
    return _ROWS_PROBED[key]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [H], in the model's dtype
    qkv: Linear  # H -> (nh + 2 nkv) d
    out: Linear  # nh d -> H
    mlp_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H
