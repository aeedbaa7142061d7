"""Models and runners for the transformers ``KVPageCache`` tests (``tests/test_hf_cache*.py``).

* :func:`tiny_model`: seeded, random-initialised tiny causal LMs of several families (``AutoModelForCausalLM
  .from_config``), including sliding-window layouts; nothing is downloaded.
* :func:`bundled_model`: transformers' ``LlamaForCausalLM`` on the bundled SmolLM2 GGUF's weights, from the
  session fixture ``smollm2_reference``.
* :func:`forward_logits`: teacher-forced logits through any cache, one forward pass per chunk.
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen3Config,
)

#: Tiny families and their config overrides: full attention, all-sliding (window 24) and two hybrids (Qwen3's
#: first layer full, the rest windowed; Gemma 3's five windowed layers per full one).
TINY = {
    "llama": (LlamaConfig, {}),
    "qwen3": (Qwen3Config, {}),
    "mistral_sliding": (MistralConfig, {"sliding_window": 24}),
    "qwen3_hybrid": (Qwen3Config, {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1}),
    "gemma3": (Gemma3TextConfig, {"num_hidden_layers": 6, "sliding_window": 16}),
}


def tiny_model(family: str = "llama", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-initialised float32 causal LM of ``family`` (:data:`TINY`): 3 layers (Gemma 3: 6), 4 query / 2 KV
    heads of 16 channels.

    ``initializer_range`` 0.2 makes its next-token distributions peaked (greedy decisions are not near-ties).
    """
    cls, extra = TINY[family]
    kw: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(extra)
    kw.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cls(**kw)).eval()


def bundled_model(reference: SimpleNamespace) -> LlamaForCausalLM:
    """transformers' Llama on the bundled GGUF's weights (``smollm2_reference`` fixture), float32, eval mode."""
    model = LlamaForCausalLM(reference.config).eval()
    result = model.load_state_dict(reference.tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    return model


def cache_kw(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever this transformers' ``forward`` takes."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def generate(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
    """``model.generate`` with ``cache`` (under this release's keyword), greedy by default, no warnings shown."""
    kw: dict[str, Any] = dict(do_sample=False, pad_token_id=0)
    kw.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(input_ids, **kw, **cache_kw(model, cache))


@torch.no_grad()
def forward_logits(model: torch.nn.Module, cache: Any, ids: Sequence[int], chunks: Sequence[int]) -> torch.Tensor:
    """Float32 logits ``[len(ids), vocab]`` of one sequence fed through ``cache`` in chunks of the given sizes.

    ``chunks`` must sum to ``len(ids)``; e.g. ``[prompt_len] + [1] * n`` is prefill then decode.
    """
    assert sum(chunks) == len(ids)
    rows, a = [], 0
    for n in chunks:
        out = model(input_ids=torch.tensor([list(ids[a:a + n])]), use_cache=True, **cache_kw(model, cache))
        rows.append(out.logits[0].float())
        a += n
    return torch.cat(rows)
