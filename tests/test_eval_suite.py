"""The evaluation set of ``kvpage eval --suite``: its members resolve here, one is held back, and the run's JSON.

The members' texts are read where they ship (Debian's base-files or the repository, CPython's stdlib,
installed packages); the bundled model's tokenizer (≈2 s to build from the GGUF) counts their tokens.
The end-to-end runs use the tiny random model with its byte tokenizer (``tests/_tiny.py``).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import replace

import pytest

from _tiny import tiny_loaded
from kvpage.cli import main
from kvpage.eval.suite import SUITE, SuiteMember, check_suite, member_token_ids, resolve_member, select_members
from kvpage.eval.suite_report import format_summary_table, summarize_suite

KINDS_AT_LEAST = 4


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled SmolLM2 tokenizer, read from the GGUF without its weights."""
    from kvpage.model.loader import _gguf_tokenizer, default_model_path

    return _gguf_tokenizer(default_model_path())


def test_every_member_resolves_to_its_token_count(tokenizer):
    for m in SUITE:
        r = resolve_member(m)
        ids = member_token_ids(tokenizer, r)
        assert len(ids) == m.tokens, m.name
        assert len(tokenizer.encode(r.text, add_special_tokens=False)) > m.tokens, m.name
        assert r.text.strip() and len(r.text) > 4 * m.tokens // 2, m.name
        if r.version == m.recorded_version:             # same package / Python version: the recorded text exactly
            assert r.sha256_matches, r.mismatch_warning()
    assert max(m.tokens for m in SUITE) >= 4096          # a context half the model's 8,192
    assert len({m.kind for m in SUITE}) >= KINDS_AT_LEAST


def test_exactly_one_held_back_member_and_it_is_not_gpl3():
    check_suite(SUITE)
    held = [m for m in SUITE if m.held_back]
    assert [m.name for m in held] == ["language_reference"]
    assert "GPL" not in held[0].locator and held[0].kind == "technical documentation"
    gpl = next(m for m in SUITE if "GPL-3" in m.locator)
    assert not gpl.held_back and gpl.kind != held[0].kind
    assert all(m.kind != held[0].kind for m in SUITE if not m.held_back)  # no tuning member of its kind


def test_sha256_is_stable_across_resolutions():
    first = {m.name: resolve_member(m).sha256 for m in SUITE}
    second = {m.name: resolve_member(m).sha256 for m in SUITE}
    assert first == second and len(set(first.values())) == len(SUITE)
    assert first["gpl3"] == "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"  # GPL-3's known sum


def test_changed_text_warns_with_versions():
    m = replace(SUITE[1], recorded_sha256="0" * 64, recorded_version="3.0.0")
    warning = resolve_member(m).mismatch_warning()
    assert warning is not None and "argparse" in warning and "python 3.0.0" in warning and "0000000000000000" in warning
    assert resolve_member(SUITE[1]).mismatch_warning() is None


