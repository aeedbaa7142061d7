"""The shared decoder of the Llama-like families (gpt-fast style), for varlen batches over a paged cache.

Notation: ``T`` tokens in this forward pass (all requests concatenated), ``H``
query heads, ``Hkv`` key/value heads, ``D`` head_dim, ``E`` hidden size, ``I``
intermediate size, ``V`` vocabulary.

The model never touches the KV cache and never masks: each layer hands its
RoPE'd ``q, k, v`` to an :class:`~kvpage.model.attention_fn.AttentionFn`, which
writes ``k, v`` into the cache and attends over it, honouring the layer's
:meth:`DecoderForCausalLM.attention_params` (scale, sliding window, soft-cap).
Positions are per token (``positions[t]`` is the index of token ``t`` within
its own sequence), so prefill chunks and decode tokens of different requests
mix freely in one call.

What a family changes is stated in :mod:`kvpage.model.families` and resolved
once per model into an :class:`~kvpage.model.families.Architecture`; the layer
code below only switches on it. Numerics follow transformers' modeling files
(RMSNorm in float32, RoPE in the rotate-half layout with cos/sin computed in
float32 and cast to the model dtype); for speed the q/k/v projections run as one
matmul and gate/up as another, and once loaded the projections and the LM head
are :class:`~kvpage.model.linear.PackedLinear` (oneDNN-prepacked weights for
bfloat16 on CPU, plain ``F.linear`` otherwise). Llama's path (RMSNorm, RoPE +
split and SiLU-gating as fused CPU kernels) is the one SmolLM2 runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model import families
from kvpage.model import linear as packed_linear
from kvpage.model.attention_fn import AttentionFn, check_forward_args
from kvpage.model.config import ModelConfig
from kvpage.model.linear import PackedLinear
from kvpage.model.quantized_linear import GgufLinear, GgufWeight, quantized_linear
from kvpage.model.rope import rope_tables
from kvpage.model.weights import check_state_dict, parameter_shapes
from kvpage.ops import fused
from kvpage.ops.layer_attention import LayerAttention

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed as transformers' ``LlamaRMSNorm``.

    ``y = weight * (x / sqrt(mean(x^2) + eps))`` with the normalisation in
    float32 and the result cast back to the input dtype before the weight.
    Parameter: ``weight [dim]`` in the model dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]`` → same shape and dtype (one fused kernel on the CPU: :func:`kvpage.ops.fused.rms_norm`)."""
        return fused.rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = (x / sqrt(mean(x^2) + eps)) * (1 + weight)``, all in float32, then cast to ``x``'s dtype.

    The checkpoint stores ``weight`` zero-centred (``1 + weight`` is the gain), as transformers'
    ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]`` → same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's ``gelu_tanh(gate) * up`` of a fused ``[..., 2*I]`` projection (gate columns first) → ``[..., I]``.

    ``gelu_tanh`` is transformers' ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


