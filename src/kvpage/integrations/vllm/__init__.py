"""kvpage inside vLLM: :class:`KVPageConnector`, an out-of-tree vLLM v1 KV connector over kvpage's stores and formats.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPageConnector",
        "kv_connector_module_path": "kvpage.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_store": "redis://127.0.0.1:6379", "kv_cache_dtype": "int8"}}'

Importing this package imports neither vLLM nor torch; ``KVPageConnector`` (looked up by vLLM's connector factory
with ``getattr``) imports :mod:`.connector`, which imports vLLM and says how to install it when it is missing. The
vLLM-free parts -- settings (:mod:`.config`), records (:mod:`.records`), the cache layout (:mod:`.cache_layout`),
stores (:mod:`.stores`) and both halves (:mod:`.scheduler`, :mod:`.worker`) -- import kvpage's formats, spec,
hashing and stores only.
"""
from __future__ import annotations

from typing import Any

#: ``kv_connector`` and ``kv_connector_module_path`` of vLLM's ``--kv-transfer-config``.
CONNECTOR_NAME = "KVPageConnector"
MODULE_PATH = "kvpage.integrations.vllm"

__all__ = ["CONNECTOR_NAME", "MODULE_PATH", "KVPageConnector", "KVPageConnectorMetadata"]


def __getattr__(name: str) -> Any:
    """``KVPageConnector`` / ``KVPageConnectorMetadata`` on first use (imports vLLM then, not before).

    Raises:
        ImportError: vLLM is not installed (the message says how to install kvpage into vLLM's environment).
    """
    if name in ("KVPageConnector", "KVPageConnectorMetadata"):
        from kvpage.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
