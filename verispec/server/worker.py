"""The engine thread: the one owner of the decoder and its continuous-batching Engine.

The Engine is synchronous and not thread-safe, so a single thread runs it:

    loop:  1. take commands (add, cancel, stop) from a thread-safe queue; block when idle
           2. one engine round over every running request
           3. hand each request's events to its asyncio queue (loop.call_soon_threadsafe)

Once it has been idle, with no command, for `measure_after_idle_s` seconds, it measures the
cost models of the batch sizes that k="auto" prices and has not measured yet (nor found in the
cost cache; `_measure_while_idle`), one at a time, smallest first. A command that arrives stops the
measurement within one pass (the measurement asks between passes); the size is measured from
the start at the next idle time. The wait keeps the measurement out of a client's way that
sends one request after another: a request that arrives during a measurement waits for the
pass in progress (up to a second for the Qwen2.5-Coder-1.5B at batch 16), and begun at once
after each answer, that wait fell on every request (its first token 0.3-1.4 s late on a 2-core
AMD EPYC).
Rounds meanwhile price those sizes by estimates (verispec.cost_table). Measuring here, rather
than at start or when a round first needs a size, keeps the start short and never stalls a
round's streams for a measurement; measuring in this thread, rather than beside it, keeps one
owner of the runtime and leaves the measurement the whole machine.

HTTP handlers only `submit` token ids already checked (verispec.server.prompts tokenises them in
a pool of its own, so a long prompt stalls no round) and `cancel`. A request counts against the
capacity (max_batch running + max_queue waiting) from `submit` until it leaves the engine;
beyond it `submit` raises QueueFull at once. A round that fails fails only the rows it names
(`Event.error`); a round that raises as a whole fails every row of it, and serving goes on.
Messages that reach clients never carry an exception's text: it is logged here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from verispec.costs import MeasurementInterrupted
from verispec.engine import Event
from verispec.params import SamplingParams

log = logging.getLogger("verispec")

# Seconds without a command before an idle engine measures missing cost models (see above).
MEASURE_AFTER_IDLE_S = 5.0


class QueueFull(Exception):
    pass


class GenerationFailed(RuntimeError):
    """The request's round failed (the cause is in the server's log, not in this message)."""


class RequestHandle:
    """One request as its HTTP handler sees it: the prompt's size once admitted, then events."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[Event | int | BaseException] = asyncio.Queue()
        self.prompt_tokens = 0
        self.finished = False
        self.request_id: int | None = None  # the engine's id; the engine thread's business

    async def next(self) -> Event | int:
        """The next item from the engine: the prompt's size once admitted, then events (the
        last one carries the output). Safe to cancel: an item is never lost."""
        item = await self.inbox.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if isinstance(item, Event):
            self.finished = item.output is not None
        return item


@dataclass(frozen=True, slots=True)
class _Add:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    prediction_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class _Cancel:
    handle: RequestHandle


class _Stop:
    pass


