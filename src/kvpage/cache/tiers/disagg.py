"""``KVTransferConfig``: prefill/decode disaggregation over a shared store, spelled as vLLM's ``kv_transfer_config``.

``LLM(kv_transfer_config={"kv_connector": "KVPageStoreConnector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"kv_store": "redis://host:6379/0"}})``, or the same JSON through
``--kv-transfer-config`` on ``kvpage generate`` / ``kvpage serve``. The roles are vLLM's:

* ``kv_producer`` (the prefill instance): writes every newly cached block to the store and, when a request finishes,
  flushes those writes before its answer is returned (so a decode request sent after the answer finds them); it
  does not read the store.
* ``kv_consumer`` (the decode instance): loads a prompt's blocks from the store as a prefix hit; it writes nothing.
* ``kv_both``: reads and writes, with the producer's synchronous flush.

The store is the one ``kv_store`` names (the engine's own setting or ``kv_connector_extra_config["kv_store"]``);
its keys are the layout fingerprint plus the block hash, so a producer and a consumer share blocks only when their
layouts (model, format, block size, heads, hash algorithm) are equal. Tensor-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpage.config_json import config_fields

#: vLLM's ``kv_role`` values.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: ``kv_connector`` names kvpage answers to: its store connector (the name vLLM users would register it under).
KV_CONNECTORS = ("KVPageStoreConnector",)
#: Keys of ``kv_connector_extra_config`` kvpage reads.
EXTRA_CONFIG_KEYS = ("kv_store",)
_FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` for kvpage's store connector.

    Attributes:
        kv_connector: the connector's name, one of :data:`KV_CONNECTORS`.
        kv_role: one of :data:`KV_ROLES`.
        kv_connector_extra_config: connector settings; ``kv_store`` (a store URL, as the engine's ``kv_store``) is
            the only key read.

    Raises:
        ValueError: an unknown connector or role, an unknown extra key, or a ``kv_store`` that is not a string
            (the message names the field).
    """

    kv_connector: str = "KVPageStoreConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)} (kvpage "
                             f"moves KV through its own store), got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be an object, got {extra!r}")
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; known: "
                             f"{', '.join(EXTRA_CONFIG_KEYS)}")
        store = extra.get("kv_store")
        if store is not None and (not isinstance(store, str) or "://" not in store):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.kv_store must be a store URL "
                             f"(redis://host:port/db, disk:///dir), got {store!r}")

    @property
    def is_kv_producer(self) -> bool:
        """Whether this instance writes blocks to the store (``kv_producer``, ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this instance loads blocks from the store (``kv_consumer``, ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def kv_store(self) -> str | None:
        """The store URL of ``kv_connector_extra_config``, or ``None``."""
        return self.kv_connector_extra_config.get("kv_store")

    @classmethod
    def coerce(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """A config from itself, a dict of its fields, or that dict as JSON (``--kv-transfer-config``).

        vLLM's other keys (``kv_connector_module_path``, ``kv_buffer_device``, ``kv_rank``, ...) are refused by name:
        kvpage moves KV through its store only.

        Raises:
            ValueError: bad JSON, not an object, an unknown key or a bad field (named).
        """
        if isinstance(value, cls):
            return value
        value = config_fields(value, "kv_transfer_config", _FIELDS)
        return cls(**{k: ({} if k == "kv_connector_extra_config" and v is None else v) for k, v in value.items()})
