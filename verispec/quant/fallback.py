"""GGUF blocks in PyTorch ops: dequantisation and products, where verispec's C++ kernels
(`verispec.quant.quant_kernels`) are not available. Correct and slow: every product expands its
weight to float32 first.

Dequantisation follows the `gguf` package's reference (`gguf.quants`) operation for operation
in float32, so its values are the same bits (tests/test_gguf.py). The block layouts, per block
of 32 (or 256 for the K types) weights, bytes in order:
- Q8_0: fp16 d, 32 int8 q; w = d q.
- Q4_0: fp16 d, 16 bytes of nibbles (low nibbles weights 0..15, high 16..31); w = d (q - 8).
- Q4_1: fp16 d, fp16 m, nibbles as Q4_0; w = d q + m.
- Q5_0: fp16 d, 32 bits of fifth bits, nibbles; w = d (q - 16).
- Q5_1: fp16 d, fp16 m, fifth bits, nibbles; w = d q + m.
- Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes
  of nibbles (each 32 bytes: low nibbles one sub-block, high the next); w = (d sc) q - dmin m.
- Q5_K: as Q4_K plus 32 bytes of fifth bits before the nibbles (bit j of byte i: weight i of
  sub-block j).
- Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (sub-blocks of 16),
  fp16 d; w = (d sc) (q - 32).
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def dequantize(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """weight [N, row_bytes] uint8 (the file's blocks) -> [N, K] float32."""
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"no PyTorch dequantisation for {qtype.name}")
    block, size = GGML_QUANT_SIZES[qtype]
    rows, row_bytes = weight.shape
    if row_bytes % size:
        raise ValueError(f"{qtype.name} rows are whole blocks of {size} bytes, got {row_bytes}")
    blocks = weight.reshape(-1, size)  # [N * K / block, size]
    return _DEQUANTIZE[qtype](blocks).reshape(rows, row_bytes // size * block)


def get_rows(weight: torch.Tensor, qtype: GGMLQuantizationType, ids: torch.Tensor
             ) -> torch.Tensor:
    """Rows ids [T] of weight [N, row_bytes] -> [T, K] float32 (an embedding lookup)."""
    return dequantize(weight[ids], qtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """x [R, K] float32 times the dequantised weight [N, K], transposed -> [R, N] float32.

    One matrix-vector product per row: a GEMM's rounding may depend on how many rows it holds
    (its kernel changes with the row count), a per-row product's never does, so a row's result
    is the same bits alone or among others (batch invariance: speculative greedy output equals
    plain greedy)."""
    dense = dequantize(weight, qtype)  # [N, K]
    return torch.stack([torch.mv(dense, row) for row in x.float()])


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block -> [B, 1] float32."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[B, n, 16 or 32] bytes -> [B, n, 2 x width]: each group's low nibbles, then its high."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _fifth_bits(packed: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes (a little-endian 32-bit word) -> [B, 32] uint8 bits, weight i = bit i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed[:, :, None] >> shifts) & 1).reshape(-1, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 2:])[:, 0].to(torch.int8) - 8  # [B, 32]
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 4:])[:, 0].float()
    return _half(blocks, 0) * q + _half(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 6:])[:, 0] | (_fifth_bits(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 8:])[:, 0] | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [B, 12] -> the 8 sub-blocks' 6-bit scales and mins, [B, 8] each: sub-blocks 0-3
    in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11
    with their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(blocks[:, 4:16])
    scale = (_half(blocks, 0) * scales.float())[:, :, None]  # [B, 8, 1]
    offset = (_half(blocks, 2) * mins.float())[:, :, None]
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (scale * q - offset).reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(blocks[:, 4:16])
    scale = (_half(blocks, 0) * scales.float())[:, :, None]
    offset = (_half(blocks, 2) * mins.float())[:, :, None]
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8)[None, :, None]
    high = (blocks[:, None, 16:48] >> shifts) & 1  # [B, 8, 32]: bit j of byte i
    return (scale * (low | (high << 4)).float() - offset).reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 2, 4, 32)  # [B, half, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[None, None, :, None]
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 0x03  # [B, half, 4, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    scale = _half(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return (scale[:, :, None] * q).reshape(-1, 256)


_DEQUANTIZE = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
               Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
