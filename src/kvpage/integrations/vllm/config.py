"""The connector's settings, parsed once from vLLM's ``kv_connector_extra_config``.

Plain Python: imports neither vLLM nor torch, so a bad setting is reported the same way in every process.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The storage formats a record can take, and what each costs per value (SmolLM2 135M's head_dim 64, bf16 vLLM):
#: ``auto`` vLLM's own cache dtype, bit-exact; ``int8`` 8.25 bits (int8 codes and a float16 scale per token and
#: head); ``fp8`` 8.25 bits (e4m3 of Hadamard-rotated rows, same scales); ``int4`` about 4.5 bits (KIVI codes with
#: 8-bit per-channel key and per-group value steps and zero points) plus an int8 copy of each request's first block.
STORAGE_FORMATS: tuple[str, ...] = ("auto", "int8", "fp8", "int4")

#: Keys the connector reads from ``kv_connector_extra_config``; any other key is refused (a typo would otherwise
#: silently fall back to a default).
EXTRA_CONFIG_KEYS: tuple[str, ...] = (
    "kv_store", "kv_cache_dtype", "kv_store_options", "save_async", "model_name", "int4_first_block",
)


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` asks of :class:`~kvpage.integrations.vllm.KVPageConnector`.

    Attributes:
        kv_store: where records live: a directory path (``/var/cache/kv``, ``disk:///var/cache/kv``) or a Redis URL
            (``redis://host:port/db``, ``redis+cluster://h1:p1,h2:p2``), as
            :func:`kvpage.cache.tiers.stores.open_store` reads them.
        kv_cache_dtype: the storage format of a record, one of :data:`STORAGE_FORMATS` (``auto``: lossless).
        kv_store_options: keyword options for the store (``max_bytes`` of a disk store; ``ttl_seconds``,
            ``timeout_s``, ``namespace`` of Redis).
        save_async: encode and write records on a background thread after the step's blocks were copied out (vLLM's
            blocks are never held); ``False`` writes them before ``wait_for_save`` returns.
        model_name: the model's name in the layout fingerprint; default vLLM's ``model`` argument. Two deployments
            of the same weights under different paths set the same name to share records.
        int4_first_block: with ``kv_cache_dtype`` ``int4``, the format of a request's first block: ``int8`` (kvpage's
            int4 semantics: an 8-bit copy for attention sinks; about 0.30x of ``auto`` on 1,000-token prompts) or
            ``int4`` (every block 4-bit: about 0.27x, a larger error on the tokens every later one attends to).
    """

    kv_store: str
    kv_cache_dtype: str = "auto"
    kv_store_options: tuple[tuple[str, Any], ...] = ()
    save_async: bool = True
    model_name: str | None = None
    int4_first_block: str = "int8"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse and check ``kv_connector_extra_config`` (no side effects).

        Raises:
            ValueError: ``kv_store`` missing or empty, an unknown key, a ``kv_cache_dtype`` outside
                :data:`STORAGE_FORMATS`, ``kv_store_options`` not a dict, ``save_async`` not a bool,
                ``int4_first_block`` not ``int8``/``int4``; the message says what is accepted.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"KVPageConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"accepted: {list(EXTRA_CONFIG_KEYS)}")
        store = extra.get("kv_store")
        if not isinstance(store, str) or not store.strip():
            raise ValueError("KVPageConnector needs kv_connector_extra_config['kv_store']: a directory path or a "
                             "redis://host:port/db URL, e.g. {\"kv_store\": \"/tmp/kvpage-store\"}")
        dtype = str(extra.get("kv_cache_dtype", "auto")).strip().lower()
        if dtype not in STORAGE_FORMATS:
            raise ValueError(f"KVPageConnector: kv_cache_dtype {extra.get('kv_cache_dtype')!r} is not a storage "
                             f"format; use one of {list(STORAGE_FORMATS)}")
        opts = extra.get("kv_store_options", {}) or {}
        if not isinstance(opts, Mapping):
            raise ValueError(f"KVPageConnector: kv_store_options must be a dict, got {type(opts).__name__}")
        save_async = extra.get("save_async", True)
        if not isinstance(save_async, bool):
            raise ValueError(f"KVPageConnector: save_async must be true or false, got {save_async!r}")
        name = extra.get("model_name")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"KVPageConnector: model_name must be a non-empty string, got {name!r}")
        first = str(extra.get("int4_first_block", "int8")).strip().lower()
        if first not in ("int8", "int4"):
            raise ValueError(f"KVPageConnector: int4_first_block must be 'int8' or 'int4', got {first!r}")
        return cls(store.strip(), dtype, tuple(sorted(opts.items())), save_async, name, first)
