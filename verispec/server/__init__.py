"""`verispec serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    app.py       routes, server-sent events, OpenAI-style errors, `create_app`, `serve`
    settings.py  ServerConfig: capacity, limits, API key, docs, shutdown timeout
    guards.py    middleware: internal errors, shutdown (503), API key (401), body size (413)
    worker.py    the one thread that owns the decoder and its Engine
    protocol.py  request bodies (validated), response objects, error objects
    prompts.py   prompts and chat messages -> token ids, off the engine thread, within limits
    metrics.py   Prometheus metrics in a per-app registry
    loadtest.py  `python -m verispec.server.loadtest`: N requests from C concurrent clients
    ray_serve.py `verispec serve --ray`: replicas on a Ray cluster behind a gateway (needs ray)
    ray_router.py  the replicas' request router: prefix affinity, then the least loaded
    affinity.py  a prompt's opening as chained block keys; which replica saw which keys
"""

from verispec.server.app import create_app, default_model_name, serve
from verispec.server.settings import ServerConfig

__all__ = ["ServerConfig", "create_app", "default_model_name", "serve"]
