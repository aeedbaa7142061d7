"""OpenAI-compatible HTTP serving: ``kvpage serve``.

* :mod:`kvpage.server.app`: ``build_app(llm, served_model_name)`` (FastAPI) and ``ServerThread``;
* :mod:`kvpage.server.async_engine`: one thread steps the engine, asyncio handlers stream its outputs;
* :mod:`kvpage.server.protocol`: the request/response models;
* :mod:`kvpage.server.metrics`: the ``kvpage:`` Prometheus metrics;
* :mod:`kvpage.server.listen`: the socket ``kvpage serve`` binds before the model loads.

Importing :mod:`kvpage.server` does not import FastAPI; the names below load lazily.
"""
from __future__ import annotations

from typing import Any

__all__ = ["AsyncEngine", "ServerThread", "build_app"]


def __getattr__(name: str) -> Any:
    if name in ("build_app", "ServerThread"):
        from kvpage.server import app

        return getattr(app, name)
    if name == "AsyncEngine":
        from kvpage.server.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'kvpage.server' has no attribute {name!r}")
