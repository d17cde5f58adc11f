"""The OpenAI-compatible HTTP app: routes, streaming, errors, metrics, graceful shutdown.

    app = create_app(decoder, "my-model", ServerConfig(max_batch=16))   # an ASGI app
    serve(decoder, "my-model", host="127.0.0.1", port=8000)            # run it with uvicorn

A request passes the guards (verispec.server.guards: API key, body size), is validated
(protocol.py: a 400 for anything a round could fail on), tokenised in a pool of its own and
checked against the context (prompts.py), and then goes to the engine thread
(`verispec.server.worker`), which batches all requests in flight. A streaming client that
disconnects has its request cancelled (Starlette cancels the response when it sees the
disconnect); a non-streaming one is noticed by polling. On SIGTERM uvicorn stops accepting
connections, a request that still arrives is answered 503, and the responses in flight have
`shutdown_timeout` seconds to finish; then uvicorn cancels them, the engine drops what is left,
and the process exits 0. A 500 names an id to find in the log, never an exception's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from verispec.drafters.suffix_cache import SuffixCache
from verispec.engine import Event
from verispec.server.guards import (
    CLIENT_CLOSED,
    BearerAuth,
    BodyLimit,
    Draining,
    InternalErrors,
)
from verispec.server.metrics import CountRequests, Metrics
from verispec.server.prompts import Prompts
from verispec.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Reply,
    SamplingFields,
    sse,
)
from verispec.server.settings import ServerConfig
from verispec.server.worker import EngineThread, GenerationFailed, QueueFull, RequestHandle

log = logging.getLogger("verispec")

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is there


def create_app(decoder, model_name: str, config: ServerConfig | None = None,
               metric_labels: dict[str, str] | None = None) -> FastAPI:
    """An app serving `decoder` (a SpeculativeDecoder) under `model_name`, as `config` says
    (default ServerConfig()). `app.state.draining = True` turns new requests away (503).
    metric_labels: set on every sample of /metrics (one replica among several: its id)."""
    config = config or ServerConfig()
    engine = EngineThread(decoder, max_batch=config.max_batch, max_queue=config.max_queue,
                          idle_cache_bytes=config.idle_cache_bytes,
                          cache_memory=config.cache_memory)
    prompts = Prompts(decoder, config.max_prompt_tokens)
    cache = getattr(decoder.drafter, "cache", None)  # a cross-request lookup's (--draft suffix)
    metrics = Metrics(in_flight=lambda: engine.outstanding,
                      suffix_cache=cache.usage if isinstance(cache, SuffixCache) else None,
                      labels=metric_labels, idle_cache_bytes=lambda: engine.idle_bytes)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)
        prompts.close()

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="verispec", lifespan=lifespan, **docs)
    # Outermost last: counted, then internal errors caught, then shutdown, key, body size.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        also = frozenset({"/metrics", "/health"}) if config.protect_metrics else frozenset()
        app.add_middleware(BearerAuth, api_key=config.api_key, also=also)
    app.add_middleware(Draining, is_draining=lambda: app.state.draining)
    app.add_middleware(InternalErrors)
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.engine, app.state.metrics, app.state.draining = engine, metrics, False
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    served = {"id": model_name, "object": "model", "created": created, "owned_by": "verispec"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:  # the openai client's models.retrieve
        if not model_id:  # /v1/models/
            return await models()
        if model_id != model_name:
            raise unknown_model(model_id)
        return served

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        return await respond(request, body, Reply(chat=False, model=model_name),
                             partial(prompts.completion, body.prompt))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_model(body)
        messages = [message.as_dict() for message in body.messages]
        return await respond(request, body, Reply(chat=True, model=model_name),
                             partial(prompts.chat, messages))

    def unknown_model(name: str) -> APIError:
        return APIError(404, f"The model `{name}` does not exist; this server serves "
                             f"`{model_name}`", param="model", code="model_not_found")

    def check_model(body: SamplingFields) -> None:
        if body.model != model_name:
            raise unknown_model(body.model)

    async def respond(request: Request, body: SamplingFields, reply: Reply, encode
                      ) -> Response:
        """encode: -> the prompt's ids, checked, off the engine thread (APIError if refused)."""
        arrived = time.perf_counter()
        # whose earlier text a cross-request lookup may propose to it (--suffix-cache)
        params = replace(body.params(), lookup_scope=config.lookup_scope(
            request.headers.get("authorization")))
        if engine.outstanding >= engine.capacity:  # spare the tokenising; submit checks again
            raise queue_full(f"the server is at capacity ({engine.capacity} requests in "
                             "flight or waiting); retry later")
        prompt_ids = await encode()
        prediction_ids = None if body.prediction is None else await prompts.prediction(
            body.prediction.text)
        params = prompts.fit(len(prompt_ids), params, body.explicit_max_tokens)
        try:
            handle = await engine.submit(prompt_ids, params, prediction_ids)
        except QueueFull as err:
            raise queue_full(str(err)) from None
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except GenerationFailed:
            raise internal_error(reply) from None
        clock = Clock(metrics, handle, arrived)
        if body.stream:
            return EventStream(stream(reply, handle, clock, body.include_usage),
                               on_close=partial(release, handle))
        try:
            output = await collect(handle, request, clock)
            if output is None:
                return Response(status_code=CLIENT_CLOSED)
        except GenerationFailed:
            raise internal_error(reply, handle) from None
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
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a request
    that fails midway ends with an error event instead, so no client takes it for whole.
    With include_usage every chunk before the usage chunk says `"usage": null`, as OpenAI's."""
    def event_of(chunk: dict) -> str:
        return sse({**chunk, "usage": None} if include_usage else chunk)

    if reply.chat:
        yield event_of(reply.chunk("", role=True))
    try:
        while not handle.finished:
            event = await handle.next()
            output = clock.note(event)
            if event.text:
                yield event_of(reply.chunk(event.text))
            if output is not None:
                yield event_of(reply.chunk("", output=output))
                if include_usage:
                    yield sse(reply.usage_chunk(output, handle.prompt_tokens))
    except GenerationFailed:
        yield sse(internal_error(reply, handle).body())
        return
    yield sse("[DONE]")


