"""``KVPageConnector``: vLLM v1's ``KVConnectorBase_V1`` over kvpage's formats and stores.

The glue between vLLM's connector verbs and kvpage's two halves (:mod:`.scheduler`, :mod:`.worker`): it reads
vLLM's config and request objects and nothing else. Importing this module imports vLLM; without vLLM it raises an
``ImportError`` that says how to install it (``kvpage`` itself never imports vLLM).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpage.integrations.vllm.scheduler import BlockTransfer

INSTALL_HINT = (
    "kvpage.integrations.vllm.KVPageConnector runs inside vLLM, which is not installed in this environment. "
    "Install kvpage into vLLM's environment instead: `pip install --no-deps -e /path/to/kvpage` (plus "
    "`pip install redis` for a Redis store), then start vLLM with --kv-transfer-config "
    "'{\"kv_connector\": \"KVPageConnector\", \"kv_connector_module_path\": \"kvpage.integrations.vllm\", ...}'"
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - exercised by tests without vLLM via a subprocess
    raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e

from kvpage.integrations.vllm.cache_layout import UnsupportedCacheLayoutError, cpu_attn_blocks  # noqa: E402
from kvpage.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvpage.integrations.vllm.records import VLLMLayout, record_specs  # noqa: E402
from kvpage.integrations.vllm.scheduler import ConnectorScheduler  # noqa: E402
from kvpage.integrations.vllm.stores import RecordStores  # noqa: E402
from kvpage.integrations.vllm.worker import ConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KVPageConnectorMetadata(KVConnectorMetadata):
    """One step's transfers, from the scheduler process to the workers (plain, picklable data).

    Attributes:
        loads: blocks to fill from the store before the forward pass.
        saves: blocks to copy into the store after it.
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def vllm_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_name: str | None) -> tuple[VLLMLayout, list[str]]:
    """The deployment's :class:`VLLMLayout` and its attention layers' names in layer order (no side effects).

    Raises:
        UnsupportedCacheLayoutError: more than one KV cache group (a hybrid model with vLLM's hybrid allocator; this
            connector is not ``SupportsHMA``), a group that is not full attention, keys and values of different
            sizes, a quantized vLLM cache, or tensor/pipeline parallelism (records would mix ranks' heads).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedCacheLayoutError(
            f"KVPageConnector handles one full-attention KV cache group; this model has {len(groups)} "
            f"({[type(g.kv_cache_spec).__name__ for g in groups]}): hybrid models (sliding-window or linear-attention "
            f"layers) need a connector that supports vLLM's hybrid allocator (SupportsHMA), which this one does not")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
        raise UnsupportedCacheLayoutError(
            f"KVPageConnector stores full-attention caches only (it does not support vLLM's hybrid allocator, "
            f"SupportsHMA, nor windows that drop blocks); this model's layers have {spec}")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise UnsupportedCacheLayoutError(f"keys of {spec.head_size} and values of {spec.head_size_v} channels: "
                                          f"KVPageConnector needs them equal")
    par = vllm_config.parallel_config
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        raise UnsupportedCacheLayoutError(
            f"KVPageConnector stores whole layers of one worker; tensor_parallel_size={par.tensor_parallel_size}, "
            f"pipeline_parallel_size={par.pipeline_parallel_size} is not supported")
    names = list(groups[0].layer_names)
    layout = VLLMLayout(model=model_name or str(vllm_config.model_config.model), num_layers=len(names),
                        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, block_size=spec.block_size,
                        dtype=spec.dtype)
    return layout, names


class KVPageConnector(KVConnectorBase_V1):
    """vLLM KV connector that keeps whole prompt blocks in kvpage's disk or Redis stores, in kvpage's formats.

    Turned on with ``--kv-transfer-config '{"kv_connector": "KVPageConnector", "kv_connector_module_path":
    "kvpage.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"kv_store": "/path/or/redis://host:6379", "kv_cache_dtype": "int8"}}'``
    (extra config: :class:`~kvpage.integrations.vllm.config.ConnectorConfig`).

    Scheduler side: probes the store for the prompt's full blocks after vLLM's own hits (kvpage's chained hashes
    of the token ids, see :mod:`kvpage.integrations.vllm.scheduler`), loads synchronously (before the forward pass
    that needs them) and saves each prompt block in the step that fills it. Worker side: dequantizes records into
    vLLM's blocks and quantizes vLLM's blocks into records (:mod:`kvpage.integrations.vllm.worker`). Records carry
    the layout fingerprint (model, layers, heads, head size, block size, storage format), so deployments with
    different layouts never read each other's blocks; a missing, corrupt or foreign record is reported through
    :meth:`get_block_ids_with_load_errors` and recomputed (with ``kv_load_failure_policy="recompute"``; vLLM's
    default ``"fail"`` fails the request instead, so the connector warns about it).

    Args:
        vllm_config: vLLM's config (``kv_transfer_config.kv_connector_extra_config`` is read).
        role: scheduler or worker.
        kv_cache_config: vLLM's KV cache groups (one full-attention group is required).

    Raises:
        ValueError: a bad extra config (names the key and what is accepted).
        UnsupportedCacheLayoutError: a KV layout the connector does not read (hybrid model, parallelism, another
            attention backend), at start-up.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.layout, self.layer_names = vllm_layout(vllm_config, kv_cache_config, self.config.model_name)
        self.specs = record_specs(self.layout, self.config.kv_cache_dtype, self.config.int4_first_block)
        self.stores = RecordStores(self.config.kv_store, self.specs, **dict(self.config.kv_store_options))
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(self.stores, self.layout.block_size)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
                logger.warning("KVPageConnector: kv_load_failure_policy is %r, so a missing or corrupt record fails "
                               "its request; set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                               self._kv_transfer_config.kv_load_failure_policy)
        else:
            self._worker = ConnectorWorker(self.specs, self.stores, self.layout.dtype, self.config.save_async)
        logger.info("KVPageConnector (%s): store %s, format %s, layout fingerprint %s", role.name,
                    self.config.kv_store, self.config.kv_cache_dtype, self.specs.blocks.fingerprint[:16])

    # ==== worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn vLLM's layer caches and check their layout (attention backend, ISA, shape, dtype).

        Raises:
            UnsupportedCacheLayoutError: a layout the connector does not read; the message names what it found.
        """
        assert self._worker is not None
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise UnsupportedCacheLayoutError(f"vLLM registered no KV cache for layers {missing[:4]}")
        ctx = self._vllm_config.compilation_config.static_forward_context
        layer = ctx.get(self.layer_names[0])
        backend = layer.attn_backend.get_name() if layer is not None and hasattr(layer, "attn_backend") else "?"
        isa = getattr(layer, "isa", None)
        view = cpu_attn_blocks(backend, isa, self.layout.num_kv_heads, self.layout.head_size, self.layout.block_size,
                               str(self._vllm_config.cache_config.cache_dtype))
        self._worker.register([kv_caches[n] for n in self.layer_names], view, self.layer_names)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's blocks into vLLM's caches before the forward pass (synchronous)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPageConnectorMetadata) and self._worker is not None
        if meta.loads:
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` wrote every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: :meth:`wait_for_save` copies whole blocks of every layer once the pass is done."""

    def wait_for_save(self) -> None:
        """Copy the blocks this step filled out of vLLM's caches and hand them to the store (coded and written on a
        background thread unless ``save_async`` is false); vLLM's blocks are free when this returns."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPageConnectorMetadata) and self._worker is not None
        if meta.saves:
            self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing finishes asynchronously: loads are synchronous and saves never hold vLLM's blocks."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose records were missing, corrupt or foreign since the last call: vLLM recomputes them."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Write the saves in flight and close the stores."""
        if self._worker is not None:
            self._worker.close()
            logger.info("KVPageConnector: %d blocks loaded, %d saved; store %s", self._worker.blocks_loaded,
                        self._worker.blocks_saved, self.stores.stats())
        else:
            self.stores.close()

    # ==== scheduler side ======================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after vLLM's hits that the store holds, in whole blocks, and ``False`` (loaded synchronously)."""
        assert self._scheduler is not None
        lora = getattr(request, "lora_request", None)
        n = self._scheduler.get_num_new_matched_tokens(
            request.request_id, request.prompt_token_ids, num_computed_tokens,
            cache_salt=getattr(request, "cache_salt", None),
            lora_name=None if lora is None else str(lora.lora_name),
            cacheable=not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the load of the ``num_external_tokens`` vLLM accepted into the request's fresh blocks."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the workers (does not modify ``scheduler_output``)."""
        assert self._scheduler is not None
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        cached = [(rid, None if c.new_block_ids[i] is None else c.new_block_ids[i][0], rid in c.resumed_req_ids,
                   c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids)]
        step = self._scheduler.build_connector_meta(new, cached, dict(scheduler_output.num_scheduled_tokens))
        return KVPageConnectorMetadata(loads=step.loads, saves=step.saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks were saved in the steps that filled them, so vLLM frees them now."""
        assert self._scheduler is not None
        self._scheduler.request_finished(request.request_id)
        return False, None
