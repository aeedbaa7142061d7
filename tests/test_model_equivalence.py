"""kvpage's Llama forward against transformers' ``LlamaForCausalLM`` on the same weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from kvpage.model.config import ModelConfig
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import apply_chat_template, load_model

from _forced import divergence

TOLERANCE = 1e-3  # max abs logit difference, float32

TEXT = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists called it an "
    "eyesore, but it soon became the symbol of the city. It is 330 metres tall and was the tallest "
    "man-made structure in the world for 41 years. Summarise this in one sentence."
)
QUESTION = "What is the capital of France, and what is it famous for?"


class DenseAttention:
    """Reference ``AttentionFn``: exact causal attention over each sequence's growing K/V, in float64.

    Keeps ``{(seq_id, layer): (K, V)}``; :meth:`batch` declares which sequences
    the next forward's tokens belong to (varlen order). Also checks the
    contract: shapes, contiguity and dtype of what the model passes in.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layout: list[tuple[int, int]] = [(0, -1)]

    def batch(self, *layout: tuple[int, int]) -> DenseAttention:
        """``(seq_id, num_tokens)`` per sequence, in the order their tokens are concatenated."""
        self.layout = list(layout)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.config
        T = q.shape[0]
        assert q.shape == (T, c.num_heads, c.head_dim) and k.shape == v.shape == (T, c.num_kv_heads, c.head_dim)
        assert q.dtype == k.dtype == v.dtype == self.dtype
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        outs, start = [], 0
        for seq, n in self.layout:
            n = T if n < 0 else n
            qs, ks, vs = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
            past_k, past_v = self.kv.get((seq, layer), (ks[:, :0], vs[:, :0]))
            K, V = torch.cat((past_k, ks), dim=1), torch.cat((past_v, vs), dim=1)  # [Hkv, S, D]
            self.kv[(seq, layer)] = (K, V)
            mask = torch.ones(n, K.shape[1], dtype=torch.bool).tril(K.shape[1] - n)  # query i sees keys <= past + i
            o = F.scaled_dot_product_attention(qs, K, V, attn_mask=mask, enable_gqa=True)  # [H, n, D]
            outs.append(o.transpose(0, 1).to(q.dtype))
            start += n
        assert start == T
        return torch.cat(outs)  # [T, H, D]


def run(model: LlamaForCausalLM, attn: DenseAttention, ids: list[int], start: int = 0) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of one sequence's tokens at positions ``start...``."""
    hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn.batch((0, len(ids))))
    return model.compute_logits(hidden)


