"""``--speculative-config`` on ``kvpage generate`` / ``serve``: parsing, errors, passing to ``LLM``, summary line."""
from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvpage import cli
from kvpage.cli import generate
from kvpage.cli.engine_flags import build_llm
from kvpage.engine.args import json_object
from kvpage.engine.speculative.metrics import SpecDecodingCounters, SpecDecodingStats

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_flag_parses_to_a_dict(command: list[str]) -> None:
    args = cli.build_parser().parse_args([*command, "--speculative-config", NGRAM])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    assert cli.build_parser().parse_args(command).speculative_config is None


@pytest.mark.parametrize("text,why", [
    ("{method: ngram}", "is not valid JSON"),
    ('["ngram", 4]', "got a JSON list"),
    ("4", "got a JSON int"),
    ("", "is not valid JSON"),
])
def test_bad_json_names_the_flag(capsys, text: str, why: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["generate", "hi", "--speculative-config", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config: must be a JSON object" in err and why in err
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        json_object(text)


def _fake_llm(monkeypatch) -> dict[str, Any]:
    """Replace ``LLM`` by a recorder of its keyword arguments; returns the record."""
    import kvpage.engine.llm

    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, model: Any, **kwargs: Any) -> None:
            seen.update(kwargs)

    monkeypatch.setattr(kvpage.engine.llm, "LLM", Recorder)
    return seen


def test_the_dict_reaches_llm_as_the_engine_setting(monkeypatch) -> None:
    seen = _fake_llm(monkeypatch)
    build_llm(cli.build_parser().parse_args(["generate", "hi", "--speculative-config", NGRAM]))
    assert seen["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    seen.clear()
    build_llm(cli.build_parser().parse_args(["serve", "--speculative-config", NGRAM]), max_num_batched_tokens=64)
    assert seen["speculative_config"]["method"] == "ngram" and seen["max_num_batched_tokens"] == 64
    seen.clear()
    build_llm(cli.build_parser().parse_args(["generate", "hi"]))
    assert "speculative_config" not in seen and seen["kv_cache_dtype"] == "auto"  # not given: not passed


def test_summary_line() -> None:
    assert generate.spec_decode_line(None) is None
    c = SpecDecodingCounters(3)
    c.observe(3, 3, 4)
    c.observe(3, 1, 2)
    c.observe(2, 0, 1)
    assert generate.spec_decode_line(c.snapshot()) == (
        "[kvpage] speculative: 8 drafted, 4 accepted in 3 rounds; acceptance rate 50.0%, mean accepted length "
        "2.33; per position 0.67 0.33 0.50")
    assert generate.spec_decode_line(SpecDecodingStats.empty(2)) == (
        "[kvpage] speculative: 0 drafted, 0 accepted in 0 rounds; acceptance rate 0.0%, mean accepted length "
        "0.00; per position 0.00 0.00")


def test_generate_prints_the_line_only_when_the_engine_speculates(monkeypatch, capsys) -> None:
    from types import SimpleNamespace

    from _tiny import tiny_loaded
    from kvpage.model import loader

    tiny = tiny_loaded(0, max_positions=256)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    argv = ["generate", "abc abc abc", "--no-chat", "--max-tokens", "3", "--num-blocks", "16", "--threads", "1"]
    assert cli.main(argv) == 0
    assert "[kvpage] speculative:" not in capsys.readouterr().out  # EngineStats without spec_decoding, or None
    c = SpecDecodingCounters(2)
    c.observe(2, 1, 2)
    real_build = generate.build_llm

    def build(args: argparse.Namespace, **kw: Any) -> Any:
        llm = real_build(args, **kw)
        monkeypatch.setattr(llm.engine, "stats", lambda: SimpleNamespace(spec_decoding=c.snapshot()))
        return llm

    monkeypatch.setattr(generate, "build_llm", build)
    assert cli.main(argv) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[kvpage] speculative:")]
    assert line == generate.spec_decode_line(c.snapshot())


@pytest.mark.parametrize("flag,example,foreign", [
    ("--kv-events-config", '--kv-events-config \'{"enable_kv_cache_events": true', "ngram"),
    ("--speculative-config", '--speculative-config \'{"method": "ngram"', "enable_kv_cache_events"),
    ("--kv-transfer-config", '--kv-transfer-config \'{"kv_connector": "KVPageStoreConnector"', "ngram"),
])
@pytest.mark.parametrize("text", ["{oops", "[1, 2]"])
def test_bad_json_message_shows_that_flags_example(capsys, flag: str, example: str, foreign: str, text: str) -> None:
    """Each JSON flag's error shows an example of that flag, never another flag's (the shared type once showed a
    speculative-config example for every JSON flag)."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", flag, text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a JSON object" in err
    assert f"e.g. {example}" in err and foreign not in err
    with pytest.raises(argparse.ArgumentTypeError, match="must be a JSON object") as plain:
        json_object(text)
    assert "e.g." not in str(plain.value)  # the flag-less type shows no (other flag's) example