class EngineThread:
    """The engine on its own thread; `submit` and `cancel` are called from the event loop."""

    def __init__(self, decoder, max_batch: int = 16, max_queue: int = 64,
                 measure_after_idle_s: float = MEASURE_AFTER_IDLE_S,
                 idle_cache_bytes: int | None = None, cache_memory: int | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.decoder = decoder
        self.max_batch = max_batch
        self.measure_after_idle_s = measure_after_idle_s
        self.capacity = max_batch + max_queue
        # the memory bounds, settled once: an engine rebuilt after a failed round keeps them
        self._engine = decoder.engine(max_batch, idle_cache_bytes, cache_memory)
        self.idle_cache_bytes = self._engine.scheduler.idle_cache_bytes
        self.cache_memory = self._engine.scheduler.cache_memory
        self._commands: queue.Queue[_Add | _Cancel | _Stop] = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}  # engine id -> handle (engine thread)
        self._lock = threading.Lock()
        self._outstanding = 0
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        # batch sizes to measure while idle (None: not asked yet; the engine thread's business)
        self._to_measure: list[int] | None = None

    @property
    def idle_bytes(self) -> int:
        """What the engine's pooled caches of requests that left hold (read from any thread:
        a snapshot of a pool the engine thread may be changing; 0 while it is rebuilt)."""
        engine = self._engine
        return 0 if engine is None else engine.scheduler.idle_bytes

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet gone: waiting, running, or about to be added."""
        return self._outstanding

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel the requests left (the HTTP server stops only once their clients are done or
        cut off), then end the thread."""
        self._commands.put(_Stop())
        self._thread.join()

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     prediction_ids: list[int] | None = None) -> RequestHandle:
        """Queue a request; returns once the engine took it. Raises QueueFull at once when the
        engine is at capacity, ValueError for a request the engine refuses."""
        with self._lock:
            if self._outstanding >= self.capacity:
                raise QueueFull(f"the server is at capacity ({self.max_batch} running, "
                                f"{self.capacity - self.max_batch} waiting); retry later")
            self._outstanding += 1
        handle = RequestHandle()
        self._commands.put(_Add(handle, prompt_ids, params, prediction_ids))
        handle.prompt_tokens = await handle.next()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Drop a request that has not finished (its client went away); frees its slot."""
        if not handle.finished:
            self._commands.put(_Cancel(handle))

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # 1. Commands: wait for one when idle (measuring meanwhile), else take those there.
            commands = []
            if not self._engine.has_work:
                commands.append(self._next_command())
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
            for command in commands:
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Cancel):
                    self._cancel(command.handle)
                else:
                    self._cancel_all()
                    return
            # 2.-3. One round; events go to their requests.
            if self._engine.has_work:
                self._step()

    def _next_command(self) -> _Add | _Cancel | _Stop:
        """The next command, for an idle engine: what comes within measure_after_idle_s, else
        what comes after (or during) the measurement of the cost models still missing."""
        if self._measures():
            try:
                return self._commands.get(timeout=self.measure_after_idle_s)
            except queue.Empty:
                self._measure_while_idle()
        return self._commands.get()

    def _measures(self) -> bool:
        """Whether some batch size's cost model is still to be measured (asked once)."""
        decoder = self.decoder
        if decoder.k != "auto" or decoder.drafter is None:
            return False
        if self._to_measure is None:
            try:
                self._to_measure = decoder.cost_table.unmeasured(self.max_batch)
            except Exception:
                log.exception("could not tell which cost models to measure; estimates stay")
                self._to_measure = []
        return bool(self._to_measure)

    def _measure_while_idle(self) -> None:
        """Measure the batch sizes' cost models still missing while no command waits (see the
        module docstring). A size whose measurement fails is logged and left to estimates."""
        decoder = self.decoder
        while self._to_measure and self._commands.empty():
            size = self._to_measure[0]
            try:
                decoder.cost_table.measure(size, interrupt=lambda: not self._commands.empty())
            except MeasurementInterrupted:
                return
            except Exception:
                log.exception("measuring the cost model of batch %d failed; it stays "
                              "estimated", size)
            self._to_measure.pop(0)

    def _add(self, command: _Add) -> None:
        try:
            request_id = self._engine.add_request(command.prompt_ids, command.params, chat=False,
                                             prediction=command.prediction_ids)
        except Exception as err:  # a refused request goes back to its handler as the error
            self._leave()
            if not isinstance(err, ValueError):
                log.exception("the engine could not add a request")
                err = GenerationFailed("the request could not be queued")
            _post(command.handle, err)
            return
        command.handle.request_id = request_id
        self._handles[request_id] = command.handle
        _post(command.handle, len(command.prompt_ids))

    def _cancel(self, handle: RequestHandle) -> None:
        if handle.request_id in self._handles and self._engine.cancel(handle.request_id):
            del self._handles[handle.request_id]
            self._leave()

    def _cancel_all(self) -> None:
        """At stop: drop every request left, and tell its handler if one still listens."""
        for handle in list(self._handles.values()):
            self._cancel(handle)
            _post(handle, GenerationFailed("the server is shutting down"))

    def _step(self) -> None:
        try:
            events = self._engine.step()
        except Exception:  # fail the round's requests, keep serving
            log.exception("an engine round failed; failing its %d requests",
                          len(self._handles))
            for handle in self._handles.values():
                self._leave()
                _post(handle, GenerationFailed("generation failed"))
            self._handles.clear()
            self._engine = None  # its caches go before the new engine's
            self._engine = self.decoder.engine(self.max_batch, self.idle_cache_bytes,
                                               self.cache_memory)
            return
        for event in events:
            handle = self._handles[event.request_id]
            error = getattr(event, "error", None)
            if event.output is not None or error is not None:
                del self._handles[event.request_id]
                self._leave()
            if error is not None:  # this row alone failed; the engine logged why
                log.error("request %d failed: %r", event.request_id, error)
                _post(handle, GenerationFailed("generation failed"))
            else:
                _post(handle, event)

    def _leave(self) -> None:
        with self._lock:
            self._outstanding -= 1


def _post(handle: RequestHandle, item: Event | int | BaseException) -> None:
    """Hand an item to the handler's event loop (gone if the server already shut down)."""
    try:
        handle.loop.call_soon_threadsafe(handle.inbox.put_nowait, item)
    except RuntimeError:
        log.warning("dropped an event: the server's event loop is closed")
