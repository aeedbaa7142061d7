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

from kvpage.ops.layer_attention import PLAIN, LayerAttention


class AttentionFn(Protocol):
    """Attention over the paged KV cache for one layer of one forward pass.

    Args:
        layer_index: global layer index (0-based; draft/MTP layers follow main layers).
        q: ``[num_tokens, num_heads, head_dim]`` queries of this step's tokens, RoPE applied.
        k: ``[num_tokens, num_kv_heads, head_dim]`` keys of this step's tokens, RoPE applied.
        v: ``[num_tokens, num_kv_heads, head_dim]`` values of this step's tokens; ``None`` for a key-only
            (MLA latent) cache, whose keys serve as values.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output, dtype of ``q``.

    The tokens of all requests in the batch are concatenated along dim 0
    (varlen layout); the callable knows which request each token belongs to. It applies the layer's
    :class:`~kvpage.ops.layer_attention.LayerAttention` (scale, sliding window, soft-cap), which the model
    states through ``attention_params`` (:func:`layer_attention`).
    """

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor: ...


class CausalLM(Protocol):
    """What the engine needs of a model family (the other half of the contract).

    ``model(input_ids, positions, attn)``: ``input_ids`` and ``positions`` ``[num_tokens]`` int64 (the
    varlen batch), ``attn`` the step's :class:`AttentionFn`; returns the hidden states
    ``[num_tokens, hidden]``. ``compute_logits(hidden [N, hidden])`` returns float32 logits ``[N, vocab]``.
    :class:`~kvpage.model.llama.LlamaForCausalLM` is one; so is any ``nn.Module`` with these two.
    """

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def check_forward_args(positions: torch.Tensor, num_layers: int, total_layers: int, num_positions: int) -> None:
    """The argument checks every family's ``forward_layers`` makes before running.

    Raises:
        ValueError: ``num_layers`` outside ``[1, total_layers]``.
        IndexError: a position outside ``[0, num_positions)`` (the RoPE table's rows).
    """
    if not 1 <= num_layers <= total_layers:
        raise ValueError(f"num_layers must be in [1, {total_layers}], got {num_layers}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_positions):
        raise IndexError(f"positions must be in [0, {num_positions}), got "
                         f"[{int(positions.min())}, {int(positions.max())}]")


def layer_attention(model: object, layer_index: int) -> LayerAttention:
    """The scale, sliding window and soft-cap of the model's layer ``layer_index`` (its own 0-based index).

    A family states them with ``attention_params(layer_index) -> LayerAttention``; a model without that
    method has plain causal attention with scale ``head_dim ** -0.5`` in every layer (:data:`PLAIN`).
    """
    fn = getattr(model, "attention_params", None)
    if fn is None:
        return PLAIN
    params = fn(layer_index)
    if not isinstance(params, LayerAttention):
        raise TypeError(f"{type(model).__name__}.attention_params({layer_index}) returned "
                        f"{type(params).__name__}, not LayerAttention")
    return params


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
