"""Every model family through the whole engine: paged blocks, chunked prefill, prefix caching, sliding windows.

Each family is a small random-initialised transformers model (``from_config``) saved as a Hugging Face
folder with the bundled model's tokenizer, then loaded by kvpage's own loader and served by ``LLM`` with
``block_size`` 16, chunked prefill (8-token chunks) and prefix caching. The prompt is longer than the
sliding window (24 tokens), so windowed layers really slide. The logits every engine step computed (its
model's ``compute_logits``, recorded with the position they predict from) must match transformers' forward
over the same tokens within 1e-3 (float32), for a first request and for a second one that hits the first
one's cached prompt blocks. Quantized caches (``int8``, ``int4``) run on every family; their divergence is
bounded loosely (random weights: the figures are reported by ``benchmarks/families.py``, not asserted tight).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpage.engine.llm import LLM
from kvpage.engine.sampling import SamplingParams

TOLERANCE = 1e-3
WINDOW = 24
PROMPT_LEN = 40
DECODE_STEPS = 32

_COMMON: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=256, tie_word_embeddings=True)


def family_config(family: str) -> Any:
    """A tiny transformers config of ``family`` (windowed families with a 24-token window)."""
    import transformers as tf

    c = dict(_COMMON)
    if family == "llama":
        return tf.LlamaConfig(**c)
    if family == "qwen2":
        return tf.Qwen2Config(**c)
    if family == "qwen2_window":  # Qwen2's own sliding window: the last layers use it (max_window_layers)
        return tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if family == "qwen3":
        return tf.Qwen3Config(**c)
    if family == "mistral":
        return tf.MistralConfig(**c, sliding_window=WINDOW)
    if family == "gemma2":
        return tf.Gemma2Config(**c, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**c, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"])
    if family in ("deepseek_v3", "deepseek_v3_moe"):
        for k in ("num_key_value_heads", "head_dim", "intermediate_size"):
            c.pop(k)
        moe = (dict(first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                    n_shared_experts=1, routed_scaling_factor=2.5) if family == "deepseek_v3_moe" else
               dict(first_k_dense_replace=4, n_routed_experts=4))
        return tf.DeepseekV3Config(**c, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                                   kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=16, **moe)
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "qwen2_window", "qwen3", "mistral", "gemma2", "gemma3", "deepseek_v3", "deepseek_v3_moe"]


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights of a scale that gives a peaked next-token distribution (norm weights near their unit)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def save_family(folder: Path, family: str, tokenizer: Any, *, seed: int, weight_seed: int) -> Path:
    """Save a tiny random ``family`` model (config.json, safetensors, ``tokenizer``) into ``folder``."""
    from transformers import AutoModelForCausalLM

    config = family_config(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed=weight_seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory: pytest.TempPathFactory, smollm2) -> dict[str, Path]:
    """``family -> folder`` of a saved tiny random model (config.json, safetensors, the bundled tokenizer)."""
    return {family: save_family(tmp_path_factory.mktemp(family), family, smollm2.tokenizer, seed=i,
                                weight_seed=100 + i) for i, family in enumerate(FAMILIES)}


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own float32 forward over ``ids``: logits ``[len(ids), vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class LogitRecorder:
    """Wraps a model's ``forward`` and ``compute_logits`` to record ``(position, logits row)`` of every step.

    With one request per step, the row ``compute_logits`` gets is the forward's last token, whose position is
    the last of the forward's ``positions``.
    """

    def __init__(self, model: Any) -> None:
        self.rows: list[tuple[int, torch.Tensor]] = []
        self._last_pos = -1
        forward, compute = model.forward, model.compute_logits

        def rec_forward(input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *a: Any) -> torch.Tensor:
            self._last_pos = int(positions[-1])
            return forward(input_ids, positions, attn, *a)

        def rec_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute(hidden)
            assert out.shape[0] == 1, "one request per step"
            self.rows.append((self._last_pos, out[0].clone()))
            return out

        model.forward, model.compute_logits = rec_forward, rec_logits


def _serve(folder: Path, kv_cache_dtype: str) -> tuple[LLM, LogitRecorder]:
    llm = LLM(str(folder), progress=False, kv_cache_dtype=kv_cache_dtype, block_size=16, num_blocks=64,
              max_num_batched_tokens=8, max_num_seqs=1, enable_prefix_caching=True, enable_chunked_prefill=True)
    return llm, LogitRecorder(llm.model)


def _prompt(seed: int) -> list[int]:
    return torch.randint(100, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(llm: LLM, rec: LogitRecorder, prompt: list[int]) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    rec.rows.clear()
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return prompt + list(out.outputs[0].token_ids), list(rec.rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_match_transformers_through_the_paged_cache(family_folders: dict[str, Path],
                                                                   family: str) -> None:
    """Prefill (chunked) + 32 decode steps, then a second request hitting the cached prompt: every step's
    logits within 1e-3 of transformers' forward on the same weights and tokens."""
    folder = family_folders[family]
    llm, rec = _serve(folder, "float32")
    prompt = _prompt(1)
    seq, rows = _run(llm, rec, prompt)
    assert len(seq) == PROMPT_LEN + DECODE_STEPS
    ref = hf_logits(folder, seq)
    assert len(rows) >= DECODE_STEPS
    for pos, got in rows:
        assert (got - ref[pos]).abs().max().item() < TOLERANCE, (family, pos)
    # the same prompt again: its full blocks come from the prefix cache
    before = llm.kv_cache_stats()
    seq2, rows2 = _run(llm, rec, prompt)
    hits = llm.kv_cache_stats().prefix_hits - before.prefix_hits
    assert hits >= (PROMPT_LEN // 16) * 16 - 16, f"{family}: the second request hit {hits} cached tokens"
    ref2 = hf_logits(folder, seq2)
    for pos, got in rows2:
        assert (got - ref2[pos]).abs().max().item() < TOLERANCE, (family, "prefix hit", pos)
    llm.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_caches_run_on_every_family(family_folders: dict[str, Path], family: str,
                                              kv_cache_dtype: str) -> None:
    """int8 and int4 serve every family; their logits stay near transformers' (loose bound: random weights)."""
    folder = family_folders[family]
    llm, rec = _serve(folder, kv_cache_dtype)
    seq, rows = _run(llm, rec, _prompt(2))
    ref = hf_logits(folder, seq)
    kl = []
    for pos, got in rows:
        assert torch.isfinite(got).all()
        p = ref[pos].log_softmax(-1)
        kl.append(float((p.exp() * (p - got.log_softmax(-1))).sum()))
    assert max(kl) < 0.5, (family, kv_cache_dtype, max(kl))
    llm.close()
