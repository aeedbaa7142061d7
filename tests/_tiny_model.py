"""A tiny random-initialised Llama on the bundled model's tokenizer, for fast server tests (no checkpoint weights).

2 layers, hidden 64: a forward pass costs well under a millisecond, so HTTP
tests and fuzzers can run hundreds of requests; the text it produces is noise.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import LoadedModel


def tiny_random_model(base: LoadedModel, *, max_position_embeddings: int = 128, seed: int = 0) -> LoadedModel:
    """A :class:`LoadedModel` with ``base``'s tokenizer, vocabulary and EOS ids, and random float32 weights.

    Args:
        base: a loaded checkpoint (the session's ``smollm2``); only its tokenizer and config are used.
        max_position_embeddings: the tiny model's context (keep it small: it bounds every request).
        seed: weights are ``N(0, 0.02)`` from ``torch.manual_seed(seed)`` (norm weights are 1).
    """
    config = replace(base.config, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02)
          for name, shape in model.hf_parameter_shapes().items()}
    model.load_hf_state_dict(sd)
    return LoadedModel(config=config, model=model.eval(), tokenizer=base.tokenizer, path=base.path)
