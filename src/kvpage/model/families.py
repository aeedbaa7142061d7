"""The model families kvpage's decoder runs, and how each differs from Llama: the one place those differences live.

A :class:`Family` is a small declarative description keyed by transformers' ``model_type``. The shared
decoder (:mod:`kvpage.model.decoder`) builds its layers from it, :meth:`ModelConfig.from_hf
<kvpage.model.config.ModelConfig.from_hf>` validates a checkpoint's config against it, and the loader
builds ``Family.model_class`` for it. :func:`resolve` turns a family plus one checkpoint's transformers
config into an :class:`Architecture`: the concrete per-model values (biases present, per-layer sliding
windows, softmax scale, soft-caps, which RoPE table each layer uses).

What each family changes (checked against transformers 5.x ``modeling_<family>.py``):

================  ==============================================================================
``llama``         the reference: RMSNorm ``w * x``, SwiGLU, RoPE, no biases, plain causal attention.
``mistral``       ``sliding_window`` (``None`` = off) on every layer.
``qwen2``         q/k/v projection biases (always); sliding window only on the layers ``layer_types``
                  marks ``sliding_attention`` (none unless ``use_sliding_window``).
``qwen3``         per-head q/k RMSNorm over ``head_dim`` before RoPE; ``attention_bias`` adds q/k/v/o
                  biases; sliding window as Qwen2.
``gemma2``        RMSNorm ``x * (1 + w)`` in float32; embeddings times ``sqrt(hidden_size)`` (rounded to
                  the model dtype); ``gelu_pytorch_tanh``-gated MLP; four norms per layer (input,
                  post-attention, pre- and post-feedforward); softmax scale ``query_pre_attn_scalar ** -0.5``;
                  ``attn_logit_softcapping`` on the scores, ``final_logit_softcapping`` on the logits;
                  ``layer_types`` alternating sliding/full attention.
``gemma3_text``   Gemma 2 plus Gemma-style q/k norms; RoPE parameters per layer type (``rope_parameters``
                  nested by layer type: local layers ``sliding_attention``, global layers
                  ``full_attention``); transformers 5.x does not apply ``attn_logit_softcapping`` for this
                  family, so neither does kvpage.
================  ==============================================================================

To add a family: one :class:`Family` entry in :data:`FAMILIES` (with ``model_class`` naming its own
module when the shared decoder does not fit, e.g. an MLA family).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from kvpage.ops.layer_attention import PLAIN, LayerAttention

#: ``layer_types`` values (transformers' names).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

#: The shared decoder, as ``"module:attribute"`` (resolved lazily: this module must not import it).
SHARED_DECODER = "kvpage.model.decoder:DecoderForCausalLM"


@dataclass(frozen=True)
class Family:
    """How one model family differs from Llama (every field's default is Llama's behaviour).

    Attributes:
        model_type: transformers' ``model_type`` (the registry key).
        hf_class: transformers' causal-LM class whose tensor names and numerics this family follows.
        activation_key: config attribute naming the MLP activation (``hidden_act``; Gemma: ``hidden_activation``).
        activations: activations the gated MLP implements for this family (others raise ``ValueError``).
        attention_bias: ``"none"`` (a true ``config.attention_bias`` raises ``ValueError``), ``"qkv"``
            (q/k/v biases always, Qwen2) or ``"flag"`` (``config.attention_bias`` adds q/k/v/o biases).
        qk_norm: per-head RMSNorm of q and k over ``head_dim`` before RoPE (``q_norm``, ``k_norm``).
        norm: ``"rms"`` (``w * x``, Llama) or ``"gemma"`` (``x * (1 + w)`` in float32) for every RMSNorm.
        sandwich_norms: four norms per layer: the attention output is normed (``post_attention_layernorm``)
            before the residual add, the MLP input by ``pre_feedforward_layernorm`` and its output by
            ``post_feedforward_layernorm``.
        embed_scale: embeddings are multiplied by ``sqrt(hidden_size)`` in the model dtype.
        scale_from_query_pre_attn_scalar: softmax scale ``query_pre_attn_scalar ** -0.5`` instead of
            ``head_dim ** -0.5``.
        attn_softcap: apply ``config.attn_logit_softcapping`` to the attention scores.
        final_softcap: apply ``config.final_logit_softcapping`` to the logits.
        sliding: ``"none"``; ``"all"`` (``config.sliding_window`` on every layer, ``None`` = off; Mistral);
            ``"layer_types"`` (on the layers ``config.layer_types`` marks ``sliding_attention``).
        rope_by_layer_type: ``rope_parameters`` may be nested by layer type (one RoPE table per type).
        model_class: ``"module:attribute"`` of the model class the loader builds, called as
            ``cls(config, dtype=dtype)``.
        config_builder: ``"module:attribute"`` of a ``(hf_config, torch_dtype) -> ModelConfig`` function
            that :meth:`ModelConfig.from_hf <kvpage.model.config.ModelConfig.from_hf>` calls instead of its
            own flattening (a family whose cache layout is not Llama's, e.g. MLA); ``None`` for the shared
            decoder's families.
    """

    model_type: str
    hf_class: str
    activation_key: str = "hidden_act"
    activations: tuple[str, ...] = ("silu",)
    attention_bias: Literal["none", "qkv", "flag"] = "none"
    qk_norm: bool = False
    norm: Literal["rms", "gemma"] = "rms"
    sandwich_norms: bool = False
    embed_scale: bool = False
    scale_from_query_pre_attn_scalar: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    sliding: Literal["none", "all", "layer_types"] = "none"
    rope_by_layer_type: bool = False
    model_class: str = SHARED_DECODER
    config_builder: str | None = None


def _gemma(model_type: str, hf_class: str, *, attn_softcap: bool = False, qk_norm: bool = False,
           rope_by_layer_type: bool = False) -> Family:
    """What Gemma 2 and Gemma 3 share: 1+w norms, sandwich norms, scaled embeddings, GeGLU, pre-attn scalar."""
    return Family(model_type, hf_class, activation_key="hidden_activation", activations=("gelu_pytorch_tanh",),
                  attention_bias="flag", qk_norm=qk_norm, norm="gemma", sandwich_norms=True, embed_scale=True,
                  scale_from_query_pre_attn_scalar=True, attn_softcap=attn_softcap, final_softcap=True,
                  sliding="layer_types", rope_by_layer_type=rope_by_layer_type)


#: Every family kvpage runs, keyed by ``model_type``.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", sliding="all"),
    Family("qwen2", "Qwen2ForCausalLM", attention_bias="qkv", sliding="layer_types"),
    Family("qwen3", "Qwen3ForCausalLM", attention_bias="flag", qk_norm=True, sliding="layer_types"),
    _gemma("gemma2", "Gemma2ForCausalLM", attn_softcap=True),
    _gemma("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, rope_by_layer_type=True),
    # multi-head latent attention: its own layer code and a key-only latent cache (kvpage.model.deepseek)
    Family("deepseek_v3", "DeepseekV3ForCausalLM", model_class="kvpage.model.deepseek:DeepseekV3ForCausalLM",
           config_builder="kvpage.model.deepseek:mla_model_config"),
)}


def family_for(model_type: str | None) -> Family:
    """The registered family of a transformers ``model_type``.

    Raises:
        ValueError: not registered; the message names it and lists the supported types.
    """
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise ValueError(f"unsupported architecture {model_type!r}; kvpage's model supports model_type in "
                         f"{tuple(FAMILIES)}")
    return family


def load_attr(path: str) -> Any:
    """The object a ``"module:attribute"`` path names (imported on first use, so this module imports no model code).

    Raises:
        ImportError, AttributeError: the module or attribute does not exist.
    """
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def nested_rope_parameters(hf_config: Any) -> dict[str, dict[str, Any]] | None:
    """``rope_parameters`` keyed by layer type (Gemma 3), or ``None`` when the config has one flat dict.

    A dict is nested when some key is a layer type the config declares (transformers' own rule); then
    every entry keyed by a declared or standard layer type is returned (a config whose layers all slide
    still has its ``full_attention`` entry), except entries saved as ``None``.
    """
    rope = getattr(hf_config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return None
    declared = set(getattr(hf_config, "layer_types", None) or ())
    if not declared or not any(key in declared for key in rope):
        return None
    keys = declared | {FULL_ATTENTION, SLIDING_ATTENTION}
    return {k: dict(v) for k, v in rope.items() if k in keys and v is not None}


@dataclass(frozen=True)
class Architecture:
    """One model's resolved family choices (built by :func:`resolve`).

    Attributes:
        family: the family description.
        activation: the gated MLP's activation (one of ``family.activations``).
        qkv_bias, o_bias: the q/k/v and output projections have biases.
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (length ``num_layers``).
        sliding_window: window of the ``sliding_attention`` layers (positive), ``None`` when no layer slides.
        scale: softmax scale, ``None`` for ``head_dim ** -0.5``.
        attn_softcap: tanh cap of the attention scores, or ``None``.
        final_softcap: tanh cap of the logits, or ``None``.
        rope_layer_types: layer types with their own RoPE parameters (nested ``rope_parameters``), in
            table order after the shared table; empty when every layer uses the config's one RoPE.
    """

    family: Family
    activation: str
    qkv_bias: bool
    o_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    scale: float | None
    attn_softcap: float | None
    final_softcap: float | None
    rope_layer_types: tuple[str, ...] = ()

    def attention(self, layer_index: int) -> LayerAttention:
        """The :class:`LayerAttention` (scale, sliding window, soft-cap) of layer ``layer_index``.

        Raises:
            IndexError: ``layer_index`` outside ``[0, num_layers)``.
        """
        if not 0 <= layer_index < len(self.layer_types):
            raise IndexError(f"layer_index must be in [0, {len(self.layer_types)}), got {layer_index}")
        window = self.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None
        if window is None and self.scale is None and self.attn_softcap is None:
            return PLAIN
        return LayerAttention(scale=self.scale, sliding_window=window, logit_softcap=self.attn_softcap)

    def rope_table(self, layer_index: int) -> int:
        """Index of the RoPE table layer ``layer_index`` uses: 0 the shared (``full_attention``) one, else
        ``1 + rope_layer_types.index(its type)``."""
        layer_type = self.layer_types[layer_index]
        return 1 + self.rope_layer_types.index(layer_type) if layer_type in self.rope_layer_types else 0


def _positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not float(value) > 0:
        raise ValueError(f"{name} must be positive or None, got {value!r}")
    return float(value)


def resolve(model_type: str, hf_config: Any, num_layers: int) -> Architecture:
    """The concrete choices of one model of a registered family.

    Args:
        model_type: the family key (``ModelConfig.model_type``).
        hf_config: the checkpoint's transformers config, or ``None`` (a hand-built Llama config: defaults).
        num_layers: decoder layers of the model.

    Returns:
        The resolved :class:`Architecture`.

    Raises:
        ValueError: unknown ``model_type``; an activation the family does not implement; attention biases
            on a family without them, or ``mlp_bias``; bidirectional attention; ``layer_types`` of a
            length other than ``num_layers`` or with an unknown type; a non-positive window, scale or cap.
    """
    fam = family_for(model_type)

    def get(name: str, default: Any = None) -> Any:
        return default if hf_config is None else getattr(hf_config, name, default)

    act = get(fam.activation_key) or get("hidden_act") or fam.activations[0]
    if act not in fam.activations:
        raise ValueError(f"unsupported activation {act!r} for {model_type}; implemented: {fam.activations}")
    flag = bool(get("attention_bias", False))
    if flag and fam.attention_bias == "none":
        raise ValueError(f"unsupported attention_bias=True for {model_type}: kvpage's {model_type} forward has no "
                         "attention bias terms")
    if get("mlp_bias", False):
        raise ValueError(f"unsupported mlp_bias=True for {model_type}: kvpage's MLP has no bias terms")
    if get("use_bidirectional_attention", False):
        raise ValueError(f"unsupported use_bidirectional_attention=True for {model_type}: kvpage attends causally")

    window: int | None = None
    if fam.sliding == "all":
        types = [SLIDING_ATTENTION if get("sliding_window") is not None else FULL_ATTENTION] * num_layers
    elif fam.sliding == "layer_types" and get("layer_types") is not None:
        types = list(get("layer_types"))
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    else:
        types = [FULL_ATTENTION] * num_layers
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown} for {model_type}")
    if SLIDING_ATTENTION in types:
        window = get("sliding_window")
        if window is not None and not int(window) > 0:
            raise ValueError(f"sliding_window must be positive or None, got {window!r}")
        window = None if window is None else int(window)

    scale = None
    if fam.scale_from_query_pre_attn_scalar:
        scalar = _positive_or_none("query_pre_attn_scalar", get("query_pre_attn_scalar"))
        scale = None if scalar is None else scalar ** -0.5
    nested = nested_rope_parameters(hf_config) if fam.rope_by_layer_type else None
    rope_types = tuple(t for t in sorted(nested or ()) if t != FULL_ATTENTION and t in types)
    return Architecture(
        family=fam,
        activation=str(act),
        qkv_bias=fam.attention_bias == "qkv" or (fam.attention_bias == "flag" and flag),
        o_bias=fam.attention_bias == "flag" and flag,
        layer_types=tuple(types),
        sliding_window=window,
        scale=scale,
        attn_softcap=_positive_or_none("attn_logit_softcapping", get("attn_logit_softcapping"))
        if fam.attn_softcap else None,
        final_softcap=_positive_or_none("final_logit_softcapping", get("final_logit_softcapping"))
        if fam.final_softcap else None,
        rope_layer_types=rope_types,
    )


def layer_windows(model_type: str, hf_config: Any, num_layers: int) -> list[int | None]:
    """Per layer, its sliding window in tokens or ``None`` (full attention), from the config alone (no weights):
    what the model's ``attention_params`` will say, for sizing a cache before a model is built.

    Raises:
        ValueError: as :func:`resolve` (an unregistered family, an unsupported setting).
    """
    if family_for(model_type).config_builder is not None:  # families with their own layer code: no windows yet
        return [None] * num_layers
    arch = resolve(model_type, hf_config, num_layers)
    return [arch.attention(i).sliding_window for i in range(num_layers)]
