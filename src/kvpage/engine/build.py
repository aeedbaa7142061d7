"""``build_engine``: assemble a serving engine from a model and an :class:`~kvpage.engine.config.EngineConfig`.

One downward pass, each part handed its collaborators in its constructor and never patched afterwards::

    spec (groups with kinds) ─► capacity ─► controller (tensors) ─► group managers ─► tiers (both halves)
        ─► KV cache (scheduler side) ─► group attention + runner + worker (worker side) ─► engine

Every size a user sees comes from one computation, :func:`~kvpage.engine.sizing.kv_capacity`: the block count is
the largest that fits the budget after the side pools of block-wise formats (tail, window and first-block copies)
and the window slots are paid for. Each group's kind picks its manager (:data:`kvpage.cache.groups.MANAGERS`) and
its worker-side attention (:data:`kvpage.engine.group_attention.ATTENTION`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpage.cache.capacity import CapacityReport
from kvpage.cache.controller import CacheController, LayerCache
from kvpage.cache.groups import GroupManager, manager_for
from kvpage.cache.kv_events.collector import KVEventCollector
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.tail.pool import TailPool
from kvpage.cache.tiers.connector import TieredConnector
from kvpage.cache.tiers.host import TieredWorker, build_tiers
from kvpage.engine.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.group_attention import GroupAttention, group_attention_for
from kvpage.engine.memory import KVBudget, resolve_kv_budget
from kvpage.engine.model_runner import ModelRunner
from kvpage.engine.scheduler import SchedulerConfig
from kvpage.engine.sizing import build_spec, kv_capacity
from kvpage.engine.speculative.model_drafter import DraftModelDrafter, LayerSkipDrafter
from kvpage.engine.speculative.ngram import NgramProposer
from kvpage.engine.speculative.proposer import Drafter, NgramDrafter
from kvpage.engine.worker import Worker
from kvpage.model.attention_fn import CausalLM, early_exit, layer_attention
from kvpage.ops.backends import select_backend
from kvpage.spec import CacheSpec

if TYPE_CHECKING:
    from kvpage.model.config import ModelConfig
    from kvpage.model.loader import LoadedModel


@dataclass(frozen=True)
class BuiltEngine:
    """The assembled parts (the :class:`~kvpage.engine.llm.LLM` keeps them; tests and tools read them).

    Attributes:
        spec: the cache layout.
        controller: the device (and host) cache tensors.
        caches: global layer index -> that layer's device tensors (the controller's dict, updated in place by a
            re-allocation).
        groups: the group managers of every layer group, in spec order (one per group, chosen by its kind).
        tails: layer group name -> its tail tensors (quantize-on-seal groups only).
        connector: the tiers' scheduler half, or ``None``.
        tier_worker: the tiers' worker half, or ``None``.
        kv: the scheduler's KV cache.
        runner: the model runner.
        worker: the worker side (runner, controller, tiers' worker half).
        engine: the continuous-batching engine.
        num_blocks: device blocks.
        max_model_len: longest sequence, in tokens.
        capacity: what the KV cache allocates and holds (:func:`~kvpage.engine.sizing.kv_capacity`).
        budget: the KV budget and where it came from (``kv_cache_memory_fraction`` resolved).
        drafter: the speculation method (``speculative_config``), or ``None``.
    """

    spec: CacheSpec
    controller: CacheController
    caches: dict[int, LayerCache]
    groups: tuple[GroupManager, ...]
    tails: dict[str, TailPool]
    connector: TieredConnector | None
    tier_worker: TieredWorker | None
    kv: KVCache
    runner: ModelRunner
    worker: Worker
    engine: LLMEngine
    num_blocks: int
    max_model_len: int
    capacity: CapacityReport
    budget: KVBudget
    drafter: Drafter | None = None

    @property
    def side_pool_bytes(self) -> int:
        """Bytes the tail pools allocate beside the block pool (0 without block-wise formats; over side groups
        only the first-block copies' scales: their rows are pool blocks)."""
        return sum(t.nbytes for t in self.tails.values())


def build_engine(config: EngineConfig, loaded: LoadedModel, model: CausalLM) -> BuiltEngine:
    """Assemble the engine for ``loaded`` (config, tokenizer, name) running ``model`` (already on its device).

    Raises:
        ValueError: ``max_model_len`` beyond the model's context.
        BudgetTooSmallError (a ``ValueError``): the budget holds no block after the side pools
            (the message gives the bytes the side pools need and the bytes given).
        StaticScalesError: scales missing or invalid for a layer of a static-scale format.
        CacheAllocationError: a device or host cache could not be allocated (names the group).
        ModelNotFoundError / ValueError / TypeError: a speculative draft that cannot serve (see :func:`_load_draft`,
            :func:`_drafter`).
    """
    mc = loaded.config
    device = torch.device(config.device)
    context = int(mc.max_position_embeddings)
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {context} tokens")
    max_model_len = context if config.max_model_len is None else config.max_model_len

    sc = config.speculative
    draft = _load_draft(config, loaded, device) if sc is not None and sc.method == "draft_model" else None
    windows = [layer_attention(model, i).sliding_window for i in range(mc.num_layers)]
    spec = build_spec(config, mc, model_name=Path(loaded.path).name, draft=None if draft is None else draft.config,
                      layer_windows=windows)
    budget = resolve_kv_budget(config, model, device, context)
    capacity = kv_capacity(config, mc, budget.bytes, seq_len=max_model_len, spec=spec)
    num_blocks, sizing = capacity.num_blocks, config.sizing(max_model_len)
    slots = capacity.window_slots or None

    # worker side: the tensors every group's kind asks for
    controller = CacheController(spec, device)
    caches = controller.allocate_device(num_blocks, {g.name: g.kind.rows(g, num_blocks, sizing, slots)
                                                     for g in spec.groups if g.kind.window_rows})
    # scheduler side: one manager per group, over one pool (side space of quantize-on-seal groups is carved from it)
    pool = PrefixBlockPool(num_blocks)
    # quantize-on-seal groups carve their tails from the pool together or not at all, as capacity counted them
    carve = capacity.side_blocks_per_slot > 0
    groups = tuple(manager_for(g, sizing, pool=pool, num_window_slots=slots, carve=carve) for g in spec.groups)
    window = next((m for g, m in zip(spec.groups, groups) if g.kind.window_rows), None)  # at most one such group
    tiers = build_tiers(  # host tier (C08: a failed host allocation stops here), stores
        controller, swap_space=config.swap_space, config=config.offload, stores=config.kv_stores,
        supports_swap=all(g.kind.supports_swap for g in spec.groups), window_slots=window,
    )
    connector, tier_worker = (None, None) if tiers is None else tiers
    kv = KVCache(num_blocks, spec.block_size, groups=groups, pool=pool, enable_caching=config.enable_prefix_caching,
                 prefix_caching_hash_algo=config.prefix_caching_hash_algo, connector=connector)

    tails: dict[str, TailPool] = {}
    backends: dict[str, GroupAttention] = {}
    for g in spec.groups:
        tail = None
        layout = g.kind.tail(g, sizing, num_blocks if carve else None)
        if layout is not None:
            tail = tails[g.name] = TailPool(spec, layout, config.torch_dtype, device, layers=g.layer_indices,
                                            caches=caches)
        ops = select_backend(config.attention_backend, spec.layer(g.layer_indices[0]), device)
        backends[g.name] = group_attention_for(spec, g, caches, ops=ops, tail=tail)
    model_groups = tuple(g.name for g in spec.model_groups)
    runner = ModelRunner(model, spec, [backends[n] for n in model_groups], device, groups=model_groups,
                         connector=tier_worker)
    worker = Worker(runner, controller, tier_worker)
    drafter = _drafter(config, mc, runner, kv, spec, backends, draft, device)
    engine = LLMEngine(
        worker, loaded.tokenizer, kv,
        eos_token_ids=set(mc.eos_token_ids), max_model_len=max_model_len, vocab_size=mc.vocab_size,
        scheduler_config=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                         config.enable_chunked_prefill,
                                         config.num_lookahead_tokens,
                                         None if sc is None else sc.disable_by_batch_size),
        drafter=drafter,
        kv_events=_kv_events(config, spec, kv, connector),
        flush_finished=config.kv_transfer is not None and config.kv_transfer.is_kv_producer,
    )
    return BuiltEngine(spec, controller, caches, groups, tails, connector, tier_worker, kv, runner, worker, engine,
                       int(num_blocks), max_model_len, capacity, budget, drafter)


def _kv_events(config: EngineConfig, spec: CacheSpec, kv: KVCache,
               connector: TieredConnector | None = None) -> KVEventCollector | None:
    """The KV events collector and its ZeroMQ publisher (``kv_events_config``), or ``None`` when events are off.

    With tiers (``connector``), the host tier and the stores report to it too (``medium`` ``"CPU"``, ``"DISK"``,
    ``"REMOTE"``).

    The prefix index is one for every layer group (a block id holds all groups' KV), so stored blocks are
    published as group 0 of kind ``full_attention``, or ``sliding_window`` when every model group slides.

    Raises:
        ValueError: an endpoint that cannot be bound or connected (names the field).
    """
    if config.kv_events is None:
        return None
    from kvpage.cache.kv_events.publisher import ZmqEventPublisher  # imports zmq only when events are on

    windows = [g.sliding_window for g in spec.model_groups]
    sliding = all(w is not None for w in windows) and bool(windows)
    publisher = ZmqEventPublisher(config.kv_events, spec.block_size,
                                  spec_kind="sliding_window" if sliding else "full_attention",
                                  sliding_window=min(w for w in windows if w is not None) if sliding else None)
    collector = KVEventCollector(kv.subscribe, publisher)
    if connector is not None:
        connector.offload.record_events(collector.record_tier)
    return collector


def _load_draft(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> LoadedModel:
    """The draft model of ``speculative_config`` (method ``draft_model``), on ``device``, checked against the target.

    Raises:
        ModelNotFoundError: no model at the path.
        ValueError: its vocabulary differs from the target's (speculation needs the same tokenizer).
    """
    from kvpage.model.loader import LoadedModel, load_model

    sc = config.speculative
    assert sc is not None and sc.model is not None
    draft = sc.model if isinstance(sc.model, LoadedModel) else load_model(sc.model, dtype=config.torch_dtype,
                                                                           progress=False,
                                                                           weights_dtype=config.weights_dtype_resolved)
    weight_dtype = next(draft.model.parameters()).dtype
    if weight_dtype != config.torch_dtype:
        raise ValueError(f"speculative_config.model is loaded in {weight_dtype}, but the engine runs {config.torch_dtype}")
    target_vocab = getattr(loaded.tokenizer, "get_vocab", None)
    draft_vocab = getattr(draft.tokenizer, "get_vocab", None)
    same = draft.config.vocab_size == loaded.config.vocab_size
    if same and callable(target_vocab) and callable(draft_vocab):
        same = target_vocab() == draft_vocab()
    if not same:
        raise ValueError(f"speculative_config.model={sc.model!r} has another vocabulary than the target "
                         f"({draft.config.vocab_size} vs {loaded.config.vocab_size} tokens, or different "
                         f"token strings); a draft model must share the target's tokenizer")
    draft.model = draft.model.to(device).eval()
    return draft


def _drafter(config: EngineConfig, mc: ModelConfig, runner: ModelRunner, kv: KVCache, spec: CacheSpec,
             backends: dict[str, GroupAttention], draft: LoadedModel | None, device: torch.device) -> Drafter | None:
    """The speculation method of ``config`` over the built runner, cache and backends, or ``None``.

    Raises:
        ValueError: ``layer_skip``'s ``num_layers`` not below the target's layer count.
        TypeError: ``layer_skip`` on a model family without an early exit.
    """
    sc = config.speculative
    if sc is None:
        return None
    if sc.method == "ngram":
        assert sc.prompt_lookup_min is not None and sc.prompt_lookup_max is not None
        return NgramDrafter(NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max))
    if sc.method == "layer_skip":
        early_exit(runner.model)  # a clear error now, not at the first step
        return LayerSkipDrafter(runner, kv, sc.draft_layers(mc.num_layers))
    assert draft is not None and spec.draft is not None
    draft_runner = ModelRunner(draft.model, spec, [backends["draft"]], device, groups=("draft",),
                               layer_offset=spec.draft.first_layer)
    return DraftModelDrafter(draft_runner, kv)
