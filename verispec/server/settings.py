"""How one server runs: capacity, limits, access, shutdown (`verispec serve`'s flags)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a full-context prompt is ~50 KB of JSON
SUFFIX_CACHE_MODES = ("per-key", "shared", "off")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """max_batch requests decode together and max_queue more wait (then 429); a body over
    max_body_bytes is 413; a prompt over max_prompt_tokens (None: the model's context less one
    token for the answer) is 400; api_key (None: open) guards /v1/*, and /metrics and /health
    too with protect_metrics; docs serves /docs, /redoc and /openapi.json; after SIGTERM the
    requests in flight have shutdown_timeout seconds to finish, then they are cancelled.
    suffix_cache: whose earlier prompts and outputs may serve a request (`lookup_scope`): what
    a cross-request lookup proposes, and the cached start of a prompt (`verispec.scheduler`):
    "per-key" those sent with the same API key, "shared" all, "off" none. idle_cache_bytes: what
    the caches of requests that left may hold together, kept for later requests to start from
    (None: an eighth of the machine's memory); cache_memory: what all requests' caches may take,
    a request waiting for room (None: three quarters of the memory available at start)."""

    max_batch: int = 16
    max_queue: int = 64
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None
    api_key: str | None = None
    protect_metrics: bool = False
    docs: bool = False
    shutdown_timeout: float = 10.0
    suffix_cache: str = "per-key"
    idle_cache_bytes: int | None = None
    cache_memory: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}")
        _check(self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}")
        _check(self.max_body_bytes >= 1024,
               f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        _check(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
               f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        _check(self.api_key is None or (self.api_key.strip() == self.api_key and
                                        bool(self.api_key) and " " not in self.api_key),
               "api_key must be a non-empty string without spaces")
        _check(not self.protect_metrics or self.api_key is not None,
               "protect_metrics needs an api_key")
        _check(self.shutdown_timeout >= 0,
               f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        _check(self.suffix_cache in SUFFIX_CACHE_MODES,
               f"suffix_cache must be one of {SUFFIX_CACHE_MODES}, got {self.suffix_cache!r}")
        for name in ("idle_cache_bytes", "cache_memory"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and
                                     value >= 0),
                   f"{name} must be an integer >= 0 or None, got {value!r}")

    def lookup_scope(self, authorization: str | None) -> str | None:
        """The `SamplingParams.lookup_scope` of a request sent with this Authorization header
        (None: none). per-key: a digest of its bearer key (the key itself is never kept), one
        scope for the requests without one; shared: one scope for all; off: None.

        Example: per-key, "Bearer sk-a" -> "key:" + the first 16 hex digits of sha256("sk-a")."""
        if self.suffix_cache == "off":
            return None
        if self.suffix_cache == "shared":
            return ""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