def queue_full(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="queue_full")


def internal_error(reply: Reply, handle: RequestHandle | None = None) -> APIError:
    """The 500 of a request whose round failed: its id, to find the cause in the log."""
    request_id = reply.response_id
    log.error("request %s failed (the engine logged why under its request %s)", request_id,
              None if handle is None else handle.request_id)
    return APIError(500, f"internal error (request {request_id})", type="server_error")


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
        if tuple(errors[0]["loc"]) == ("body",):  # no body, or one not read as JSON
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json" and not kind.endswith("+json"):
                message = (f"the body must be JSON with Content-Type: application/json "
                           f"(got {kind or 'no Content-Type'})")
            elif errors[0]["type"] == "missing":
                message = "the request has no body: send a JSON object"
            else:
                message = "the body must be a JSON object"
            return await api_error(request, APIError(400, message))
        # loc: ("body", field, ...); a union reports one error per member it tried, under a
        # part naming the member ("str", "list[int]", "function-after[unicode_only(), str]")
        paths = [".".join(str(part) for part in e["loc"][1:] if not _names_a_type(part))
                 for e in errors]
        # where a member's own check refused the value (a lone surrogate in a string), the
        # other members' "should be a valid list" says nothing: only the check is reported
        checked = {path for path, e in zip(paths, errors, strict=True)
                   if e["type"] == "value_error"}
        kept = [(path, e) for path, e in zip(paths, errors, strict=True)
                if path not in checked or e["type"] == "value_error"]
        paths, errors = [path for path, _ in kept], [e for _, e in kept]
        texts = [e["msg"].removeprefix("Value error, ") for e in errors]
        message = "; ".join(f"{path}: {text}" if path else text
                            for path, text in zip(paths[:3], texts, strict=False))
        param = str(errors[0]["loc"][1]) if len(errors[0]["loc"]) > 1 else None
        return await api_error(request, APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return await api_error(request, APIError(err.status_code, str(err.detail), type=kind))



def _names_a_type(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def default_model_name(target) -> str:
    """The name clients pass as `model`: the target's folder or file name (no .gguf)."""
    if target is None:
        return EMBEDDED_MODEL_NAME
    return Path(target).expanduser().resolve().name.removesuffix(".gguf")


def serve(decoder, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None) -> None:
    """Serve until SIGINT/SIGTERM; both give the requests in flight config.shutdown_timeout
    seconds to finish, then cancel the rest and return."""
    import uvicorn

    config = config or ServerConfig()

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.draining = True  # requests that still arrive: 503
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal it shut down for under the handler found here: SIGTERM then
    # ends the process with status 0 instead of killing it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    warm_up(decoder, config.max_batch)
    app = create_app(decoder, model_name, config)
    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info",
                                  timeout_graceful_shutdown=config.shutdown_timeout)).run()


def warm_up(decoder, max_batch: int) -> None:
    """Before serving, the one-row cost model that k="auto" prices rounds with: measured (a few
    seconds) or read from the cost cache. Batch sizes are read from the cache too; those that
    are not are priced by estimates until the engine measures them while it idles
    (verispec.server.worker), so that a first start is ready in seconds, not minutes."""
    if decoder.k != "auto" or decoder.drafter is None:
        return
    _ = decoder.costs
    missing = decoder.cost_table.unmeasured(max_batch)
    if missing:
        log.info("cost models of batch sizes %s: estimated until measured while idle",
                 ", ".join(map(str, missing)))
