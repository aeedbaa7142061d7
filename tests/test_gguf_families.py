"""GGUF files of every family kvpage computes, written by the tests (``tests/_gguf_files.py``), loaded by kvpage.

Each file is a tiny random transformers model written as llama.cpp writes one (its arch name, keys, tensor
names and transforms), with quantized matrices: every type llama.cpp users ship appears in some family
(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K, F16/BF16, F32 for 1-D tensors). kvpage's engine (float32 cache)
must give the logits transformers gives on the same file (``from_pretrained(..., gguf_file=...)``) within
1e-3 at every step, and the same 16 greedy tokens. A second set states llama.cpp keys transformers' GGUF
reader ignores (Gemma soft-caps, sliding-window pattern, linear RoPE scaling, a key_length that is not 256):
kvpage must follow the file, checked against transformers running the source config on the file's weights.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from _families import hf_model
from _gguf_files import VOCAB, write_gguf
from test_families_engine import LogitRecorder

from kvpage import LLM, SamplingParams
from kvpage.model.loader import apply_chat_template, load_model, read_gguf

PROMPT = [1, 30, 200, 411, 57, 92, 300, 17, 250, 18, 499, 64, 77, 128, 256, 311, 42, 9, 3, 480]
STEPS = 16
TINY = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, max_position_embeddings=256,
            attn_implementation="eager", initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)

#: ``id -> (config class, config overrides, ggml type per matrix role, add_bos_token)``. Config values that
#: transformers' GGUF reader does not take from the file are left at transformers' defaults here.
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Q], bool]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  tie_word_embeddings=False),
              dict(embed=Q.Q8_0, output=Q.Q6_K, attn_q=Q.Q4_K, attn_k=Q.Q5_K, attn_v=Q.Q4_0, attn_output=Q.Q4_1,
                   ffn_gate=Q.Q5_0, ffn_up=Q.Q5_1, ffn_down=Q.BF16), True),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                      sliding_window=None, tie_word_embeddings=True),
                dict(embed=Q.F16, attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q4_K, attn_output=Q.Q4_K, ffn_gate=Q.Q4_K,
                     ffn_up=Q.Q4_K, ffn_down=Q.Q4_K), True),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True),
              dict(embed=Q.F16, attn_q=Q.Q8_0, attn_k=Q.Q8_0, attn_v=Q.Q8_0, attn_output=Q.Q8_0, ffn_gate=Q.Q6_K,
                   ffn_up=Q.Q6_K, ffn_down=Q.Q6_K), False),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                  tie_word_embeddings=True),
              dict(embed=Q.BF16, attn_q=Q.Q5_K, attn_k=Q.Q5_K, attn_v=Q.Q5_K, attn_output=Q.Q5_K, ffn_gate=Q.Q4_0,
                   ffn_up=Q.Q4_0, ffn_down=Q.Q4_0), False),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                    sliding_window=8),
               dict(embed=Q.Q8_0, attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q6_K, attn_output=Q.Q4_K, ffn_gate=Q.Q8_0,
                    ffn_up=Q.Q8_0, ffn_down=Q.Q6_K), True),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=256, sliding_window=8),
               dict(embed=Q.Q8_0, attn_q=Q.Q6_K, attn_k=Q.Q6_K, attn_v=Q.Q6_K, attn_output=Q.Q6_K, ffn_gate=Q.Q5_1,
                    ffn_up=Q.Q5_1, ffn_down=Q.Q4_K), True),
}

#: Files whose llama.cpp keys transformers' GGUF reader ignores: compared with the source config's model.
LLAMACPP_KEYS: dict[str, tuple[str, dict[str, Any], dict[str, Q], bool]] = {
    "gemma2-softcaps-keylength": ("Gemma2Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        dict(embed=Q.Q8_0, attn_q=Q.Q4_K, attn_k=Q.Q4_K, attn_v=Q.Q4_K, attn_output=Q.Q4_K, ffn_gate=Q.Q4_K,
             ffn_up=Q.Q4_K, ffn_down=Q.Q4_K), True),
    "gemma3-pattern-linear-rope": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=3.0, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}),
        dict(embed=Q.Q8_0, attn_q=Q.Q5_K, attn_k=Q.Q5_K, attn_v=Q.Q5_K, attn_output=Q.Q8_0, ffn_gate=Q.Q5_K,
             ffn_up=Q.Q5_K, ffn_down=Q.Q5_K), True),
}

#: llama.cpp's ``deepseek2`` (DeepSeek-V3, MLA) files, which transformers cannot read: compared with transformers'
#: ``DeepseekV3ForCausalLM`` on the source config and the file's (dequantized) weights. ``attn_k_b`` / ``attn_v_b``
#: (the converter's split ``kv_b``) rows of 32 take Q8_0; rows that do not fill a block fall back to F16.
_DS = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32,
           v_head_dim=32, tie_word_embeddings=False)
DEEPSEEK2: dict[str, tuple[str, dict[str, Any], dict[str, Q], bool]] = {
    # DeepSeek-V3's shape: q LoRA, a dense first layer, then 4 routed experts in 2 groups (1 kept), 2 per token,
    # a shared expert, normalised and scaled routing weights
    "deepseek2-qlora-moe": ("DeepseekV3Config", dict(
        **_DS, num_hidden_layers=3, q_lora_rank=64, first_k_dense_replace=1, n_routed_experts=4, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256, routed_scaling_factor=2.5,
        norm_topk_prob=True),
        dict(embed=Q.Q8_0, output=Q.Q6_K, attn_q_a=Q.Q4_K, attn_q_b=Q.Q8_0, attn_kv_a_mqa=Q.Q5_K, attn_k_b=Q.Q8_0,
             attn_v_b=Q.Q8_0, attn_output=Q.Q8_0, ffn_gate=Q.Q4_K, ffn_up=Q.Q4_K, ffn_down=Q.Q6_K, ffn_gate_inp=Q.F32,
             ffn_gate_exps=Q.Q4_K, ffn_up_exps=Q.Q5_K, ffn_down_exps=Q.Q6_K, ffn_gate_shexp=Q.Q8_0,
             ffn_up_shexp=Q.Q8_0, ffn_down_shexp=Q.Q8_0), True),
    # a direct q_proj, YaRN, every layer dense, tied embeddings, unnormalised routing fields
    "deepseek2-qproj-yarn": ("DeepseekV3Config", dict(
        **{**_DS, "tie_word_embeddings": True}, num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0}),
        dict(embed=Q.Q8_0, attn_q=Q.Q8_0, attn_kv_a_mqa=Q.Q8_0, attn_k_b=Q.F16, attn_v_b=Q.Q8_0,
             attn_output=Q.Q8_0, ffn_gate=Q.Q8_0, ffn_up=Q.Q8_0, ffn_down=Q.Q8_0), False),
}


def _write(case: tuple[str, dict[str, Any], dict[str, Q], bool], path: Path, name: str,
           chat_template: str | None = "default") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cls, overrides, types, add_bos = case
    source = hf_model(getattr(transformers, cls)(**{**TINY, **overrides}))
    with torch.no_grad():  # transformers starts DeepSeek's router bias at 0: a dropped bias would not show
        for name, p in source.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    kwargs = {} if chat_template == "default" else {"chat_template": chat_template}
    held = write_gguf(source, path, types, add_bos=add_bos, name=name, **kwargs)
    return source, held


def _kvpage_run(path: Path) -> tuple[list[int], torch.Tensor]:
    """kvpage's greedy tokens and the logits of every step (last prompt token, then each generated one)."""
    llm = LLM(str(path), progress=False, dtype="float32", kv_cache_dtype="float32", block_size=16, num_blocks=16,
              max_num_seqs=1)
    rec = LogitRecorder(llm.model)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                     ignore_eos=True))[0]
    assert [p for p, _ in rec.rows] == list(range(len(PROMPT) - 1, len(PROMPT) - 1 + STEPS))
    return list(out.outputs[0].token_ids), torch.stack([row for _, row in rec.rows]).float()


