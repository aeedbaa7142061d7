"""``build_engine``: assemble a serving engine from a model and an :class:`~kvpage.engine.config.EngineConfig`.

One downward pass, each part handed its collaborators in its constructor and
never patched afterwards::

    spec ─► controller ─► group managers ─► tiers (connector) ─► KV-cache manager ─► runner ─► engine

Every size a user sees comes from one computation, :func:`~kvpage.engine.capacity.kv_capacity`:
the block count is the largest that fits the budget after the side pools of
block-wise formats (tail, window and first-block copies) are paid for.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpage.cache.controller import CacheController, LayerCache
from kvpage.cache.groups import GroupManager, SealedGroupManager, SlidingWindowManager, is_bounded_window, managers_for
from kvpage.cache.manager import KVCacheManager
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.tail import TailPool
from kvpage.engine.capacity import CapacityReport, build_spec, kv_capacity
from kvpage.engine.memory import KVBudget, resolve_kv_budget
from kvpage.cache.tiers.connector import TieredConnector
from kvpage.cache.tiers.host import build_offload
from kvpage.engine.group_attention import GroupAttention, group_attention_for
from kvpage.engine.speculative.model_drafter import DraftModelDrafter, LayerSkipDrafter
from kvpage.engine.speculative.ngram import NgramProposer
from kvpage.engine.speculative.proposer import Drafter, NgramDrafter
from kvpage.model.attention_fn import early_exit, layer_attention
from kvpage.ops.backends import select_backend
from kvpage.engine.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.kv_cache import SchedulerKVCache
from kvpage.engine.model_runner import ModelRunner
from kvpage.engine.scheduler import SchedulerConfig
from kvpage.model.attention_fn import CausalLM
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
        caches: global layer index -> that layer's device tensors (updated in place by a re-allocation).
        groups: the group managers of every layer group, in spec order (a block-wise sliding-window group has two:
            its sealed tail, then its window slots; :func:`~kvpage.cache.groups.managers_for`).
        tails: layer group name -> its tail tensors (block-wise groups only).
        connector: the tiers, or ``None``.
        kv: the scheduler's KV interface (device manager + connector).
        runner: the model runner.
        engine: the continuous-batching engine.
        num_blocks: device blocks.
        max_model_len: longest sequence, in tokens.
        capacity: what the KV cache allocates and holds (:func:`~kvpage.engine.capacity.kv_capacity`).
        budget: the KV budget and where it came from (``kv_cache_memory_fraction`` resolved).
        drafter: the speculation method (``speculative_config``), or ``None``.
    """

    spec: CacheSpec
    controller: CacheController
    caches: dict[int, LayerCache]
    groups: tuple[GroupManager, ...]
    tails: dict[str, TailPool]
    connector: TieredConnector | None
    kv: SchedulerKVCache
    runner: ModelRunner
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
    num_blocks = capacity.num_blocks
    controller = CacheController(spec, device)
    pool = PrefixBlockPool(num_blocks)  # side space of quantize-on-seal groups is carved from it on demand
    window_slots = {g.name: capacity.window_slots for g in spec.groups if is_bounded_window(g)}
    per_group = [managers_for(g, max_num_seqs=config.max_num_seqs, residual_tokens=config.residual_tokens,
                              num_lookahead_tokens=config.num_lookahead_tokens,
                              pool=pool, max_model_len=max_model_len,
                              num_window_slots=window_slots.get(g.name)) for g in spec.groups]
    groups = tuple(m for ms in per_group for m in ms)  # a block-wise window group has two (managers_for)
    caches = allocate_device_caches(controller, num_blocks, window_slots)
    window = next((g for g in groups if isinstance(g, SlidingWindowManager)), None)  # at most one bounded group
    offload = build_offload(  # host tier (C08: a failed host allocation stops here), stores
        controller, swap_space=config.swap_space, config=config.offload,
        kv_disk_dir=None if config.kv_disk_dir is None else str(config.kv_disk_dir),
        kv_disk_max_bytes=config.kv_disk_max_bytes, kv_store=config.kv_store,
        supports_swap=all(g.supports_swap for g in groups), window_slots=window,
    )
    connector = None if offload is None else TieredConnector(offload, spec.block_size)
    manager = KVCacheManager(num_blocks, spec.block_size, groups=groups,
                             enable_caching=config.enable_prefix_caching,
                             record_block_changes=connector is not None, pool=pool)
    def copy_blocks(pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of forked blocks: every layer's tensors (main, sliding, draft)."""
        controller.copy_blocks(pairs, None if window is None else window.window_rows)

    kv = SchedulerKVCache(manager, connector, copy_blocks)

    tails: dict[str, TailPool] = {}
    backends: dict[str, GroupAttention] = {}
    for ms, group_spec in zip(per_group, spec.groups):
        g, tail = ms[0], None
        slots = next((m for m in ms if isinstance(m, SlidingWindowManager)), None)
        if isinstance(g, SealedGroupManager):
            tail = TailPool(spec, g.table, config.torch_dtype, device, layers=g.layers, caches=caches)
            tails[g.name] = tail
        ops = select_backend(config.attention_backend, spec.layer(group_spec.layer_indices[0]), device)
        backends[group_spec.name] = group_attention_for(spec, g, caches, tail=tail, is_live=manager.is_live,
                                                        is_in_use=manager.is_in_use, ops=ops,
                                                        window=slots if slots is not g else None)
    model_groups = tuple(g.name for g in spec.model_groups)
    runner = ModelRunner(model, spec, [backends[n] for n in model_groups], device, groups=model_groups)
    drafter = _drafter(config, mc, runner, spec, backends, draft, device)
    engine = LLMEngine(
        runner, loaded.tokenizer, kv,
        eos_token_ids=set(mc.eos_token_ids), max_model_len=max_model_len, vocab_size=mc.vocab_size,
        scheduler_config=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                         config.enable_chunked_prefill,
                                         config.num_lookahead_tokens,
                                         None if sc is None else sc.disable_by_batch_size),
        drafter=drafter,
    )
    return BuiltEngine(spec, controller, caches, groups, tails, connector, kv, runner, engine, int(num_blocks),
                       max_model_len, capacity, budget, drafter)


def allocate_device_caches(controller: CacheController, num_blocks: int,
                           group_blocks: dict[str, int] | None = None) -> dict[int, LayerCache]:
    """Allocate every layer group's device tensors (the model's groups, then draft layers when the spec has them);
    ``group_blocks``: rows of a group's tensors when not ``num_blocks`` (window slots).

    Returns:
        global layer index -> that layer's tensors.

    Raises:
        CacheAllocationError: a tensor could not be allocated (names the layer and group).
    """
    caches = dict(controller.initialize_kv_cache(num_blocks, group_blocks))
    if controller.spec.draft is not None:
        caches.update(controller.initialize_draft_kv_cache(num_blocks))
    return caches


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
                                                                           progress=False)
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


def _drafter(config: EngineConfig, mc: ModelConfig, runner: ModelRunner, spec: CacheSpec,
             backends: dict[str, GroupAttention], draft: LoadedModel | None, device: torch.device) -> Drafter | None:
    """The speculation method of ``config`` over the built runner and backends, or ``None``.

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
        return LayerSkipDrafter(runner, sc.draft_layers(mc.num_layers))
    assert draft is not None and spec.draft is not None
    draft_runner = ModelRunner(draft.model, spec, [backends["draft"]], device, groups=("draft",),
                               layer_offset=spec.draft.first_layer)
    return DraftModelDrafter(draft_runner)
