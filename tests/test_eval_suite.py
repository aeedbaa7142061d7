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
from kvpage.eval.suite import (
    SUITE,
    ResolvedText,
    SuiteMember,
    check_suite,
    member_token_ids,
    resolve_member,
    select_members,
)
from kvpage.eval.suite_report import (
    LONG_CONTEXT_TOKENS,
    depth_rows,
    format_depth_summary,
    format_summary_table,
    payload_depth_rows,
    summarize_suite,
    suite_markdown,
    suite_payload,
)

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
    assert data["suite_schema_version"] == 2 and data["held_back"] == "language_reference"
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
    """A run split at 16 positions with a 'long' member of >= 24 tokens (the tiny model's context is 512)."""
    monkeypatch.setattr("kvpage.eval.divergence.DEPTH_SPLIT", 16)
    monkeypatch.setattr("kvpage.eval.suite_report.LONG_CONTEXT_TOKENS", 24)
    rc, printed, _ = _run(["eval", "--suite", "--suite-members", "gpl3,language_reference", "--tokens", "40",
                           "--formats", "int8", "--out", str(tmp_path), "--threads", "1", "--no-progress"], monkeypatch)
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["command"] == (f"kvpage eval --suite --suite-members gpl3,language_reference --formats int8 "
                               f"--tokens 40 --mode decode --threads 1 --out {tmp_path} --no-progress")
    assert len(data["load_average"]) == 3 and len(data["load_average_end"]) == 3 and data["cpu"]
    # depth rows: both members (40 >= 24 tokens), split 16 + 23, equal to their rows' own depth parts
    assert data["depth_split"] == 16 and [(d["member"], d["name"]) for d in data["depth"]] == [
        ("gpl3", "auto"), ("gpl3", "int8"), ("language_reference", "auto"), ("language_reference", "int8")]
    for d in data["depth"][1::2]:
        member = next(m for m in data["members"] if m["name"] == d["member"])
        dep = member["results"][1]["divergence"]["depth"]
        assert dep["first"]["num_positions"] == 16 and dep["rest"]["num_positions"] == 23 == d["rest_positions"]
        assert d["rest_kld_mean"] == dep["rest"]["kld_mean"] > 0
        assert d["kld_ratio"] == pytest.approx(dep["rest"]["kld_mean"] / dep["first"]["kld_mean"], rel=1e-12)
        assert d["flagged"] is (d["kld_ratio"] > 2)
        # the whole text's mean is the positions-weighted mean of the parts
        whole = member["results"][1]["divergence"]["kld_mean"]
        assert (16 * dep["first"]["kld_mean"] + 23 * dep["rest"]["kld_mean"]) / 39 == pytest.approx(whole, rel=1e-9)
        assert f"{d['rest_kld_mean']:.6f}" in printed.split("## KLD by depth")[1]
    md = suite_markdown(data)
    lines = md.splitlines()
    gpl = next(x for x in lines if x.startswith("| `gpl3` | legal prose"))
    assert "| 40 |" in gpl and "`3972dc9744f6`" in gpl and gpl.endswith("| no |")
    assert next(x for x in lines if x.startswith("| `language_reference` |")).endswith("| **yes** |")
    int8 = data["summary"][1]
    row = next(x for x in lines if x.startswith("| `int8` | ") and "/" not in x)
    assert f"{int8['tuning_delta_ppl_percent']:+.2f}%" in row and f"{int8['held_back_kld_mean']:.5f}" in row
    per = next(x for x in lines if x.startswith("| `int8` | ") and "/" in x)
    ref = data["members"][1]["results"][1]
    assert per.endswith(f"{ref['delta_ppl_percent']:+.2f}% / {ref['divergence']['kld_mean']:.5f} |")


# --- KLD by depth and the Markdown render, on synthetic runs (per-position arrays known here) -----------------


def _synthetic_member(name: str, tokens: int, held_back: bool = False) -> ResolvedText:
    m = SuiteMember(name=name, kind=f"{name} kind", locator=f"file:/{name}", tokens=tokens, version_of=None,
                    recorded_version=None, recorded_sha256="ab" * 32, held_back=held_back)
    return ResolvedText(member=m, text=f"{name} text", origin=f"/{name}", version=None, sha256="ab" * 32)


