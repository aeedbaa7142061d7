"""kvpage's absorbed-MLA DeepSeek-V3 forward against transformers' ``DeepseekV3ForCausalLM`` on the same weights.

Tiny random-initialised models (no downloads): 2-3 layers, hidden 64, 4 heads, kv_lora_rank 32,
rope 8, nope 16, v 16, dense MLPs. The reference attention is exact float64 causal attention over a
key-only cache (values = keys) with the scale the model states in ``attention_params``.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3

from kvpage.cache.controller import CacheController
from kvpage.model.config import ModelConfig
from kvpage.model.deepseek import DeepseekV3ForCausalLM, mla_model_config
from kvpage.model.mlp import MoEMLP
from kvpage.ops.attention import AttentionMetadata, paged_attention
from kvpage.spec import CacheSpec

TOLERANCE = 1e-3  # max abs logit difference, float32
L, E, H, R, ROPE, NOPE, V_DIM, VOCAB = 3, 64, 4, 32, 8, 16, 16, 512

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
CASES = {
    "q_proj": {"q_lora_rank": None},
    "q_lora": {"q_lora_rank": 24, "rope_interleave": False, "tie_word_embeddings": True},
    "q_lora_yarn": {"q_lora_rank": 24, "rope_parameters": YARN},
    # DeepSeek-V3's MoE from layer 1: 8 routed experts in 2 groups (1 kept), 2 per token, a shared expert
    "moe": {"q_lora_rank": 24, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True},
}


def hf_config(**overrides: object) -> DeepseekV3Config:
    """A tiny dense DeepSeek-V3 config (eager attention); ``overrides`` replace any field."""
    kw: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=E, intermediate_size=96, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=H, kv_lora_rank=R, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM,
        first_k_dense_replace=L, max_position_embeddings=128, rms_norm_eps=1e-5, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


class DenseMLAAttention:
    """Reference ``AttentionFn``: exact causal float64 attention over each sequence's growing cache.

    Key-only layers (``v is None``) attend with the keys as values. The softmax scale is the
    model's ``attention_params(layer).scale``. :meth:`batch` declares the varlen layout
    ``(seq_id, num_tokens)`` of the next forward. Also checks the shapes MLA must hand over.
    """

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        self.model, self.config = model, model.config
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.layout: list[tuple[int, int]] = [(0, -1)]

    def batch(self, *layout: tuple[int, int]) -> DenseMLAAttention:
        self.layout = list(layout)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        c, T = self.config, q.shape[0]
        assert q.shape == (T, c.num_heads, c.head_dim) and k.shape == (T, c.num_kv_heads, c.head_dim)
        assert (v is None) == (not c.kv_has_value)
        assert q.dtype == k.dtype == self.model.dtype and q.is_contiguous() and k.is_contiguous()
        scale = self.model.attention_params(layer).scale
        outs, start = [], 0
        for seq, n in self.layout:
            n = T if n < 0 else n
            qs, ks = (t[start : start + n].double().transpose(0, 1) for t in (q, k))  # [heads, n, D]
            vs = None if v is None else v[start : start + n].double().transpose(0, 1)
            past_k, past_v = self.kv.get((seq, layer), (ks[:, :0], None if vs is None else vs[:, :0]))
            K = torch.cat((past_k, ks), dim=1)  # [Hkv, S, D]
            Vv = K if vs is None else torch.cat((past_v, vs), dim=1)
            self.kv[(seq, layer)] = (K, None if vs is None else Vv)
            mask = torch.ones(n, K.shape[1], dtype=torch.bool).tril(K.shape[1] - n)
            o = F.scaled_dot_product_attention(qs, K, Vv, attn_mask=mask, scale=scale, enable_gqa=True)  # [H, n, D]
            outs.append(o.transpose(0, 1).to(q.dtype))
            start += n
        assert start == T
        return torch.cat(outs)  # [T, H, D]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logits: matrices ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build(case: str) -> tuple[HFDeepseekV3, DeepseekV3ForCausalLM]:
    torch.manual_seed(0)
    hf = HFDeepseekV3(hf_config(**CASES[case])).eval()
    randomize(hf, seed=1)
    gen = torch.Generator().manual_seed(3)
    for name, b in hf.named_buffers():  # the MoE's load-balancing bias steers the choice, not the weights
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    ours = DeepseekV3ForCausalLM(mla_model_config(hf.config))
    ours.load_hf_state_dict(dict(hf.state_dict()))
    return hf, ours.eval()


@pytest.fixture(scope="module", params=list(CASES))
def models(request) -> tuple[HFDeepseekV3, DeepseekV3ForCausalLM]:
    return build(request.param)


IDS = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(2)).tolist()


def run(model: DeepseekV3ForCausalLM, attn: DenseMLAAttention, ids: list[int], start: int = 0) -> torch.Tensor:
    hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn.batch((0, len(ids))))
    return model.compute_logits(hidden)


def reference(hf: HFDeepseekV3, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_scale_matches_transformers(models):
    hf, ours = models
    for i, layer in enumerate(hf.model.layers):
        assert ours.attention_params(i).scale == pytest.approx(layer.self_attn.scaling, rel=1e-12)
    with pytest.raises(IndexError):
        ours.attention_params(L)


def test_prefill_logits_match_transformers(models):
    hf, ours = models
    with torch.inference_mode():
        logits = run(ours, DenseMLAAttention(ours), IDS)
    ref = reference(hf, IDS)
    assert logits.shape == ref.shape == (len(IDS), VOCAB) and logits.dtype == torch.float32
    assert (logits - ref).abs().max().item() < TOLERANCE
    assert ref.std().item() > 0.3  # the comparison is not vacuous


def test_token_by_token_decode_matches_transformers(models):
    hf, ours = models
    attn = DenseMLAAttention(ours)
    with torch.inference_mode():
        steps = [run(ours, attn, IDS[:1])] + [run(ours, attn, [t], start=p) for p, t in enumerate(IDS[1:], start=1)]
    assert (torch.cat(steps) - reference(hf, IDS)).abs().max().item() < TOLERANCE


def test_varlen_batch_mixes_prefill_chunk_and_decode(models):
    hf, ours = models
    a, b = IDS[:30], IDS[30:][::-1]
    attn = DenseMLAAttention(ours)
    with torch.inference_mode():
        first = ours.compute_logits(ours(torch.tensor(a[:20] + b[:10]), torch.cat((torch.arange(20), torch.arange(10))),
                                         attn.batch((0, 20), (1, 10))))
        second = ours.compute_logits(ours(torch.tensor(a[20:21] + b[10:]),
                                          torch.cat((torch.tensor([20]), torch.arange(10, len(b)))),
                                          attn.batch((0, 1), (1, len(b) - 10))))
    assert (torch.cat((first[:20], second[:1])) - reference(hf, a[:21])).abs().max().item() < TOLERANCE
    assert (torch.cat((first[20:], second[1:])) - reference(hf, b)).abs().max().item() < TOLERANCE


def test_early_exit_matches_a_truncated_transformers_model(models):
    hf, ours = models
    short = HFDeepseekV3(replace_layers(hf.config, 1)).eval()
    result = short.load_state_dict(hf.state_dict(), strict=False)
    assert not result.missing_keys
    with torch.inference_mode():
        hidden = ours.forward_layers(torch.tensor(IDS), torch.arange(len(IDS)), DenseMLAAttention(ours), 1)
        logits = ours.compute_logits(hidden)
    assert (logits - reference(short, IDS)).abs().max().item() < TOLERANCE
    with pytest.raises(ValueError):
        ours.forward_layers(torch.tensor(IDS), torch.arange(len(IDS)), DenseMLAAttention(ours), L + 1)
    with pytest.raises(IndexError):
        ours(torch.tensor([1]), torch.tensor([128]), DenseMLAAttention(ours))


def replace_layers(config: DeepseekV3Config, layers: int) -> DeepseekV3Config:
    d = config.to_dict()
    d.update(num_hidden_layers=layers, first_k_dense_replace=layers)
    return DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")},
                            attn_implementation="eager")


class PagedMLAAttention:
    """``AttentionFn`` over kvpage's own paged cache (:func:`paged_attention`) for one sequence, key-only spec."""

    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache_dtype: str = "float32", block_size: int = 16) -> None:
        c = model.config
        self.spec = CacheSpec.build(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                    has_value=c.kv_has_value, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        self.cache = CacheController(self.spec).initialize_kv_cache(8)
        self.model, self.bs, self.len, self.meta = model, block_size, 0, None

    def step(self, n: int) -> PagedMLAAttention:
        """The next forward adds ``n`` tokens to the sequence (blocks 0, 1, ... in order)."""
        self.len += n
        self.meta = AttentionMetadata.build(block_tables=[list(range(8))], seq_lens=[self.len], query_lens=[n],
                                            slot_mapping=list(range(self.len - n, self.len)), block_size=self.bs)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        return paged_attention(q, k, v, self.cache[layer], self.spec.layer(layer), self.meta, layer_index=layer,
                               params=self.model.attention_params(layer))


@pytest.mark.parametrize("kv_cache_dtype, tol", [("float32", TOLERANCE), ("int8", 0.25)])
def test_paged_latent_cache_matches_transformers(models, kv_cache_dtype, tol):
    """Prefill of 20 then token-by-token decode through kvpage's paged attention op over a latent-only cache."""
    hf, ours = models
    attn = PagedMLAAttention(ours, kv_cache_dtype)
    assert "value" not in attn.cache[0]
    with torch.inference_mode():
        steps = [ours.compute_logits(ours(torch.tensor(IDS[:20]), torch.arange(20), attn.step(20)))]
        steps += [ours.compute_logits(ours(torch.tensor([t]), torch.tensor([p]), attn.step(1)))
                  for p, t in enumerate(IDS[20:], start=20)]
    errs = (torch.cat(steps) - reference(hf, IDS)).abs().amax(dim=-1)  # [positions]
    err = errs.max().item()
    if kv_cache_dtype != "float32" and any(isinstance(layer.mlp, MoEMLP) for layer in ours.layers):
        # the latent's rounding may flip a token's expert choice (a discontinuity, ~1 position in 48 here)
        assert (errs < tol).float().mean().item() >= 0.9, errs.tolist()
    else:
        assert err < tol
    assert kv_cache_dtype == "float32" or err > TOLERANCE  # the int8 cache really quantized the latent


def test_bfloat16_model_stays_close():
    hf, ours32 = build("q_lora")
    ours = DeepseekV3ForCausalLM(mla_model_config(hf.config), dtype=torch.bfloat16)
    ours.load_hf_state_dict(dict(hf.state_dict()))
    with torch.inference_mode():
        got = run(ours, DenseMLAAttention(ours), IDS[:16])
    assert (got - reference(hf, IDS[:16])).abs().max().item() < 0.25


def test_mla_model_config_is_the_latent_cache():
    c = mla_model_config(hf_config(q_lora_rank=24))
    assert isinstance(c, ModelConfig)
    assert (c.num_kv_heads, c.head_dim, c.kv_has_value, c.num_heads) == (1, R + ROPE, False, H)
    assert (c.num_layers, c.vocab_size, c.hidden_size, c.intermediate_size) == (L, VOCAB, E, 96)
    assert c.hf_config is not None and c.rope_type == "default"
    assert mla_model_config(hf_config(rope_parameters=YARN)).rope_type == "yarn"


def test_cache_bytes_per_token_is_the_latent_arithmetic():
    latent = CacheSpec.build(num_layers=L, num_kv_heads=1, head_dim=R + ROPE, has_value=False, kv_cache_dtype="float32")
    assert latent.bytes_per_token == L * (R + ROPE) * 4
    # an uncompressed MLA cache holds per head a key of NOPE + ROPE and a value of V_DIM elements
    full = CacheSpec.build(num_layers=L, num_kv_heads=H, head_dim=(NOPE + ROPE + V_DIM) // 2, has_value=True,
                           kv_cache_dtype="float32")
    assert full.bytes_per_token == L * H * (NOPE + ROPE + V_DIM) * 4
    assert full.bytes_per_token / latent.bytes_per_token == pytest.approx(H * (NOPE + ROPE + V_DIM) / (R + ROPE))


@pytest.mark.parametrize("overrides, match", [
    ({"first_k_dense_replace": 1, "n_routed_experts": 6, "n_group": 4}, "n_group=4 groups"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 5},
     "num_experts_per_tok=5 exceeds"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 0}, "n_group must be >= 1, got 0"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "topk_group": 0},
     "topk_group must be >= 1, got 0"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "topk_group": 3}, "topk_group=3 exceeds"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "num_experts_per_tok": 0},
     "num_experts_per_tok must be >= 1"),
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 2, "n_shared_experts": -1},
     "n_shared_experts must be >= 0"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_mla_model_config_rejects_what_it_cannot_run(overrides, match):
    with pytest.raises(ValueError, match=match):
        mla_model_config(hf_config(**overrides))