def _hf_run(model: torch.nn.Module) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (full forward per step) and the logits at the same positions as :func:`_kvpage_run`."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids[:-1]])).logits[0, len(PROMPT) - 1:].float()
    return ids[len(PROMPT):], logits


def compare(model_id: str, folder: Path) -> tuple[float, bool, str]:
    """Write family ``model_id``'s GGUF into ``folder`` and run it through kvpage and transformers.

    Returns ``(max |logit diff|, greedy tokens equal, the file's tensor types)``; the reference is
    transformers' own GGUF loading for :data:`FAMILIES` and the source config on the file's weights for
    :data:`LLAMACPP_KEYS`.
    """
    path = folder / f"{model_id}.gguf"
    if model_id in FAMILIES:
        _write(FAMILIES[model_id], path, "Mistral Tiny" if model_id == "mistral" else model_id)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=path.name, local_files_only=True, dtype=torch.float32,
            attn_implementation="eager").eval()
        types = FAMILIES[model_id][2]
    else:
        case = {**LLAMACPP_KEYS, **DEEPSEEK2}[model_id]
        source, held = _write(case, path, model_id)
        ref = type(source)(source.config).eval()
        missing, unexpected = ref.load_state_dict(held, strict=False)  # tied lm_head follows the embedding
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        types = case[2]
    ours_ids, ours_logits = _kvpage_run(path)
    ref_ids, ref_logits = _hf_run(ref)
    used = "/".join(sorted({t.name for t in types.values()} | {"F32"}))
    return float((ours_logits - ref_logits).abs().max()), ours_ids == ref_ids, used


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("model_id", [*FAMILIES, *LLAMACPP_KEYS, *DEEPSEEK2])
def test_gguf_family_matches_transformers(model_id: str, gguf_dir: Path) -> None:
    diff, same, _ = compare(model_id, gguf_dir)
    assert diff < 1e-3, f"{model_id}: max |logit diff| {diff}"
    assert same, f"{model_id}: greedy tokens differ"


