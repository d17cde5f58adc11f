"""The sampled chain procedures (verify.chains: token-wise and block) on the CPU, in C++
(native.cpp): the same uniforms and decisions as the PyTorch reference, without its
~40 small tensor operations and [V] temporaries per call, and with block verification's
Z_i computed only where a coin needs it.

Built with the system compiler on first use (~1 s; plain C++, no PyTorch headers; cached by
verispec.kernel_build), loaded with ctypes. Where it cannot build, or with VERISPEC_KERNELS=0,
`load()` gives None and verify.chains runs its PyTorch code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from verispec import kernel_build

log = logging.getLogger("verispec")

SOURCE = Path(__file__).with_name("native.cpp")
# no -ffp-contract: each float32 product is rounded before its difference, as in PyTorch
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wno-psabi"]
METHOD_CODES = {"token": 0, "block": 1}


def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot run here."""
    return _build() if kernel_build.kernel_setting().enabled else None


@functools.cache
def _build() -> ctypes.CDLL | None:
    handle = kernel_build.build_library("verify_native", SOURCE, FLAGS,
                                        "verification: the C++ chain verifier")
    if handle is None:
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    handle.verify_chains.restype = integer
    handle.verify_chains.argtypes = [integer] * 4 + [pointer] * 11
    return handle


def runs(*tensors: torch.Tensor | None) -> bool:
    """Whether these distributions can be verified here: float32, contiguous, on the CPU, and
    the library built."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                             and t.is_contiguous()) for t in tensors) and load() is not None


def verify_chains(
    method: str,  # "token" or "block"
    draft_tokens: torch.Tensor,  # [G, W] long: row g's first num_draft[g] are real
    num_draft: torch.Tensor,  # [G] long
    coins: torch.Tensor,  # [G, W] float32
    next_uniform: torch.Tensor,  # [G, 1] float64
    target: torch.Tensor,  # [R, V] float32: the target rows of every position
    target_at: torch.Tensor,  # [G, W + 1] long: row g's p(. | x_<=i) is target[target_at[g, i]]
    draft: torch.Tensor | None,  # [R', V] float32, or None: point masses on the draft tokens
    draft_at: torch.Tensor | None,  # [G, W] long: row g's q(. | x_<=i) is draft[draft_at[g, i]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [G, W+1] long: the accepted prefix, the next token, -1 after; num_accepted [G]
    long; ok [G] bool: False where the next token's distribution has no positive mass, zeros
    or NaN, and then tokens hold 0 there). Raises ValueError for a draft token outside [0, V)."""
    handle = load()
    assert handle is not None, "call only where runs() says so"
    groups, width = draft_tokens.shape
    vocab = target.shape[1]

    def host(tensor, dtype):  # contiguous, in the type the C++ reads, kept alive by the caller
        return tensor.to(dtype=dtype).contiguous()

    tokens, lengths = host(draft_tokens, torch.int64), host(num_draft, torch.int64)
    coins, uniforms = host(coins, torch.float32), host(next_uniform, torch.float64)
    target_at = host(target_at, torch.int64)
    draft_at = None if draft is None else host(draft_at, torch.int64)
    out = torch.empty(groups, width + 1, dtype=torch.int64)
    accepted = torch.empty(groups, dtype=torch.int64)
    ok = torch.empty(groups, dtype=torch.bool)
    bad = handle.verify_chains(
        METHOD_CODES[method], groups, width, vocab, tokens.data_ptr(), lengths.data_ptr(),
        coins.data_ptr(), uniforms.data_ptr(), target.data_ptr(), target_at.data_ptr(),
        None if draft is None else draft.data_ptr(),
        None if draft_at is None else draft_at.data_ptr(), out.data_ptr(), accepted.data_ptr(),
        ok.data_ptr())
    if bad:
        raise ValueError(f"draft tokens must be in [0, {vocab}); row {bad - 1} has "
                         f"{draft_tokens[bad - 1, : int(num_draft[bad - 1])].tolist()}")
    return out, accepted, ok
