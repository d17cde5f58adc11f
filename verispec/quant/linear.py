"""GGUF weights as the native runtime's layers: a linear layer and an embedding table that keep
the file's blocks and compute from them.

`QuantMatrix` is one 2-D tensor of the file ([N, K] values: N rows of K), in its own format:
block types hold the file's bytes [N, row_bytes] (a view of the memory-mapped file),
F32/F16/BF16 hold the values; any other type is dequantised to bfloat16 when it is built, said
in a log line. `QuantLinear` is y = x W^T + b over one; indexing a `QuantMatrix` by ids gives
dequantised rows (the embedding lookup, and the head rows a feature draft reads).

Products run on `verispec.quant.quant_kernels` (C++, int8 activations per block) where it is built,
else in PyTorch (`verispec.quant.fallback`). Where the kernel path multiplies a type as panels
(the AVX2 and AVX-512 paths: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), a layer repacks its
weight once when it is built (a copy in memory the size of the file's tensor) and multiplies 16
outputs at a time. All are
batch-invariant: a row's result does not depend on how many rows share the call.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from verispec.quant import fallback
from verispec.quant.gguf import PLAIN_TYPES, GGUFTensor

log = logging.getLogger("verispec")

Q = GGMLQuantizationType


@functools.cache
def kernels() -> ModuleType | None:
    """verispec.quant.quant_kernels where its C++ path is built and on, else None (PyTorch)."""
    try:
        from verispec.quant import quant_kernels as module
    except ImportError:
        module = None
    if module is None or getattr(module, "path", "off") == "off":
        log.info("quantised weights: products in PyTorch (dequantised per call; slow)")
        return None
    return module


class QuantMatrix:
    """A 2-D tensor of the file, [N, K] values, kept in its own format (see the module doc).
    matrix[ids] -> float32 rows [len(ids), K]."""

    def __init__(self, tensor: GGUFTensor) -> None:
        if len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name} is {len(tensor.shape)}-D, a matrix is 2-D")
        self.name, self.shape = tensor.name, torch.Size(tensor.shape)
        if tensor.qtype in fallback.SUPPORTED or tensor.qtype in PLAIN_TYPES:
            self.qtype, self.data = tensor.qtype, tensor.data
        else:
            log.info("%s: %s has no verispec kernel; dequantised to bfloat16 at load",
                     tensor.name, tensor.qtype.name)
            values = reference_dequantize(np.asarray(tensor.data.numpy()), tensor.qtype)
            self.qtype, self.data = Q.BF16, torch.from_numpy(values).to(torch.bfloat16)

    # What the native runtime reads off an embedding table: rows come out in float32.
    dtype = torch.float32
    device = torch.device("cpu")

    @property
    def quantized(self) -> bool:
        return self.qtype not in PLAIN_TYPES

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __getitem__(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        if not self.quantized:
            return self.data[ids].float()
        module = kernels()
        if module is not None:
            return module.get_rows(self.data, self.qtype, ids)
        return fallback.get_rows(self.data, self.qtype, ids.reshape(-1)).reshape(
            *ids.shape, self.shape[1])

    def detach(self) -> QuantMatrix:
        return self

    def dequantize(self) -> torch.Tensor:
        """The whole matrix [N, K] float32 (a full-precision copy: tests and small tables)."""
        if not self.quantized:
            return self.data.float()
        module = kernels()
        if module is not None:
            return module.dequantize(self.data, self.qtype)
        return fallback.dequantize(self.data, self.qtype)

    def to(self, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """A dense copy (a draft model built on this table needs one)."""
        return self.dequantize().to(dtype=dtype or torch.float32, device=device)


class QuantLinear:
    """y = x W^T + b with W a QuantMatrix: x [R, K] -> [R, N] float32, each row's result the
    same bits alone or among others. Duck-types the native runtime's `Linear` (out_features,
    in_features; no AMX tiles, no int8 scales)."""

    tiles = None
    scales = None
    kernels = None

    def __init__(self, weight: QuantMatrix, bias: torch.Tensor | None = None,
                 order: torch.Tensor | None = None) -> None:
        """order [N]: output i is the product's output order[i] (bias in the product's order),
        for files whose rows are stored in another order than the runtime computes in."""
        self.weight, self.bias, self.order = weight, None if bias is None else bias.float(), order
        self.out_features, self.in_features = weight.shape
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"{weight.name}: bias {tuple(self.bias.shape)} for "
                             f"{self.out_features} outputs")
        # [N / 16, ...] uint8, or None: the file's layout. Panels hold the rows in `order`
        # (and the bias follows): a panel's outputs do not depend on which rows share it.
        self.panels = _panels(weight, order)
        if self.panels is not None and order is not None:
            self.bias = None if self.bias is None else self.bias[order].contiguous()
            self.order = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not weight.quantized:  # a plain tensor: per-row products, as the fallback's
            dense = weight.data.float()  # [N, K]
            y = torch.stack([torch.mv(dense, row) for row in x.float()])
        elif self.panels is not None:
            y = kernels().matmul_panels(x.float().contiguous(), self.panels, weight.qtype,
                                        self.in_features)
        elif (module := kernels()) is not None:
            y = module.matmul(x.float().contiguous(), weight.data, weight.qtype)
        else:
            y = fallback.matmul(x, weight.data, weight.qtype)
        if self.bias is not None:
            y = y + self.bias
        return y if self.order is None else y[:, self.order]


def _panels(weight: QuantMatrix, order: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weight's rows (in `order`, where given) repacked as panels of 16 rows where this
    CPU's kernel path multiplies its type that way (verispec/quant/kernels/panels.h), else
    None."""
    module = kernels()
    if (module is None or not weight.quantized or weight.shape[0] % 16
            or int(weight.qtype) not in module.panel_types()):
        return None
    rows = weight.data if order is None else weight.data[order].contiguous()
    return module.pack(rows, weight.qtype)


class ConcatLinear:
    """Several QuantLinear layers over the same input, outputs side by side: the runtime's fused
    q/k/v and gate/up projections without copying the file's tensors into one. Where every part
    is in panels of one type, keeps its rows' order and has a bias or none does, the panels are
    joined (they are copies already; each part keeps a view) and one product gives all outputs:
    a kernel call and a concatenation fewer per layer, which a small model's step feels. A
    panel's outputs do not depend on the other panels of the call: the same bits either way."""

    tiles = None
    scales = None
    kernels = None

    def __init__(self, parts: list[QuantLinear]) -> None:
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("concatenated layers must share their input width")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.panels, self.bias = None, None
        biased = {part.bias is not None for part in parts}
        if all(part.panels is not None and part.order is None for part in parts) and \
                len({part.weight.qtype for part in parts}) == 1 and len(biased) == 1:
            self.panels = torch.cat([part.panels for part in parts])  # [sum N / 16, bytes]
            start = 0
            for part in parts:  # each part keeps its rows, now a view of the joined copy
                part.panels = self.panels[start: start + len(part.panels)]
                start += len(part.panels)
            if biased == {True}:
                self.bias = torch.cat([part.bias for part in parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            return torch.cat([part(x) for part in self.parts], dim=1)  # [R, sum N]
        y = kernels().matmul_panels(x.float().contiguous(), self.panels,
                                    self.parts[0].weight.qtype, self.in_features)  # [R, sum N]
        return y if self.bias is None else y + self.bias