def test_gguf_config_reads_llamacpp_keys(gguf_dir: Path) -> None:
    """The keys transformers' GGUF table leaves out reach kvpage's config with llama.cpp's meaning."""
    path = gguf_dir / "keys-gemma3.gguf"
    source, _ = _write(LLAMACPP_KEYS["gemma3-pattern-linear-rope"], path, "g3")
    config, _ = read_gguf(path)
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == source.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}
    assert (config["query_pre_attn_scalar"], config["final_logit_softcapping"], config["head_dim"]) == (64, 3.0, 64)
    path2 = gguf_dir / "keys-gemma2.gguf"
    _write(LLAMACPP_KEYS["gemma2-softcaps-keylength"], path2, "g2")
    config2, _ = read_gguf(path2)
    assert (config2["attn_logit_softcapping"], config2["final_logit_softcapping"]) == (2.0, 3.0)
    assert config2["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config2["sliding_window"] == 8 and config2["query_pre_attn_scalar"] == 64


def test_gguf_tokenizer_carries_bos_flag_and_template(gguf_dir: Path) -> None:
    """The tokenizer built from the file reflects ``tokenizer.ggml.add_bos_token`` and ``tokenizer.chat_template``."""
    with_bos, without = gguf_dir / "tok-bos.gguf", gguf_dir / "tok-nobos.gguf"
    _write(FAMILIES["gemma3"], with_bos, "g")
    _write(FAMILIES["qwen2"], without, "q")
    tok_bos, tok_plain = load_model(with_bos, progress=False).tokenizer, load_model(without, progress=False).tokenizer
    assert tok_bos.add_bos_token is True and tok_bos.encode("hello")[0] == 1
    assert tok_plain.add_bos_token is False and tok_plain.encode("hello")[0] != 1
    assert tok_bos.chat_template.startswith("{% for message in messages %}")
    ids = apply_chat_template(tok_bos, "hi")
    assert tok_bos.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_without_template_names_the_file(gguf_dir: Path) -> None:
    path = gguf_dir / "no-template.gguf"
    _write(FAMILIES["qwen2"], path, "q", chat_template=None)
    tok = load_model(path, progress=False).tokenizer
    assert not tok.chat_template
    with pytest.raises(ValueError, match=r"no-template\.gguf has no chat template.*--no-chat.*completions"):
        apply_chat_template(tok, "hi")


def test_cli_generate_gemma3_gguf(gguf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvpage generate --model FILE.gguf --no-chat`` on a non-Llama file whose tokenizer adds BOS: the prompt is
    encoded with that BOS, and the answer is transformers' greedy continuation of those ids on the same file."""
    from kvpage import cli

    path = gguf_dir / "cli-gemma3.gguf"
    _write(FAMILIES["gemma3"], path, "gemma3")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=path.name, local_files_only=True, dtype=torch.float32,
        attn_implementation="eager").eval()
    prompt = "The capital of France is"
    ids = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=path.name)(prompt)["input_ids"]
    assert ids[0] == 1  # the file asks for BOS (add_bos_token true), and transformers' tokenizer adds it
    assert cli.main(["generate", prompt, "--model", str(path), "--no-chat", "--max-tokens", str(STEPS),
                     "--temperature", "0", "--kv-cache-dtype", "float32", "--num-blocks", "16"]) == 0
    captured = capsys.readouterr()
    text = captured.out.split("\n[kvpage]")[0].strip()
    assert f"{len(ids)} prompt tokens" in captured.out + captured.err
    seq = list(ids)
    with torch.no_grad():
        for _ in range(STEPS):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[-1] == 2:  # EOS ends the CLI's answer
                break
    tok = load_model(path, progress=False).tokenizer
    assert text == tok.decode(seq[len(ids):], skip_special_tokens=True).strip()


