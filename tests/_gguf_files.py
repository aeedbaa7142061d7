"""GGUF files the tests write themselves, as llama.cpp's ``convert_hf_to_gguf.py`` + ``llama-quantize`` would.

:func:`write_gguf` turns a random-initialised transformers model of any family into a ``.gguf`` with
``gguf.GGUFWriter``: llama.cpp's architecture name and metadata keys, its tensor names (gguf-py's
``TensorNameMap``), its value transforms (Llama's Q/K row permutation, Gemma's norms stored as ``1 + w``),
1-D tensors in F32 and every matrix in the type the caller picks. The tokenizer is a 512-token cut of the
bundled SmolLM2 GGUF's byte-level BPE (its first tokens and the merges among them) with a ChatML template.

``gguf.quants.quantize`` (gguf 0.19) writes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16/F32 but not the K-quants
(``NotImplementedError``), so :func:`quantize_k` is a small reference quantizer for Q4_K, Q5_K and Q6_K:
plain min/max scales (not llama.cpp's search for the best scale), written in the block layout that
``gguf.quants.dequantize`` reads. :func:`write_gguf` returns the state dict the file holds (dequantized,
transforms undone), so a reference model can run on exactly the file's weights.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGML_QUANT_SIZES, GGUFWriter, MODEL_ARCH_NAMES, get_tensor_name_map
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

VOCAB = 512
QK_K = 256
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _scale_min_pack(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into Q4_K's 12 bytes (inverse of ``Q4_K.get_scale_min``)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    d = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mm = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, mm, md], axis=1)


def quantize_k(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K blocks of ``x`` ``[..., n]`` (``n`` a multiple of 256), as ``uint8 [..., bytes]``."""
    shape = x.shape
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    n = blocks.shape[0]
    if qtype == Q.Q6_K:
        sub = blocks.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=-1)  # [n, 16]
        sub_scale = amax / 31.0
        d = np.maximum(sub_scale.max(axis=-1), 1e-12) / 127.0  # [n]
        sc = np.clip(np.round(sub_scale / d[:, None]), -128, 127).astype(np.int8)  # [n, 16]
        eff = d[:, None].astype(np.float16).astype(np.float32) * sc
        q = np.where(eff[..., None] > 0, np.round(sub / np.where(eff == 0, 1, eff)[..., None]), 0)
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # per 128-half: 4 rows of 32
        ql = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
        ql = np.stack(ql, axis=2).reshape(n, 128)  # [half][low/high 32][32]
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        out = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)],
                             axis=1)
        return out.reshape(*shape[:-1], -1)
    levels = 15 if qtype == Q.Q4_K else 31
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n, 8]; value = d*sc*q - dmin*m with m >= 0
    hi = sub.max(axis=-1)
    scale, mins = (hi - lo) / levels, -lo
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63.0
    dmin = np.maximum(mins.max(axis=-1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 0, 63)
    m = np.clip(np.round(mins / dmin16.astype(np.float32)[:, None]), 0, 63)
    eff, off = d16.astype(np.float32)[:, None] * sc, dmin16.astype(np.float32)[:, None] * m
    q = np.where(eff[..., None] > 0, np.round((sub + off[..., None]) / np.where(eff == 0, 1, eff)[..., None]), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, 4, 2, 32)  # 4 chunks of 64: sub-blocks 2j, 2j+1
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    head = [d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), _scale_min_pack(sc, m)]
    if qtype == Q.Q5_K:
        bits = (q >> 4).reshape(n, 8, 32)  # bit 4 of sub-block j goes to bit j of qh[l]
        qh = sum((bits[:, j].astype(np.uint8) << j) for j in range(8)).astype(np.uint8)
        head.append(qh)
    return np.concatenate([*head, qs], axis=1).reshape(*shape[:-1], -1)


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """``x`` in ``qtype``: gguf-py's quantizer, or :func:`quantize_k` for the K-quants."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize_k(x, qtype)
    return gguf_quantize(x.astype(np.float32), qtype)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(writer: GGUFWriter, add_bos: bool, chat_template: str | None = CHATML) -> None:
    """The first :data:`VOCAB` tokens of the bundled SmolLM2 GGUF's byte-level BPE, its merges among them,
    ids BOS 1 / EOS 2 / PAD 2, ``add_bos_token`` = ``add_bos`` and ``chat_template`` (``None``: none)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from kvpage.model.loader import default_model_path

    meta, _ = read_gguf_metadata(str(default_model_path()), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = meta["tokenizer.ggml.tokens"][:VOCAB]
    vocab = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if "".join(m.split(" ")) in vocab and all(p in vocab for p in m.split(" "))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 17 else 1 for i in range(VOCAB)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


#: llama.cpp's ``general.architecture`` for each transformers ``model_type`` (Mistral is written as ``llama``).
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "deepseek_v3": "deepseek2"}


