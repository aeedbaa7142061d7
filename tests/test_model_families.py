"""kvpage's shared decoder against transformers' own Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 models.

Tiny random models (see ``_families.py``); windowed cases use a window of 8 over 40 tokens. The
reference attention is float64 and applies each layer's ``attention_params``, so these tests check
both the model's numerics and the per-layer attention contract it states.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from kvpage.model.config import SUPPORTED_MODEL_TYPES, ModelConfig
from kvpage.model.decoder import DecoderForCausalLM
from kvpage.model.families import FAMILIES, family_for
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import load_model
from kvpage.ops.layer_attention import PLAIN, LayerAttention

from _families import CASES, VOCAB, WINDOW, WindowedDenseAttention, hf_config, hf_model, kvpage_model, run_chunks

TOLERANCE = 1e-3  # max abs logit difference, float32
SEQ = 40

CASE_IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request):
    """``(case id, transformers model, kvpage model, ids, transformers' logits [SEQ, V])``."""
    name, cls_name, overrides = request.param
    hf = hf_model(hf_config(cls_name, overrides))
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    return name, hf, kvpage_model(hf), ids, ref


def test_prefill_matches_transformers(case):
    name, hf, model, ids, ref = case
    with torch.inference_mode():
        ours = run_chunks(model, ids, [SEQ])
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (SEQ, VOCAB)
    assert (ours - ref).abs().max().item() < TOLERANCE, name


def test_token_by_token_decode_matches_transformers(case):
    name, hf, model, ids, ref = case
    with torch.inference_mode():
        ours = run_chunks(model, ids, [1] * SEQ)
    assert (ours - ref).abs().max().item() < TOLERANCE, name


def test_chunked_prefill_and_varlen_batch_match_transformers(case):
    """Chunks that straddle the window, and two sequences in one forward (positions restart per sequence)."""
    name, hf, model, ids, ref = case
    with torch.inference_mode():
        chunked = run_chunks(model, ids, [13, 13, 14])
        attn = WindowedDenseAttention(model)
        first = model.compute_logits(model(torch.cat((ids[:30], ids[:11])),
                                           torch.cat((torch.arange(30), torch.arange(11))),
                                           attn.batch((0, 30), (1, 11))))
        second = model.compute_logits(model(torch.cat((ids[30:31], ids[11:])),
                                            torch.cat((torch.tensor([30]), torch.arange(11, SEQ))),
                                            attn.batch((0, 1), (1, SEQ - 11))))
    assert (chunked - ref).abs().max().item() < TOLERANCE, name
    assert (torch.cat((first[:30], second[:1])) - ref[:31]).abs().max().item() < TOLERANCE, name
    assert (torch.cat((first[30:], second[1:])) - ref).abs().max().item() < TOLERANCE, name


def test_attention_params_state_what_transformers_attends_with(case):
    name, hf, model, _, _ = case
    cfg = hf.config
    windows = []
    for i, layer in enumerate(hf.model.layers):
        params = model.attention_params(i)
        assert isinstance(params, LayerAttention)
        attn = layer.self_attn
        # Mistral's attention reads config.sliding_window in every layer; the others keep their own
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
        assert params.sliding_window == window, (name, i)
        windows.append(window)
        scale = cfg.head_dim ** -0.5 if params.scale is None else params.scale
        assert scale == pytest.approx(attn.scaling, rel=1e-12), (name, i)
        cap = getattr(attn, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None
        assert params.logit_softcap == cap
    if name.endswith("-window") or name.startswith("gemma"):  # the test really exercises a window...
        assert WINDOW in windows
        assert None in windows or name == "mistral-window"  # ...and, but for Mistral, full layers too
    if name in ("llama", "qwen2", "qwen3", "mistral-nowindow"):
        assert all(model.attention_params(i) is PLAIN for i in range(len(hf.model.layers)))
    with pytest.raises(IndexError):
        model.attention_params(len(hf.model.layers))


def test_gemma3_layers_use_their_layer_types_rope():
    hf = hf_model(hf_config("Gemma3TextConfig", dict(CASES[CASE_IDS.index("gemma3")][2])))
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    model = kvpage_model(hf)
    assert [layer.rope_table for layer in model.layers] == [1, 0, 1, 0]
    rotary = hf.model.rotary_emb
    pos = torch.arange(128)[None]
    for table, layer_type in ((0, "full_attention"), (1, "sliding_attention")):
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos, layer_type)
        ours = (model.rope_cos, model.rope_sin) if table == 0 else (model.rope_cos_sliding_attention,
                                                                     model.rope_sin_sliding_attention)
        assert torch.equal(ours[0], cos[0])
        assert torch.equal(ours[1].abs(), sin[0].abs())
    assert model.config.rope_theta == 1e6 and model.config.rope_type == "linear"


def test_registry_covers_the_families_and_llama_name_is_the_shared_decoder():
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"}
    assert LlamaForCausalLM is DecoderForCausalLM
    for family in FAMILIES.values():
        assert hasattr(transformers, family.hf_class), family
    with pytest.raises(ValueError, match="'gpt2'"):
        family_for("gpt2")


def small_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of 300 tokens trained on two sentences: loads under every family's
    ``AutoTokenizer`` mapping (Qwen2's swaps in ``Qwen2Tokenizer``, which needs a BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog " * 20, "hello world, kvpage pages the cache " * 20]
    backend.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


@pytest.mark.parametrize("case_id", ["qwen2-window", "qwen3-bias-window", "gemma2", "gemma3"])
def test_loader_builds_the_family_from_a_saved_folder(tmp_path, case_id):
    _, cls_name, overrides = CASES[CASE_IDS.index(case_id)]
    hf = hf_model(hf_config(cls_name, overrides))
    hf.save_pretrained(tmp_path)
    small_tokenizer().save_pretrained(tmp_path)

    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.model_type == hf.config.model_type
    assert type(loaded.model) is DecoderForCausalLM and loaded.model.family is FAMILIES[hf.config.model_type]
    ids = loaded.tokenizer.encode("hello quick fox", add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == "hello quick fox" and max(ids) < VOCAB
    direct = kvpage_model(hf)
    assert loaded.config == direct.config
    ours = dict(loaded.model.state_dict())
    assert ours.keys() == dict(direct.state_dict()).keys()
    for key, tensor in direct.state_dict().items():
        assert torch.equal(ours[key], tensor), key
    sd = hf.state_dict()
    layer = loaded.model.layers[1]
    assert torch.equal(layer.qkv_proj.weight[: 4 * 16], sd["model.layers.1.self_attn.q_proj.weight"])
    if layer.qkv_bias is not None:
        assert torch.equal(layer.qkv_bias[4 * 16: 6 * 16], sd["model.layers.1.self_attn.k_proj.bias"])
    if layer.q_norm is not None:
        assert torch.equal(layer.k_norm.weight, sd["model.layers.1.self_attn.k_norm.weight"])
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(run_chunks(loaded.model, ids, [SEQ]), run_chunks(direct, ids, [SEQ]))


@pytest.mark.parametrize(
    ("cls_name", "overrides", "pattern"),
    [
        ("Gemma3Config", {}, "'gemma3'"),  # the multimodal wrapper; its text model is gemma3_text
        ("Gemma2Config", {"hidden_activation": "gelu"}, "'gelu'"),
        ("Qwen2Config", {"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
        ("Gemma3TextConfig", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("MistralConfig", {"attention_bias": True}, "attention_bias"),
        ("Qwen3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ("Gemma3TextConfig", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}}, "dynamic"),
    ],
)
def test_unsupported_configs_raise_naming_what(cls_name, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf(getattr(transformers, cls_name)(**overrides))


def test_state_dict_of_another_family_is_rejected_with_names():
    qwen3 = hf_model(hf_config("Qwen3Config", dict(num_hidden_layers=1)))
    llama_cfg = ModelConfig.from_hf(hf_config("LlamaConfig", dict(num_hidden_layers=1)))
    with pytest.raises(ValueError, match=r"unexpected 2 tensor\(s\): model.layers.0.self_attn.k_norm.weight"):
        DecoderForCausalLM(llama_cfg).load_hf_state_dict(dict(qwen3.state_dict()))


def _fake_builder(hf_config, torch_dtype):
    return ("built", hf_config.model_type, torch_dtype)


def test_a_family_with_its_own_config_builder_and_model_class_is_one_registry_entry(monkeypatch):
    """What an MLA-like family needs: ``from_hf`` defers to its builder; the loader builds its ``model_class``."""
    from types import SimpleNamespace

    from kvpage.model.families import Family, load_attr

    monkeypatch.setitem(FAMILIES, "fake_mla", Family("fake_mla", "LlamaForCausalLM",
                                                     model_class="kvpage.model.llama:LlamaForCausalLM",
                                                     config_builder=f"{__name__}:_fake_builder"))
    assert ModelConfig.from_hf(SimpleNamespace(model_type="fake_mla"), torch.bfloat16) == (
        "built", "fake_mla", torch.bfloat16)
    assert load_attr(family_for("fake_mla").model_class) is DecoderForCausalLM
