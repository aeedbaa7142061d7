"""A Llama-family decoder in one file (gpt-fast style), for varlen batches over a paged cache.

Notation: ``T`` tokens in this forward pass (all requests concatenated), ``H``
query heads, ``Hkv`` key/value heads, ``D`` head_dim, ``E`` hidden size, ``I``
intermediate size, ``V`` vocabulary.

The model never touches the KV cache: each layer hands its RoPE'd ``q, k, v`` to
an :class:`~kvpage.model.attention_fn.AttentionFn`, which writes ``k, v`` into
the cache and attends over it. Positions are per token (``positions[t]`` is the
index of token ``t`` within its own sequence), so prefill chunks and decode
tokens of different requests mix freely in one call.

Numerics follow transformers' ``modeling_llama`` (RMSNorm in float32, RoPE in
the rotate-half layout with cos/sin computed in float32 and cast to the model
dtype, SiLU-gated MLP); for speed the q/k/v projections run as one matmul and
gate/up as another, and once loaded the projections and the LM head are
:class:`~kvpage.model.linear.PackedLinear` (oneDNN-prepacked weights for
bfloat16 on CPU, plain ``F.linear`` otherwise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model import linear as packed_linear
from kvpage.model.attention_fn import AttentionFn
from kvpage.model.config import ModelConfig
from kvpage.model.linear import PackedLinear
from kvpage.ops import fused

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling, from transformers' own init functions.

    ``"default"`` uses ``LlamaRotaryEmbedding.compute_default_rope_parameters``;
    every other type (``linear``, ``llama3``, ``yarn``) uses
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]``, so the
    scaling math is the library's, not a copy.

    Args:
        config: model config; its :meth:`ModelConfig.to_hf` config is passed to transformers.

    Returns:
        ``(inv_freq, attention_scaling)``: float32 ``[D // 2]`` frequencies
        (radians per position) and the factor transformers multiplies cos/sin by
        (1.0 except for yarn).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = config.to_hf()
    rope_type = config.rope_type
    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None and rope_type == "default":
        init = LlamaRotaryEmbedding.compute_default_rope_parameters
    if init is None:
        raise ValueError(f"transformers has no RoPE init function for rope_type {rope_type!r}")
    inv_freq, attention_scaling = init(hf_config, device=torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def rope_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position RoPE tables for positions ``[0, max_position_embeddings)``.

    Computed in float32 exactly as transformers' ``LlamaRotaryEmbedding.forward``
    (``freqs = pos * inv_freq``, ``emb = cat(freqs, freqs)``, times the attention
    scaling), then cast to ``dtype``. The sine table has its first half negated so
    that RoPE is ``x * cos + swap_halves(x) * sin_signed``, which equals
    transformers' ``x * cos + rotate_half(x) * sin`` bit for bit.

    Returns:
        ``(cos, sin_signed)``, each ``[max_position_embeddings, D]`` in ``dtype``.
    """
    inv_freq, scaling = rope_inv_freq(config)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    cos = emb.cos() * scaling  # [P, D]
    sin = emb.sin() * scaling  # [P, D]
    half = config.head_dim // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [P, D]
    return cos.to(dtype), sin_signed.to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed as transformers' ``LlamaRMSNorm``.

    ``y = weight * (x / sqrt(mean(x^2) + eps))`` with the normalisation in
    float32 and the result cast back to the input dtype before the weight.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, E]`` → ``[T, E]``, same dtype (one fused kernel on the CPU: :func:`kvpage.ops.fused.rms_norm`)."""
        return fused.rms_norm(x, self.weight, self.eps)  # [T, E]


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused q/k/v and gate/up projections.

    Parameters: ``qkv_proj.weight [(H + 2*Hkv) * D, E]`` (rows: q heads, then k,
    then v, each head's ``D`` rows contiguous as in transformers),
    ``o_proj.weight [E, H*D]``, ``gate_up_proj.weight [2*I, E]`` (gate rows then up
    rows), ``down_proj.weight [E, I]``, two RMSNorm weights ``[E]``.
    """

    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        E, D, H, Hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        inter = config.intermediate_size
        self.input_layernorm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.qkv_proj = nn.Linear(E, (H + 2 * Hkv) * D, bias=False, dtype=dtype, device="meta")
        self.o_proj = nn.Linear(H * D, E, bias=False, dtype=dtype, device="meta")
        self.gate_up_proj = nn.Linear(E, 2 * inter, bias=False, dtype=dtype, device="meta")
        self.down_proj = nn.Linear(inter, E, bias=False, dtype=dtype, device="meta")

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """One decoder layer.

        Args:
            x: ``[T, E]`` residual stream.
            positions: ``[T]`` int64 position of each token.
            cos, sin_signed: ``[P, D]`` RoPE tables (:func:`rope_tables`), indexed by ``positions``.
            attn: attention over the cache, called once with this layer's index.

        Returns:
            ``[T, E]`` updated residual stream.
        """
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.input_layernorm(x)  # [T, E]
        qkv = self.qkv_proj(h).view(T, H + 2 * Hkv, D)  # [T, H+2Hkv, D]: q heads, k heads, v heads
        # RoPE (rotate-half: x * cos + roll(x, D/2) * sin_signed) on q and k, split into contiguous q, k, v
        q, k, v = fused.rope_split(qkv, cos, sin_signed, positions, H, Hkv)  # [T,H,D], [T,Hkv,D], [T,Hkv,D]
        o = attn(self.layer_index, q, k, v)  # [T, H, D]
        x = x + self.o_proj(o.reshape(T, H * D))  # [T, E]
        h = self.post_attention_layernorm(x)  # [T, E]
        return x + self.down_proj(fused.silu_mul(self.gate_up_proj(h)))  # [T, E]: silu(gate) * up, then down


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a varlen token batch; attention (and the KV cache) is injected.

    Architecture (Touvron et al. 2023, as implemented by transformers'
    ``LlamaForCausalLM``): token embedding → ``num_layers`` pre-norm decoder
    layers (GQA attention with RoPE, SwiGLU MLP) → final RMSNorm → LM head
    (tied to the embedding when ``config.tie_word_embeddings``).

    All parameters have ``requires_grad=False``; run under ``torch.inference_mode()``.
    Weights live on the ``meta`` device (no memory, no init cost) until
    :meth:`load_hf_state_dict` puts the checkpoint's tensors in their place.

    Args:
        config: architecture.
        dtype: compute and weight dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Raises:
        ValueError: unsupported ``dtype``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"unsupported model dtype {dtype}; use one of {_SUPPORTED_DTYPES}")
        self.config = config
        self.dtype = dtype
        E = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, E, dtype=dtype, device="meta")
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(E, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(E, config.vocab_size, bias=False, dtype=dtype, device="meta")
        self.tied_lm_head: PackedLinear | None = None  # packed copy of the tied embedding, set at load
        cos, sin_signed = rope_tables(config, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin_signed, persistent=False)  # [P, D]
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Run the decoder over ``T`` tokens of one or more sequences.

        Args:
            input_ids: ``[T]`` int64 token ids (requests concatenated).
            positions: ``[T]`` int64 position of each token within its own sequence,
                in ``[0, max_position_embeddings)`` (an out-of-range position raises ``IndexError``).
            attn: called once per layer as ``attn(layer_index, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D])``
                with contiguous tensors in the model dtype, RoPE applied to ``q`` and ``k``;
                returns ``[T, H, D]``.

        Returns:
            ``[T, E]`` final-normed hidden states in the model dtype; feed the rows
            you need (e.g. each sequence's last token) to :meth:`compute_logits`.
        """
        return self.forward_layers(input_ids, positions, attn, len(self.layers))

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                       num_layers: int) -> torch.Tensor:
        """Run only the first ``num_layers`` decoder layers, then the final norm: an early exit.

        The self-draft of ``layer_skip`` speculation (LayerSkip, Elhoushi et al. 2024; Draft & Verify,
        Zhang et al. 2023): with :meth:`compute_logits` it is a smaller model sharing every weight, and
        its layers' K/V are the full model's own for the same tokens. Arguments and result as
        :meth:`forward`.

        Raises:
            ValueError: ``num_layers`` outside ``[1, num_layers of the model]``.
            IndexError: a position out of range (as :meth:`forward`).
        """
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}], got {num_layers}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.rope_cos.shape[0]):
            raise IndexError(f"positions must be in [0, {self.rope_cos.shape[0]}), got "
                             f"[{int(positions.min())}, {int(positions.max())}]")
        x = self.embed_tokens(input_ids)  # [T, E]
        for layer in self.layers[:num_layers]:
            x = layer(x, positions, self.rope_cos, self.rope_sin, attn)  # [T, E]
        return self.norm(x)  # [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``hidden [N, E]`` (model dtype) → float32 logits ``[N, V]``."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, V]
        if self.tied_lm_head is not None and self.tied_lm_head.is_packed:
            return self.tied_lm_head(hidden).float()  # [N, V]
        return F.linear(hidden, self.embed_tokens.weight).float()  # [N, V]

    # -- weights -------------------------------------------------------------------------------

    def hf_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes this model takes, as transformers' ``LlamaForCausalLM`` names them.

        ``lm_head.weight`` is listed only when embeddings are untied.
        """
        c = self.config
        E, D, inter = c.hidden_size, c.head_dim, c.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, E)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (E,)
            shapes[p + "post_attention_layernorm.weight"] = (E,)
            shapes[p + "self_attn.q_proj.weight"] = (c.num_heads * D, E)
            shapes[p + "self_attn.k_proj.weight"] = (c.num_kv_heads * D, E)
            shapes[p + "self_attn.v_proj.weight"] = (c.num_kv_heads * D, E)
            shapes[p + "self_attn.o_proj.weight"] = (E, c.num_heads * D)
            shapes[p + "mlp.gate_proj.weight"] = (inter, E)
            shapes[p + "mlp.up_proj.weight"] = (inter, E)
            shapes[p + "mlp.down_proj.weight"] = (E, inter)
        return shapes

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Put weights named as in transformers' ``LlamaForCausalLM`` into this model.

        q/k/v rows are concatenated into ``qkv_proj`` and gate/up rows into
        ``gate_up_proj``; every tensor is cast to the model dtype. A tensor that
        already has the model dtype becomes the parameter itself (no copy: a
        copy into fresh memory costs ~1.5 s of page faults for this 135M model
        on these machines), so do not modify ``sd`` afterwards. The projections
        (and an untied LM head) become :class:`~kvpage.model.linear.PackedLinear`
        modules: bfloat16 CPU weights are prepacked into their own memory then
        (``sd``'s tensors are no longer referenced), others stay as they are.
        With tied embeddings and ``linear.PACK_TIED_LM_HEAD``, a packed copy of
        the embedding is kept for the LM head (``tied_lm_head``; one extra
        ``V x E`` matrix, since the lookup needs the dense one). Parameters end
        up on the device of the given tensors. Ignored: ``*.rotary_emb.inv_freq``
        buffers (old checkpoints) and ``lm_head.weight`` when embeddings are tied
        (some checkpoints store the tied copy).

        Args:
            sd: ``{name: tensor}``, any float dtype, on any one device.

        Raises:
            ValueError: naming every missing tensor, unexpected tensor and shape
                mismatch (expected vs found) at once; nothing is loaded then.
        """
        expected = self.hf_parameter_shapes()
        ignored = {n for n in sd if n.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
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
            raise ValueError("state dict does not fit this Llama config: " + " | ".join(parts))

        def gather(*names: str) -> torch.Tensor:
            tensors = [sd[n].to(self.dtype) for n in names]
            weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            return weight.contiguous()

        def put(module: nn.Module, *names: str) -> None:
            module.weight = nn.Parameter(gather(*names), requires_grad=False)

        def put_linear(parent: nn.Module, attr: str, *names: str) -> None:
            setattr(parent, attr, PackedLinear(gather(*names)))

        put(self.embed_tokens, "model.embed_tokens.weight")
        put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            put_linear(self, "lm_head", "lm_head.weight")
        self.tied_lm_head = None
        if self.lm_head is None and packed_linear.PACK_TIED_LM_HEAD:
            self.tied_lm_head = PackedLinear(self.embed_tokens.weight, copy_of_shared=True)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_layernorm, p + "input_layernorm.weight")
            put(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
            put_linear(layer, "qkv_proj", *(p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")))
            put_linear(layer, "o_proj", p + "self_attn.o_proj.weight")
            put_linear(layer, "gate_up_proj", *(p + f"mlp.{n}_proj.weight" for n in ("gate", "up")))
            put_linear(layer, "down_proj", p + "mlp.down_proj.weight")
