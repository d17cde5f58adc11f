"""Quantized GGUF models at the file's own bit width.

- `gguf`: reading a GGUF file (metadata, tensors as views of the memory-mapped file).
- `model`: `GGUFModel`, the configuration from the metadata and the embedding/head tables.
- `linear`: the layers the native runtime computes with (`QuantMatrix`, `QuantLinear`).
- `kernels`: C++ products on the file's blocks; `fallback`: the same in PyTorch ops.
"""