def _synthetic_results(tokens: int, seed: int, deep_factor: float) -> tuple[list, dict]:
    """auto, int8 and int4 results of a ``tokens``-token text from known per-position arrays (also returned)."""
    import numpy as np

    from kvpage.eval.divergence import summarize_divergence
    from kvpage.eval.perplexity import PerplexityResult

    rng = np.random.default_rng(seed)
    n = tokens - 1
    nll_b = rng.normal(3.0, 1.0, n)
    out, arrays = [], {}
    for name, bits, scale in (("auto", 32.0, 0.0), ("int8", 8.25, 0.001), ("int4", 4.8, 0.01)):
        depth = np.where(np.arange(n) < 1024, 1.0, deep_factor if name == "int4" else 1.0)
        kld = rng.exponential(scale, n) * depth if scale else np.zeros(n)
        same = rng.uniform(size=n) < (1 - 20 * scale)
        nll_f = nll_b + (rng.normal(scale, 10 * scale, n) if scale else 0.0)
        div = summarize_divergence(kld, same, nll_f, nll_b)
        nll = float(nll_f.mean())
        out.append(PerplexityResult(name=name, kv_cache_dtype=name if name != "auto" else "float32", mode="decode",
                                    num_tokens=tokens, num_predictions=n, nll=nll, ppl=math.exp(nll),
                                    bits_per_value=bits, kv_bytes_per_token=bits * 720, seconds=2.0, block_size=16,
                                    divergence=div))
        arrays[name] = (kld, same, nll_f, nll_b)
    return out, arrays


@pytest.fixture(scope="module")
def synthetic_runs():
    """Three members: a 1,024-token tuning one, a 4,200-token tuning one (int4 3x worse after 1,024), a held-back one."""
    runs, arrays = [], {}
    for name, tokens, held, factor in (("short", 1024, False, 1.0), ("long", 4200, False, 3.0),
                                       ("held", 2048, True, 1.0)):
        results, arr = _synthetic_results(tokens, len(runs) + 1, factor)
        runs.append((_synthetic_member(name, tokens, held), results))
        arrays[name] = arr
    return runs, arrays


def test_depth_rows_only_for_long_members_match_numpy(synthetic_runs):
    import numpy as np

    runs, arrays = synthetic_runs
    assert LONG_CONTEXT_TOKENS == 4096
    rows = depth_rows(runs)
    assert [(r.member, r.name) for r in rows] == [("long", "auto"), ("long", "int8"), ("long", "int4")]
    for r in rows:
        kld, same, nll_f, nll_b = arrays["long"][r.name]
        d = nll_f - nll_b
        assert r.split == 1024 and r.rest_positions == 4199 - 1024 and r.num_tokens == 4200
        assert r.first_kld_mean == pytest.approx(np.mean(kld[:1024]), rel=1e-12, abs=1e-15)
        assert r.rest_kld_mean == pytest.approx(np.mean(kld[1024:]), rel=1e-12, abs=1e-15)
        assert r.rest_kld_se == pytest.approx(np.std(kld[1024:], ddof=1) / math.sqrt(3175), rel=1e-9, abs=1e-15)
        assert r.first_delta_ppl_percent == pytest.approx(100 * math.expm1(np.mean(d[:1024])), rel=1e-9, abs=1e-12)
        assert r.rest_delta_ppl_percent == pytest.approx(100 * math.expm1(np.mean(d[1024:])), rel=1e-9, abs=1e-12)
    auto, int8, int4 = rows
    assert auto.kld_ratio is None and not auto.flagged
    assert 0.85 < int8.kld_ratio < 1.15 and not int8.flagged
    assert 2.6 < int4.kld_ratio < 3.4 and int4.flagged
    assert [r.member for r in depth_rows(runs, min_tokens=2048)] == ["long"] * 3 + ["held"] * 3
    table = format_depth_summary(rows)
    assert table is not None and format_depth_summary([]) is None
    line = next(x for x in table.splitlines() if x.startswith("long") and " int4 " in x)
    assert line.endswith(f"{int4.kld_ratio:.2f} !") and f"{int4.rest_kld_mean:.6f}" in line
    assert not next(x for x in table.splitlines() if " int8 " in x).endswith("!")


