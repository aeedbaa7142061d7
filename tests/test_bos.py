"""A text prompt is tokenized as the model's tokenizer asks, BOS included, on every entry point (issue 29, item 1).

The model here is a tiny random Llama saved as a Hugging Face folder with a byte-level BPE tokenizer whose
post-processor puts ``<bos>`` first, as Gemma's, Llama 3's and Mistral's tokenizers do, and whose chat
template renders ``{{ bos_token }}`` itself. ``tokenizer(text)`` is the reference: ``LLM.generate``,
``kvpage generate --no-chat``, the server's ``/v1/completions`` with a string prompt, ``kvpage eval`` and
``kvpage calibrate`` must all see the same ids, BOS first; chat prompts must carry exactly one BOS.
"""
from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import transformers
from _families import hf_config, hf_model

from kvpage import LLM, SamplingParams
from kvpage.cli import main as cli_main
from kvpage.eval import text_token_ids
from kvpage.eval.calibrate import calibration_token_ids
from kvpage.eval.suite import ResolvedText, SuiteMember, member_token_ids
from kvpage.server.app import ServerThread, build_app

BOS, EOS = 0, 1
TEXT = "the capital of France is"
CORPUS = ["the quick brown fox jumps over the lazy dog", "the capital of France is Paris, a city on the Seine"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def bos_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A 300-token byte-level BPE whose post-processor adds ``<bos>`` (id 0) to every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<bos>", "<eos>"]))
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", BOS)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random Llama (vocab 512) with :func:`bos_tokenizer`, saved as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("bos-llama")
    hf_model(hf_config("LlamaConfig", dict(num_hidden_layers=2, bos_token_id=BOS, eos_token_id=EOS))).save_pretrained(path)
    bos_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(folder) -> transformers.PreTrainedTokenizerBase:
    """transformers' own load of the folder's tokenizer: the reference ids."""
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), num_blocks=64, max_model_len=128, progress=False)


def test_the_reference_tokenizer_adds_bos(tok) -> None:
    """The premise: this tokenizer's own encoding of a text starts with BOS (once)."""
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert ids[1:] == tok.encode(TEXT, add_special_tokens=False)


def test_encode_text_follows_the_tokenizer_unless_told(tok) -> None:
    from kvpage.model.encode import encode_text

    plain = tok.encode(TEXT, add_special_tokens=False)
    assert encode_text(tok, TEXT) == tok(TEXT)["input_ids"] == [BOS, *plain]
    assert encode_text(tok, TEXT, bos=False) == plain
    assert encode_text(tok, TEXT, bos=True) == [BOS, *plain]          # exactly one, not two


def test_encode_text_bos_true_without_a_bos_token_is_an_error() -> None:
    from _tiny import ByteTokenizer

    from kvpage.model.encode import encode_text

    tok = ByteTokenizer()
    assert encode_text(tok, "ab") == [97, 98]                          # a tokenizer that adds nothing
    with pytest.raises(ValueError, match="no BOS token"):
        encode_text(tok, "ab", bos=True)


def test_llm_generate_string_prompt_starts_with_bos(llm, tok) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    out = llm.generate(TEXT, greedy)[0]
    assert out.prompt_token_ids == tok(TEXT)["input_ids"]
    assert out.prompt_token_ids[0] == BOS
    same = llm.generate({"prompt_token_ids": tok(TEXT)["input_ids"]}, greedy)[0]
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    assert llm.encode(TEXT) == (TEXT, tok(TEXT)["input_ids"])


def test_chat_prompt_has_exactly_one_bos(llm, tok) -> None:
    """The template renders ``<bos>`` itself: encoding the rendered text must not add a second one."""
    messages = [{"role": "user", "content": TEXT}]
    ids = llm.chat_prompt(messages)["prompt_token_ids"]
    ref = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert ids == list(ref)
    assert ids[0] == BOS and ids.count(BOS) == 1
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.prompt_token_ids.count(BOS) == 1


def test_cli_generate_no_chat_counts_the_bos(folder, tok, capsys) -> None:
    rc = cli_main(["generate", "--no-chat", "--model", str(folder), "--max-tokens", "3", "--num-blocks", "32",
                   "--max-model-len", "64", TEXT])
    out = capsys.readouterr().out
    assert rc == 0, out
    counted = int(re.search(r"\[kvpage\] (\d+) prompt tokens", out).group(1))
    assert counted == len(tok(TEXT)["input_ids"]) == len(tok.encode(TEXT, add_special_tokens=False)) + 1


