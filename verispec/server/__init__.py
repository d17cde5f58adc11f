"""`verispec serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

    app.py       routes, server-sent events, OpenAI-style errors, `create_app`, `serve`
    worker.py    the one thread that owns the decoder and its Scheduler
    protocol.py  request bodies, response objects, error objects
    prompts.py   prompts and chat messages -> token ids
    metrics.py   Prometheus metrics in a per-app registry
    loadtest.py  `python -m verispec.server.loadtest`: N requests from C concurrent clients
"""

from verispec.server.app import create_app, default_model_name, serve

__all__ = ["create_app", "default_model_name", "serve"]