#: Gated-MLP products by transformers' activation name.
GATED_ACTIVATIONS = {"silu": fused.silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP block with fused q/k/v and gate/up projections.

    Parameters: ``qkv_proj.weight [(H + 2*Hkv) * D, E]`` (rows: q heads, then k,
    then v, each head's ``D`` rows contiguous as in transformers),
    ``o_proj.weight [E, H*D]``, ``gate_up_proj.weight [2*I, E]`` (gate rows then up
    rows), ``down_proj.weight [E, I]``, RMSNorm weights ``[E]`` (two, or four with
    sandwich norms). Optional per :class:`~kvpage.model.families.Architecture`:
    ``qkv_bias [(H + 2*Hkv) * D]``, ``o_bias [E]``, ``q_norm``/``k_norm`` weights ``[D]``.

    Args:
        config: architecture.
        layer_index: global 0-based index (passed to the :class:`AttentionFn`).
        dtype: weight and compute dtype.
        arch: the resolved family choices (default: resolved from ``config``).
    """

    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 arch: families.Architecture | None = None) -> None:
        super().__init__()
        if arch is None:
            arch = families.resolve(config.model_type, config.hf_config, config.num_layers)
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_table = arch.rope_table(layer_index)  # which of the model's RoPE tables this layer uses
        E, D, H, Hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        inter, eps, fam = config.intermediate_size, config.rms_norm_eps, arch.family
        norm = GemmaRMSNorm if fam.norm == "gemma" else RMSNorm
        self.input_layernorm = norm(E, eps, dtype)
        # Llama-like: the MLP's input norm. Sandwich norms: the attention output's norm.
        self.post_attention_layernorm = norm(E, eps, dtype)
        self.pre_feedforward_layernorm = norm(E, eps, dtype) if fam.sandwich_norms else None
        self.post_feedforward_layernorm = norm(E, eps, dtype) if fam.sandwich_norms else None
        self.qkv_proj = nn.Linear(E, (H + 2 * Hkv) * D, bias=False, dtype=dtype, device="meta")
        self.qkv_bias = _param((H + 2 * Hkv) * D, dtype=dtype) if arch.qkv_bias else None
        self.q_norm = norm(D, eps, dtype) if fam.qk_norm else None
        self.k_norm = norm(D, eps, dtype) if fam.qk_norm else None
        self.o_proj = nn.Linear(H * D, E, bias=False, dtype=dtype, device="meta")
        self.o_bias = _param(E, dtype=dtype) if arch.o_bias else None
        self.gate_up_proj = nn.Linear(E, 2 * inter, bias=False, dtype=dtype, device="meta")
        self.down_proj = nn.Linear(inter, E, bias=False, dtype=dtype, device="meta")
        self.act_mul = GATED_ACTIVATIONS[arch.activation]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """One decoder layer.

        Args:
            x: ``[T, E]`` residual stream.
            positions: ``[T]`` int64 position of each token.
            cos, sin_signed: ``[P, D]`` RoPE tables (:func:`kvpage.model.rope.rope_tables`), indexed by ``positions``.
            attn: attention over the cache, called once with this layer's index.

        Returns:
            ``[T, E]`` updated residual stream.
        """
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.input_layernorm(x)  # [T, E]
        qkv = self.qkv_proj(h)  # [T, (H+2Hkv)*D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qkv = qkv.view(T, H + 2 * Hkv, D)  # q heads, k heads, v heads
        if self.q_norm is not None:  # per-head q/k norm over D, before RoPE (Qwen3, Gemma 3)
            qkv = torch.cat((self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + Hkv]), qkv[:, H + Hkv:]), dim=1)
        # RoPE (rotate-half: x * cos + roll(x, D/2) * sin_signed) on q and k, split into contiguous q, k, v
        q, k, v = fused.rope_split(qkv, cos, sin_signed, positions, H, Hkv)  # [T,H,D], [T,Hkv,D], [T,Hkv,D]
        o = attn(self.layer_index, q, k, v)  # [T, H, D]
        a = self.o_proj(o.reshape(T, H * D))  # [T, E]
        if self.o_bias is not None:
            a = a + self.o_bias
        if self.post_feedforward_layernorm is None:  # Llama-like pre-norm block
            x = x + a
            h = self.post_attention_layernorm(x)  # [T, E]
            return x + self.down_proj(self.act_mul(self.gate_up_proj(h)))  # [T, E]: act(gate) * up, then down
        x = x + self.post_attention_layernorm(a)  # sandwich norms (Gemma)
        h = self.pre_feedforward_layernorm(x)  # type: ignore[misc]
        return x + self.post_feedforward_layernorm(self.down_proj(self.act_mul(self.gate_up_proj(h))))


class DecoderForCausalLM(nn.Module):
    """Decoder-only causal LM of any family in :data:`kvpage.model.families.FAMILIES` whose
    ``model_class`` is this one; attention (and the KV cache) is injected.

    Architecture (Touvron et al. 2023, as implemented by transformers'
    ``LlamaForCausalLM`` and its relatives): token embedding (Gemma: times
    ``sqrt(E)``) → ``num_layers`` decoder layers (GQA attention with RoPE, gated
    MLP) → final RMSNorm → LM head (tied to the embedding when
    ``config.tie_word_embeddings``; Gemma 2: tanh soft-cap of the logits).
    ``kvpage.model.llama.LlamaForCausalLM`` is this class.

    All parameters have ``requires_grad=False``; run under ``torch.inference_mode()``.
    Weights live on the ``meta`` device (no memory, no init cost) until
    :meth:`load_hf_state_dict` puts the checkpoint's tensors in their place.

    Args:
        config: architecture (``config.model_type`` picks the family).
        dtype: compute and weight dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Raises:
        ValueError: unsupported ``dtype``, or what :func:`kvpage.model.families.resolve` rejects.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"unsupported model dtype {dtype}; use one of {_SUPPORTED_DTYPES}")
        self.config = config
        self.dtype = dtype
        self.arch = families.resolve(config.model_type, config.hf_config, config.num_layers)
        E = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, E, dtype=dtype, device="meta")
        self.embed_scale: float | None = None  # Gemma: sqrt(E) rounded to the model dtype, as transformers
        if self.arch.family.embed_scale:
            self.embed_scale = float(torch.tensor(E ** 0.5).to(dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, self.arch) for i in range(config.num_layers))
        norm = GemmaRMSNorm if self.arch.family.norm == "gemma" else RMSNorm
        self.norm = norm(E, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(E, config.vocab_size, bias=False, dtype=dtype, device="meta")
        self.tied_lm_head: PackedLinear | GgufLinear | None = None  # the tied LM head's own form, set at load
        cos, sin_signed = rope_tables(config, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D]
        self.register_buffer("rope_sin", sin_signed, persistent=False)  # [P, D]
        for layer_type in self.arch.rope_layer_types:  # Gemma 3's local layers: their own RoPE parameters
            cos, sin_signed = rope_tables(config, dtype, layer_type)
            self.register_buffer(f"rope_cos_{layer_type}", cos, persistent=False)  # [P, D]
            self.register_buffer(f"rope_sin_{layer_type}", sin_signed, persistent=False)  # [P, D]
        self.requires_grad_(False)

    @property
    def family(self) -> families.Family:
        """This model's family description."""
        return self.arch.family

    def attention_params(self, layer_index: int) -> LayerAttention:
        """What layer ``layer_index``'s attention computes beyond plain causal attention.

        The engine's attention ops honour it; the model itself never masks.

        Returns:
            :class:`~kvpage.ops.layer_attention.LayerAttention`: ``scale`` (``None`` = ``head_dim ** -0.5``;
            Gemma: ``query_pre_attn_scalar ** -0.5``), ``sliding_window`` (keys at positions
            ``> p - sliding_window`` for a query at ``p``; ``None`` = full causal context) and
            ``logit_softcap`` (Gemma 2's ``attn_logit_softcapping``).

        Raises:
            IndexError: ``layer_index`` outside ``[0, num_layers)``.
        """
        return self.arch.attention(layer_index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Run the decoder over ``T`` tokens of one or more sequences.

        Args:
            input_ids: ``[T]`` int64 token ids (requests concatenated).
            positions: ``[T]`` int64 position of each token within its own sequence,
                in ``[0, max_position_embeddings)`` (an out-of-range position raises ``IndexError``).
            attn: called once per layer as ``attn(layer_index, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D])``
                with contiguous tensors in the model dtype, RoPE applied to ``q`` and ``k``;
                returns ``[T, H, D]``. It applies :meth:`attention_params` of that layer.

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
        check_forward_args(positions, num_layers, len(self.layers), self.rope_cos.shape[0])
        x = self.embed_tokens(input_ids)  # [T, E]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        tables = [(self.rope_cos, self.rope_sin)] + [
            (getattr(self, f"rope_cos_{t}"), getattr(self, f"rope_sin_{t}")) for t in self.arch.rope_layer_types]
        for layer in self.layers[:num_layers]:
            cos, sin_signed = tables[layer.rope_table]
            x = layer(x, positions, cos, sin_signed, attn)  # [T, E]
        return self.norm(x)  # [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``hidden [N, E]`` (model dtype) → float32 logits ``[N, V]``.

        With a final soft-cap ``c`` (Gemma 2), ``c * tanh(logits / c)``, computed in float32.
        """
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # [N, V]
        elif self.tied_lm_head is not None and getattr(self.tied_lm_head, "is_packed", True):
            logits = self.tied_lm_head(hidden).float()  # [N, V] (a packed copy counts only while packed)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()  # [N, V]
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- weights -------------------------------------------------------------------------------

    def hf_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes this model takes, as the family's transformers class names them.

        ``lm_head.weight`` is listed only when embeddings are untied. See
        :func:`kvpage.model.weights.parameter_shapes`.
        """
        return parameter_shapes(self.config, self.arch)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Put weights named as in the family's transformers class (e.g. ``Qwen2ForCausalLM``) into this model.

        The names are checked first (:func:`kvpage.model.weights.check_state_dict`). q/k/v rows (and
        biases) are concatenated into ``qkv_proj`` (``qkv_bias``) and gate/up rows into
        ``gate_up_proj``; every tensor is cast to the model dtype. A tensor that already has the
        model dtype becomes the parameter itself (no copy: a copy into fresh memory costs ~1.5 s of
        page faults for a 135M model), so do not modify ``sd`` afterwards. The projections (and an
        untied LM head) become :class:`~kvpage.model.linear.PackedLinear` modules: bfloat16 CPU
        weights are prepacked into their own memory then, others stay as they are. A projection given as
        GGUF blocks (:class:`~kvpage.model.quantized_linear.GgufWeight`, all of its parts of one ggml type)
        becomes a :class:`~kvpage.model.quantized_linear.GgufLinear` instead (dequantized where that does not
        apply). Parameters end up
        on the device of the given tensors. With tied embeddings, the LM head (``tied_lm_head``) is
        ``lm_head.weight`` when it is given as GGUF blocks a :class:`~kvpage.model.quantized_linear.GgufLinear`
        runs (the file's copy of the embedding as shipped), else, with ``linear.PACK_TIED_LM_HEAD``, a packed
        copy of the embedding. Ignored: ``*.rotary_emb.inv_freq`` buffers and a float ``lm_head.weight`` when
        embeddings are tied.

        Args:
            sd: ``{name: tensor}``, any float dtype, on any one device; projection weights may also be
                :class:`~kvpage.model.quantized_linear.GgufWeight` (CPU only).

        Raises:
            ValueError: naming every missing tensor, unexpected tensor and shape
                mismatch (expected vs found) at once; nothing is loaded then.
        """
        cfg = self.config
        check_state_dict(self.hf_parameter_shapes(), sd, cfg.tie_word_embeddings, cfg.model_type)

        def gather(*names: str) -> torch.Tensor:
            tensors = [(w.dequantize() if isinstance(w := sd[n], GgufWeight) else w).to(self.dtype) for n in names]
            weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            return weight.contiguous()

        def put(module: nn.Module, *names: str) -> None:
            module.weight = nn.Parameter(gather(*names), requires_grad=False)

        def put_linear(parent: nn.Module, attr: str, *names: str) -> None:
            kept = [sd[n] for n in names]
            if all(isinstance(w, GgufWeight) for w in kept) and len({w.ggml_type for w in kept}) == 1:
                module = quantized_linear(GgufWeight.cat(kept))  # type: ignore[arg-type]
                if module is not None:
                    setattr(parent, attr, module)
                    return
            setattr(parent, attr, PackedLinear(gather(*names)))  # float, mixed, or a shape GgufLinear refuses

        put(self.embed_tokens, "model.embed_tokens.weight")
        put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            put_linear(self, "lm_head", "lm_head.weight")
        for i, layer in enumerate(self.layers):
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
        self.tied_lm_head = None
        head = sd.get("lm_head.weight")
        if self.lm_head is None and isinstance(head, GgufWeight):
            self.tied_lm_head = quantized_linear(head)  # the file's blocks of the tied embedding (None: not run)
        if self.lm_head is None and self.tied_lm_head is None and packed_linear.PACK_TIED_LM_HEAD:
            self.tied_lm_head = PackedLinear(self.embed_tokens.weight, copy_of_shared=True)
