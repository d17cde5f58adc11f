"""Attention in the native runtime's PyTorch loop, and rotary embeddings.

Batch invariance: in decode and verification passes (up to INVARIANT_MAX positions) a query at
position p attends over the keys 0..L(p)-1, L(p) = p + 1 rounded up to KEY_BLOCK, with the keys
after p masked, whatever else the pass holds: one attention call for the queries that share an
L, and a one-token step is the case of one query. Whether the attention kernel's rows are then
independent of how many rows a call holds is probed when a model is built
(`rows_are_independent`: true for bfloat16 on oneDNN CPUs, not for float32); where the probe
fails, queries attend one by one over exactly their own keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from verispec.runtime.native.cache import KVCache
    from verispec.runtime.native.shape import LlamaShape

INVARIANT_MAX = 16  # passes up to this many positions attend batch-invariantly
KEY_BLOCK = 64  # such passes attend over keys padded to a multiple of this, the rest masked


@dataclass(frozen=True, slots=True)
class QueryGroup:
    """Queries first..last-1 of a short pass, which attend over the first `keys` cached
    positions with `mask` [group * (last - first), keys] hiding each one's future."""

    first: int
    last: int
    keys: int
    mask: torch.Tensor


def padded_keys(length: int, max_positions: int) -> int:
    """The key length a query at position length-1 attends over in a short pass."""
    return min(-(-length // KEY_BLOCK) * KEY_BLOCK, max_positions)



def attention_plan(start: int, length: int, shape: LlamaShape, grouped: bool,
                   device: torch.device | None = None, prompts: bool = False
                   ) -> list[QueryGroup] | None:
    """How a short pass's queries attend (see the module docstring): the groups of queries
    that share a padded key length, each with its mask; None for a prompt pass, or where
    queries must go one by one (grouped False: the probe failed). prompts: a prompt pass is
    planned too, its groups cut every INVARIANT_MAX queries (what the probe checked), so each
    of its queries gets the bits a short pass gives it."""
    if (length > INVARIANT_MAX and not prompts) or not grouped:
        return None
    group = shape.num_heads // shape.num_kv_heads
    positions = torch.arange(start, start + length, device=device)  # [T]
    keys = [padded_keys(p + 1, shape.max_positions) for p in range(start, start + length)]
    plan, first = [], 0
    for last in range(1, length + 1):
        if last == length or keys[last] != keys[first] or last - first == INVARIANT_MAX:
            allowed = torch.arange(keys[first], device=device) <= positions[first:last, None]
            mask = allowed.expand(group, -1, -1).reshape(-1, keys[first])  # [group Tg, L]
            plan.append(QueryGroup(first, last, keys[first], mask))
            first = last
    return plan


def attend(q: torch.Tensor, cache: KVCache, index: int, start: int, end: int,
           plan: list[QueryGroup] | None) -> torch.Tensor:
    """q [nh, T, d] -> [nh, T, d], causal over layer `index` of the cache up to `end`."""
    keys, values = cache.keys[index], cache.values[index]  # [nkv, capacity, d]
    heads, length, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # A query's heads that share a KV head ride as `group` rows of that head: no copies of
    # keys. 4-d inputs take the fused CPU kernel (3-d ones fall back to the unfused math
    # path, several times slower).
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, nkv, capacity, d]
    grouped = q.view(kv_heads, group, length, dim)
    if plan is not None:  # padded, masked, the queries of one key length together
        return torch.cat([
            F.scaled_dot_product_attention(
                grouped[:, :, part.first:part.last].reshape(1, kv_heads, -1, dim),
                keys[:, :, :part.keys], values[:, :, :part.keys], attn_mask=part.mask
            ).view(heads, part.last - part.first, dim)
            for part in plan], dim=1)
    if length <= INVARIANT_MAX:  # one by one, each over exactly its own keys
        return attend_each_query(q, cache, index, start)
    # A prompt pass: one causal call over every head (4-d, so the fused flash kernel runs;
    # a 3-d call took the unfused math path: 15 s instead of ~1 s for 1,334 positions).
    keys = keys[:, :, :end].repeat_interleave(group, dim=1)  # [1, nh, end, d]
    values = values[:, :, :end].repeat_interleave(group, dim=1)
    if start == 0:
        return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values,
                                              is_causal=True)[0]
    mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(start)
    return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=mask)[0]


