"""Prometheus metrics of one server, in its own registry (several apps may live in a process).

Per-position acceptance is the ratio of two counters: draft position i (0-based) was checked
`verispec_draft_position_checked_total{position="i"}` times and accepted
`verispec_draft_position_accepted_total{position="i"}` times.

A server that is one of several replicas labels every sample with its replica
(`Metrics(labels={"replica": ...})`); `merge` joins several replicas' pages into one.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from verispec.drafters.suffix_cache import CacheUsage
from verispec.server.guards import CLIENT_CLOSED, CLIENT_LEFT

PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                   "/metrics"})
MODEL_PATH = "/v1/models/{id}"  # one label for every model id asked about (bounded labels)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self, in_flight: Callable[[], int],
                 suffix_cache: Callable[[], CacheUsage] | None = None,
                 labels: dict[str, str] | None = None,
                 idle_cache_bytes: Callable[[], int] | None = None) -> None:
        """in_flight: how many requests the engine holds (waiting or running), read on scrape;
        suffix_cache: what a cross-request lookup cache holds (`SuffixCache.usage`), where the
        drafter has one; labels: set on every sample (e.g. {"replica": "ab12"});
        idle_cache_bytes: what the KV caches of requests that left hold, read on scrape."""
        self.labels = dict(labels or {})
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("verispec_requests", "HTTP requests by path and status",
                                ["path", "status"], registry=registry)
        self.cancelled = Counter("verispec_requests_cancelled",
                                 "requests dropped because their client disconnected",
                                 registry=registry)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=registry)
        self.cached_prompt_tokens = Counter(
            "verispec_prompt_tokens_cached", "prompt tokens of finished requests that an "
            "earlier request's cache held (not computed again)", registry=registry)
        self.generated_tokens = Counter("verispec_generated_tokens", "tokens generated",
                                        registry=registry)
        self.target_forwards = Counter("verispec_target_forwards",
                                       "target forward passes (rows of batched passes)",
                                       registry=registry)
        self.drafted = Counter("verispec_draft_tokens", "draft tokens proposed",
                               registry=registry)
        self.checked = Counter("verispec_draft_tokens_checked",
                               "draft tokens compared with the target", registry=registry)
        self.accepted = Counter("verispec_draft_tokens_accepted",
                                "draft tokens that passed verification", registry=registry)
        self.position_checked = Counter("verispec_draft_position_checked",
                                        "draft tokens checked, by draft position",
                                        ["position"], registry=registry)
        self.position_accepted = Counter("verispec_draft_position_accepted",
                                         "draft tokens accepted, by draft position",
                                         ["position"], registry=registry)
        self.ttft = Histogram("verispec_time_to_first_token_seconds",
                              "request arrival to its first generated tokens",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.latency = Histogram("verispec_request_latency_seconds",
                                 "request arrival to its last token", buckets=LATENCY_BUCKETS,
                                 registry=registry)
        Gauge("verispec_requests_in_flight", "requests waiting or running in the engine",
              registry=registry).set_function(in_flight)
        if idle_cache_bytes is not None:
            Gauge("verispec_idle_cache_bytes", "memory the KV caches of requests that left "
                  "keep for later requests to start from (bounded by --idle-cache-mb)",
                  registry=registry).set_function(idle_cache_bytes)
        if suffix_cache is not None:
            for field, help_text in (
                    ("tokens", "earlier requests' tokens the lookup cache holds"),
                    ("states", "states of the lookup cache's suffix automata"),
                    ("documents", "earlier requests the lookup cache holds"),
                    ("evicted", "requests dropped from the lookup cache (least recently used)")):
                Gauge(f"verispec_suffix_cache_{field}", help_text, registry=registry
                      ).set_function(lambda field=field: getattr(suffix_cache(), field))

    def finished(self, output, prompt_tokens: int, latency_s: float) -> None:
        """Count a finished request; output: its verispec GenerationOutput."""
        stats = output.stats
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.target_forwards.inc(stats.target_forwards)
        self.drafted.inc(stats.drafted)
        self.checked.inc(stats.checked)
        self.accepted.inc(stats.accepted)
        for position, (checked, accepted) in enumerate(
                zip(stats.per_position_checked, stats.per_position_accepted, strict=True)):
            self.position_checked.labels(str(position)).inc(checked)
            self.position_accepted.labels(str(position)).inc(accepted)
        self.latency.observe(latency_s)

    def render(self) -> bytes:
        page = generate_latest(self.registry)
        return with_labels(page.decode(), self.labels).encode() if self.labels else page


def with_labels(page: str, labels: dict[str, str]) -> str:
    """Prometheus text with `labels` put first on every sample line.

    Example: with_labels('x_total{path="/"} 1.0', {"replica": "r1"})
             -> 'x_total{replica="r1",path="/"} 1.0'"""
    added = ",".join(f'{name}="{value}"' for name, value in labels.items())
    lines = []
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, brace, rest = line.partition("{")
            if brace:
                line = f"{name}{{{added},{rest}" if not rest.startswith("}") else \
                    f"{name}{{{added}{rest}"
            else:
                name, _, value = line.partition(" ")
                line = f"{name}{{{added}}} {value}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def merge(pages: list[str]) -> str:
    """Several servers' Prometheus pages as one: each metric family once (its HELP and TYPE
    lines from the first page that has it), followed by every page's samples of it."""
    families: dict[str, list[str]] = {}
    for page in pages:
        family = None
        for line in page.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                lines = families.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
            elif line and family is not None:
                families[family].append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines)


class CountRequests:
    """ASGI middleware: count every HTTP response by path and status code."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response starts, or the client left before its request was whole

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if scope.get(CLIENT_LEFT):
                status = CLIENT_CLOSED
            path = route_label(scope["path"])
            self.metrics.requests.labels(path, str(status)).inc()


def route_label(path: str) -> str:
    """A request path as /metrics labels it: a route's own path, the model route's template
    for /v1/models/<any id>, else "other" (so that clients cannot grow the label set)."""
    trimmed = path.rstrip("/")
    if trimmed in PATHS:
        return trimmed
    return MODEL_PATH if path.startswith("/v1/models/") else "other"