def greedy(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    attn = DenseAttention(model.config, model.dtype)
    out = [int(run(model, attn, prompt)[-1].argmax())]
    for _ in range(steps - 1):
        out.append(int(run(model, attn, out[-1:], start=len(prompt) + len(out) - 1)[-1].argmax()))
    return out


@pytest.fixture(scope="module")
def hf_model(smollm2_reference) -> HFLlama:
    """transformers' own model, on the weights of transformers' own GGUF reading."""
    model = HFLlama(smollm2_reference.config).eval()
    result = model.load_state_dict(smollm2_reference.tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[str, list[int]]:
    tok = smollm2.tokenizer
    ids = {"text": apply_chat_template(tok, TEXT), "question": apply_chat_template(tok, QUESTION)}
    assert len(ids["text"]) >= 64
    return ids


@pytest.fixture(scope="module")
def reference_logits(hf_model, prompts) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return {name: hf_model(torch.tensor([ids])).logits[0].float() for name, ids in prompts.items()}


@pytest.mark.slow
def test_prefill_logits_match_transformers(smollm2, prompts, reference_logits):
    with torch.inference_mode():
        ours = run(smollm2.model, DenseAttention(smollm2.config, torch.float32), prompts["text"])
    ref = reference_logits["text"]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (len(prompts["text"]), 49152)
    assert (ours - ref).abs().max().item() < TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_prefill_then_decode_matches_transformers(smollm2, prompts, reference_logits):
    ids, model = prompts["text"], smollm2.model
    attn = DenseAttention(smollm2.config, torch.float32)
    with torch.inference_mode():
        steps = [run(model, attn, ids[:40])]
        steps += [run(model, attn, [tok], start=pos) for pos, tok in enumerate(ids[40:], start=40)]
    ours = torch.cat(steps)
    assert len(steps) == 1 + len(ids) - 40
    assert (ours - reference_logits["text"]).abs().max().item() < TOLERANCE


@pytest.mark.slow
def test_varlen_batch_mixes_prefill_chunks_and_decode(smollm2, prompts, reference_logits):
    """Two requests in one forward: positions restart per sequence and nothing leaks between them."""
    a, b, model = prompts["text"], prompts["question"], smollm2.model
    attn = DenseAttention(smollm2.config, torch.float32)
    with torch.inference_mode():
        # step 1: chunk of A (0..29) + chunk of B (0..19); step 2: one decode token of A + the rest of B
        ids = torch.tensor(a[:30] + b[:20])
        pos = torch.cat((torch.arange(30), torch.arange(20)))
        first = model.compute_logits(model(ids, pos, attn.batch((0, 30), (1, 20))))
        ids = torch.tensor(a[30:31] + b[20:])
        pos = torch.cat((torch.tensor([30]), torch.arange(20, len(b))))
        second = model.compute_logits(model(ids, pos, attn.batch((0, 1), (1, len(b) - 20))))
    ours_a = torch.cat((first[:30], second[:1]))
    ours_b = torch.cat((first[30:], second[1:]))
    assert (ours_a - reference_logits["text"][:31]).abs().max().item() < TOLERANCE
    assert (ours_b - reference_logits["question"]).abs().max().item() < TOLERANCE


@pytest.mark.slow
def test_safetensors_folder_loads_the_same_model(tmp_path, smollm2, hf_model, prompts):
    hf_model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.path == tmp_path.resolve()
    assert loaded.config == smollm2.config
    assert apply_chat_template(loaded.tokenizer, TEXT) == prompts["text"]
    with torch.inference_mode():
        from_folder = run(loaded.model, DenseAttention(loaded.config, torch.float32), prompts["text"])
        from_gguf = run(smollm2.model, DenseAttention(smollm2.config, torch.float32), prompts["text"])
    assert torch.equal(from_folder, from_gguf)  # same float32 weights, same code: bit-identical


@pytest.mark.slow
def test_greedy_answer_float32(smollm2, prompts):
    with torch.inference_mode():
        answer = smollm2.tokenizer.decode(greedy(smollm2.model, prompts["question"], 16))
    assert answer.startswith("The capital of France is Paris. It's a city steeped in history and culture")


@pytest.mark.slow
@pytest.mark.parametrize("weights_dtype", ["dequantized", "auto"])
def test_bfloat16_model_tracks_float32(smollm2, prompts, reference_logits, weights_dtype):
    """bf16 weights and activations vs float32, teacher-forced on float32's 16-token answer.

    Not an exact greedy comparison (float32's own answer has top-1/top-2 margins down to 0.04, so a
    bf16 greedy answer matching it depends on rounding). Measured over the prompt and answer
    (default AVX-512 dispatch / forced AVX2): 0 / 0 argmax flips of 59, mean KL 0.0016 / 0.0015.
    ``auto`` keeps the file's Q4_1 projections and Q8_0 head as shipped; a whole-sequence forward has
    more than ``DENSE_ROWS`` rows, so they are decoded to bf16 for the BLAS (gguf-py's weights rounded
    once, as ``dequantized`` rounds them): the same 0 flips, KL 0.0017. The decode-shaped kernel path is
    checked against float32 in ``tests/test_quantized_linear.py``.
    """
    loaded = load_model(smollm2.path, dtype=torch.bfloat16, progress=False, weights_dtype=weights_dtype)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    question = prompts["question"]
    with torch.inference_mode():
        ids = question + greedy(smollm2.model, question, 16)
        ref = run(smollm2.model, DenseAttention(smollm2.config, torch.float32), ids)
        logits = run(loaded.model, DenseAttention(loaded.config, torch.bfloat16), ids)
    assert logits.dtype == torch.float32
    # bf16 rounding through 30 layers, not a wrong weight: transformers' float32 logits on the prompt
    assert (logits[: len(question)] - reference_logits["question"]).abs().max().item() < 2.0
    flips, kl = divergence(logits[:-1], ref[:-1])  # row i predicts ids[i + 1]
    assert flips <= 0.05 * (len(ids) - 1) and kl < 4e-3, (flips, kl)


# -- tiny random models: RoPE scaling variants and untied heads, no checkpoint needed --------------


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_tiny_random_model_matches_transformers(rope):
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rope_parameters=rope,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    hf = HFLlama(hf_config).eval()
    config = ModelConfig.from_hf(hf_config)
    model = LlamaForCausalLM(config)
    model.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, 97, (300,))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        attn = DenseAttention(config, torch.float32)
        ours = model.compute_logits(model(ids, torch.arange(300), attn.batch((0, 300))))
    assert (ours - ref).abs().max().item() < 1e-4


def test_position_beyond_table_raises():
    config = ModelConfig.from_hf(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=8))
    model = LlamaForCausalLM(config)
    with torch.inference_mode(), pytest.raises(IndexError):
        model(torch.tensor([1]), torch.tensor([8]), lambda i, q, k, v: q)


def test_hand_built_config_gets_the_same_rope_as_from_hf():
    hf_config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})
    from_hf = ModelConfig.from_hf(hf_config)
    by_hand = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000.0,
                          rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=64)
    a, b = LlamaForCausalLM(from_hf), LlamaForCausalLM(by_hand)
    assert torch.equal(a.rope_cos, b.rope_cos) and torch.equal(a.rope_sin, b.rope_sin)
    # linear scaling: position 2p with factor 2 has the angles of position p without scaling
    plain = LlamaForCausalLM(ModelConfig.from_hf(LlamaConfig(**{**hf_config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})))
    assert torch.allclose(a.rope_cos[20], plain.rope_cos[10], atol=1e-6)
    assert not torch.allclose(a.rope_cos[20], plain.rope_cos[20], atol=1e-3)