def attend_each_query(q: torch.Tensor, cache: KVCache, index: int, start: int) -> torch.Tensor:
    """q [nh, T, d] at positions start.. -> [nh, T, d]: each query alone over exactly its own
    keys (one call a query: its bits do not depend on the pass, whatever the dtype)."""
    keys, values = cache.keys[index].unsqueeze(0), cache.values[index].unsqueeze(0)
    heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(kv_heads, heads // kv_heads, length, dim)
    return torch.cat([
        F.scaled_dot_product_attention(
            grouped[None, :, :, t], keys[:, :, :start + t + 1],
            values[:, :, :start + t + 1]).view(heads, 1, dim)
        for t in range(length)], dim=1)


def attend_tree(q: torch.Tensor, cache: KVCache, base: int, index: int,
                paths: list[list[int]], positions: list[int], grouped: bool) -> torch.Tensor:
    """q [nh, T, d] -> [nh, T, d] for a tree row (slots from `base` on hold the tree; each new
    slot's path and position given): each query alone, over keys laid out as the chain to it
    would hold them (slots 0..base-1, then its path's slots), padded and masked as that
    chain's query would be, so it gets the chain's bits."""
    heads, _, dim = q.shape
    kv_heads = cache.keys.shape[1]
    out = []
    for t, (path, position) in enumerate(zip(paths, positions, strict=True)):
        end = position + 1
        plan = attention_plan(position, 1, cache.shape, grouped, q.device)
        keys_to = end if plan is None else plan[0].keys
        keys, values = cache.keys[index, :, :keys_to], cache.values[index, :, :keys_to]
        if path:  # the path's keys where the chain keeps them, after slot base - 1
            at = torch.tensor(path, device=keys.device)
            keys, values = keys.clone(), values.clone()
            keys[:, base:end], values[:, base:end] = cache.keys[index][:, at], \
                cache.values[index][:, at]
        one = q[:, t].reshape(1, kv_heads, -1, dim)  # [1, nkv, group, d]
        mask = None if plan is None else plan[0].mask
        out.append(F.scaled_dot_product_attention(
            one, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask
        ).view(heads, 1, dim))
    return torch.cat(out, dim=1)


def rope_tables(shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, d] float32: full-width tables with the sign of the rotated half
    folded in, so that rotate(x) = x * cos + swap_halves(x) * sin."""
    half = shape.head_dim // 2
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(shape.max_positions, dtype=torch.float64), inv_freq)
    return (torch.cat([angles.cos(), angles.cos()], -1).float(),
            torch.cat([-angles.sin(), angles.sin()], -1).float())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' half-split convention, in x's dtype as transformers
    computes it: x [..., T, heads, d], cos/sin [T, d] from `rope_tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos.unsqueeze(1), swapped, sin.unsqueeze(1))


def rows_are_independent(dtype: torch.dtype, device: torch.device, head_dim: int,
                          group: int) -> bool:
    """Probe: does the attention kernel give each query row the same bits whether the call holds
    it alone or with up to INVARIANT_MAX others (padded keys, masked)? Random inputs, a few
    positions on both sides of a KEY_BLOCK boundary; a few milliseconds. (float32 on CPU fails
    it: 11 queries of a 3-head group, 33 rows, round differently from 16.)"""
    generator = torch.Generator().manual_seed(0)
    kv_heads, capacity, count = 2, 3 * KEY_BLOCK, INVARIANT_MAX

    def random(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device)

    keys, values = random(1, kv_heads, capacity, head_dim), random(1, kv_heads, capacity, head_dim)
    with torch.inference_mode():
        for start in (0, KEY_BLOCK - INVARIANT_MAX, KEY_BLOCK + 5):
            queries = random(kv_heads, group, count, head_dim)
            length = padded_keys(start + count, capacity)
            allowed = torch.arange(length, device=device) <= torch.arange(
                start, start + count, device=device)[:, None]  # [T, L]
            inputs = (queries, keys[:, :, :length], values[:, :, :length], allowed)
            together = _probe_attend(*inputs, 0, count)
            for first in range(count):  # each query alone, and every number of rows
                if not (torch.equal(_probe_attend(*inputs, first, first + 1),
                                    together[:, :, first:first + 1])
                        and torch.equal(_probe_attend(*inputs, 0, first + 1),
                                        together[:, :, :first + 1])):
                    return False
    return True


def _probe_attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  allowed: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Queries first..last-1 of queries [nkv, group, T, d] in one call -> [nkv, group, Tg, d]."""
    kv_heads, group, _, head_dim = queries.shape
    mask = allowed[first:last].expand(group, -1, -1).reshape(-1, allowed.shape[1])
    out = F.scaled_dot_product_attention(
        queries[:, :, first:last].reshape(1, kv_heads, -1, head_dim), keys, values,
        attn_mask=mask)
    return out.view(kv_heads, group, last - first, head_dim)
