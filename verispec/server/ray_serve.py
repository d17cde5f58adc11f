"""`verispec serve --ray`: the server as replicas on a Ray cluster, one per machine (or per N
cores), behind one gateway that keeps requests with a common opening on one replica.

    client -> Serve's HTTP proxy -> Gateway -(PrefixAffinityRouter)-> Replica: create_app + engine

`Replica` holds what `verispec serve` runs: `create_app`'s app over its own engine, built from
the same flags (its model resolved by name on its own node), its /metrics labelled with its
replica id. `Gateway` is the application's ingress: it reads a request's body (under the body
limit, else 413), names its opening (`affinity.prefix_keys`) and hands the request to a replica
chosen by `PrefixAffinityRouter`; the replica runs it through its app and streams the ASGI
messages back. So keys (401), limits (400, 413, 429), errors and the OpenAI protocol are the
one server's; responses carry `x-verispec-replica`.

Faults. A replica that dies is restarted by Serve (and moved, if its machine left). The gateway
answers each request in flight on it: one that has sent nothing yet is sent once more, to
another replica (the router has dropped the dead one), then 503; a stream that has begun ends
with an error event and no `[DONE]`. Each replica takes max_batch + max_queue requests (then
its engine answers 429, as one server does); when every replica is full, as many more as the
replicas hold together wait at the gateway, and further requests are 429.

    build_app({"target": "qwen2.5-coder-1.5b-instruct", "replicas": "2"})   # `serve run`
    run(args)                                                              # the CLI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass, replace

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from verispec.server.affinity import Forwarded, prefix_keys
from verispec.server.guards import BodyLimit, InternalErrors, send_error
from verispec.server.metrics import merge
from verispec.server.protocol import sse
from verispec.server.ray_router import KNOWN_REPLICAS

log = logging.getLogger("verispec")

APP_NAME = "verispec"
REPLICA_HEADER = b"x-verispec-replica"
ROOM_FOR_PROBES = 8  # /health and /metrics calls a full replica still takes


@dataclass(frozen=True, slots=True)
class RayConfig:
    """replicas: how many (autoscale (min, max) instead: as the load needs); replica_cpus:
    cores each reserves and decodes with (None: one replica per machine, all its cores);
    address: the cluster to join (None: RAY_ADDRESS, else a new local one)."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    replica_cpus: float | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        low, high = self.autoscale or (0, 1)
        if not (0 <= low <= high and high >= 1):
            raise ValueError(f"--autoscale takes MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, "
                             f"got {self.autoscale[0]}:{self.autoscale[1]}")
        if self.replica_cpus is not None and self.replica_cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RayConfig:
        autoscale = None
        if args.autoscale:
            low, sep, high = args.autoscale.partition(":")
            if not (sep and low.strip().isdigit() and high.strip().isdigit()):
                raise ValueError(f"--autoscale takes MIN:MAX (e.g. 1:4), got {args.autoscale!r}")
            autoscale = (int(low), int(high))
        if args.replicas is not None and autoscale is not None:
            raise ValueError("--replicas and --autoscale exclude each other")
        return cls(replicas=args.replicas or 1, autoscale=autoscale,
                   replica_cpus=args.replica_cpus, address=args.address)


