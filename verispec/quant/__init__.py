"""Quantized GGUF models at the file's own bit width.

- `gguf`: reading a GGUF file (metadata, tensors as views of the memory-mapped file).
- `quantized_model`: `GGUFModel`, the configuration from the metadata and the embedding/head
  tables.
- `linear`: the layers the native runtime computes with (`QuantMatrix`, `QuantLinear`).
- `quant_kernels`: C++ products on the file's blocks (their sources in `kernels/`); `fallback`:
  the same in PyTorch ops.
"""