def test_suite_payload_carries_depth_and_markdown_renders_it(synthetic_runs):
    runs, _ = synthetic_runs
    payload = json.loads(json.dumps(suite_payload(runs, model="m", command="kvpage eval --suite")))
    assert payload["suite_schema_version"] == 2 and payload["schema_version"] == 3
    assert payload["depth_split"] == 1024 and payload["depth_min_tokens"] == 4096
    assert [(d["member"], d["name"], d["flagged"]) for d in payload["depth"]] == [
        ("long", "auto", False), ("long", "int8", False), ("long", "int4", True)]
    assert [r.to_dict() for r in payload_depth_rows(payload)] == payload["depth"]   # recomputed from the rows
    short = payload["members"][0]["results"][2]["divergence"]["depth"]
    assert short["rest"] is None and short["first"]["num_positions"] == 1023
    md = suite_markdown(payload)
    int4 = payload["depth"][2]
    row = next(x for x in md.splitlines() if x.startswith("| `long` | `int4` |"))
    assert f"**{int4['kld_ratio']:.2f}** ⚠" in row and f"{int4['rest_kld_mean']:.5f} ± {int4['rest_kld_se']:.5f}" in row
    # a suite schema 1 payload (rows without depth) renders without the depth table
    old = json.loads(json.dumps(payload))
    for m in old["members"]:
        for r in m["results"]:
            r["divergence"].pop("depth")
    for key in ("depth", "depth_split", "depth_min_tokens", "depth_kld_ratio_flag"):
        old.pop(key)
    assert payload_depth_rows(old) == [] and "KLD rest / first" not in suite_markdown(old)
    assert "KLD rest / first" in md


@pytest.mark.parametrize("argv", [
    ["eval", "--suite", "--formats", "int8,int4"],
    ["eval", "--suite", "--suite-members", "gpl3,argparse", "--formats", "int8", "--tokens", "64", "--mode", "chunked",
     "--chunk-size", "32", "--model", "m dir/x.gguf", "--block-size", "32", "--dtype", "bfloat16", "--threads", "1",
     "--out", "o", "--no-kl-divergence", "--kv-cache-scales", "s.json", "--kv-quant-residual-tokens", "0",
     "--no-progress"],
    ["eval", "--text", "a b.txt", "--formats", "auto"],
])
def test_recorded_command_line_parses_back_to_the_same_flags(argv):
    import shlex

    from kvpage.cli import build_parser
    from kvpage.eval.command import command_line

    args = build_parser().parse_args(argv)
    line = command_line(args)
    assert line.startswith("kvpage eval ") and "--formats" in line and "--out" in line
    assert vars(build_parser().parse_args(shlex.split(line)[1:])) == vars(args)


def test_recorded_command_line_covers_every_eval_flag():
    """A flag added to ``kvpage eval`` must be added to command_line (and to the full argv above)."""
    import argparse
    import inspect

    from kvpage.cli import build_parser
    from kvpage.eval import command

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["eval"]._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    source = inspect.getsource(command.command_line)
    written = {f for f in flags if f'"{f}"' in source or f'"--no-{f[2:]}"' in source}   # --x or its --no-x form
    missing = sorted(f for f in flags - written if not f.startswith("--no-"))
    assert not missing, f"command_line does not write {missing}"


