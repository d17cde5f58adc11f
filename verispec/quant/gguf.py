"""Reading a GGUF file without expanding it: metadata, and every tensor as a view of the file.

A GGUF file is a header (magic, version, counts), metadata key/values, a table of tensors
(name, dimensions fastest first, ggml type, offset), then the tensor data, aligned. `read`
parses the header and the table with `struct` over one memory map and leaves every tensor where
it lies: a weight of N rows is a uint8 tensor [N, row_bytes] of the file's own blocks (no copy;
pages come in when a kernel first reads them), a float tensor is a float tensor over the file.

Metadata string arrays (the vocabulary, the merges) are walked over, not decoded: the tokenizer
is built from them by transformers once and cached (`verispec.loading`). The `gguf` package's
own reader decodes every array element into Python objects (33 s and 0.7 GB for Qwen2.5's
vocabulary of 151,936 tokens on this machine), which is why this reader exists; the tests check
it against that reader tensor by tensor.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.errors import VerispecError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Metadata value types (GGUFValueType): the fixed-width ones as struct formats.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
PLAIN_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
               GGMLQuantizationType.BF16: torch.bfloat16}


class GGUFError(VerispecError, ValueError):
    """A file that is not a GGUF verispec can read: the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor as the file stores it. shape is in torch order ([N, K] for a weight of N output
    rows over K inputs). data: for a block type, uint8 [N, row_bytes] (a 1-D tensor: [row_bytes]),
    the file's bytes; for F32/F16/BF16, a tensor of that dtype and shape."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.quantized:
            block, size = GGML_QUANT_SIZES[self.qtype]
            if self.shape[-1] % block:
                raise GGUFError(f"tensor {self.name}: rows of {self.shape[-1]} values do not "
                                f"fill {self.qtype.name} blocks of {block}")
            expected = (*self.shape[:-1], self.shape[-1] // block * size)
            if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
                raise GGUFError(f"tensor {self.name}: {tuple(self.data.shape)} bytes, expected "
                                f"{expected}")
        elif tuple(self.data.shape) != self.shape:
            raise GGUFError(f"tensor {self.name}: data {tuple(self.data.shape)} for {self.shape}")

    @property
    def quantized(self) -> bool:
        return self.qtype not in PLAIN_TYPES


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, object]  # string arrays appear as their element count
    tensors: dict[str, GGUFTensor]
    tokenizer_key: str  # a hash of the tokenizer.* metadata bytes ('' when there are none)

    @property
    def architecture(self) -> str:
        value = self.metadata.get("general.architecture")
        if not isinstance(value, str):
            raise GGUFError(f"{self.path} has no general.architecture in its metadata")
        return value

    @property
    def quantized(self) -> bool:
        """Whether any tensor is stored in blocks (rather than F32/F16/BF16)."""
        return any(tensor.quantized for tensor in self.tensors.values())

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.metadata

    def arch_value(self, key: str, default=None):
        """metadata '{architecture}.{key}'."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name} has no tensor {name!r}")
        return self.tensors[name]


class _Cursor:
    """Reads little-endian values from the mapped file, with bounds checks that turn a short
    file into a GGUFError."""

    def __init__(self, blob: np.ndarray, path: Path) -> None:
        self.buffer, self.size, self.path, self.pos = memoryview(blob), blob.size, path, 0

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if size < 0 or end > self.size:
            self.truncated()
        view = self.buffer[self.pos:end]
        self.pos = end
        return view

    def truncated(self):
        raise GGUFError(f"{self.path} is truncated: its header runs past the end of the file "
                        f"({self.size} bytes)")

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a metadata string is not UTF-8 (a corrupt file?)"
                            ) from None

    def value(self, kind: int):
        """One metadata value; a string array is skipped over and stands as its length."""
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.scalar("I"), self.scalar("Q")
            if element in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[element]
                raw = self.take(count * struct.calcsize(fmt))
                return list(struct.unpack(f"<{count}{fmt}", raw))
            if element == _STRING:  # walked in a tight loop: a vocabulary has ~10^5 entries
                buffer, pos, unpack = self.buffer, self.pos, struct.Struct("<Q").unpack_from
                try:
                    for _ in range(count):
                        pos += 8 + unpack(buffer, pos)[0]
                except struct.error:
                    self.truncated()
                if pos > self.size:
                    self.truncated()
                self.pos = pos
                return count
            raise GGUFError(f"{self.path}: metadata array of unknown type {element}")
        raise GGUFError(f"{self.path}: metadata value of unknown type {kind} (a corrupt file?)")


def read(path: str | Path) -> GGUFFile:
    """Parse `path`'s header and tensor table; tensors stay in the file (memory-mapped)."""
    path = Path(path)
    try:
        # copy-on-write: writable arrays for torch.from_numpy; nothing writes, nothing is copied
        blob = np.memmap(path, mode="c", dtype=np.uint8)
    except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
        raise GGUFError(f"cannot map {path}: {err}") from None
    cursor = _Cursor(blob, path)
    if bytes(cursor.take(4)) != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    version = cursor.scalar("I")
    if version not in VERSIONS:
        raise GGUFError(f"{path} is GGUF version {version}; verispec reads versions "
                        f"{', '.join(map(str, VERSIONS))}")
    tensor_count, metadata_count = cursor.scalar("Q"), cursor.scalar("Q")
    # 1. Metadata; the raw bytes of the tokenizer's entries are hashed as they pass.
    metadata: dict[str, object] = {}
    tokenizer_digest, tokenizer_seen = hashlib.sha256(), False
    for _ in range(metadata_count):
        first = cursor.pos
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
        if key.startswith("tokenizer."):
            tokenizer_digest.update(blob[first:cursor.pos])
            tokenizer_seen = True
    # 2. The tensor table.
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        kind, offset = cursor.scalar("I"), cursor.scalar("Q")
        table.append((name, tuple(reversed(dims)), kind, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    # 3. Each tensor as a view of its bytes.
    tensors = {}
    for name, shape, kind, offset in table:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown ggml type {kind}") from None
        tensors[name] = _view(blob, path, name, qtype, shape, data_start + offset)
    key = tokenizer_digest.hexdigest()[:16] if tokenizer_seen else ""
    return GGUFFile(path, metadata, tensors, key)


def _view(blob: np.ndarray, path: Path, name: str, qtype: GGMLQuantizationType,
          shape: tuple[int, ...], start: int) -> GGUFTensor:
    block, size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block:
        raise GGUFError(f"{path}: tensor {name} {shape} does not fill {qtype.name} blocks")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row_bytes = shape[-1] // block * size
    end = start + rows * row_bytes
    if end > blob.size:
        raise GGUFError(f"{path} is truncated: tensor {name} ends at byte {end}, the file at "
                        f"{blob.size}")
    raw = torch.from_numpy(blob[start:end])  # a view of the file: no copy
    if qtype in PLAIN_TYPES:
        data = raw.view(PLAIN_TYPES[qtype]).view(shape)
    else:
        data = raw.view(*shape[:-1], row_bytes)
    return GGUFTensor(name, qtype, shape, data)
