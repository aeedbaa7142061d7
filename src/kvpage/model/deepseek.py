"""DeepSeek-V3-style decoder with multi-head latent attention (MLA) whose KV cache is the compressed latent.

MLA (DeepSeek-V2 paper, Liu et al. 2024, arXiv:2405.04434, sec. 2.1; kept in DeepSeek-V3,
arXiv:2412.19437) compresses each token's keys and values into one latent
``c_kv = RMSNorm(h @ W_DKV)`` of width ``R = kv_lora_rank`` plus one decoupled RoPE key ``k_pe`` of
width ``r = qk_rope_head_dim`` shared by all heads. Per head ``h`` the full key is
``[c_kv @ W_UK_h.T, k_pe]`` and the value ``c_kv @ W_UV_h.T``, with ``W_UK_h [n, R]`` and
``W_UV_h [v, R]`` the two parts of ``kv_b_proj`` (``n = qk_nope_head_dim``, ``v = v_head_dim``).

This module runs the *absorbed* form (the paper's "absorb W_UK into W_Q and W_UV into W_O") for every
step, prefill and decode alike, so the cache never holds anything but the latent:

* query: ``q_lat_h = q_nope_h @ W_UK_h`` (``[R]``), handed to attention as ``cat(q_lat, q_pe)``
  ``[T, H, R + r]``;
* key: ``cat(c_kv, k_pe)`` ``[T, 1, R + r]``, value ``None`` (a key-only cache: the keys serve as values);
  ``q . k`` over the concatenation is ``q_nope_h . k_nope_h + q_pe_h . k_pe`` exactly, so with the
  softmax scale of :meth:`DeepseekV3ForCausalLM.attention_params` (``(n + r) ** -0.5``, times YaRN's
  ``mscale**2``) the scores equal transformers';
* output: attention returns ``[T, H, R + r]``; its first ``R`` channels are ``softmax @ c_kv``, which
  ``W_UV_h`` maps to the head's ``[v]`` output before ``o_proj``.

The cache-facing :class:`~kvpage.model.config.ModelConfig` (:func:`mla_model_config`) therefore has
``num_kv_heads = 1``, ``head_dim = R + r`` and ``kv_has_value = False``: ``R + r`` elements per token
and layer instead of ``H * (n + r + v)``.

Numerics follow transformers' ``modeling_deepseek_v3`` (5.x): RMSNorm in float32 (the ``q_a`` and
``kv_a`` norms with transformers' fixed ``eps = 1e-6``), RoPE tables in float32 cast to the model
dtype, interleaved-pair rotation when ``rope_interleave`` (the default) else rotate-half, SiLU-gated
MLP; from layer ``first_k_dense_replace`` on the MLP is DeepSeek-V3's routed mixture of experts with shared
experts (:mod:`kvpage.model.mlp`).
Notation: ``T`` tokens, ``H`` query heads, ``E`` hidden, ``I`` MLP width, ``V`` vocabulary, ``P``
positions, ``Q`` = ``q_lora_rank``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model import linear as packed_linear
from kvpage.model.attention_fn import AttentionFn, check_forward_args
from kvpage.model.config import ModelConfig, common_hf_fields
from kvpage.model.linear import PackedLinear
from kvpage.model.llama import RMSNorm, rope_inv_freq
from kvpage.model.mlp import DenseMLP, MoEDims, MoEMLP, split_fused_experts
from kvpage.ops.layer_attention import LayerAttention

#: ``model_type`` values this module computes exactly.
MLA_MODEL_TYPES: tuple[str, ...] = ("deepseek_v3",)

#: transformers builds ``q_a_layernorm`` and ``kv_a_layernorm`` as ``DeepseekV3RMSNorm(rank)``: default eps,
#: not ``config.rms_norm_eps``.
LATENT_NORM_EPS = 1e-6

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MLADims:
    """The MLA widths of a DeepSeek config (read from ``ModelConfig.hf_config``).

    Attributes:
        q_lora_rank: ``Q``, the query down-projection rank, or ``None`` (a direct ``q_proj``).
        kv_lora_rank: ``R``, the latent width cached per token.
        qk_nope_head_dim: ``n``, per-head query/key width without RoPE.
        qk_rope_head_dim: ``r``, the decoupled RoPE width (one shared key head).
        v_head_dim: ``v``, per-head value width.
        rope_interleave: RoPE rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (else rotate-half).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @classmethod
    def from_hf(cls, hf_config: Any) -> MLADims:
        """Read the widths from a transformers ``DeepseekV3Config``."""
        q, c = getattr(hf_config, "q_lora_rank", None), hf_config
        return cls(None if q is None else int(q), int(c.kv_lora_rank), int(c.qk_nope_head_dim),
                   int(c.qk_rope_head_dim), int(c.v_head_dim), bool(getattr(c, "rope_interleave", True)))

    @property
    def qk_head_dim(self) -> int:
        """``n + r``: the per-head query/key width transformers' softmax scale is based on."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """``R + r``: the cached key width (latent plus RoPE key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_model_config(hf_config: Any, torch_dtype: torch.dtype | None = None) -> ModelConfig:
    """The cache-facing :class:`ModelConfig` of a DeepSeek-V3 (MLA) checkpoint.

    ``num_kv_heads = 1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``, ``kv_has_value = False``
    (per token and layer the cache holds ``cat(c_kv, k_pe)``; keys serve as values);
    ``num_heads`` is the query heads, ``intermediate_size`` the dense MLP width (the first
    ``first_k_dense_replace`` layers; the others are MoE, :class:`~kvpage.model.mlp.MoEDims`).
    ``hf_config`` is kept on the result (RoPE init and the MLA widths are read from it).

    Args:
        hf_config: a transformers ``DeepseekV3Config`` (``model_type == "deepseek_v3"``).
        torch_dtype: overrides the config's ``dtype``/``torch_dtype`` (default float32).

    Raises:
        ValueError: naming what is unsupported: another ``model_type``; MoE widths that do not route
            (:meth:`~kvpage.model.mlp.MoEDims.from_hf`); an activation other than SiLU; attention or MLP
            biases; a quantized (e.g. FP8) checkpoint;
            a RoPE type outside :data:`~kvpage.model.config.SUPPORTED_ROPE_TYPES` or a partial rotary
            factor; an odd ``qk_rope_head_dim``.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MLA_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r} for the MLA model; supported: {MLA_MODEL_TYPES}")
    if first_moe_layer(hf_config) < int(hf_config.num_hidden_layers):
        MoEDims.from_hf(hf_config)  # raises on widths that do not route
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported activation {act!r}; only 'silu' (SwiGLU) is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"unsupported {flag}=True: kvpage's MLA forward has no bias terms")
    if getattr(hf_config, "quantization_config", None):
        raise ValueError("unsupported quantized checkpoint (quantization_config is set, e.g. DeepSeek-V3's FP8 "
                         "weights with weight_scale_inv): dequantize it first")
    fields = common_hf_fields(hf_config, torch_dtype)   # raises on an unsupported RoPE
    dims = MLADims.from_hf(hf_config)
    if dims.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {dims.qk_rope_head_dim}")
    return ModelConfig(**fields, num_kv_heads=1, head_dim=dims.cache_dim, kv_has_value=False)


def first_moe_layer(hf_config: Any) -> int:
    """Index of the first MoE layer (transformers' ``first_k_dense_replace``; 0 when unset, as its default of 3 is
    applied by the config class itself); ``num_hidden_layers`` or more: every MLP is dense."""
    return int(getattr(hf_config, "first_k_dense_replace", 0) or 0)


def mla_softmax_scale(config: ModelConfig) -> float:
    """transformers' ``DeepseekV3Attention.scaling``: ``qk_head_dim ** -0.5``, times ``mscale**2`` under YaRN.

    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the RoPE type is not ``"default"``,
    ``mscale_all_dim`` is set and ``factor > 1`` (transformers' ``yarn_apply_mscale``; the DeepSeek-V2
    paper's long-context extension with YaRN, Peng et al. 2023). This is the scale of the *full* ``n + r`` dot product, which the absorbed ``R + r`` product equals.
    """
    scale = MLADims.from_hf(config.to_hf()).qk_head_dim ** -0.5
    rope = config.rope_scaling or {}
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    factor = float(rope.get("factor", 1.0) or 1.0)
    if config.rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def mla_rope_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[max_position_embeddings, r]`` in ``dtype``, as ``DeepseekV3RotaryEmbedding.forward``.

    Inverse frequencies and the cos/sin scaling (YaRN's attention factor) come from transformers'
    ``ROPE_INIT_FUNCTIONS`` via :func:`kvpage.model.llama.rope_inv_freq` (its config has
    ``head_dim = qk_rope_head_dim``); ``emb = cat(freqs, freqs)`` in float32, then cast.
    """
    inv_freq, scaling = rope_inv_freq(config)  # [r/2]
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, r]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, heads, r]`` with per-token ``cos, sin [T, 1, r]`` (already indexed by position).

    ``interleave``: transformers' ``apply_rotary_pos_emb_interleave`` (pairs ``(x[2i], x[2i+1])`` rotated
    by angle ``i``, output de-interleaved as ``[evens, odds]``; q and k share the layout, so ``q . k`` is
    that of the interleaved form). Otherwise rotate-half, ``x * cos + rotate_half(x) * sin``.
    """
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]  # [T, 1, r/2]
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, r/2] each
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [T, heads, r]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, r]
    return x * cos + rotated * sin  # [T, heads, r]


class MLADecoderLayer(nn.Module):
    """Pre-norm MLA attention (absorbed form) + SwiGLU MLP.

    Fused parameters (filled by :meth:`DeepseekV3ForCausalLM.load_hf_state_dict`):
    ``in_proj [Qo + R + r, E]`` = rows of ``q_proj`` (``Qo = H*(n+r)``) or ``q_a_proj`` (``Qo = Q``), then
    ``kv_a_proj_with_mqa``; ``q_b_proj [H*(n+r), Q]`` when ``q_lora_rank`` is set; the absorbed
    ``w_uk [H, n, R]`` and ``w_uv_t [H, R, v]`` (from ``kv_b_proj [H*(n+v), R]``); ``o_proj [E, H*v]``;
    RMSNorm weights; ``mlp``: a :class:`~kvpage.model.mlp.DenseMLP` before ``first_k_dense_replace``, else a
    :class:`~kvpage.model.mlp.MoEMLP`.
    """

    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = MLADims.from_hf(config.to_hf())
        self.dims, self.layer_index, self.num_heads = d, layer_index, config.num_heads
        E, H, inter = config.hidden_size, config.num_heads, config.intermediate_size
        self.q_out = H * d.qk_head_dim if d.q_lora_rank is None else d.q_lora_rank
        meta = {"dtype": dtype, "device": "meta"}
        self.input_layernorm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.in_proj = nn.Linear(E, self.q_out + d.cache_dim, bias=False, **meta)
        self.q_a_layernorm = None if d.q_lora_rank is None else RMSNorm(d.q_lora_rank, LATENT_NORM_EPS, dtype)
        self.q_b_proj = None if d.q_lora_rank is None else nn.Linear(d.q_lora_rank, H * d.qk_head_dim, bias=False, **meta)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.register_buffer("w_uk", torch.empty(H, d.qk_nope_head_dim, d.kv_lora_rank, **meta), persistent=False)
        self.register_buffer("w_uv_t", torch.empty(H, d.kv_lora_rank, d.v_head_dim, **meta), persistent=False)
        self.o_proj = nn.Linear(H * d.v_head_dim, E, bias=False, **meta)
        hf = config.hf_config
        self.mlp: DenseMLP | MoEMLP = (DenseMLP(E, inter, dtype) if layer_index < first_moe_layer(hf) else
                                       MoEMLP(E, MoEDims.from_hf(hf), dtype))

    def attention(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttentionFn) -> torch.Tensor:
        """Absorbed MLA over the cache: normed ``h [T, E]`` -> ``[T, H*v]`` (before ``o_proj``)."""
        d, H, T = self.dims, self.num_heads, h.shape[0]
        R, n = d.kv_lora_rank, d.qk_nope_head_dim
        proj = self.in_proj(h)  # [T, Qo + R + r]
        q = proj[:, : self.q_out]  # [T, Qo]
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))  # [T, H*(n+r)]
        q = q.view(T, H, d.qk_head_dim)  # [T, H, n+r]
        c_kv = self.kv_a_layernorm(proj[:, self.q_out : self.q_out + R])  # [T, R]
        k_pe = proj[:, self.q_out + R :].view(T, 1, d.qk_rope_head_dim)  # [T, 1, r]
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, r]
        q_pe = apply_rope(q[..., n:], c, s, d.rope_interleave)  # [T, H, r]
        k_pe = apply_rope(k_pe, c, s, d.rope_interleave)  # [T, 1, r]
        q_lat = torch.bmm(q[..., :n].transpose(0, 1), self.w_uk)  # [H, T, R]: q_nope_h @ W_UK_h
        q_full = torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)  # [T, H, R+r]
        k_full = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)  # [T, 1, R+r]
        o = attn(self.layer_index, q_full, k_full, None)  # [T, H, R+r]; keys are values
        o_lat = o[..., :R].transpose(0, 1)  # [H, T, R]: softmax @ c_kv per head
        return torch.bmm(o_lat, self.w_uv_t).transpose(0, 1).reshape(T, H * d.v_head_dim)  # [T, H*v]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """One decoder layer.

        Args:
            x: ``[T, E]`` residual stream.
            positions: ``[T]`` int64 positions.
            cos, sin: ``[P, r]`` RoPE tables (:func:`mla_rope_tables`), indexed by ``positions``.
            attn: attention over the cache; called once with this layer's index, ``v=None``.

        Returns:
            ``[T, E]`` updated residual stream.
        """
        x = x + self.o_proj(self.attention(self.input_layernorm(x), positions, cos, sin, attn))  # [T, E]
        h = self.post_attention_layernorm(x)  # [T, E]
        return x + self.mlp(h)  # [T, E]


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3-architecture causal LM with absorbed MLA over a latent KV cache.

    Embedding -> ``num_layers`` pre-norm layers (MLA, then a SwiGLU MLP or the MoE) -> final RMSNorm -> LM head
    (tied when ``config.tie_word_embeddings``), as transformers' ``DeepseekV3ForCausalLM``. The attention callable
    receives ``q [T, H, R+r]``, ``k [T, 1, R+r]``, ``v=None`` per layer (see the module docstring) and must
    use the scale of :meth:`attention_params`. Weights live on ``meta`` until :meth:`load_hf_state_dict`;
    all parameters have ``requires_grad=False``.

    Args:
        config: from :func:`mla_model_config` (its ``hf_config`` is required).
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Raises:
        ValueError: unsupported ``dtype``, or a config that is not an MLA one (no ``hf_config``,
            ``kv_has_value`` true, or ``head_dim != kv_lora_rank + qk_rope_head_dim``).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"unsupported model dtype {dtype}; use one of {_SUPPORTED_DTYPES}")
        if config.hf_config is None or config.kv_has_value or config.num_kv_heads != 1:
            raise ValueError("DeepseekV3ForCausalLM needs the key-only config of mla_model_config(hf_config)")
        self.dims = MLADims.from_hf(config.hf_config)
        if config.head_dim != self.dims.cache_dim:
            raise ValueError(f"config.head_dim {config.head_dim} != kv_lora_rank + qk_rope_head_dim "
                             f"{self.dims.cache_dim}")
        self.config, self.dtype = config, dtype
        E = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, E, dtype=dtype, device="meta")
        self.layers = nn.ModuleList(MLADecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(E, config.vocab_size, bias=False,
                                                                          dtype=dtype, device="meta")
        self.tied_lm_head: PackedLinear | None = None
        self._attention = LayerAttention(scale=mla_softmax_scale(config))
        cos, sin = mla_rope_tables(config, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, r]
        self.register_buffer("rope_sin", sin, persistent=False)  # [P, r]
        self.requires_grad_(False)

    def attention_params(self, layer_index: int) -> LayerAttention:
        """Layer ``layer_index``'s attention knobs: the MLA softmax scale (:func:`mla_softmax_scale`), no window.

        Raises:
            IndexError: no such layer.
        """
        if not 0 <= layer_index < len(self.layers):
            raise IndexError(f"layer {layer_index} outside [0, {len(self.layers)})")
        return self._attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Run the decoder over ``T`` tokens of one or more sequences (varlen, requests concatenated).

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 positions within each sequence, in ``[0, max_position_embeddings)``.
            attn: called once per layer as ``attn(layer_index, q [T,H,R+r], k [T,1,R+r], None)`` with
                contiguous model-dtype tensors (RoPE applied to the last ``r`` channels); returns ``[T,H,R+r]``.

        Returns:
            ``[T, E]`` final-normed hidden states; see :meth:`compute_logits`.

        Raises:
            IndexError: a position out of range.
        """
        return self.forward_layers(input_ids, positions, attn, len(self.layers))

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                       num_layers: int) -> torch.Tensor:
        """The first ``num_layers`` layers, then the final norm (the ``layer_skip`` early exit); as :meth:`forward`.

        Raises:
            ValueError: ``num_layers`` outside ``[1, num_layers of the model]``.
            IndexError: a position out of range.
        """
        check_forward_args(positions, num_layers, len(self.layers), self.rope_cos.shape[0])
        x = self.embed_tokens(input_ids)  # [T, E]
        for layer in self.layers[:num_layers]:
            x = layer(x, positions, self.rope_cos, self.rope_sin, attn)  # [T, E]
        return self.norm(x)  # [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``hidden [N, E]`` (model dtype) -> float32 logits ``[N, V]``."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, V]
        if self.tied_lm_head is not None and self.tied_lm_head.is_packed:
            return self.tied_lm_head(hidden).float()  # [N, V]
        return F.linear(hidden, self.embed_tokens.weight).float()  # [N, V]

    # -- weights -------------------------------------------------------------------------------

    def hf_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes this model takes, as transformers' ``DeepseekV3ForCausalLM`` names them.

        ``q_proj`` when ``q_lora_rank`` is ``None``, else ``q_a_proj``, ``q_a_layernorm`` and ``q_b_proj``;
        ``lm_head.weight`` only with untied embeddings; each layer's ``mlp.*`` as its MLP names them
        (dense, or the MoE's router, routed and shared experts).
        """
        c, d = self.config, self.dims
        E, H = c.hidden_size, c.num_heads
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, E)
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            shapes[p + "input_layernorm.weight"] = (E,)
            shapes[p + "post_attention_layernorm.weight"] = (E,)
            if d.q_lora_rank is None:
                shapes[a + "q_proj.weight"] = (H * d.qk_head_dim, E)
            else:
                shapes[a + "q_a_proj.weight"] = (d.q_lora_rank, E)
                shapes[a + "q_a_layernorm.weight"] = (d.q_lora_rank,)
                shapes[a + "q_b_proj.weight"] = (H * d.qk_head_dim, d.q_lora_rank)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (d.cache_dim, E)
            shapes[a + "kv_a_layernorm.weight"] = (d.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)
            shapes[a + "o_proj.weight"] = (E, H * d.v_head_dim)
            shapes.update(self.layers[i].mlp.hf_shapes(p + "mlp."))
        return shapes

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Put weights named as in transformers' ``DeepseekV3ForCausalLM`` into this model.

        Every tensor is cast to the model dtype (a tensor already in it is used without a copy: do not
        modify ``sd`` afterwards). ``q_proj``/``q_a_proj`` and ``kv_a_proj_with_mqa`` become one fused
        ``in_proj``; ``kv_b_proj`` is split once into the absorbed ``w_uk [H, n, R]`` and
        ``w_uv_t [H, R, v]``; projections become :class:`~kvpage.model.linear.PackedLinear` (as in
        :meth:`kvpage.model.llama.LlamaForCausalLM.load_hf_state_dict`); MoE experts are stacked per layer
        (:meth:`~kvpage.model.mlp.MoEMLP.load`; checkpoint names, or transformers' fused in-memory ones:
        :func:`~kvpage.model.mlp.split_fused_experts`), the router kept in float32. Ignored: ``*rotary_emb.inv_freq``,
        a tied ``lm_head.weight``, and ``model.layers.{i}.*`` for ``i >= num_layers`` (DeepSeek-V3's MTP
        module, which transformers ignores too).

        Args:
            sd: ``{name: tensor}``, any float dtype, on any one device.

        Raises:
            ValueError: naming every missing tensor, unexpected tensor and shape mismatch at once;
                nothing is loaded then.
        """
        c, d = self.config, self.dims
        sd = split_fused_experts(sd)  # transformers' in-memory MoE layout -> the checkpoint's names
        expected = self.hf_parameter_shapes()
        ignored = {n for n in sd if n.endswith("rotary_emb.inv_freq")}
        ignored |= {n for n in sd if n.startswith("model.layers.") and n.split(".")[2].isdigit()
                    and int(n.split(".")[2]) >= c.num_layers}
        if c.tie_word_embeddings:
            ignored.add("lm_head.weight")
        missing = sorted(set(expected) - set(sd))
        unexpected = sorted(set(sd) - set(expected) - ignored)
        mismatched = [f"{n}: expected {expected[n]}, found {tuple(sd[n].shape)}"
                      for n in expected if n in sd and tuple(sd[n].shape) != expected[n]]
        if missing or unexpected or mismatched:
            parts = [f"{what} {len(names)} tensor(s): {', '.join(names[:20])}" + (" ..." if len(names) > 20 else "")
                     for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
            if mismatched:
                parts.append(f"shape mismatch in {len(mismatched)} tensor(s): {'; '.join(mismatched[:20])}")
            raise ValueError("state dict does not fit this DeepSeek-V3 (MLA) config: " + " | ".join(parts))

        def gather(*names: str) -> torch.Tensor:
            tensors = [sd[n].to(self.dtype) for n in names]
            return (tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)).contiguous()

        def put(module: nn.Module, name: str) -> None:
            module.weight = nn.Parameter(gather(name), requires_grad=False)

        put(self.embed_tokens, "model.embed_tokens.weight")
        put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            self.lm_head = PackedLinear(gather("lm_head.weight"))
        self.tied_lm_head = None
        if self.lm_head is None and packed_linear.PACK_TIED_LM_HEAD:
            self.tied_lm_head = PackedLinear(self.embed_tokens.weight, copy_of_shared=True)
        H, n, v, R = c.num_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            put(layer.input_layernorm, p + "input_layernorm.weight")
            put(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
            q_name = a + ("q_proj.weight" if d.q_lora_rank is None else "q_a_proj.weight")
            layer.in_proj = PackedLinear(gather(q_name, a + "kv_a_proj_with_mqa.weight"))
            if d.q_lora_rank is not None:
                put(layer.q_a_layernorm, a + "q_a_layernorm.weight")
                layer.q_b_proj = PackedLinear(gather(a + "q_b_proj.weight"))
            put(layer.kv_a_layernorm, a + "kv_a_layernorm.weight")
            kv_b = sd[a + "kv_b_proj.weight"].to(self.dtype).view(H, n + v, R)  # rows per head: k_nope, then v
            layer.w_uk = kv_b[:, :n].contiguous()  # [H, n, R]
            layer.w_uv_t = kv_b[:, n:].transpose(1, 2).contiguous()  # [H, R, v]
            layer.o_proj = PackedLinear(gather(a + "o_proj.weight"))
            layer.mlp.load(sd, p + "mlp.")