@pytest.mark.parametrize("model_id", list(FAMILIES))
def test_gguf_text_prompt_is_encoded_as_transformers_encodes_it(model_id: str, gguf_dir: Path) -> None:
    """A text prompt to ``LLM`` on a GGUF file gets the token ids transformers' tokenizer gives for the same file:
    BOS first exactly when the file's ``tokenizer.ggml.add_bos_token`` asks for it (issue 29 item 1)."""
    path = gguf_dir / f"text-{model_id}.gguf"
    _write(FAMILIES[model_id], path, model_id)
    text = "The capital of France is"
    want = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=path.name)(text)["input_ids"]
    llm = LLM(str(path), progress=False, dtype="float32", kv_cache_dtype="float32", block_size=16, num_blocks=16,
              max_num_seqs=1)
    _, got = llm.encode(text)
    assert got == want
    assert (got[0] == 1) is FAMILIES[model_id][3]
    out = llm.generate(text, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert list(out.prompt_token_ids) == want


def test_deepseek2_gguf_config_and_tensors(gguf_dir: Path) -> None:
    """llama.cpp's deepseek2 keys reach the DeepSeek-V3 config with their meaning, and the stacked experts
    and router bias come back as the file's values (the split ``kv_b`` is checked by the logits test)."""
    path = gguf_dir / "ds-config.gguf"
    source, held = _write(DEEPSEEK2["deepseek2-qlora-moe"], path, "ds")
    config, _ = read_gguf(path)
    src = source.config
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                 "moe_intermediate_size", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                 "num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert config[name] == getattr(src, name), name
    assert config["model_type"] == "deepseek_v3" and config["rope_interleave"] is True
    assert read_gguf(path, fast=False)[0] == config  # gguf-py's reader (older transformers) reads the same
    yarn_path = gguf_dir / "ds-yarn.gguf"
    _write(DEEPSEEK2["deepseek2-qproj-yarn"], yarn_path, "dsy")
    yarn, _ = read_gguf(yarn_path)
    assert yarn["q_lora_rank"] is None and yarn["tie_word_embeddings"] is True
    assert yarn["rope_parameters"] == pytest.approx(
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0})
    from kvpage.model.loader import _load_gguf

    model = _load_gguf(path, torch.float32, progress=False).model
    experts = model.layers[2].mlp
    assert torch.equal(experts.bias, held["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert torch.equal(experts.experts_gate_up, held["model.layers.2.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.experts_down, held["model.layers.2.mlp.experts.down_proj"])


def test_deepseek2_older_unsplit_kv_b_file_loads_the_same(gguf_dir: Path) -> None:
    """A file of the older converter (whole ``attn_kv_b``, ``head_count_kv`` = heads, ``key_length`` = ``n + r``,
    no ``*_mla`` keys) gives the same config and the same transformers tensors as today's split form."""
    from _gguf_files import write_gguf

    from kvpage.model.loader import _gguf_hf_state_dict

    cls, overrides, _, _ = DEEPSEEK2["deepseek2-qlora-moe"]
    source = hf_model(getattr(transformers, cls)(**{**TINY, **overrides}))
    new, old = gguf_dir / "ds-split.gguf", gguf_dir / "ds-unsplit.gguf"
    write_gguf(source, new, {}, name="split")  # F16 everywhere: elementwise, so both forms hold the same values
    held = write_gguf(source, old, {}, name="unsplit", deepseek_legacy=True)
    (config_new, tensors_new), (config_old, tensors_old) = read_gguf(new), read_gguf(old)
    assert "blk.0.attn_kv_b.weight" in {t.name for t in tensors_old}
    assert "blk.0.attn_k_b.weight" in {t.name for t in tensors_new}
    assert config_old == {**config_new, "_model_name_or_path": "unsplit"}
    names = list(held) + [f"model.layers.{i}.mlp.experts.{x}.{p}_proj.weight" for i in (1, 2) for x in range(4)
                          for p in ("gate", "up", "down")]
    sd_new = _gguf_hf_state_dict(tensors_new, "deepseek2", config_new, names, progress=False)
    sd_old = _gguf_hf_state_dict(tensors_old, "deepseek2", config_old, names, progress=False)
    assert sd_new.keys() == sd_old.keys() and "model.layers.0.self_attn.kv_b_proj.weight" in sd_new
    for name in sd_new:
        assert torch.equal(sd_new[name], sd_old[name]), name
    assert torch.equal(sd_new["model.layers.0.self_attn.kv_b_proj.weight"],
                       held["model.layers.0.self_attn.kv_b_proj.weight"])


def test_deepseek2_softmax_router_is_refused(gguf_dir: Path) -> None:
    """A DeepSeek-V2-style file (softmax gating, or no ``expert_gating_func`` at all) is refused naming the key."""
    import gguf

    path = gguf_dir / "ds-v2.gguf"
    source = hf_model(transformers.DeepseekV3Config(**{**TINY, **DEEPSEEK2["deepseek2-qlora-moe"][1]}))
    w = gguf.GGUFWriter(str(path), "deepseek2")
    from _gguf_files import _deepseek2_metadata, _metadata

    _metadata(w, source.config, "deepseek2", "v2")
    _deepseek2_metadata(w, source.config)
    w.kv_data[0]["deepseek2.expert_gating_func"].value = int(gguf.ExpertGatingFuncType.SOFTMAX)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"deepseek2\.expert_gating_func=1.*sigmoid"):
        read_gguf(path)


