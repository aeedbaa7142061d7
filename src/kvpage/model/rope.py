"""RoPE tables (Su et al. 2021, rotate-half layout) computed with transformers' own init functions.

One table pair per distinct set of RoPE parameters: every family has the config's one (the global,
``full_attention`` parameters of Gemma 3); Gemma 3's local layers get a second one from the
``sliding_attention`` entry of its nested ``rope_parameters``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpage.model import families

if TYPE_CHECKING:
    from kvpage.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling, from transformers' own init functions.

    ``"default"`` uses ``LlamaRotaryEmbedding.compute_default_rope_parameters``
    (for a nested entry, the same formula with that entry's ``rope_theta``);
    every other type (``linear``, ``llama3``, ``yarn``) uses
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``, so the
    scaling math is the library's, not a copy.

    Args:
        config: model config; its :meth:`ModelConfig.to_hf` config is passed to transformers.
        layer_type: for a config whose ``rope_parameters`` are nested by layer type (Gemma 3), the
            entry to use (``None``: ``"full_attention"``); ignored for a flat config.

    Returns:
        ``(inv_freq, attention_scaling)``: float32 ``[D // 2]`` frequencies
        (radians per position) and the factor transformers multiplies cos/sin by
        (1.0 except for yarn).

    Raises:
        ValueError: a RoPE type transformers has no init function for.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = config.to_hf()
    nested = families.nested_rope_parameters(hf_config)
    if nested is None:
        rope_type = config.rope_type
        init = ROPE_INIT_FUNCTIONS.get(rope_type)
        if init is None and rope_type == "default":
            init = LlamaRotaryEmbedding.compute_default_rope_parameters
        if init is None:
            raise ValueError(f"transformers has no RoPE init function for rope_type {rope_type!r}")
        inv_freq, attention_scaling = init(hf_config, device=torch.device("cpu"))
        return inv_freq.float(), float(attention_scaling)
    layer_type = layer_type or families.FULL_ATTENTION
    params = nested[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":  # the default init of the nested families (Gemma3RotaryEmbedding's formula)
        dim = config.head_dim
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:
        raise ValueError(f"transformers has no RoPE init function for rope_type {rope_type!r}")
    inv_freq, attention_scaling = init(hf_config, torch.device("cpu"), layer_type=layer_type)
    return inv_freq.float(), float(attention_scaling)


def rope_tables(config: ModelConfig, dtype: torch.dtype,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position RoPE tables for positions ``[0, max_position_embeddings)``.

    Computed in float32 exactly as transformers' ``LlamaRotaryEmbedding.forward``
    (``freqs = pos * inv_freq``, ``emb = cat(freqs, freqs)``, times the attention
    scaling), then cast to ``dtype``. The sine table has its first half negated so
    that RoPE is ``x * cos + swap_halves(x) * sin_signed``, which equals
    transformers' ``x * cos + rotate_half(x) * sin`` bit for bit.

    Args:
        config: model config.
        dtype: table dtype (the model dtype).
        layer_type: nested ``rope_parameters`` entry, as :func:`rope_inv_freq`.

    Returns:
        ``(cos, sin_signed)``, each ``[max_position_embeddings, D]`` in ``dtype``.
    """
    inv_freq, scaling = rope_inv_freq(config, layer_type)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    cos = emb.cos() * scaling  # [P, D]
    sin = emb.sin() * scaling  # [P, D]
    half = config.head_dim // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [P, D]
    return cos.to(dtype), sin_signed.to(dtype)