class Replica:
    """`verispec serve`'s app and engine on one Ray worker. Not an ingress itself (an
    application has one: the gateway), it runs the app's lifespan as a server would: the
    engine starts with the replica and stops when Serve retires it."""

    async def __init__(self, serve_args: dict) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as the verispec command does
        import torch

        from verispec.cli_args import serve_config, serve_decoder
        from verispec.server.app import create_app, default_model_name, warm_up

        args = argparse.Namespace(**serve_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        torch.set_num_threads(max(1, int(args.replica_cpus or _node_cpus())))
        config = serve_config(args)
        decoder = serve_decoder(args)
        warm_up(decoder, config.max_batch)
        self.app = create_app(decoder, args.model_name or default_model_name(args.target),
                              config, metric_labels={"replica": self.replica_id})
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()

    async def __del__(self) -> None:
        """Serve calls this once the requests in flight finished or had
        graceful_shutdown_timeout_s (--shutdown-timeout); the engine drops what is left."""
        self.app.state.draining = True
        await self.lifespan.__aexit__(None, None, None)

    async def forward(self, request: Forwarded):
        """Run one request through the app -> its ASGI messages, as they are sent."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": list(request.headers),
                 "client": None, "server": None}
        outbox: asyncio.Queue = asyncio.Queue()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await asyncio.Event().wait()  # a client that leaves cancels this call instead

        async def send(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (REPLICA_HEADER, self.replica_id.encode())]
                message = {**message, "headers": headers}
            await outbox.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: outbox.put_nowait(None))
        try:
            while (message := await outbox.get()) is not None:
                yield message
            task.result()
        finally:
            task.cancel()


@serve.ingress()
class Gateway:
    """The ingress: body read (413 over the limit), opening named, request sent to a replica."""

    def __init__(self, replicas, max_body_bytes: int) -> None:
        self.replicas = replicas.options(method_name="forward", stream=True)
        self.max_body_bytes = max_body_bytes
        self.app_name = serve.get_replica_context().app_name

    def __serve_build_asgi_app__(self):
        return InternalErrors(BodyLimit(self.relay, max_bytes=self.max_body_bytes))

    async def relay(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = (await receive()).get("body", b"")  # BodyLimit hands it over whole
        request = Forwarded(scope["method"], scope["path"], scope.get("query_string", b""),
                            tuple(scope["headers"]), body, _prefix(scope, body))
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            await self.metrics(request, send)
        else:
            await self.forward(request, send)

    async def forward(self, request: Forwarded, send) -> None:
        """Relay a replica's answer; a request that failed before it sent anything is sent
        once more (the router no longer offers a replica that died)."""
        for attempt in (1, 2):
            started, streaming = False, False
            try:
                async for message in self.replicas.remote(request):
                    if message["type"] == "http.response.start":
                        started = True
                        streaming = b"text/event-stream" in dict(message["headers"]).get(
                            b"content-type", b"")
                    await send(message)
                return
            except BackPressureError:
                await send_error(send, 429, "every replica is at capacity; retry later",
                                 type="rate_limit_error", code="queue_full")
                return
            except Exception as err:
                log.warning("a replica failed during %s %s (attempt %d): %s", request.method,
                            request.path, attempt, type(err).__name__)
                if started:
                    await _break_off(send, streaming)
                    return
        await send_error(send, 503, "the replica serving this request failed; retry",
                         type="server_error", code="replica_failed")

    async def metrics(self, request: Forwarded, send) -> None:
        """Every replica's /metrics (each sample labelled with its replica) on one page."""
        pages, seen = [], set()
        status, headers, body = await self._collect(request)  # also starts the router
        if status != 200:  # e.g. 401 under --protect-metrics
            await _respond(send, status, headers, body)
            return
        pages.append(body.decode())
        seen.add(headers.get(REPLICA_HEADER))
        for replica in KNOWN_REPLICAS.get(self.app_name, ()):
            if replica.encode() in seen:
                continue
            try:
                status, headers, body = await self._collect(replace(request, replica=replica))
            except Exception as err:  # gone since: it has nothing to report
                log.warning("no metrics from replica %s: %r", replica, err)
                continue
            if status == 200 and headers.get(REPLICA_HEADER) not in seen:
                pages.append(body.decode())
                seen.add(headers.get(REPLICA_HEADER))
        page = merge(pages).encode()
        await _respond(send, 200, {b"content-type": headers.get(
            b"content-type", b"text/plain; version=0.0.4")}, page)

    async def _collect(self, request: Forwarded) -> tuple[int, dict, bytes]:
        status, headers, parts = 500, {}, []
        async for message in self.replicas.remote(request):
            if message["type"] == "http.response.start":
                status, headers = message["status"], dict(message["headers"])
            else:
                parts.append(message.get("body", b""))
        return status, headers, b"".join(parts)


def _prefix(scope, body: bytes) -> tuple[int, ...]:
    if scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
        return ()
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ()  # the replica answers 400
    return prefix_keys(parsed) if isinstance(parsed, dict) else ()


async def _break_off(send, streaming: bool) -> None:
    """End a response that had begun when its replica failed: a stream with an error event
    (no [DONE]), any other body short of its length, which clients report as an error."""
    if streaming:
        error = {"error": {"message": "the replica serving this request failed",
                           "type": "server_error", "param": None, "code": "replica_failed"}}
        await send({"type": "http.response.body", "body": sse(error).encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _respond(send, status: int, headers: dict, body: bytes) -> None:
    kept = [(k, v) for k, v in headers.items() if k not in (b"content-length", REPLICA_HEADER)]
    await send({"type": "http.response.start", "status": status,
                "headers": [*kept, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _node_cpus() -> float:
    node = ray.get_runtime_context().get_node_id()
    for entry in ray.nodes():
        if entry["NodeID"] == node:
            return entry["Resources"].get("CPU", 1)
    return 1


def deployment(args: argparse.Namespace):
    """The application for `serve.run`: the gateway bound to the replicas, as `args` (the
    serve flags, parsed) say."""
    from verispec.cli_args import serve_config

    ray_config = RayConfig.from_args(args)
    config = serve_config(args)  # a bad flag fails here, before any replica loads a model
    serve_args = {name: value for name, value in vars(args).items() if name != "run"}
    capacity = config.max_batch + config.max_queue
    options = {
        "ray_actor_options": {"num_cpus": ray_config.replica_cpus or 1},
        "max_ongoing_requests": capacity + ROOM_FOR_PROBES,
        # requests being routed count too: a burst the replicas can hold must pass
        "max_queued_requests": capacity * (ray_config.autoscale or (0, ray_config.replicas))[1],
        "graceful_shutdown_timeout_s": config.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2,
        "request_router_config": RequestRouterConfig(
            # by import path, so that the gateway's process holds the very class it reads
            request_router_class="verispec.server.ray_router.PrefixAffinityRouter",
            request_router_kwargs={"max_imbalance": config.max_batch}),
    }
    if ray_config.replica_cpus is None:
        options["max_replicas_per_node"] = 1
    if ray_config.autoscale is None:
        options["num_replicas"] = ray_config.replicas
    else:
        low, high = ray_config.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "target_ongoing_requests": config.max_batch}
    replicas = serve.deployment(Replica, name="Replica", **options).bind(serve_args)
    gateway = serve.deployment(
        Gateway, name="Gateway", num_replicas=1,
        # its router asks each replica how many requests it holds: on a busy machine an answer
        # takes longer than Serve's first 0.1 s deadline, and a request whose prefix owner did
        # not answer in time would go to another replica
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {
            "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0",
            "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10.0"}}},
        max_ongoing_requests=100_000,
        # longer than the replicas': what they end after --shutdown-timeout still reaches clients
        graceful_shutdown_timeout_s=config.shutdown_timeout + 5)
    return gateway.bind(replicas, config.max_body_bytes)


def build_app(args: dict):
    """The application from `serve run verispec.server.ray_serve:build_app key=value ...` or a
    Serve config file's `args`: keys are `verispec serve`'s flags (`max-batch` or `max_batch`),
    a flag without value takes true or false.

    Example: {"target": "smollm2-135m-instruct", "replicas": 2, "api-key": "sk-1"}"""
    from verispec.cli_args import add_serve_args

    parser = argparse.ArgumentParser(prog="build_app")
    add_serve_args(parser)
    argv = []
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None:
            raise ValueError(f"build_app: {key!r} is not a `verispec serve` flag")
        if action.nargs == 0:
            if str(value).lower() in ("1", "true", "yes", "on"):
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return deployment(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`verispec serve --ray`: join (or start) the cluster, deploy, serve until SIGTERM or
    Ctrl-C, then give the requests in flight --shutdown-timeout seconds and remove the app."""
    app = deployment(args)  # flags checked before the cluster starts
    ray_config = RayConfig.from_args(args)
    started_here = ray_config.address is None and not os.environ.get("RAY_ADDRESS")
    ray.init(address=ray_config.address, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info("serving on http://%s:%d/v1 from %s", args.host, args.port,
                 f"{ray_config.autoscale[0]}-{ray_config.autoscale[1]} replicas"
                 if ray_config.autoscale else f"{ray_config.replicas} replica(s)")
        while not stop.wait(1.0):  # a timed wait: signals get through
            pass
        log.info("draining (up to %.0f s)", args.shutdown_timeout)
        serve.delete(APP_NAME)
    finally:
        if started_here:
            serve.shutdown()
            ray.shutdown()
    return 0
