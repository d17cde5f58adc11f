"""Which requests run a round, and what each feeds: admission, chunked prefill, pooled caches.

The engine (verispec.engine) asks `schedule()` once a round: waiting requests join while
slots are free (up to max_batch running), each with a target runner and a drafter of its own
(pooled: a row that leaves hands them to the next); a row with more than a chunk of its prompt
still to feed takes the next chunk this round (`DecodeConfig.chunk_at`), the others decode. A
long prompt arriving in a running batch so delays the other rows' rounds by one chunk's pass,
not its whole pass. The scheduler knows nothing of drafting, verification or text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from verispec.config import DecodeConfig
from verispec.drafters.drafter import Drafter, follow_target, retire
from verispec.request import Request
from verispec.runtime import Runner, common_prefix


class Scheduler:
    def __init__(self, max_batch: int, config: DecodeConfig, target: Runner,
                 drafter: Drafter | None, runners: Iterable[Runner] = (),
                 drafters: Iterable[Drafter] = ()) -> None:
        """target, drafter: what pooled runners and drafters are made from (`sibling`,
        `fork`). runners, drafters: taken first, as they are (caches kept), so a lone prompt
        on a decoder's own runner reuses what the previous prompt left in its cache."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.max_batch, self.config = max_batch, config
        self.target, self.drafter = target, drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._own_runners: list[Runner] = list(runners)
        self._own_drafters: list[Drafter] = list(drafters)
        self._free_runners: list[Runner] = []
        self._free_drafters: list[Drafter] = []

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
        # 1. Join: waiting requests take free slots.
        while self.waiting and len(self.running) < self.max_batch:
            self._admit(self.waiting.popleft())
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
        self._free_runners.append(request.runner)
        if request.drafter is not None:
            retire(request.drafter, request.history, request.params)
            self._free_drafters.append(request.drafter)

    def _admit(self, request: Request) -> None:
        """A row joins with a runner and drafter of its own. Own ones keep their caches, so a
        prompt sharing a prefix with the previous one reuses it; a pooled one starts empty, so
        a row's output never depends on which request had its runner before (a prompt pass's
        keys and values need not be the same bits as the same positions computed in another
        prompt's pass)."""
        request.runner = _take(self._own_runners, self._free_runners, self.target.sibling)
        if self.drafter is not None:
            request.drafter = _take(self._own_drafters, self._free_drafters,
                                    self.drafter.fork)
            follow_target(request.drafter, request.runner)
        # what the runner holds of this prompt already; its rounds feed the rest
        request.prompt_fed = common_prefix(request.runner.cached_ids, request.prompt_ids)
        self.running.append(request)


def _take(own: list, free: list, make):
    """A runner or drafter for a joining row: an own one as it is (its cache kept), else a
    pooled or new one, emptied."""
    if own:
        return own.pop()
    item = free.pop() if free else make()
    item.reset()
    return item
