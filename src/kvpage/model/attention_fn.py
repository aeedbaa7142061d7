"""The contract between the model and the paged KV cache.

The model never sees cache tensors, block tables or KV formats. For every
attention layer it calls an :data:`AttentionFn` with the current step's
queries, keys and values (after RoPE); the engine builds that callable over the
paged cache (:mod:`kvpage.ops.attention`) for one forward pass.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class AttentionFn(Protocol):
    """Attention over the paged KV cache for one layer of one forward pass.

    Args:
        layer_index: global layer index (0-based; draft/MTP layers follow main layers).
        q: ``[num_tokens, num_heads, head_dim]`` queries of this step's tokens, RoPE applied.
        k: ``[num_tokens, num_kv_heads, head_dim]`` keys of this step's tokens, RoPE applied.
        v: ``[num_tokens, num_kv_heads, head_dim]`` values of this step's tokens.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output, dtype of ``q``.

    The tokens of all requests in the batch are concatenated along dim 0
    (varlen layout); the callable knows which request each token belongs to.
    """

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class CausalLM(Protocol):
    """What the engine needs of a model family (the other half of the contract).

    ``model(input_ids, positions, attn)``: ``input_ids`` and ``positions`` ``[num_tokens]`` int64 (the
    varlen batch), ``attn`` the step's :class:`AttentionFn`; returns the hidden states
    ``[num_tokens, hidden]``. ``compute_logits(hidden [N, hidden])`` returns float32 logits ``[N, vocab]``.
    :class:`~kvpage.model.llama.LlamaForCausalLM` is one; so is any ``nn.Module`` with these two.
    """

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class EarlyExitLM(CausalLM, Protocol):
    """A :class:`CausalLM` that can stop after its first layers (the ``layer_skip`` self-draft).

    ``forward_layers(input_ids, positions, attn, num_layers)`` runs the first ``num_layers`` decoder
    layers then the final norm, returning ``[num_tokens, hidden]`` as the full forward does.
    """

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                       num_layers: int) -> torch.Tensor: ...


def early_exit(model: CausalLM) -> Callable[[torch.Tensor, torch.Tensor, AttentionFn, int], torch.Tensor]:
    """``model.forward_layers``, checked to exist.

    Raises:
        TypeError: the model family has no early exit (``forward_layers``), so it cannot self-draft.
    """
    fn = getattr(model, "forward_layers", None)
    if not callable(fn):
        raise TypeError(f"{type(model).__name__} has no forward_layers(): this model family cannot run the "
                        f"layer_skip self-draft")
    out: Callable[[torch.Tensor, torch.Tensor, AttentionFn, int], torch.Tensor] = fn
    return out
