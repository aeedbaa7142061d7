"""The cache an :class:`~kvpage.engine.config.EngineConfig` gives a model: its layout and its size at a budget.

:func:`build_spec` turns the config's resolved formats (main and draft, :class:`~kvpage.engine.config.EngineConfig`)
and the model's shape into the :class:`~kvpage.spec.CacheSpec`; :func:`kv_capacity` sizes it with
:func:`~kvpage.cache.capacity.cache_capacity` (the one computation of every capacity figure kvpage reports: the
builder's block count, ``kvpage generate``'s ratio, ``kvpage formats``, the README table); :func:`startup_line` is
the engine's one start-up line.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpage.cache.capacity import MiB, BudgetTooSmallError, CapacityReport, cache_capacity
from kvpage.engine.shape import SMOLLM2_SHAPE, ModelShape, Shape, model_shape
from kvpage.spec import CacheSpec

if TYPE_CHECKING:
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.memory import KVBudget
    from kvpage.engine.threads import ThreadChoice

__all__ = ["BudgetTooSmallError", "CapacityReport", "MiB", "ModelShape", "SMOLLM2_SHAPE", "Shape", "build_spec",
           "kv_capacity", "model_shape", "startup_line"]


def build_spec(config: EngineConfig, model: ModelShape, model_name: str = "",
               draft: ModelShape | None = None, layer_windows: Sequence[int | None] | None = None) -> CacheSpec:
    """The cache layout ``config`` gives ``model`` (what :func:`~kvpage.engine.build.build_engine` builds).

    ``layer_windows``: per model layer, its sliding window or ``None`` (the family's ``attention_params``);
    windowed layers beside full-attention ones form the ``sliding`` group (:meth:`CacheSpec.build`); default the
    model's own ``layer_windows`` when it has them (a :class:`Shape`), else all full attention.

    With ``speculative_config`` method ``draft_model``, ``draft`` is the draft model's KV shape: its layers
    become the spec's ``draft`` group, in ``config.draft_kv_format``.

    Raises:
        ValueError: a ``draft_model`` config without ``draft``.
    """
    if layer_windows is None:
        layer_windows = getattr(model, "layer_windows", None)
    num_draft = 0
    if config.draft_kv_format is not None:
        if draft is None:
            raise ValueError("speculative_config method 'draft_model' needs the draft model's shape (draft=)")
        num_draft = draft.num_layers
    return CacheSpec.build(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        has_value=model.kv_has_value, layer_windows=layer_windows,
        model_dtype=config.torch_dtype, block_size=config.block_size_resolved,
        kv_cache_dtype=config.kv_format, model_name=model_name, static_scales=config.static_scales,
        num_draft_layers=num_draft, draft_kv_cache_dtype=config.draft_kv_format,
        draft_num_kv_heads=None if draft is None else draft.num_kv_heads,
        draft_head_dim=None if draft is None else draft.head_dim, layer_formats=config.kv_layer_formats,
    )


def kv_capacity(
    config: EngineConfig,
    model: ModelShape,
    budget_bytes: int | None = None,
    *,
    seq_len: int | None = None,
    spec: CacheSpec | None = None,
) -> CapacityReport:
    """Blocks, bytes and tokens the engine allocates for ``config`` on ``model`` within ``budget_bytes``.

    Args:
        config: the engine settings (format, block size, ``max_num_seqs``, ``kv_quant_residual_tokens``,
            ``num_blocks``, ``max_model_len``).
        model: the model's KV shape (a :class:`~kvpage.model.config.ModelConfig` or a :class:`Shape`).
        budget_bytes: KV budget in bytes, side pools included; default ``config.kv_budget_bytes``.
            Ignored when ``config.num_blocks`` is set (then the budget is what gets allocated).
        seq_len: tokens per request for :attr:`CapacityReport.max_concurrency`; default
            ``config.max_model_len``, else the model's context.
        spec: the layout, when the caller already built it (must be :func:`build_spec`'s).

    Returns:
        the :class:`CapacityReport`; no memory is allocated.

    Raises:
        BudgetTooSmallError (a ``ValueError``): the budget is below the side pools, or holds no block
            after them (the message gives the bytes needed and the bytes given).
    """
    spec = build_spec(config, model) if spec is None else spec
    max_len = config.max_model_len or int(model.max_position_embeddings)  # (build_engine's max_model_len)
    knob = "kv_cache_memory_fraction" if config.kv_cache_memory_fraction is not None else "kv_cache_memory_bytes"
    budget = config.kv_budget_bytes if budget_bytes is None else int(budget_bytes)
    return cache_capacity(spec, config.sizing(max_len), budget, num_blocks=config.num_blocks,
                          seq_len=max_len if seq_len is None else seq_len, budget_knob=knob)


def startup_line(threads: ThreadChoice, capacity: CapacityReport, budget: KVBudget) -> str:
    """The engine's one start-up line: torch threads (and the rule), the KV cache, where the budget came from.

    E.g. ``[kvpage] engine: 1 torch thread (rule: 2 CPUs - load 1, at most torch's 2); int8 KV cache:
    2,824 blocks x 16 tokens = 45,184 tokens in 511.9 MiB (+0.0 MiB side pools); ...; budget 512.0 MiB (default)``.
    """
    n = threads.num_threads
    size = f"{capacity.budget_bytes / MiB:,.1f} MiB ({budget.source})"
    return (f"[kvpage] engine: {n} torch thread{'s' if n != 1 else ''} ({threads.reason}); "
            f"{capacity.summary()}; budget {size}")
