"""ASGI middleware that guards the routes: internal errors, shutdown, API keys, body size.

Outermost first, as `create_app` stacks them:

    InternalErrors  an unexpected exception -> 500 "internal error" + an id; the text is logged
    Draining        once shutdown began: 503 for new requests
    BearerAuth      `Authorization: Bearer KEY` on /v1/* (and /metrics, /health when asked)
    BodyLimit       a body over the limit -> 413, from Content-Length before reading, else
                    once the bytes read pass it

Each answers in OpenAI's error object. They are pure ASGI (no BaseHTTPMiddleware) so a
streaming response passes through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from collections.abc import Callable

log = logging.getLogger("verispec")


async def send_error(send, status: int, message: str, type: str = "invalid_request_error",
                     code: str | None = None, headers: tuple = ()) -> None:
    """Answer with OpenAI's error object {"error": {message, type, param, code}}."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class InternalErrors:
    """An exception no handler took: logged here with a fresh id, answered 500 with only that
    id (exception text can carry paths, prompts or library internals). Not re-raised, so the
    server does not drop the keep-alive connection over it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def note_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, note_start)
        except Exception:
            error_id = uuid.uuid4().hex[:16]
            log.exception("internal error %s on %s %s", error_id, scope.get("method"),
                          scope.get("path"))
            if not started:
                await send_error(send, 500, f"internal error (id {error_id})",
                                 type="server_error")
            else:  # a stream that broke: end it, the client sees no [DONE]
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class Draining:
    """After `is_draining()` turns true (SIGTERM), new requests are answered 503 while those
    already running finish."""

    def __init__(self, app, is_draining: Callable[[], bool]) -> None:
        self.app, self.is_draining = app, is_draining

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.is_draining():
            await send_error(send, 503, "the server is shutting down", type="server_error",
                             code="shutting_down", headers=((b"connection", b"close"),))
            return
        await self.app(scope, receive, send)


class BearerAuth:
    """`Authorization: Bearer <key>` required on /v1/* (and on `also`, e.g. /metrics), as
    OpenAI's clients send their api_key; 401 otherwise. The key is compared in constant time."""

    def __init__(self, app, api_key: str, also: frozenset[str] = frozenset()) -> None:
        self.app, self.also = app, also
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.guarded(scope["path"]):
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)):
                await send_error(send, 401, "invalid or missing API key: send "
                                 "`Authorization: Bearer <key>`", code="invalid_api_key",
                                 headers=((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)

    def guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in self.also


# Set in an HTTP scope whose client left before its request was whole (`CountRequests`).
CLIENT_LEFT = "verispec.client_left"
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"


class BodyLimit:
    """Refuse a request body over `max_bytes` with 413: at once from its Content-Length, else
    (chunked uploads) as soon as the bytes read pass the limit. The body is read here, so the
    route never parses more than the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self.refuse(send)
            return
        # 1. Read the whole body, counting.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                scope[CLIENT_LEFT] = True  # no response: counted as the client's, not a 500
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.refuse(send)
                return
            if not message.get("more_body", False):
                break
        # 2. Hand it to the route in one message; later receives (disconnects) pass through.
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def refuse(self, send) -> None:
        await send_error(send, 413, f"the request body is over this server's limit of "
                         f"{self.max_bytes} bytes", code="request_too_large",
                         headers=((b"connection", b"close"),))