def _accuracy_script():
    """benchmarks/accuracy.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"
    spec = importlib.util.spec_from_file_location("kvpage_benchmark_accuracy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accuracy_note_renders_from_a_suite_folder(synthetic_runs, tmp_path):
    runs, _ = synthetic_runs
    suite = tmp_path / "suite"
    cmd = f"kvpage eval --suite --formats int8,int4 --mode decode --threads 1 --out {suite}"
    payload = suite_payload(runs, model="/x/SmolLM2.gguf", dtype="float32", mode="decode", threads=1, block_size=None,
                            total_seconds=3599.4, torch="2.13.0+cpu", cpu="Test CPU 9000", cpu_count=2, python="3.11.7",
                            date="2026-12-02 10:00:00 +0000", load_average=[1.25, 1.5, 1.75], command=cmd,
                            load_average_end=[2.0, 1.8, 1.6])
    (suite / "long").mkdir(parents=True)
    for png in ("ppl_vs_bits.png", "kld_vs_bits.png"):
        (suite / "long" / png).write_bytes(b"\x89PNG")
    (suite / "results.json").write_text(json.dumps(payload), encoding="utf-8")
    note = tmp_path / "notes" / "ACCURACY.md"
    assert _accuracy_script().main(["--suite-dir", str(suite), "--note", str(note)]) == 0
    md = note.read_text(encoding="utf-8")
    lines = md.splitlines()

    def section(title: str) -> str:
        start = md.index(title)
        end = md.find("\n## ", start + 1)
        return md[start:] if end < 0 else md[start:end]

    # each member's table: format, bits, ppl, Δppl ± se, KLD ± se, p99, top-1 ± se from its rows
    long_int4 = payload["members"][1]["results"][2]
    d = long_int4["divergence"]
    want = (f"| `int4` | 4.800 | {long_int4['ppl']:.3f} | {long_int4['delta_ppl_percent']:+.2f} ± "
            f"{d['delta_ppl_se_percent']:.2f}% | {d['kld_mean']:.5f} ± {d['kld_se']:.5f} | {d['kld_p99']:.4f} | "
            f"{d['top1_percent']:.2f} ± {d['top1_se_percent']:.2f} |")
    assert want in section("## Each tuning member") and "### `long`: long kind, 4,200 tokens" in md
    assert "| `auto` | 32.000 |" in md and "| baseline |" in md
    # the held-back member on its own, with its own numbers
    held = section("## The held-back member")
    h = payload["members"][2]["results"][1]
    assert "### `held` (held back)" in held and f"{h['divergence']['kld_mean']:.5f} ± " in held
    assert "### `held`" not in section("## Each tuning member")
    # the summary (tuning mean; held back apart) and the targets
    int8 = next(s for s in payload["summary"] if s["name"] == "int8")
    row = next(x for x in section("## Summary").splitlines() if x.startswith("| `int8` | 8.250 |"))
    assert f"{int8['tuning_delta_ppl_percent']:+.2f}%" in row and f"{int8['held_back_kld_mean']:.5f}" in row
    target = next(x for x in lines if x.startswith("| `int8` | Δppl ≤ +0.15% |"))
    met = "met" if int8["tuning_delta_ppl_percent"] <= 0.15 else "**missed**"
    assert f"{int8['tuning_delta_ppl_percent']:+.2f}% at 8.25 bits: {met}" in target
    # KLD by depth of the long member, flagged
    dep = section("## KLD by depth")
    d4 = next(x for x in payload["depth"] if x["name"] == "int4")
    assert f"**{d4['kld_ratio']:.2f}** ⚠" in dep and f"`int4` on `long` ({d4['kld_ratio']:.2f}x)" in dep
    # plots linked relative to the note where they exist
    assert "![Δppl against effective bits per value, long](../suite/long/ppl_vs_bits.png)" in md
    assert "(../suite/long/kld_vs_bits.png)" in md and "(no plots in the suite folder)" in md
    # the command, the machine, its load average and the texts' sha256
    how = section("## How this was made")
    assert f"python benchmarks/accuracy.py --suite-dir {suite}" in how and cmd in how
    assert "Test CPU 9000, 2 CPUs, 1 torch thread(s)" in how and "3599 s" in how
    assert "1.25 / 1.50 / 1.75 at the start, 2.00 / 1.80 / 1.60 at the end" in how
    assert how.count(f"`{'ab' * 32}` (the recorded text)") == 3 and "[`results.json`](../suite/results.json)" in how


def test_accuracy_note_reads_an_older_suite_payload_and_redraws_plots(synthetic_runs, tmp_path):
    """Suite schema 1 (no depth, command or load average): rendered with 'not recorded'; --redraw-plots draws PNGs."""
    runs, _ = synthetic_runs
    payload = json.loads(json.dumps(suite_payload(runs[:1], model="m.gguf", dtype="float32", mode="decode")))
    for key in ("depth", "depth_split", "depth_min_tokens", "depth_kld_ratio_flag"):
        payload.pop(key)
    for r in payload["members"][0]["results"]:
        r["divergence"].pop("depth")
    suite = tmp_path / "s"
    suite.mkdir()
    (suite / "results.json").write_text(json.dumps(payload), encoding="utf-8")
    note = tmp_path / "A.md"
    assert _accuracy_script().main(["--suite-dir", str(suite), "--note", str(note), "--redraw-plots"]) == 0
    md = note.read_text(encoding="utf-8")
    assert "Not recorded: no member that long" in md and "which ran:\nnot recorded" in md
    assert "Load average (1 / 5 / 15 min): not recorded" in md and "no held-back member was run" in md
    for png in ("ppl_vs_bits.png", "kld_vs_bits.png"):
        assert (suite / "short" / png).read_bytes()[:4] == b"\x89PNG" and f"(s/short/{png})" in md


def test_accuracy_single_text_render_only_still_works(tmp_path):
    """The older one-text note (``--render-only``) from the committed GPL-3 results.json (schema 1, no KL)."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy" / "results.json"
    out = tmp_path / "accuracy"
    out.mkdir()
    shutil.copy(src, out / "results.json")
    note = tmp_path / "ACCURACY.md"
    assert _accuracy_script().main(["--render-only", "--out", str(out), "--note", str(note)]) == 0
    md = note.read_text(encoding="utf-8")
    rows = {r["name"]: r for r in json.loads(src.read_text())["results"]}
    assert f"| `int4` | int4 | 4.820 | 6,941 | {rows['int4']['ppl']:.3f} | +0.14% |" in md
    assert "![Δppl against effective bits per value](accuracy/ppl_vs_bits.png)" in md
    assert (out / "ppl_vs_bits.png").read_bytes()[:4] == b"\x89PNG" and not (out / "kld_vs_bits.png").exists()