@pytest.fixture(scope="module")
def server(llm) -> Iterator[SimpleNamespace]:
    with ServerThread(build_app(llm, "bos")) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        yield SimpleNamespace(url=srv.url, http=http)


def test_server_completion_of_a_string_prompt_starts_with_bos(server, tok) -> None:
    """A string prompt costs (and answers) exactly as its ids with BOS do."""
    ids = tok(TEXT)["input_ids"]
    text = server.http.post("/v1/completions", json={"model": "bos", "prompt": TEXT, "max_tokens": 5,
                                                     "temperature": 0}).json()
    by_ids = server.http.post("/v1/completions", json={"model": "bos", "prompt": ids, "max_tokens": 5,
                                                       "temperature": 0}).json()
    assert text["usage"]["prompt_tokens"] == by_ids["usage"]["prompt_tokens"] == len(ids)
    assert text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    chat = server.http.post("/v1/chat/completions", json={"model": "bos", "max_tokens": 1, "messages": [
        {"role": "user", "content": TEXT}]}).json()
    ref = tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=True, add_generation_prompt=True)
    assert chat["usage"]["prompt_tokens"] == len(ref["input_ids"] if hasattr(ref, "keys") else ref)


def test_eval_token_helpers_follow_the_tokenizer(tok, tmp_path) -> None:
    text = " ".join(CORPUS * 4)
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    ref = tok(text)["input_ids"]
    plain = tok.encode(text, add_special_tokens=False)
    assert text_token_ids(tok, path, 12) == ref[:12] and ref[0] == BOS
    assert text_token_ids(tok, path, 12, bos=False) == plain[:12]
    assert calibration_token_ids(tok, text, 12) == ref[:12]
    assert calibration_token_ids(tok, text, 12, bos=False) == plain[:12]
    member = SuiteMember(name="m", kind="prose", locator="x", tokens=12, version_of=None, recorded_version=None,
                         recorded_sha256="0")
    resolved = ResolvedText(member=member, text=text, origin="here", version=None, sha256="0")
    assert member_token_ids(tok, resolved) == ref[:12]
    assert member_token_ids(tok, resolved, bos=False) == plain[:12]


@pytest.mark.parametrize("flag,expect_bos", [(None, True), ("--no-bos", False), ("--bos", True)])
def test_cli_eval_scores_the_text_with_bos_unless_told(folder, tok, tmp_path, capsys, flag, expect_bos) -> None:
    text = " ".join(CORPUS * 4)
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    out_dir = tmp_path / "out"
    argv = ["eval", "--text", str(path), "--model", str(folder), "--formats", "auto", "--tokens", "16",
            "--no-progress", "--no-kl-divergence", "--out", str(out_dir), *([flag] if flag else [])]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert ("(BOS first)" if expect_bos else "(no BOS)") in printed
    results = json.loads((out_dir / "results.json").read_text())
    assert results["bos"] is expect_bos
    assert results["num_tokens"] == 16
    words = shlex.split(results["command"])
    assert [w for w in words if w.endswith("bos")] == ([flag] if flag else [])


def test_cli_calibrate_measures_the_text_with_bos(folder, tmp_path, capsys) -> None:
    """The scales come from the ids with BOS: the same as collect_kv_absmax on ``tokenizer(text)``'s ids."""
    import torch

    from kvpage.eval.calibrate import collect_kv_absmax
    from kvpage.model.loader import load_model
    from kvpage.scales import StaticScales

    text = " ".join(CORPUS * 4)
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "scales.safetensors"
    assert cli_main(["calibrate", "--text", str(path), "--out", str(out), "--model", str(folder), "--tokens", "20",
                     "--no-progress"]) == 0
    capsys.readouterr()
    loaded = load_model(folder, dtype=torch.float32, progress=False)
    ref = collect_kv_absmax(loaded, loaded.tokenizer(text)["input_ids"][:20], progress=False)
    got = StaticScales.load(out)
    assert all(torch.equal(got.key[i], ref.key[i]) and torch.equal(got.value[i], ref.value[i]) for i in ref.key)