def test_suite_checks_and_selection_refuse_bad_input(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        check_suite([replace(m, held_back=False) for m in SUITE])
    with pytest.raises(ValueError, match="exactly one"):
        check_suite([replace(m, held_back=True) for m in SUITE[:2]])
    with pytest.raises(ValueError, match="repeat"):
        check_suite([SUITE[0], SUITE[0]])
    assert [m.name for m in select_members("language_reference, gpl3")] == ["gpl3", "language_reference"]
    with pytest.raises(ValueError, match="unknown suite member.*nope.*the suite has"):
        select_members("gpl3,nope")
    missing = SuiteMember(name="x", kind="k", locator=f"file:{tmp_path / 'a'}|{tmp_path / 'b'}", tokens=8,
                          version_of=None, recorded_version=None, recorded_sha256="")
    with pytest.raises(FileNotFoundError, match="none of"):
        resolve_member(missing)
    with pytest.raises(ValueError, match="unknown locator scheme"):
        resolve_member(replace(missing, locator="http://example.com"))


def _run(argv: list[str], monkeypatch) -> tuple[int, str, str]:
    model = tiny_loaded(seed=3)
    monkeypatch.setattr("kvpage.model.loader.load_model", lambda *a, **k: model)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_suite_end_to_end_on_tiny_model(tmp_path, monkeypatch):
    rc, printed, err = _run(["eval", "--suite", "--tokens", "24", "--formats", "int8,int4", "--out", str(tmp_path),
                             "--threads", "1", "--no-progress"], monkeypatch)
    assert rc == 0, err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["suite_schema_version"] == 1 and data["held_back"] == "language_reference"
    members = {m["name"]: m for m in data["members"]}
    assert list(members) == [m.name for m in SUITE]
    assert [n for n, m in members.items() if m["held_back"]] == ["language_reference"]
    for s in SUITE:
        m = members[s.name]
        assert m["kind"] == s.kind and m["locator"] == s.locator and m["num_tokens"] == 24
        assert m["text_sha256"] == resolve_member(s).sha256
        assert m["sha256_matches"] is (m["text_sha256"] == s.recorded_sha256)
        assert [r["name"] for r in m["results"]] == ["auto", "int8", "int4"]
        assert all(r["num_predictions"] == 23 for r in m["results"])
        assert (tmp_path / s.name / "ppl_vs_bits.png").is_file() and (tmp_path / s.name / "kld_vs_bits.png").is_file()
        assert f"## {s.name}" in printed
    # the summary: means over the four tuning members, the held-back member's own values apart
    summary = {r["name"]: r for r in data["summary"]}
    int8 = summary["int8"]
    tuning = [m for m in members.values() if not m["held_back"]]
    assert int8["tuning_members"] == 4
    assert int8["tuning_delta_ppl_percent"] == pytest.approx(
        sum(m["results"][1]["delta_ppl_percent"] for m in tuning) / 4, rel=1e-12)
    assert int8["tuning_kld_mean"] == pytest.approx(
        sum(m["results"][1]["divergence"]["kld_mean"] for m in tuning) / 4, rel=1e-12)
    ref = members["language_reference"]["results"][1]
    assert int8["held_back_delta_ppl_percent"] == ref["delta_ppl_percent"]
    assert int8["held_back_kld_mean"] == ref["divergence"]["kld_mean"] > 0
    assert summary["auto"]["tuning_kld_mean"] == 0 and summary["auto"]["tuning_delta_ppl_percent"] == 0
    assert "held back: language_reference" in printed and f"{int8['held_back_kld_mean']:.6f}" in printed
    changed = [m["name"] for m in members.values() if not m["sha256_matches"]]   # [] where the suite was fixed
    assert [n for n in members if f"suite member {n!r}: text sha256" in err] == changed


def test_suite_members_pick_and_token_override(tmp_path, monkeypatch):
    rc, printed, _ = _run(["eval", "--suite", "--suite-members", "gpl3,matplotlibrc", "--tokens", "16",
                           "--formats", "int8", "--out", str(tmp_path), "--threads", "1", "--no-progress",
                           "--no-kl-divergence"], monkeypatch)
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [m["name"] for m in data["members"]] == ["gpl3", "matplotlibrc"] and data["held_back"] is None
    row = data["summary"][1]
    assert row["held_back_delta_ppl_percent"] is None and row["tuning_kld_mean"] is None
    assert math.isfinite(row["tuning_delta_ppl_percent"]) and "held back: not run" in printed
    assert not (tmp_path / "gpl3" / "kld_vs_bits.png").exists()


def test_suite_flag_errors_exit_2_before_loading(tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("kvpage.model.loader.load_model", no_load)
    assert main(["eval", "--suite", "--suite-members", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown suite member" in capsys.readouterr().err
    assert main(["eval", "--text", "x", "--suite-members", "gpl3", "--out", str(tmp_path)]) == 2
    assert "--suite-members needs --suite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--text", "x", "--suite"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--formats", "int8"])
    assert "one of the arguments --text --suite is required" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_summary_table_marks_missing_values():
    from kvpage.eval.perplexity import PerplexityResult

    def res(name: str, ppl: float) -> PerplexityResult:
        return PerplexityResult(name=name, kv_cache_dtype=name, mode="decode", num_tokens=9, num_predictions=8,
                                nll=math.log(ppl), ppl=ppl, bits_per_value=8.0, kv_bytes_per_token=1.0, seconds=0.1,
                                block_size=16)

    tuning = resolve_member(SUITE[0])
    rows = summarize_suite([(tuning, [res("auto", 10.0), res("int8", 10.1)])])
    assert rows[1].tuning_delta_ppl_percent == pytest.approx(1.0) and rows[1].tuning_kld_mean is None
    table = format_summary_table(rows, None)
    line = next(x for x in table.splitlines() if x.startswith("int8"))
    assert "+1.00" in line and line.split()[-6:] == ["-", "-", "|", "-", "-", "-"]
    with pytest.raises(ValueError, match="ran"):
        summarize_suite([(tuning, [res("auto", 10.0)]), (tuning, [res("auto", 10.0), res("int8", 10.1)])])


def test_suite_longer_than_context_exits_2_before_scoring(tmp_path, monkeypatch):
    rc, printed, err = _run(["eval", "--suite", "--formats", "int8", "--out", str(tmp_path), "--threads", "1",
                             "--no-progress"], monkeypatch)        # the tiny model's context is 512 tokens
    assert rc == 2 and "argparse (4096)" in err and "context of 512" in err
    assert "## gpl3" not in printed and not (tmp_path / "results.json").exists()


def test_suite_markdown_from_results_json(tmp_path, monkeypatch):
    from kvpage.eval.suite_report import suite_markdown

    rc, _, _ = _run(["eval", "--suite", "--suite-members", "gpl3,language_reference", "--tokens", "16",
                     "--formats", "int8", "--out", str(tmp_path), "--threads", "1", "--no-progress"], monkeypatch)
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    md = suite_markdown(data)
    lines = md.splitlines()
    gpl = next(x for x in lines if x.startswith("| `gpl3` | legal prose"))
    assert "| 16 |" in gpl and "`3972dc9744f6`" in gpl and gpl.endswith("| no |")
    assert next(x for x in lines if x.startswith("| `language_reference` |")).endswith("| **yes** |")
    int8 = data["summary"][1]
    row = next(x for x in lines if x.startswith("| `int8` | ") and "/" not in x)
    assert f"{int8['tuning_delta_ppl_percent']:+.2f}%" in row and f"{int8['held_back_kld_mean']:.5f}" in row
    per = next(x for x in lines if x.startswith("| `int8` | ") and "/" in x)
    ref = data["members"][1]["results"][1]
    assert per.endswith(f"{ref['delta_ppl_percent']:+.2f}% / {ref['divergence']['kld_mean']:.5f} |")
