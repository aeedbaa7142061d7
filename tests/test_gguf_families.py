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


def _write(case: tuple[str, dict[str, Any], dict[str, Q], bool], path: Path, name: str,
           chat_template: str | None = "default") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cls, overrides, types, add_bos = case
    source = hf_model(getattr(transformers, cls)(**{**TINY, **overrides}))
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
        source, held = _write(LLAMACPP_KEYS[model_id], path, model_id)
        ref = type(source)(source.config).eval()
        ref.load_state_dict(held, strict=False)  # tied lm_head follows the embedding
        types = LLAMACPP_KEYS[model_id][2]
    ours_ids, ours_logits = _kvpage_run(path)
    ref_ids, ref_logits = _hf_run(ref)
    used = "/".join(sorted({t.name for t in types.values()} | {"F32"}))
    return float((ours_logits - ref_logits).abs().max()), ours_ids == ref_ids, used


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("model_id", [*FAMILIES, *LLAMACPP_KEYS])
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
    """``kvpage generate --model FILE.gguf`` on a non-Llama file: the same 16 tokens as transformers on that file."""
    from kvpage import cli

    path = gguf_dir / "cli-gemma3.gguf"
    _write(FAMILIES["gemma3"], path, "gemma3")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=path.name, local_files_only=True, dtype=torch.float32,
        attn_implementation="eager").eval()
    tok = load_model(path, progress=False).tokenizer
    prompt = "The capital of France is"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert cli.main(["generate", prompt, "--model", str(path), "--no-chat", "--max-tokens", str(STEPS),
                     "--temperature", "0", "--kv-cache-dtype", "float32", "--num-blocks", "16"]) == 0
    text = capsys.readouterr().out.split("\n[kvpage]")[0].strip()
    with torch.no_grad():
        for start in ([1], []):  # with BOS (the file asks for it) or without: the CLI's encoding is not ours to fix here
            seq = start + ids
            for _ in range(STEPS):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
                if seq[-1] == 2:  # EOS ends the CLI's answer
                    break
            if tok.decode(seq[len(start) + len(ids):], skip_special_tokens=True).strip() == text:
                break
        else:
            pytest.fail(f"CLI output {text!r} matches neither transformers' greedy continuation")


def test_deepseek2_gguf_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp's DeepSeek-V2/V3 (MLA) files are not mapped yet: a clear error naming the architecture."""
    from gguf import GGUFWriter

    path = tmp_path / "ds.gguf"
    w = GGUFWriter(str(path), "deepseek2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported architecture 'deepseek2' in ds\.gguf.*Hugging Face folder"):
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