def _deepseek2_metadata(w: GGUFWriter, c: Any, legacy: bool = False) -> None:
    """The keys ``DeepseekV2Model.set_gguf_parameters`` writes today: MLA as MQA over the latent
    (``head_count_kv`` 1, ``key_length`` = ``R + r``, ``value_length`` = ``R``, the per-head widths under
    ``*_mla``), the MoE fields, sigmoid gating and YaRN's ``yarn_log_multiplier`` = ``0.1 * mscale_all_dim``.
    ``legacy``: the older converter's keys instead (``key_length`` = ``n + r``, ``value_length`` = ``v``, no
    ``*_mla``; ``head_count_kv`` is the caller's)."""
    import gguf

    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    if legacy:
        w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length(c.v_head_dim)
    else:
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.n_group > 1:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek2_tensors(c: Any, hf_name: str, x: np.ndarray, legacy: bool = False) -> list[tuple[str, np.ndarray]]:
    """``convert_hf_to_gguf.py``'s ``DeepseekV2Model.modify_tensors`` on one transformers tensor, as
    ``(name, value)`` pairs with transformers-style names that gguf-py's map then renames: the experts
    stacked (``mlp.experts.{gate,up,down}_proj`` ``[X, ...]``), ``kv_b_proj`` ``[H * (n + v), R]`` split into
    ``k_b_proj`` ``[H, R, n]`` (transposed) and ``v_b_proj`` ``[H, v, R]``, the router bias as
    ``exp_probs_b.bias``. ``legacy``: ``kv_b_proj`` kept whole (``attn_kv_b``), as older converters wrote it."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        base, inter = hf_name[: -len("gate_up_proj")], x.shape[1] // 2
        return [(base + "gate_proj.weight", x[:, :inter]), (base + "up_proj.weight", x[:, inter:])]
    if hf_name.endswith("mlp.experts.down_proj"):
        return [(hf_name + ".weight", x)]
    if hf_name.endswith("kv_b_proj.weight") and not legacy:
        n, v = c.qk_nope_head_dim, c.v_head_dim
        kv_b = x.reshape(c.num_attention_heads, n + v, x.shape[-1])
        return [(hf_name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :n].transpose(0, 2, 1))),
                (hf_name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, n:]))]
    return [(hf_name, x)]


def _deepseek2_held(c: Any, written: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """transformers' state dict from the tensors :func:`_deepseek2_tensors` produced (dequantized): the
    inverse of its stacking and splitting."""
    held: dict[str, torch.Tensor] = {}
    for name, x in written.items():
        if name.endswith("mlp.experts.gate_proj.weight"):
            base = name[: -len("gate_proj.weight")]
            held[base + "gate_up_proj"] = torch.from_numpy(np.concatenate([x, written[base + "up_proj.weight"]], 1))
        elif name.endswith("mlp.experts.down_proj.weight"):
            held[name[: -len(".weight")]] = torch.from_numpy(x)
        elif name.endswith(".k_b_proj.weight"):
            v_b = written[name.replace("k_b_proj", "v_b_proj")]
            kv_b = np.concatenate([x.transpose(0, 2, 1), v_b], axis=1)
            held[name.replace("k_b_proj", "kv_b_proj")] = torch.from_numpy(kv_b.reshape(-1, kv_b.shape[-1]).copy())
        elif not name.endswith(("mlp.experts.up_proj.weight", ".v_b_proj.weight")):
            held[name] = torch.from_numpy(x)
    return held


def _gguf_name(name_map: Any, hf_name: str) -> str:
    if hf_name.endswith("mlp.gate.e_score_correction_bias"):  # llama.cpp: blk.N.exp_probs_b.bias
        return f"{name_map.get_name(hf_name[: -len('.gate.e_score_correction_bias')] + '.gate.e_score_correction')}.bias"
    base, _, suffix = hf_name.rpartition(".")
    return f"{name_map.get_name(base)}.{suffix}"


def _metadata(w: GGUFWriter, c: Any, arch: str, name: str, legacy: bool = False) -> None:
    """The hyper-parameters ``convert_hf_to_gguf.py`` writes for ``arch`` (``legacy``: see :func:`write_gguf`)."""
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if arch == "deepseek2" and not legacy else c.num_key_value_heads)  # MLA written as MQA
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if arch in ("llama", "qwen2", "qwen3"):
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_vocab_size(c.vocab_size)
    if arch in ("llama",):
        w.add_rope_dimension_count(c.head_dim)
    if arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if local["rope_theta"] != 10000.0:  # llama.cpp's fixed local base; newer files may state it
            w.add_float32("gemma3.rope.freq_base_swa", local["rope_theta"])
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        pattern = [t == "sliding_attention" for t in c.layer_types]
        default = [i % 6 < 5 for i in range(c.num_hidden_layers)]
        if pattern != default:
            w.add_sliding_window_pattern(pattern)


def write_gguf(model: torch.nn.Module, path: Path, types: dict[str, Q], *, add_bos: bool = False,
               chat_template: str | None = CHATML, name: str = "tiny",
               deepseek_legacy: bool = False) -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers causal LM of a family in :data:`ARCH`) as a GGUF at ``path``.

    Args:
        types: ggml type per matrix role: keys ``"embed"``, ``"output"``, ``"attn_q"``, ``"attn_k"``,
            ``"attn_v"``, ``"attn_output"``, ``"ffn_gate"``, ``"ffn_up"``, ``"ffn_down"``, and for DeepSeek
            llama.cpp's other tensor roles (``"attn_q_a"``, ``"attn_kv_a_mqa"``, ``"attn_k_b"``,
            ``"ffn_gate_exps"``, ...) (missing: F16; F16 also where a row does not fill the type's blocks).
        add_bos, chat_template: the tokenizer's ``add_bos_token`` flag and chat template (``None``: none).
        deepseek_legacy: DeepSeek as the converter wrote it before splitting ``kv_b`` (``attn_kv_b``,
            ``head_count_kv`` = heads, ``key_length`` = ``n + r``, no ``*_mla`` keys).

    Returns:
        The transformers state dict the file holds: every written tensor dequantized and the
        permutation / norm offset undone (what a reader must recover), float32.
    """
    c = model.config
    arch = ARCH[c.model_type]
    w = GGUFWriter(str(path), arch)
    _metadata(w, c, arch, name, deepseek_legacy)
    if arch == "deepseek2":
        _deepseek2_metadata(w, c, deepseek_legacy)
    tokenizer_metadata(w, add_bos, chat_template)
    enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    name_map = get_tensor_name_map(enum, c.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    tensors = [(n, t.detach().float().numpy().copy()) for n, t in model.state_dict().items()]
    if arch == "deepseek2":
        tensors = [pair for n, x in tensors for pair in _deepseek2_tensors(c, n, x, deepseek_legacy)]
    for hf_name, x in tensors:
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name_map, hf_name)
        is_norm = gguf_name.endswith("norm.weight")
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if ".attn_q." in gguf_name else c.num_key_value_heads
            x = _permute(x, heads)
        if arch.startswith("gemma") and is_norm:
            x = x + 1.0
        if x.ndim == 1:
            qtype = Q.F32
        else:
            role = {"token_embd": "embed", "output": "output"}.get(gguf_name.split(".")[0]) or gguf_name.split(".")[2]
            qtype = types.get(role, Q.F16)
            if x.shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # llama-quantize's fallback for rows it cannot block
                qtype = Q.F16
        data = quantize(x, qtype)
        w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
        back = dequantize(data, qtype).reshape(x.shape).astype(np.float32)
        if arch.startswith("gemma") and is_norm:
            back = back - 1.0
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if ".attn_q." in gguf_name else c.num_key_value_heads
            back = _unpermute(back, heads)
        held[hf_name] = torch.from_numpy(back)
    if arch == "deepseek2":
        held = _deepseek2_held(c, {n: t.numpy() for n, t in held.items()})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
