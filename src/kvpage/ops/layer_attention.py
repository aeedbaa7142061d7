"""``LayerAttention``: what one layer's attention computes beyond plain causal softmax attention.

Model families differ in a few attention knobs that are not part of the KV layout: the softmax scale
(Gemma's ``query_pre_attn_scalar``, MLA's ``qk_head_dim``-based scale with YaRN's ``mscale``), a
sliding window (Mistral, Gemma 2/3 local layers) and tanh soft-capping of the scores (Gemma 2). The
model states them per layer (``model.attention_params(layer_index)``); the attention ops honour them.
Imports nothing from kvpage.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """Attention knobs of one layer; the defaults are plain causal attention with scale ``head_dim ** -0.5``.

    Attributes:
        scale: softmax scale applied to ``q . k``; ``None`` = ``head_dim ** -0.5`` of the cached head.
        sliding_window: query at position ``p`` reads only keys at positions ``> p - sliding_window``
            (``sliding_window`` keys, itself included: transformers' ``sliding_window_overlay`` rule);
            ``None`` = the whole causal context.
        logit_softcap: scores become ``c * tanh(scores / c)`` after scaling, before the mask
            (Gemma 2's ``attn_logit_softcapping``); ``None`` = none.

    Raises:
        ValueError: a non-positive scale, window or cap.
    """

    scale: float | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("scale", "sliding_window", "logit_softcap"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"LayerAttention.{name} must be positive or None, got {v}")

    @property
    def is_plain(self) -> bool:
        """No window and no soft-cap: the fast causal paths (and the CPU kernels) serve it as is."""
        return self.sliding_window is None and self.logit_softcap is None


#: Plain causal attention with the default scale.
PLAIN = LayerAttention()
