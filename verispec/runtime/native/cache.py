"""One sequence's KV cache in the native runtime, and the token trees that sit in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.runtime.native.attention import padded_keys
from verispec.runtime.native.shape import LlamaShape


def check_taps(taps: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Tap layers name hidden states inside the stack: distinct layer counts in
    [1, num_layers - 1] (after all num_layers layers is the feature every cache keeps)."""
    taps = tuple(taps)
    if any(not isinstance(tap, int) or not 0 < tap < num_layers for tap in taps) \
            or len(set(taps)) < len(taps):
        raise ValueError(f"taps must be distinct layer counts inside the target's "
                         f"{num_layers} layers (1..{num_layers - 1}), got {taps}")
    return taps


class KVCache:
    """One sequence's keys and values, [layers, nkv, capacity, d] each, grown by doubling, and
    at every position the last hidden state (`features`) and, for each of `tap_layers`, the
    hidden state after that many layers (`taps`).

    Which positions are valid is the caller's business: rolling back is passing a smaller
    `start` next time, and the stale positions are written over."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: torch.device,
                 tap_layers: tuple[int, ...] = ()) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.tap_layers = check_taps(tap_layers, shape.num_layers)
        self.keys = self.values = None
        self.features = None  # [capacity, H]: each position's last hidden state, before the norm
        self.taps = None  # [capacity, n, H]: the hidden states after tap_layers, when any
        self.growth_limit: int | None = None  # positions it grows to at most (`limit_growth`)

    def limit_growth(self, positions: int | None) -> None:
        """Grow to at most `positions` (padded as passes attend) from now on, doubling below
        that (None: up to the context): what a memory bound priced the sequence at. A longer
        sequence is still taken, growing as without a limit."""
        self.growth_limit = None if positions is None else padded_keys(
            max(1, positions), self.shape.max_positions)

    def reserve(self, length: int) -> None:
        """Room for `length` positions and the padding short passes attend over."""
        if length > self.shape.max_positions:
            raise ValueError(f"sequence of {length} tokens exceeds the model's context of "
                             f"{self.shape.max_positions}")
        length = padded_keys(length, self.shape.max_positions)
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if length <= capacity:
            return
        limit = self.growth_limit
        ceiling = self.shape.max_positions if limit is None or length > limit else limit
        capacity = max(length, min(ceiling, max(2 * capacity, 256)))
        size = (self.shape.num_layers, self.shape.num_kv_heads, capacity, self.shape.head_dim)
        self.keys = self._grown(self.keys, size)
        self.values = self._grown(self.values, size)
        self.features = self._grown(self.features, (capacity, self.shape.hidden_size))
        if self.tap_layers:
            self.taps = self._grown(self.taps, (capacity, len(self.tap_layers),
                                                self.shape.hidden_size))

    @property
    def bytes_per_position(self) -> int:
        """The bytes one position takes: its keys and values in every layer, its features and
        taps."""
        s = self.shape
        values = s.num_layers * s.num_kv_heads * s.head_dim * 2 + s.hidden_size * (
            1 + len(self.tap_layers))
        return values * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """The bytes its buffers hold (grown to the longest sequence it has held)."""
        buffers = (self.keys, self.values, self.features, self.taps)
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Hold `source`'s first `length` positions (keys, values, features, taps), a cache of
        the same model with the same taps."""
        if source.tap_layers != self.tap_layers:
            raise ValueError(f"a cache keeping taps {source.tap_layers} cannot fill one "
                             f"keeping {self.tap_layers}")
        self.reserve(max(length, 1))
        span = slice(0, length)
        self.keys[:, :, span] = source.keys[:, :, span]
        self.values[:, :, span] = source.values[:, :, span]
        self.features[span] = source.features[span]
        if self.taps is not None:
            self.taps[span] = source.taps[span]

    def move(self, sources: list[int], to: int) -> None:
        """Copy the positions at slots `sources` (increasing, each >= its target) to slots
        to, to + 1, ...: a token tree's accepted path into its place in the sequence."""
        if not sources or sources == list(range(to, to + len(sources))):
            return
        at = torch.tensor(sources, device=self.device)
        span = slice(to, to + len(sources))
        self.keys[:, :, span], self.values[:, :, span] = self.keys[:, :, at], self.values[:, :, at]
        self.features[span] = self.features[at]
        if self.taps is not None:
            self.taps[span] = self.taps[at]

    def _grown(self, old: torch.Tensor | None, size: tuple[int, ...]) -> torch.Tensor:
        """A zeroed buffer of `size` holding `old`'s positions (the position axis is the one
        whose length differs)."""
        new = torch.zeros(size, dtype=self.dtype, device=self.device)
        if old is not None:
            new[tuple(slice(0, n) for n in old.shape)] = old
        return new


@dataclass(frozen=True, slots=True)
class TreeLinks:
    """A token tree in a cache: the slots from `base` on hold tree nodes, each the child of an
    earlier slot; slot base - 1 (the last token of the sequence) is the root. A node attends
    over slots 0..base-1 and then its ancestors and itself, in that order, so it sits at
    position base - 1 + depth and sees exactly the keys it would see in a chain."""

    base: int
    parents: torch.Tensor  # [slots - base] long: the parent slot of slot base + j (>= base - 1)

    def path(self, slot: int) -> list[int]:
        """The slots of a node's ancestors below the root, then its own: [s_1, ..., slot]."""
        path = []
        while slot >= self.base:
            path.append(slot)
            slot = int(self.parents[slot - self.base])
        if slot != self.base - 1:
            raise ValueError(f"tree node's root is slot {slot}, not {self.base - 1}")
        return path[::-1]
