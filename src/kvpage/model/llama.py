"""The Llama family: ``LlamaForCausalLM`` is the shared decoder (:mod:`kvpage.model.decoder`).

Kept as a module because much code imports ``kvpage.model.llama.LlamaForCausalLM``
(and ``RMSNorm``, ``rope_inv_freq``, ``rope_tables``). The class is the same object as
:class:`~kvpage.model.decoder.DecoderForCausalLM`: built from a Llama config it is
transformers' ``LlamaForCausalLM`` (RMSNorm, SwiGLU MLP, RoPE, GQA, through the fused
CPU kernels of :mod:`kvpage.ops.fused`); built from another family's config it is
that family's model (:mod:`kvpage.model.families`).
"""
from __future__ import annotations

from kvpage.model.decoder import DecoderForCausalLM, DecoderLayer, GemmaRMSNorm, RMSNorm
from kvpage.model.rope import rope_inv_freq, rope_tables

#: The shared decoder under its historical name.
LlamaForCausalLM = DecoderForCausalLM

__all__ = ["DecoderLayer", "GemmaRMSNorm", "LlamaForCausalLM", "RMSNorm", "rope_inv_freq", "rope_tables"]
