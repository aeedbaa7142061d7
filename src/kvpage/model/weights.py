"""Checkpoint tensors of the shared decoder: transformers' names and shapes per family, and loading them.

Names are those of the family's transformers causal-LM class (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``...): ``model.embed_tokens.weight``,
``model.norm.weight``, ``lm_head.weight`` (untied only) and per layer
``model.layers.{i}.`` + ``input_layernorm``, ``post_attention_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` weights, plus what the
:class:`~kvpage.model.families.Architecture` adds: ``self_attn.{q,k,v}_proj.bias``,
``self_attn.o_proj.bias``, ``self_attn.{q,k}_norm.weight`` and
``{pre,post}_feedforward_layernorm.weight``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpage.model.config import ModelConfig
from kvpage.model.families import Architecture
from kvpage.model.linear import PackedLinear

if TYPE_CHECKING:
    from kvpage.model.decoder import DecoderForCausalLM


def parameter_shapes(config: ModelConfig, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model takes, with its shape, as transformers names them for this family.

    Args:
        config: sizes.
        arch: the resolved family choices (biases, q/k norms, sandwich norms).

    Returns:
        ``{name: shape}``; ``lm_head.weight`` only when embeddings are untied.
    """
    c, fam = config, arch.family
    E, D, inter, H, Hkv = c.hidden_size, c.head_dim, c.intermediate_size, c.num_heads, c.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if fam.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for n in norms:
            shapes[p + n + ".weight"] = (E,)
        shapes[p + "self_attn.q_proj.weight"] = (H * D, E)
        shapes[p + "self_attn.k_proj.weight"] = (Hkv * D, E)
        shapes[p + "self_attn.v_proj.weight"] = (Hkv * D, E)
        shapes[p + "self_attn.o_proj.weight"] = (E, H * D)
        if arch.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (H * D,)
            shapes[p + "self_attn.k_proj.bias"] = (Hkv * D,)
            shapes[p + "self_attn.v_proj.bias"] = (Hkv * D,)
        if arch.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (E,)
        if fam.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, E)
        shapes[p + "mlp.up_proj.weight"] = (inter, E)
        shapes[p + "mlp.down_proj.weight"] = (E, inter)
    return shapes


def check_state_dict(expected: dict[str, tuple[int, ...]], sd: dict[str, torch.Tensor], tied: bool,
                     what: str) -> None:
    """Raise one ``ValueError`` naming every missing, unexpected and mis-shaped tensor of ``sd``.

    Ignored: ``*.rotary_emb.inv_freq`` buffers (old checkpoints) and, when ``tied``, ``lm_head.weight``
    (some checkpoints store the tied copy). ``what`` names the model in the message.
    """
    ignored = {n for n in sd if n.endswith("rotary_emb.inv_freq")}
    if tied:
        ignored.add("lm_head.weight")
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected) - ignored)
    mismatched = [
        f"{n}: expected {expected[n]}, found {tuple(sd[n].shape)}"
        for n in expected
        if n in sd and tuple(sd[n].shape) != expected[n]
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:20])}" + (" ..." if len(unexpected) > 20 else ""))
        if mismatched:
            parts.append(f"shape mismatch in {len(mismatched)} tensor(s): {'; '.join(mismatched[:20])}")
        raise ValueError(f"state dict does not fit this {what} config: " + " | ".join(parts))


def load_hf_weights(model: DecoderForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Put ``sd``'s tensors (transformers names) into ``model``'s parameters, checked first.

    q/k/v rows (and biases) are concatenated into ``qkv_proj`` (``qkv_bias``) and gate/up rows into
    ``gate_up_proj``; every tensor is cast to the model dtype. A tensor that already has the model
    dtype becomes the parameter itself (no copy: a copy into fresh memory costs ~1.5 s of page faults
    for a 135M model), so do not modify ``sd`` afterwards. The projections (and an untied LM head)
    become :class:`~kvpage.model.linear.PackedLinear` modules: bfloat16 CPU weights are prepacked
    into their own memory then, others stay as they are. Parameters end up on the device of the
    given tensors. The tied LM head's packed copy is the caller's business.

    Raises:
        ValueError: see :func:`check_state_dict`; nothing is loaded then.
    """
    cfg = model.config
    check_state_dict(model.hf_parameter_shapes(), sd, cfg.tie_word_embeddings, cfg.model_type)

    def gather(*names: str) -> torch.Tensor:
        tensors = [sd[n].to(model.dtype) for n in names]
        weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return weight.contiguous()

    def put(module: nn.Module, *names: str) -> None:
        module.weight = nn.Parameter(gather(*names), requires_grad=False)

    def put_linear(parent: nn.Module, attr: str, *names: str) -> None:
        setattr(parent, attr, PackedLinear(gather(*names)))

    put(model.embed_tokens, "model.embed_tokens.weight")
    put(model.norm, "model.norm.weight")
    if model.lm_head is not None:
        put_linear(model, "lm_head", "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            if getattr(layer, norm) is not None:
                put(getattr(layer, norm), p + norm + ".weight")
        put_linear(layer, "qkv_proj", *(p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")))
        if layer.qkv_bias is not None:
            layer.qkv_bias = nn.Parameter(gather(*(p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v"))),
                                          requires_grad=False)
        if layer.q_norm is not None:
            put(layer.q_norm, p + "self_attn.q_norm.weight")
            put(layer.k_norm, p + "self_attn.k_norm.weight")
        put_linear(layer, "o_proj", p + "self_attn.o_proj.weight")
        if layer.o_bias is not None:
            layer.o_bias = nn.Parameter(gather(p + "self_attn.o_proj.bias"), requires_grad=False)
        put_linear(layer, "gate_up_proj", *(p + f"mlp.{n}_proj.weight" for n in ("gate", "up")))
        put_linear(layer, "down_proj", p + "mlp.down_proj.weight")
