"""What drafters and the scheduler may ask of a runner, and the prefix bookkeeping every runner
shares.

A runner is one sequence (batch 1) of a causal LM with its KV cache. `logits(ids, num_logits)`
keeps the cache in sync with any token sequence: it keeps the longest cached prefix that `ids`
shares (the rollback), feeds the rest in one forward pass and returns the logits of the last
`num_logits` positions. A speculative round is then
    target.logits(history + draft, num_logits=len(draft) + 1)
and the rejected draft tokens simply fall out of the cache at the next call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class Runner(Protocol):
    """The public face of a runner: everything a drafter, the engine or the scheduler calls.

    Many rows at once go through `verispec.runtime.batched_logits(runners, ...)`, which runs
    runners of one native model in a single pass and the others one by one.
    """

    device: torch.device
    vocab_size: int  # rows of the output embedding: the width of `logits`
    max_positions: int  # the longest sequence the model takes
    forward_calls: int  # forward passes run so far (a cost statistic, not a cache property)
    # Whether a position's keys, values and logits are the same bits however its sequence was
    # cut into passes (a whole prompt, chunks of any size, verification rows): then a cache that
    # another sequence left holds, for the prefix the two share, exactly what a fresh pass over
    # this one would write, and a later request may start from it (`verispec.scheduler`).
    exact_prefixes: bool

    @property
    def cached_ids(self) -> torch.Tensor:
        """[cached_length] long: the tokens whose keys and values the cache holds."""
        ...

    @property
    def cached_length(self) -> int: ...

    def logits(self, ids: torch.Tensor, num_logits: int = 1,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """ids [L] long -> logits [num_logits, V] of the last num_logits positions.
        parents [num_logits - 1]: the last num_logits - 1 ids form a token tree."""
        ...

    def rollback(self, length: int) -> None:
        """Drop the cached positions from `length` on."""
        ...

    def reset(self) -> None:
        """Forget the whole sequence."""
        ...

    def sibling(self) -> Runner:
        """Another sequence on the same weights, with its own empty cache."""
        ...

    def describe(self) -> str:
        """A short label of the runtime and dtype, e.g. "hf float32", "native bfloat16"."""
        ...

    def copy_prefix(self, source: Runner, length: int) -> None:
        """Forget the sequence and hold the first `length` cached positions of `source`, a
        sibling (runners with exact_prefixes only)."""
        ...

    @property
    def cache_bytes(self) -> int:
        """The memory its cache holds now, in bytes: kept after a reset where a runtime keeps
        its buffers for the next sequence (the native one), so a pool of runners may count it."""
        ...

    @property
    def bytes_per_position(self) -> int:
        """The memory one cached position takes (keys and values of every layer, and what
        else the runtime keeps per position), to price a sequence before it runs."""
        ...

    def limit_growth(self, positions: int | None) -> None:
        """Let the cache grow to at most about `positions` positions (rounded up as the runtime
        lays them out; doubling below that) from now on, or up to the context (None): what a
        memory bound priced the sequence at. A longer sequence still runs."""
        ...


class PrefixRunner(ABC):
    """The bookkeeping of which tokens a runner's cache holds, shared by every runtime.

    A subclass provides the pass itself (`logits`, between `prepare` and `commit`), forgetting
    cached positions (`_truncate`), a fresh cache (`_clear`), `sibling` and `describe`.
    """

    def __init__(self, *, device: torch.device, vocab_size: int, max_positions: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self._cached_ids = torch.empty(0, dtype=torch.long)  # the tokens whose KV is cached
        self.forward_calls = 0

    exact_prefixes = False  # Runner.exact_prefixes: not unless a runtime guarantees it

    def copy_prefix(self, source: Runner, length: int) -> None:
        raise NotImplementedError(f"{self.describe()} runners do not share cached prefixes")

    @property
    def cached_ids(self) -> torch.Tensor:
        """[cached_length] long: the tokens whose keys and values the cache holds."""
        return self._cached_ids

    @property
    def cached_length(self) -> int:
        return int(self._cached_ids.numel())

    def reset(self) -> None:
        self._clear()
        self._cached_ids = torch.empty(0, dtype=torch.long)

    def rollback(self, length: int) -> None:
        """Drop the cached positions from `length` on."""
        if self.cached_length > length:
            self._truncate(length)
            self._cached_ids = self._cached_ids[:length]

    @abstractmethod
    def logits(self, ids: torch.Tensor, num_logits: int = 1,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """ids [L] (cpu long) -> logits [num_logits, V] for the last num_logits positions,
        through `prepare` (roll back to the longest cached prefix) and `commit`.

        Example: cache holds [a, b, c, x]; ids = [a, b, c, y, z], num_logits = 2 -> rollback to
        [a, b, c], feed [y, z], return the logits after y and after z.
        parents: the last num_logits - 1 ids are a token tree (native runtime only).
        """

    def prepare(self, ids: torch.Tensor, num_logits: int) -> int:
        """Check a pass over ids and roll the cache back to the longest cached prefix, leaving at
        least num_logits positions to feed; return that prefix length."""
        length = int(ids.numel())
        if not 1 <= num_logits <= length:
            raise ValueError(f"num_logits must be in [1, {length}], got {num_logits}")
        if length > self.max_positions:
            raise ValueError(f"sequence of {length} tokens exceeds the model's context of "
                             f"{self.max_positions}")
        keep = min(common_prefix(self._cached_ids, ids), length - num_logits)
        self.rollback(keep)
        return keep

    def commit(self, ids: torch.Tensor) -> None:
        """After the forward pass: the cache now holds all of ids."""
        self.forward_calls += 1
        self._cached_ids = ids.clone()

    @abstractmethod
    def _truncate(self, length: int) -> None:
        """Forget the cached positions from `length` on (the ids are dropped by the caller)."""

    @abstractmethod
    def _clear(self) -> None:
        """An empty cache (the ids are dropped by the caller)."""

    @abstractmethod
    def sibling(self) -> PrefixRunner: ...

    @abstractmethod
    def describe(self) -> str: ...


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens a and b share: [1, 2, 3], [1, 2, 4, 5] -> 2. Every pass asks
    this of its row's whole history: on the CPU NumPy answers in a few microseconds, where
    torch's comparison and nonzero cost ~50 us just after a pass has swept the caches."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    if a.device.type == "cpu" and b.device.type == "cpu":
        differ = np.flatnonzero(a.reshape(-1)[:n].numpy() != b.reshape(-1)[:n].numpy())
        return int(differ[0]) if differ.size else n
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n
