"""The OpenAI-compatible HTTP app: routes, streaming, errors, metrics, graceful shutdown.

    app = create_app(decoder, "my-model", max_batch=16, max_queue=64)   # an ASGI app
    serve(decoder, "my-model", host="127.0.0.1", port=8000)            # run it with uvicorn

Every request goes through the engine thread (`verispec.server.worker`), which batches all
requests in flight. A streaming client that disconnects has its request cancelled (Starlette
cancels the response when it sees the disconnect); a non-streaming one is noticed by polling.
On SIGTERM uvicorn stops accepting connections and waits for the responses in flight; the
engine keeps stepping until they are done and stops at the app's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from verispec.scheduler import Event
from verispec.server.worker import Engine, GenerationFailed, QueueFull, RequestHandle
from verispec.server.metrics import CountRequests, Metrics
from verispec.server.prompts import chat_ids, completion_ids
from verispec.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Reply,
    SamplingFields,
    sse,
)

log = logging.getLogger("verispec")

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is there
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"


def create_app(decoder, model_name: str, max_batch: int = 16, max_queue: int = 64) -> FastAPI:
    """An app serving `decoder` (a SpeculativeDecoder) under `model_name`; up to max_batch
    requests decode together, max_queue more wait, the next one is answered 429."""
    engine = Engine(decoder, max_batch=max_batch, max_queue=max_queue)
    metrics = Metrics(in_flight=lambda: engine.outstanding)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.engine, app.state.metrics = engine, metrics
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "verispec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        return await respond(request, body, Reply(chat=False, model=model_name),
                             partial(completion_ids, prompt=body.prompt))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_model(body)
        messages = [message.as_dict() for message in body.messages]
        return await respond(request, body, Reply(chat=True, model=model_name),
                             partial(chat_ids, messages=messages))

    def check_model(body: SamplingFields) -> None:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{model_name}`", param="model", code="model_not_found")

    async def respond(request: Request, body: SamplingFields, reply: Reply, encode
                      ) -> Response:
        params = body.params()
        arrived = time.perf_counter()
        try:
            handle = await engine.submit(encode, params)
        except QueueFull as err:
            raise APIError(429, str(err), type="rate_limit_error", code="queue_full") from None
        except ValueError as err:
            raise APIError(400, str(err)) from None
        clock = Clock(metrics, handle, arrived)
        if body.stream:
            return EventStream(stream(reply, handle, clock, body.include_usage),
                               on_close=partial(release, handle))
        try:
            output = await collect(handle, request, clock)
            if output is None:
                return Response(status_code=CLIENT_CLOSED)
        except GenerationFailed as err:
            raise APIError(500, str(err), type="server_error") from None
        finally:
            release(handle)
        return JSONResponse(reply.full(output, handle.prompt_tokens))

    def release(handle: RequestHandle) -> None:
        """After the response: a request that did not finish lost its client; drop it."""
        if not handle.finished:
            engine.cancel(handle)
            metrics.cancelled.inc()

    return app


async def stream(reply: Reply, handle: RequestHandle, clock: Clock, include_usage: bool):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    if reply.chat:
        yield sse(reply.chunk("", role=True))
    try:
        while not handle.finished:
            event = await handle.next()
            output = clock.note(event)
            if event.text:
                yield sse(reply.chunk(event.text))
            if output is not None:
                yield sse(reply.chunk("", output=output))
                if include_usage:
                    yield sse(reply.usage_chunk(output, handle.prompt_tokens))
    except GenerationFailed as err:
        yield sse(APIError(500, str(err), type="server_error").body())
    yield sse("[DONE]")


async def collect(handle: RequestHandle, request: Request, clock: Clock):
    """The request's output, or None once its client has disconnected (checked every
    DISCONNECT_POLL_S, events or not)."""
    checked = time.monotonic()
    while True:
        with contextlib.suppress(TimeoutError):
            output = clock.note(await asyncio.wait_for(handle.next(), DISCONNECT_POLL_S))
            if output is not None:
                return output
        if time.monotonic() - checked >= DISCONNECT_POLL_S:
            if await request.is_disconnected():
                return None
            checked = time.monotonic()


class Clock:
    """Times one request into the metrics: first tokens (TTFT) and the end (latency)."""

    def __init__(self, metrics: Metrics, handle: RequestHandle, arrived: float) -> None:
        self.metrics, self.handle, self.arrived = metrics, handle, arrived
        self.first = True

    def note(self, event: Event):
        """-> the event's output (None until the last event)."""
        elapsed = time.perf_counter() - self.arrived
        if self.first:
            self.metrics.ttft.observe(elapsed)
            self.first = False
        if event.output is not None:
            self.metrics.finished(event.output, self.handle.prompt_tokens, elapsed)
        return event.output


class EventStream(StreamingResponse):
    """A server-sent event stream that calls on_close however it ends: finished, client gone
    (Starlette cancels it), or never started."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object; bad requests are 400s, as OpenAI answers them."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        if errors[0].get("type") == "json_invalid":
            message = f"invalid JSON body: {errors[0].get('ctx', {}).get('error', '')}"
            return await api_error(request, APIError(400, message))
        # loc: ("body", field, ...); a union reports one error per member it tried
        paths = [".".join(str(part) for part in e["loc"][1:]) for e in errors]
        message = "; ".join(f"{path}: {e['msg']}" if path else e["msg"]
                            for path, e in zip(paths[:3], errors, strict=False))
        param = str(errors[0]["loc"][1]) if len(errors[0]["loc"]) > 1 else None
        return await api_error(request, APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return await api_error(request, APIError(err.status_code, str(err.detail), type=kind))

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> JSONResponse:
        # Starlette re-raises the error after this answer, so the server still logs it.
        return await api_error(request, APIError(500, f"internal error: {err}",
                                                 type="server_error"))


def default_model_name(target) -> str:
    """The name clients pass as `model`: the target's folder or file name (no .gguf)."""
    if target is None:
        return EMBEDDED_MODEL_NAME
    return Path(target).expanduser().resolve().name.removesuffix(".gguf")


def serve(decoder, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_batch: int = 16, max_queue: int = 64) -> None:
    """Serve until SIGINT/SIGTERM; both finish the requests in flight first."""
    import uvicorn

    # uvicorn re-raises the signal it shut down for under the handler found here: SIGTERM then
    # ends the process with status 0 instead of killing it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    warm_up(decoder, max_batch)
    app = create_app(decoder, model_name, max_batch=max_batch, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=None)


def warm_up(decoder, max_batch: int) -> None:
    """Measure the cost models that k="auto" prices rounds with, for every batch size up to
    max_batch, before serving: no request then waits for a measurement."""
    if decoder.k != "auto" or decoder.drafter is None:
        return
    log.info("measuring the cost models of batches up to %d before serving", max_batch)
    for batch in range(1, max_batch + 1):
        decoder.batch_costs(batch)  # measured once per size class, memoised
