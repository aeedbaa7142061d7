"""Calibration of static KV scales: per-layer, per-(kv head, channel) absolute maxima of K and V on sample text.

``kvpage calibrate --text FILE --out scales.safetensors`` runs the model over the
first ``--tokens`` tokens of the text through the engine's own path (the
:class:`~kvpage.engine.model_runner.ModelRunner` and
:func:`~kvpage.ops.attention.paged_attention` over an unquantized cache in the
model dtype, in prefill chunks), and records for every layer ``max |k|`` and
``max |v|`` over all tokens, per (kv head, channel). The keys are taken exactly
as the cache stores them: after RoPE, in the model dtype.

The file (see :mod:`kvpage.scales`) holds ``layers.{i}.k_absmax`` and
``layers.{i}.v_absmax``, float32 ``[kv_heads, head_dim]``, and serves both
static formats: ``int8_static`` uses ``absmax / 127`` per channel (FastDeploy
``cache_int8``), ``fp8_static`` ``max(absmax) / 448`` per layer (vLLM /
llm-compressor ``k_scale``, TensorRT-LLM ``kv_cache_scaling_factor``). This is
the plain max-calibration those tools use by default; values beyond the
calibrated range saturate at run time.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpage.model.attention_fn import layer_attention
from kvpage.model.encode import encode_text, starts_with_bos
from kvpage.ops.layer_attention import LayerAttention
from kvpage.scales import StaticScales

if TYPE_CHECKING:
    from kvpage.model.loader import LoadedModel

#: Tokens calibrated when ``--tokens`` is not given.
DEFAULT_CALIBRATION_TOKENS = 2048


class _Recorder(torch.nn.Module):
    """Wraps the model so every layer's ``k``/``v`` (as handed to the cache) updates running absmax tensors."""

    def __init__(self, model: torch.nn.Module, k_max: list[torch.Tensor], v_max: list[torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.k_max = k_max
        self.v_max = v_max

    def attention_params(self, layer_index: int) -> LayerAttention:
        """The wrapped model's attention knobs for the layer (scale, window, soft-cap)."""
        return layer_attention(self.model, layer_index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Callable[..., torch.Tensor]) -> torch.Tensor:
        def recording_attn(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
            i = layer_index
            self.k_max[i] = torch.maximum(self.k_max[i], k.detach().abs().amax(dim=0).float())  # [Hkv, D]
            # a key-only (latent) layer's keys serve as its values
            values = k if v is None else v
            self.v_max[i] = torch.maximum(self.v_max[i], values.detach().abs().amax(dim=0).float())  # [Hkv, D]
            return attn(layer_index, q, k, v)

        return self.model(input_ids, positions, recording_attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def collect_kv_absmax(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    *,
    chunk_size: int = 512,
    block_size: int = 16,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> StaticScales:
    """Per-layer absolute maxima of K (post-RoPE) and V over ``token_ids``, as the cache would store them.

    Runs ``token_ids`` as one sequence, ``chunk_size`` tokens per forward pass
    (chunked prefill; each chunk attends to every earlier token), on an
    unquantized paged cache in the model's dtype.

    Args:
        loaded: the model (its ``config`` gives layers, kv heads, head_dim; its dtype is the cache's).
        token_ids: the calibration tokens (at most the model's context).
        chunk_size: tokens per forward pass (> 0).
        block_size: tokens per cache block.
        device: where the cache lives (the model must be there already).
        progress: a tqdm bar over tokens on stderr.

    Returns:
        :class:`~kvpage.scales.StaticScales` of kind ``absmax``: ``key[i]`` and
        ``value[i]`` float32 ``[kv_heads, head_dim]`` for every layer ``i``, with
        metadata ``tokens``, ``num_layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``model``.

    Raises:
        ValueError: no tokens, more tokens than the model's context, ``chunk_size < 1``,
            or a layer's K/V had non-finite values (the model itself is broken then).
    """
    from tqdm.auto import tqdm

    from kvpage.cache.controller import CacheController
    from kvpage.cache.kv_cache import KVCache
    from kvpage.cache.requests import KVRequest
    from kvpage.engine.group_attention import GroupAttention
    from kvpage.engine.model_runner import ModelRunner, ScheduledRequest, pass_requests
    from kvpage.spec import CacheSpec

    cfg = loaded.config
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("calibration needs at least one token of text")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"{len(ids)} calibration tokens exceed the model's context of {cfg.max_position_embeddings}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = next(loaded.model.parameters()).dtype
    spec = CacheSpec.build(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           has_value=cfg.kv_has_value, model_dtype=dtype, block_size=block_size,
                           kv_cache_dtype="auto")
    num_blocks = spec.blocks_for_tokens(len(ids))
    caches = CacheController(spec, device).allocate_device(num_blocks)
    shape = (cfg.num_kv_heads, cfg.head_dim)
    k_max = [torch.zeros(shape, device=device) for _ in range(cfg.num_layers)]
    v_max = [torch.zeros(shape, device=device) for _ in range(cfg.num_layers)]
    backends = [GroupAttention(spec, g, caches) for g in spec.groups]  # the model dtype: token-wise
    runner = ModelRunner(_Recorder(loaded.model, k_max, v_max), spec, backends, torch.device(device))
    kv = KVCache.from_spec(spec, num_blocks, enable_caching=False)  # plans each chunk's pass
    req = KVRequest("calibrate", [])
    with tqdm(total=len(ids), unit="tok", desc="calibrate", disable=not progress) as bar:
        for start in range(0, len(ids), chunk_size):
            chunk = ids[start:start + chunk_size]
            blocks = kv.allocate(req, len(chunk))
            assert blocks is not None  # (the pool holds every token)
            req.all_token_ids.extend(chunk)
            batch = [ScheduledRequest(chunk, start, blocks.block_ids)]
            plan = kv.plan_pass(pass_requests(batch))
            runner.execute(batch, plan)
            kv.commit(plan)
            bar.update(len(chunk))
    for i in range(cfg.num_layers):
        for which, t in (("k", k_max[i]), ("v", v_max[i])):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"layer {i}: non-finite {which} values during calibration")
    meta = {
        "tokens": str(len(ids)),
        "num_layers": str(cfg.num_layers),
        "kv_heads": str(cfg.num_kv_heads),
        "head_dim": str(cfg.head_dim),
        "dtype": str(dtype).removeprefix("torch."),
        "model": Path(str(loaded.path)).name,
    }
    return StaticScales({i: t.cpu() for i, t in enumerate(k_max)}, {i: t.cpu() for i, t in enumerate(v_max)},
                        kind="absmax", metadata=meta, source="calibration")


def calibration_token_ids(tokenizer: Any, text: str, num_tokens: int = DEFAULT_CALIBRATION_TOKENS, *,
                          bos: bool | None = None) -> list[int]:
    """The first ``num_tokens`` token ids of ``text``, as ``kvpage eval`` reads a text
    (:func:`~kvpage.model.encode.encode_text`: ``bos=None`` follows the tokenizer, BOS first where it adds one).

    Raises:
        ValueError: ``num_tokens < 1``, the text has no tokens, or ``bos=True`` with a tokenizer without BOS.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    ids = encode_text(tokenizer, text, bos=bos)[:num_tokens]
    if not ids:
        raise ValueError("the calibration text has no tokens")
    return ids


def calibrate(
    loaded: LoadedModel,
    text: str,
    *,
    num_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    chunk_size: int = 512,
    progress: bool = True,
    device: str | torch.device = "cpu",
    bos: bool | None = None,
) -> StaticScales:
    """Calibrate static K/V absmax on the first ``num_tokens`` tokens of ``text`` (fewer if the text is shorter).

    See :func:`collect_kv_absmax` for the result, whose metadata gains ``bos`` (``true`` when the ids start
    with the tokenizer's BOS); the token count is capped at the model's context. ``bos`` as in
    :func:`calibration_token_ids` (``None``: as the tokenizer's configuration says).

    Raises:
        ValueError: empty text, ``num_tokens < 1``, ``bos=True`` with a tokenizer without BOS.
    """
    ids = calibration_token_ids(loaded.tokenizer, text, min(num_tokens, loaded.config.max_position_embeddings),
                                bos=bos)
    scales = collect_kv_absmax(loaded, ids, chunk_size=chunk_size, progress=progress, device=device)
    scales.metadata["bos"] = str(starts_with_bos(loaded.tokenizer, ids)).lower()
    return scales


def summarize(scales: StaticScales) -> list[str]:
    """Human-readable lines about calibrated absmax: ranges over layers and the scales each static format derives."""
    from kvpage.formats import Fp8StaticFormat, Int8StaticFormat

    i8, f8 = Int8StaticFormat(), Fp8StaticFormat()
    layers = sorted(scales.key)
    lines = []
    for which, table in (("K", scales.key), ("V", scales.value)):
        if not table:
            continue
        allv = torch.stack([table[i] for i in layers])                                  # [L, Hkv, D]
        per_layer = allv.flatten(1).amax(dim=1)                                          # [L]
        s8 = torch.stack([i8.scale_from_absmax(table[i]) for i in layers])              # [L, Hkv, D]
        sf = torch.stack([f8.scale_from_absmax(table[i]) for i in layers])              # [L]
        lines.append(f"{which} absmax: median channel {float(allv.median()):.3g}, per-layer max "
                     f"{float(per_layer.min()):.3g} .. {float(per_layer.max()):.3g} (layer {int(per_layer.argmax())}); "
                     f"int8_static scales {float(s8.min()):.3g} .. {float(s8.max()):.3g}; "
                     f"fp8_static scales {float(sf.min()):.3g} .. {float(sf.max()):.3g}")
    return lines
