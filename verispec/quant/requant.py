"""A GGUF draft's weights re-quantised to a cheaper block type, once, cached beside the models.

A draft only proposes tokens: the target decides every emitted one, so a draft whose weights
are coarser loses acceptance, never correctness. A decode step streams every weight from memory,
so a 0.5B draft of Q5_0 layers and a Q8_0 head (5.5 and 8.5 bits a weight) costs about 40%
less a step at Q4_0 (4.5 bits).

`requantized(file, qtype)` is the file with every block matrix wider than `qtype` (bits per
weight) re-quantised: dequantised by gguf-py's reference, quantised by its `quantize` (Q4_0,
Q4_1, Q5_0, Q8_0 there). The token embedding is left as it is (a step reads one row of it)
unless the head is tied to it. The result lives in $XDG_CACHE_HOME/verispec/models as one
safetensors file of the re-quantised tensors' bytes, keyed by the source's size and mtime, the
type and verispec's version: a changed source gets a new file, a stale one is never read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from safetensors.torch import save_file

from verispec import kernel_build
from verispec.config import DRAFT_QUANTS
from verispec.quant.gguf import GGUFFile, GGUFTensor
from verispec.version import installed_version

log = logging.getLogger("verispec")

Q = GGMLQuantizationType
# Types a draft may be re-quantised to: gguf-py quantises them, verispec's kernels multiply them.
TARGET_TYPES = {name: Q[name.upper()] for name in DRAFT_QUANTS}
FORMAT = 1


def bits_per_weight(qtype: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def parse_type(name: str | None) -> GGMLQuantizationType | None:
    """"q4_0" -> Q4_0; None / "none" -> None; anything else a ValueError."""
    if name is None or name == "none":
        return None
    if name.lower() not in TARGET_TYPES:
        raise ValueError(f"draft weights re-quantise to one of {', '.join(TARGET_TYPES)} or "
                         f"none, got {name!r}")
    return TARGET_TYPES[name.lower()]


def chosen(file: GGUFFile, qtype: GGMLQuantizationType, head: bool = True) -> list[str]:
    """The tensors `requantized` converts: block matrices wider than qtype whose rows fill its
    blocks; the embedding only where it is the head too; the head only where `head`."""
    tied = "output.weight" not in file.tensors
    head_name = "token_embd.weight" if tied else "output.weight"
    block = GGML_QUANT_SIZES[qtype][0]
    return [name for name, tensor in file.tensors.items()
            if tensor.quantized and len(tensor.shape) == 2 and tensor.shape[-1] % block == 0
            and bits_per_weight(tensor.qtype) > bits_per_weight(qtype)
            and (name != "token_embd.weight" or tied) and (head or name != head_name)]


def cache_path(file: GGUFFile, qtype: GGMLQuantizationType, root: Path,
               names: list[str]) -> Path:
    """Where the re-quantised tensors `names` of `file` live: keyed by its size, mtime, the
    type, the tensors and verispec's version."""
    stat = file.path.stat()
    key = json.dumps({"format": FORMAT, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "type": qtype.name, "tensors": sorted(names),
                      "verispec": installed_version()}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return root / f"{file.path.stem}.{qtype.name.lower()}-{digest}.safetensors"


def cache_root() -> Path:
    """$XDG_CACHE_HOME/verispec/models (beside the dequantised models' cache)."""
    return kernel_build.cache_folder("models")


def requantized(file: GGUFFile, qtype: GGMLQuantizationType, root: Path | None = None,
                head: bool = True) -> GGUFFile:
    """`file` with its wider block matrices in `qtype` (see the module docstring), read from
    the cache under `root` (default `cache_root()`) or converted and cached there first.
    head False: the output layer keeps the file's type."""
    names = chosen(file, qtype, head)
    if not names:
        return file
    path = cache_path(file, qtype, root or cache_root(), names)
    if not path.is_file():
        _convert(file, qtype, names, path)
    tensors = dict(file.tensors)
    with safe_open(path, framework="pt") as cached:
        for name in names:
            source = file.tensors[name]
            tensors[name] = GGUFTensor(name, qtype, source.shape, cached.get_tensor(name))
    return dataclasses.replace(file, tensors=tensors)


def _convert(file: GGUFFile, qtype: GGMLQuantizationType, names: list[str], path: Path
             ) -> None:
    log.info("re-quantising %d tensors of %s to %s once (cached in %s)", len(names),
             file.path.name, qtype.name, path)
    data = {}
    for name in names:
        source = file.tensors[name]
        values = dequantize(source.data.numpy(), source.qtype).reshape(source.shape)
        data[name] = torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(data, str(staging), metadata={"source": str(file.path), "type": qtype.name})
    staging.replace(path)  # atomic: a half-written cache is never read
