"""Which requests run a round, and what each feeds: admission, chunked prefill, pooled caches.

The engine (verispec.engine) asks `schedule()` once a round: waiting requests join while
slots are free (up to max_batch running), each with a target runner and a drafter of its own
(pooled: a row that leaves hands them to the next); a row with more than a chunk of its prompt
still to feed takes the next chunk this round (`DecodeConfig.chunk_at`), the others decode. A
long prompt arriving in a running batch so delays the other rows' rounds by one chunk's pass,
not its whole pass. The scheduler knows nothing of drafting, verification or text.

Prefix reuse. Where the target's caches are exact for any cut into passes
(`Runner.exact_prefixes`: GGUF models on the native runtime), a pooled runner keeps what its
last request left, and a joining request takes the free one whose cache holds the longest start
of its prompt (a system prompt, the earlier turns of a conversation, a file sent again) and
feeds only the rest. Its output is the same bits as from an empty cache. Only requests of one
`SamplingParams.lookup_scope` share (a server's API key; None: none); a seeded sampled row
starts clean (`starts_clean`); a pool keeps up to max_batch caches, the least recently used one
emptied for a prompt that matches none.

Memory. A request joins only where its caches fit in `cache_memory` beside the running rows':
each row is priced at the most its caches may take (its prompt, budget and a round's drafts at
`Runner.bytes_per_position`, and DRAFT_AHEAD more at the drafter's), its caches then grow no further
(`Runner.limit_growth`: doubling below that), and a request that does not fit waits, in order,
until rows leave (alone it always runs). A native runner keeps
its cache's buffers after a reset (grown to the longest sequence it has held), so a pool's
caches hold memory after their requests leave: the free slots' caches (`Runner.cache_bytes`
and the drafters') stay within `idle_cache_bytes` and within what the running rows leave of
`cache_memory`; past that the least recently used free slots are dropped, runner, drafter and
all, and a later request makes new ones.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.config import DecodeConfig
from verispec.drafters.drafter import (
    Drafter,
    cache_bytes,
    copy_state,
    follow_target,
    limit_growth,
    position_bytes,
    retire,
)
from verispec.params import SamplingParams
from verispec.request import Request
from verispec.runtime import Runner, common_prefix

KEEP_SLACK = 16  # tokens of a free cache a request may drop and still take it as it is
# A request waits for a running row still computing a start of at least this many tokens that
# its prompt shares, longer than any cache holds now.
WAIT_FOR_SHARED = 64


# Positions a row's cache may hold past its prompt and budget: the draft tokens and tree nodes
# of its last round.
DRAFT_POSITIONS = 64
# A cache lays positions out in blocks of this many (the native runtime's attention blocks).
POSITION_BLOCK = 64
# Positions a drafter's caches may run ahead of the target's: a draft model's chain, a feature
# draft's greedy tree ((K - 1) x its width nodes).
DRAFT_AHEAD = 256


def default_cache_memory(device: torch.device | None = None) -> int:
    """What an engine's caches may take by default: three quarters of the memory available as
    it starts, on the device the caches live on: a GPU's free memory, else the system's
    (Linux's MemAvailable, within a container's cgroup limit; half the machine's memory where
    the system does not say)."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * 3 // 4
    available = None
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: what the container may still take
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 2 // 3
        except (ValueError, OSError, AttributeError):
            available = 8 << 30
    return max(0, available) * 3 // 4


def default_idle_cache_bytes() -> int:
    """What a pool's free caches may hold by default: an eighth of the machine's memory (2 GiB
    where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 2 << 30


@dataclass(slots=True)
class _Slot:
    """A free row's runner and drafter, and the lookup scope of the request that had them."""

    runner: Runner
    drafter: Drafter | None
    scope: str | None