def test_unknown_gguf_architecture_is_refused_by_name(tmp_path: Path) -> None:
    """An architecture kvpage does not compute: a clear error naming it and the ones it loads."""
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    w = GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported architecture 'phi3' in phi\.gguf.*'llama'.*'deepseek2'"):
        load_model(path, progress=False)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_reference_k_quantizer_round_trips(qtype: Q) -> None:
    """The tests' own K-quant writer gives blocks that ``gguf.quants.dequantize`` reads back close to the input."""
    import numpy as np
    from gguf.quants import dequantize

    from _gguf_files import quantize_k

    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    back = dequantize(quantize_k(x, qtype), qtype).reshape(x.shape)
    bound = {Q.Q4_K: 0.25, Q.Q5_K: 0.12, Q.Q6_K: 0.08}[qtype]  # about one quantization step (inputs span ~7)
    assert np.abs(back - x).max() < bound
    assert np.corrcoef(back.ravel(), x.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("fast", [True, False])
def test_truncated_or_corrupt_gguf_is_one_clear_error(gguf_dir: Path, fast: bool) -> None:
    """A GGUF cut anywhere (header, metadata, tensor data), empty, or not GGUF at all: one ``ValueError`` naming the
    file (it used to surface the reader's ``struct.error`` or a numpy reshape error), from either reader."""
    whole = gguf_dir / "whole.gguf"
    _write(FAMILIES["qwen2"], whole, "qwen2")
    data = whole.read_bytes()
    for cut in (0, 30, 100, 5000, len(data) // 2, len(data) - 1):
        bad = gguf_dir / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut-{cut}\.gguf (is not a readable GGUF file \({cut:,} bytes|"
                                             rf"is truncated: tensor '[^']+' ends at byte [\d,]+, past the end)"):
            read_gguf(bad, fast=fast)
    bad = gguf_dir / "not-gguf.gguf"
    bad.write_bytes(b"hello world")
    with pytest.raises(ValueError, match=r"not-gguf\.gguf is not a readable GGUF file \(11 bytes"):
        read_gguf(bad, fast=fast)


def test_cli_reports_a_truncated_gguf_in_one_line(gguf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpage import cli

    whole = gguf_dir / "whole-cli.gguf"
    _write(FAMILIES["llama"], whole, "llama")
    bad = gguf_dir / "half.gguf"
    bad.write_bytes(whole.read_bytes()[:5000])
    assert cli.main(["generate", "hi", "--model", str(bad), "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert "half.gguf is not a readable GGUF file (5,000 bytes" in err and "Traceback" not in err
