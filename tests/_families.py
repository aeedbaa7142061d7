"""Tiny random transformers models of every family, and a float64 reference attention that honours
``attention_params`` (scale, sliding window, soft-cap): shared by the model-family tests.

Shapes everywhere: hidden 64, 4 query heads, 2 KV heads, head_dim 16, vocab 512, intermediate 96,
float32; windowed families use ``sliding_window = 8`` so a 40-token sequence really slides.
"""
from __future__ import annotations

from typing import Any

import torch
import transformers

from kvpage.model.config import ModelConfig
from kvpage.model.decoder import DecoderForCausalLM
from kvpage.model.families import family_for

VOCAB = 512
WINDOW = 8
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=128, attn_implementation="eager",
)

#: ``(case id, config class name, config overrides)``: each family, windowed and plain where it has both.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("llama", "LlamaConfig", dict(num_hidden_layers=2)),
    ("mistral-window", "MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    ("mistral-nowindow", "MistralConfig", dict(num_hidden_layers=2, sliding_window=None, tie_word_embeddings=True)),
    ("qwen2", "Qwen2Config", dict(num_hidden_layers=2)),
    ("qwen2-window", "Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, tie_word_embeddings=True)),
    ("qwen3", "Qwen3Config", dict(num_hidden_layers=2)),
    ("qwen3-bias-window", "Qwen3Config", dict(num_hidden_layers=3, attention_bias=True, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=1, initializer_range=0.1)),
    ("gemma2", "Gemma2Config", dict(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    initializer_range=0.2)),
    ("gemma3", "Gemma3TextConfig", dict(
        num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=20,
        initializer_range=0.2, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    ("gemma3-bias-softcap", "Gemma3TextConfig", dict(
        num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3, attention_bias=True, final_logit_softcapping=3.0,
        tie_word_embeddings=False, initializer_range=0.2)),
]


def hf_config(cls_name: str, overrides: dict[str, Any]) -> Any:
    """A transformers config of class ``cls_name`` with the tiny shapes plus ``overrides``."""
    return getattr(transformers, cls_name)(**{**COMMON, **overrides})


def hf_model(config: Any, seed: int = 0) -> torch.nn.Module:
    """transformers' own causal LM for ``config`` (the family's ``hf_class``), random weights, eval mode.

    Norm weights and biases (which transformers initialises to constants) get ``N(0, 0.1)`` noise, so a
    wrong ``1 + w``, a dropped bias or a swapped norm shows in the logits.
    """
    torch.manual_seed(seed)
    model = getattr(transformers, family_for(config.model_type).hf_class)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def kvpage_model(hf: torch.nn.Module) -> DecoderForCausalLM:
    """kvpage's model for ``hf.config`` with ``hf``'s weights (through ``load_hf_state_dict``)."""
    model = DecoderForCausalLM(ModelConfig.from_hf(hf.config))
    model.load_hf_state_dict(dict(hf.state_dict()))
    return model.eval()


class WindowedDenseAttention:
    """Reference ``AttentionFn`` in float64 over each sequence's growing K/V, honouring ``attention_params``.

    Per layer it reads ``model.attention_params(layer)``: softmax scale (``None`` = ``head_dim ** -0.5``),
    sliding window (a query at position ``p`` sees keys at ``j`` with ``p - window < j <= p``) and the tanh
    soft-cap of the scores (applied after scaling, before the mask). Sequences start at position 0;
    :meth:`batch` declares which sequences the next forward's tokens belong to (varlen order). Also checks
    the contract: shapes, contiguity and dtype of what the model passes in.
    """

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.model, self.config = model, model.config
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layout: list[tuple[int, int]] = [(0, -1)]

    def batch(self, *layout: tuple[int, int]) -> WindowedDenseAttention:
        """``(seq_id, num_tokens)`` per sequence, in the order their tokens are concatenated."""
        self.layout = list(layout)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.config
        T, H, Hkv, D = q.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        assert q.shape == (T, H, D) and k.shape == v.shape == (T, Hkv, D)
        assert q.dtype == k.dtype == v.dtype == self.model.dtype
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        params = self.model.attention_params(layer)
        scale = D ** -0.5 if params.scale is None else params.scale
        outs, start = [], 0
        for seq, n in self.layout:
            n = T if n < 0 else n
            qs, ks, vs = (t[start:start + n].double().transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
            past_k, past_v = self.kv.get((seq, layer), (ks[:, :0], vs[:, :0]))
            K, V = torch.cat((past_k, ks), dim=1), torch.cat((past_v, vs), dim=1)  # [Hkv, S, D]
            self.kv[(seq, layer)] = (K, V)
            S = K.shape[1]
            K, V = K.repeat_interleave(H // Hkv, dim=0), V.repeat_interleave(H // Hkv, dim=0)  # [H, S, D]
            scores = (qs @ K.transpose(1, 2)) * scale  # [H, n, S]
            if params.logit_softcap is not None:
                scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap
            qpos = torch.arange(S - n, S)[:, None]  # [n, 1]
            kpos = torch.arange(S)[None, :]  # [1, S]
            visible = kpos <= qpos
            if params.sliding_window is not None:
                visible &= kpos > qpos - params.sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            o = scores.softmax(-1) @ V  # [H, n, D]
            outs.append(o.transpose(0, 1).to(q.dtype))
            start += n
        assert start == T
        return torch.cat(outs)  # [T, H, D]


def run_chunks(model: DecoderForCausalLM, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of one sequence fed in consecutive chunks (each a forward call)."""
    attn, out, start = WindowedDenseAttention(model), [], 0
    for n in chunks:
        piece = ids[start:start + n]
        hidden = model(piece, torch.arange(start, start + n), attn.batch((0, n)))
        out.append(model.compute_logits(hidden))
        start += n
    assert start == len(ids)
    return torch.cat(out)
