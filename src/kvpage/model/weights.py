"""Checkpoint tensors of the shared decoder: transformers' names and shapes per family, and the check of a state dict.

Names are those of the family's transformers causal-LM class (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``...): ``model.embed_tokens.weight``,
``model.norm.weight``, ``lm_head.weight`` (untied only) and per layer
``model.layers.{i}.`` + ``input_layernorm``, ``post_attention_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` weights, plus what the
:class:`~kvpage.model.families.Architecture` adds: ``self_attn.{q,k,v}_proj.bias``,
``self_attn.o_proj.bias``, ``self_attn.{q,k}_norm.weight`` and
``{pre,post}_feedforward_layernorm.weight``. Putting them into the modules is the model's own
business (:meth:`kvpage.model.decoder.DecoderForCausalLM.load_hf_state_dict`), so this module
imports only the config and the family choices.
"""
from __future__ import annotations

import torch

from kvpage.model.config import ModelConfig
from kvpage.model.families import Architecture


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
