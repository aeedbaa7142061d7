"""Static K/V scales for ``int8_static`` / ``fp8_static`` measured through a transformers model.

:func:`calibrate_static_scales` runs the model once over sample text with a recording cache and returns the
per-layer, per-(kv head, channel) absolute maxima of the keys (after RoPE, as a cache stores them) and of the
values: a :class:`~kvpage.scales.StaticScales` of kind ``absmax``, the same content as a ``kvpage calibrate``
file (:meth:`StaticScales.save <kvpage.scales.StaticScales.save>` writes one), usable as
``KVPageCache(config, "int8_static", kv_cache_scales=...)``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from kvpage.integrations.transformers.layout import model_layout
from kvpage.scales import StaticScales


class _AbsmaxRecorder(DynamicCache):
    """A ``DynamicCache`` that also keeps each layer's running ``max |k|`` / ``max |v|`` per (kv head, channel)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.k_max: dict[int, torch.Tensor] = {}
        self.v_max: dict[int, torch.Tensor] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for store, x in ((self.k_max, key_states), (self.v_max, value_states)):
            m = x.detach().abs().amax(dim=(0, 2)).float().cpu()                  # [Hkv, D]
            store[layer_idx] = m if layer_idx not in store else torch.maximum(store[layer_idx], m)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name ``model.forward`` takes its cache under: ``cache`` (transformers 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def calibrate_static_scales(
    model: torch.nn.Module, input_ids: torch.Tensor, *, chunk_size: int = 512, source: str = "calibration text"
) -> StaticScales:
    """Absolute maxima of every layer's keys and values over ``input_ids``, as static scales (kind ``absmax``).

    Args:
        model: a transformers causal LM (decoder-only; its config must suit :class:`KVPageCache`).
        input_ids: ``[1, num_tokens]`` or ``[num_tokens]`` int64 token ids, unpadded (padding would be measured).
        chunk_size: tokens per forward pass (the whole text goes through one cache, so each chunk attends to
            all before it).
        source: recorded in the scales' metadata.

    Returns:
        :class:`~kvpage.scales.StaticScales` with ``key``/``value`` ``[kv_heads, head_dim]`` float32 per layer.

    Raises:
        UnsupportedModelError: as :class:`KVPageCache`.
        ValueError: a batch of more than one row, no tokens, or ``chunk_size < 1``.
    """
    layout = model_layout(model.config)
    ids = input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"calibrate on one unpadded row of tokens, got shape {list(input_ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    rec = _AbsmaxRecorder(model.config)
    name = cache_kwarg(model)
    ids = ids.to(next(model.parameters()).device)
    for a in range(0, ids.shape[1], chunk_size):
        model(input_ids=ids[:, a:a + chunk_size], use_cache=True, **{name: rec})
    missing = [i for i in range(layout.num_layers) if i not in rec.k_max]
    if missing:
        raise ValueError(f"layers {missing} never reached their cache during calibration")
    return StaticScales(rec.k_max, rec.v_max, kind="absmax", source=source,
                        metadata={"model": layout.model_type, "tokens": str(ids.shape[1]),
                                  "kv_heads": str(layout.kv_heads), "head_dim": str(layout.head_dim),
                                  "num_layers": str(layout.num_layers), "calibrated_with": "transformers"})