def test_mla_model_config_rejects_other_architectures():
    from transformers import LlamaConfig
    with pytest.raises(ValueError, match="llama"):
        mla_model_config(LlamaConfig())


def test_load_rejects_a_state_dict_that_does_not_fit():
    hf, _ = build("q_proj")
    ours = DeepseekV3ForCausalLM(mla_model_config(replace_layers(hf.config, L)))
    sd = dict(hf.state_dict())
    del sd["model.layers.0.self_attn.kv_b_proj.weight"]
    sd["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    sd["model.extra.weight"] = torch.zeros(1)
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(1)  # an MTP layer: ignored, as transformers does
    with pytest.raises(ValueError) as err:
        ours.load_hf_state_dict(sd)
    msg = str(err.value)
    assert "kv_b_proj" in msg and "model.extra.weight" in msg and "q_proj" in msg and "eh_proj" not in msg


def test_rejects_a_non_mla_config():
    c = mla_model_config(hf_config())
    with pytest.raises(ValueError):
        DeepseekV3ForCausalLM(replace(c, kv_has_value=True))


def test_router_and_moe_block_match_transformers():
    """DeepSeek-V3's group-limited routing picks the same experts with the same weights as transformers', and
    the MoE block (routed + shared experts) gives the same output; the routing is not trivial."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from kvpage.model.mlp import MoEDims, route, split_fused_experts

    cfg = hf_config(**CASES["moe"])
    torch.manual_seed(0)
    ref = DeepseekV3MoE(cfg).eval()
    randomize(ref, seed=4)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=torch.Generator().manual_seed(5)))
    ours = MoEMLP(E, MoEDims.from_hf(cfg), torch.float32)
    ours.load(split_fused_experts({"mlp." + k: v for k, v in ref.state_dict().items()}), "mlp.")
    h = torch.randn(64, E, generator=torch.Generator().manual_seed(6))
    weights, experts = route(h, ours.gate, ours.bias, ours.dims)
    with torch.no_grad():
        _, ref_w, ref_i = ref.gate(h)
        ref_out = ref(h[None])[0]
    order, ref_order = experts.argsort(dim=-1), ref_i.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), ref_i.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5), atol=1e-5)   # normalised, then scaled
    with torch.no_grad():
        assert (ours(h) - ref_out).abs().max().item() < 1e-5
    assert experts.unique().numel() >= 6                      # tokens spread over the experts
    groups = experts // 4
    assert bool((groups == groups[:, :1]).all())              # topk_group=1: one group per token