class Scheduler:
    def __init__(self, max_batch: int, config: DecodeConfig, target: Runner,
                 drafter: Drafter | None, runners: Iterable[Runner] = (),
                 drafters: Iterable[Drafter] = (), idle_cache_bytes: int | None = None,
                 cache_memory: int | None = None) -> None:
        """target, drafter: what pooled runners and drafters are made from (`sibling`,
        `fork`). runners, drafters: taken first, as they are (caches kept), so a lone prompt
        on a decoder's own runner reuses what the previous prompt left in its cache (they are
        never dropped). idle_cache_bytes: what free slots' caches may hold together (None:
        `default_idle_cache_bytes`); cache_memory: what running and free caches may take
        together (None: `default_cache_memory`); the module docstring says how."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        idle_cache_bytes = _bytes("idle_cache_bytes", idle_cache_bytes, default_idle_cache_bytes)
        cache_memory = _bytes("cache_memory", cache_memory,
                              lambda: default_cache_memory(target.device))
        self.max_batch, self.config = max_batch, config
        self.idle_cache_bytes, self.cache_memory = idle_cache_bytes, cache_memory
        self._reserved: dict[int, int] = {}  # request id -> what its caches may grow to
        # what one position takes in a row's caches: the target's, its drafter's
        self._target_bytes = target.bytes_per_position
        self._draft_bytes = position_bytes(drafter)
        self.target, self.drafter = target, drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._own_runners: list[Runner] = list(runners)
        self._own_drafters: list[Drafter] = list(drafters)
        self._kept = {id(runner) for runner in self._own_runners}  # never dropped
        self._free: list[_Slot] = []  # least recently freed first
        self.refused: list[tuple[Request, Exception]] = []  # the last schedule()'s failures
        self._pooled = 0  # runners made for the pool

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancel(self, request_id: int) -> bool:
        """Drop a request, waiting or running; the other rows are not disturbed. False if it is
        unknown or already finished."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.request_id == request_id:
                self.release(request)
                return True
        return False

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """This round's rows -> (feeding, decoding). Feeding rows have `prompt_fed` moved to
        the end of the chunk they feed this round."""
        # 1. Join: waiting requests take free slots, but for one whose prompt starts as a
        #    running row's that is still being computed: it waits to copy it (`_waits_for`).
        #    A request whose admission raises leaves with its error (`refused`), alone.
        #    One whose caches would not fit beside the running rows' waits, and the rest after
        #    it (`cache_memory`).
        waiting, self.refused = [], []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            if self._waits_for(request):
                waiting.append(request)
                continue
            need = self._need(request)
            if self.running and sum(self._reserved.values()) + need > self.cache_memory:
                self.waiting.appendleft(request)
                break
            try:
                self._admit(request)
            except Exception as error:  # noqa: BLE001 - the others still join
                if request.runner is not None:
                    # its slot goes back, never to be matched (no scope): emptied when taken
                    slot = _Slot(request.runner, request.drafter, None)
                    _limit(slot, None)
                    self._free.append(slot)
                    request.runner = request.drafter = None  # the pool's alone, to drop
                self.refused.append((request, error))
            else:
                self._reserved[request.request_id] = self._reservation(request)
        self.waiting.extendleft(reversed(waiting))
        self._trim()
        # 2. Rows with more than a chunk of prompt left feed the next; the last chunk goes
        #    with the row's first decoding round.
        feeding, decoding = [], []
        for request in self.running:
            chunk = self.config.chunk_at(request.prompt_fed)
            if request.context - request.prompt_fed > chunk:
                request.prompt_fed += chunk
                feeding.append(request)
            else:
                decoding.append(request)
        return feeding, decoding

    def release(self, request: Request) -> None:
        """A row leaves (finished, failed or cancelled): its runner and drafter go back to the
        pool."""
        self.running.remove(request)
        self._reserved.pop(request.request_id, None)
        _limit(request, None)  # outside a request, caches grow as they need
        if request.drafter is not None:
            retire(request.drafter, request.history, request.params)
        self._free.append(_Slot(request.runner, request.drafter, request.params.lookup_scope))
        self._trim()

    @property
    def idle_bytes(self) -> int:
        """What the free pooled slots' caches hold now, in bytes (the decoder's own runners,
        which it holds anyway, not counted)."""
        return sum(_held(slot) for slot in self._free if id(slot.runner) not in self._kept)

    def _trim(self) -> None:
        """Drop the least recently used free pooled slots while their caches hold more than
        idle_cache_bytes, or than the running rows leave of cache_memory."""
        room = min(self.idle_cache_bytes,
                   max(0, self.cache_memory - sum(self._reserved.values())))
        pooled = [slot for slot in self._free if id(slot.runner) not in self._kept]
        total = sum(held := [_held(slot) for slot in pooled])
        for slot, size in zip(pooled, held, strict=True):
            if total <= room:
                break
            self._free.remove(slot)
            self._pooled -= 1
            total -= size

    def _admit(self, request: Request) -> None:
        """A row joins with a runner and drafter of its own. Own ones and pooled ones keep
        their caches where those are exact (the module docstring), so a prompt sharing a
        prefix with an earlier one reuses it; else they start empty, so a row's output never
        depends on which request had its runner before (a prompt pass's keys and values need
        not be the same bits as the same positions computed in another prompt's pass: a dense
        float32 model's greedy answer to the same prompt changed from one call to the next).
        A row that must start clean (`starts_clean`) starts empty either way."""
        clean = starts_clean(request.params) or not self.target.exact_prefixes
        if self._own_runners:
            request.runner = self._own_runners.pop()
            request.drafter = self._own_drafters.pop() if self._own_drafters else None
            if clean:
                request.runner.reset()
                if request.drafter is not None:
                    request.drafter.reset()
        else:
            slot = self._take(request)
            request.runner, request.drafter = slot.runner, slot.drafter
        if request.drafter is None and self.drafter is not None:
            request.drafter = self.drafter.fork()
            request.drafter.reset()
        follow_target(request.drafter, request.runner)
        _limit(request, self._positions(request))  # (a feature draft's cache is new now)
        # what the runner holds of this prompt already (with the path of a token tree its last
        # pass verified that the prompt follows, moved into place); its rounds feed the rest
        settle = getattr(request.runner, "settle", None)
        if settle is not None:
            settle(request.prompt_ids)
        request.prompt_fed = common_prefix(request.runner.cached_ids, request.prompt_ids)
        request.stats.cached_prompt_tokens = min(request.prompt_fed, request.context - 1)
        self.running.append(request)

    def _positions(self, request: Request) -> int:
        """The most positions a request's caches may hold: its prompt, budget and a round's
        drafts, in whole blocks, within the model's context."""
        positions = request.context + request.budget + DRAFT_POSITIONS
        return min(self.target.max_positions, -(-positions // POSITION_BLOCK) * POSITION_BLOCK)

    def _need(self, request: Request) -> int:
        """The most a joining request's caches may take, at the target's and the drafter's
        bytes a position (its caches are then held to it: `limit_growth`)."""
        positions = self._positions(request)
        return positions * self._target_bytes + (positions + DRAFT_AHEAD) * self._draft_bytes

    def _reservation(self, request: Request) -> int:
        """What an admitted row's caches may take: each at its price, or what it holds
        already where more (a reused cache grows no further, and never shrinks)."""
        positions = self._positions(request)
        return (max(positions * self._target_bytes, request.runner.cache_bytes) +
                max((positions + DRAFT_AHEAD) * self._draft_bytes, cache_bytes(request.drafter)))

    def _shares(self, request: Request) -> bool:
        """Whether a joining request may start from other rows' caches (exact ones, its scope,
        not a clean row, no own runner)."""
        return (self.target.exact_prefixes and not self._own_runners and
                request.params.lookup_scope is not None and not starts_clean(request.params))

    def _sources(self, request: Request) -> tuple[list[_Slot], list[_Slot]]:
        """The caches a request may start from: its scope's free slots (least recently freed
        first) and its scope's running rows (to copy from only); none where it does not share
        (`_shares`)."""
        if not self._shares(request):
            return [], []
        scope = request.params.lookup_scope
        return ([slot for slot in self._free if slot.scope == scope],
                [_Slot(r.runner, r.drafter, scope) for r in self.running
                 if r.params.lookup_scope == scope])

    def _waits_for(self, request: Request) -> bool:
        """Whether a joining request should wait a round: a running row of its scope is still
        computing a start of its prompt of WAIT_FOR_SHARED tokens or more, longer than any
        cache holds. (Requests that arrive together with one long system prompt then compute
        it once, and each only its own rest.)"""
        if not self._shares(request):
            return False
        scope, prompt = request.params.lookup_scope, request.prompt_ids
        free, running = self._sources(request)
        _, held = _longest_start(free + running, prompt)
        coming = max((common_prefix(row.prompt_ids, prompt) for row in self.running
                      if row.params.lookup_scope == scope and
                      row.runner.cached_length < row.prompt_ids.numel()), default=0)
        return coming >= WAIT_FOR_SHARED and coming > held

    def _take(self, request: Request) -> _Slot:
        """A pooled slot for a joining request, its runner and drafter ready.

        Where caches are exact, the free slot of the request's scope whose cache holds the
        longest start of the prompt serves it: taken as it is when the prompt goes on from all
        it holds but KEEP_SLACK tokens at most (the next turn of its conversation, whose
        template may close the last answer otherwise than it was generated), else copied into
        a new slot while the pool has fewer than max_batch, or into the least recently freed
        one, so that what it holds past the shared start stays for the request it belongs to
        (and the source counts as used); a running row's longer start is copied likewise. A
        clean row, a row without a scope and a prompt that matches none take a new slot, or
        the least recently freed one emptied. A copied start goes to the drafter too where it
        can take it exactly (`copy_state`)."""
        exact, prompt = self.target.exact_prefixes, request.prompt_ids
        positions = self._positions(request)
        free, running = self._sources(request)
        best, longest = _longest_start(free, prompt)
        source, copied = _longest_start(free + running, prompt)  # ties: the free slot
        # 1. As it is.
        if best is not None and source is best and (
                best.runner.cached_length - longest <= KEEP_SLACK or
                (self._pooled >= self.max_batch and self._free[0] is best)):
            self._free.remove(best)
            return best
        # 2. Another slot: the least recently freed, or a new one.
        if self._free and not (exact and self._pooled < self.max_batch):
            slot = self._free.pop(0 if exact else -1)
        else:
            self._pooled += 1
            drafter = None if self.drafter is None else self.drafter.fork()
            slot = _Slot(self.target.sibling(), drafter, request.params.lookup_scope)
        # 3. Holding the longest start found (a free source now the most recently used), or
        #    nothing; grown no further than the request is priced at.
        _limit(slot, positions)
        try:
            if source is None:
                slot.runner.reset()
            else:
                slot.runner.copy_prefix(source.runner, copied)
                if source is best:
                    self._free.remove(best)
                    self._free.append(best)
            if slot.drafter is not None and (source is None or not copy_state(
                    slot.drafter, source.drafter, copied)):
                slot.drafter.reset()
        except Exception:
            _limit(slot, None)
            self._free.append(_Slot(slot.runner, slot.drafter, None))  # emptied when taken
            raise
        return slot


def starts_clean(params: SamplingParams) -> bool:
    """Whether a row starts from empty caches whatever the pool holds: a seeded sampled row
    verified by block or token. Its draws follow its drafts, and what it drafts when depends on
    the state it starts from (a draft model's cache, a feature draft's reach into a cached
    prompt, how its prompt is cut into chunks), while the same seed must give the same output
    whatever requests came before. Greedy rows give the target's output whatever is proposed,
    and verify="invariant" draws do not depend on the drafts."""
    return not params.greedy and params.seed is not None and params.verify != "invariant"


def _limit(slot: _Slot | Request, positions: int | None) -> None:
    """Let a slot's (or a row's) runner caches grow to at most `positions`, its drafter's to
    DRAFT_AHEAD more (None: up to the context)."""
    slot.runner.limit_growth(positions)
    limit_growth(slot.drafter, None if positions is None else positions + DRAFT_AHEAD)


def _held(slot: _Slot | Request) -> int:
    """The bytes a slot's (or a running request's) runner and drafter caches hold."""
    return slot.runner.cache_bytes + cache_bytes(slot.drafter)


def _bytes(name: str, value: int | None, default) -> int:
    """A memory setting: an integer >= 0, or None for default()."""
    if value is None:
        return default()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _longest_start(slots: list[_Slot], prompt) -> tuple[_Slot | None, int]:
    """The first of `slots` whose runner's cache holds the longest start of prompt [L], and
    its length (None, 0: none holds any)."""
    best, longest = None, 0
    for slot in slots:
        shared = common_prefix(slot.runner.cached_ids, prompt)
        if shared > longest:
            best, longest = slot, shared
    return best, longest
