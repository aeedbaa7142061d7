"""KL divergence, top-1 agreement and standard errors of ``kvpage eval`` (:mod:`kvpage.eval.divergence`).

References are computed another way: KL from float64 numpy softmaxes of the logits, percentiles by
sorting and interpolating by hand, standard errors by their textbook sums and checked against the
spread of means over many simulated replicates, and the end-to-end figures by re-running the tiny
model's two caches and comparing their logits directly.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from _tiny import tiny_loaded
from kvpage import LLM
from kvpage.cli import main
from kvpage.eval import (
    PerplexityResult,
    ReferenceLogits,
    format_table,
    kl_divergence_rows,
    log_probs,
    plot_kld_vs_bits,
    summarize_divergence,
)
from kvpage.eval.report import spread_positions

GPL3 = Path(__file__).parent / "data" / "GPL-3"


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _np_kl(logits_base: np.ndarray, logits_fmt: np.ndarray) -> np.ndarray:
    """Per-row KL(P_base || P_fmt) in float64 numpy, straight from the logits."""
    a, b = _np_log_softmax(logits_base.astype(np.float64)), _np_log_softmax(logits_fmt.astype(np.float64))
    return (np.exp(a) * (a - b)).sum(axis=-1)


def _percentile(x: np.ndarray, q: float) -> float:
    s = sorted(float(v) for v in x)
    pos = q / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def test_kl_of_identical_distributions_is_zero():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=g) * 4
    lp = log_probs(logits)
    assert lp.dtype == torch.float64
    assert torch.equal(kl_divergence_rows(lp, lp), torch.zeros(16, dtype=torch.float64))
    # the same distribution from shifted logits: only rounding apart, clamped at 0 from below
    shifted = kl_divergence_rows(lp, log_probs(logits + 7.0))
    assert shifted.min() >= 0 and shifted.max() < 1e-6
    # a row "distribution" a hair above the base makes the raw sum negative: clamped to exactly 0
    assert torch.equal(kl_divergence_rows(lp, lp.double() + 1e-9), torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="one shape"):
        kl_divergence_rows(lp, lp[:, :10])


def test_kl_and_summary_match_a_float64_reference():
    rng = np.random.default_rng(7)
    n, vocab = 400, 500
    base = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    fmt = (base + rng.normal(0, 0.3, (n, vocab)) * rng.uniform(0, 1, (n, 1))).astype(np.float32)
    ref = _np_kl(base, fmt)
    got = kl_divergence_rows(log_probs(torch.from_numpy(base)), log_probs(torch.from_numpy(fmt))).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-15)
    assert ref.min() > 1e-7 and ref.max() > 1e-2  # real divergences from tiny to large, not rounding

    same = base.argmax(-1) == fmt.argmax(-1)
    tgt = rng.integers(0, vocab, n)
    nll_b = -_np_log_softmax(base.astype(np.float64))[np.arange(n), tgt]
    nll_f = -_np_log_softmax(fmt.astype(np.float64))[np.arange(n), tgt]
    d = summarize_divergence(got, same, nll_f, nll_b)
    assert d.num_positions == n
    assert d.kld_mean == pytest.approx(ref.sum() / n, rel=1e-4)
    assert d.kld_p99 == pytest.approx(_percentile(ref, 99), rel=1e-4)
    assert d.kld_median == pytest.approx(_percentile(ref, 50), rel=1e-4)
    assert d.kld_max == pytest.approx(max(ref), rel=1e-4)
    assert d.top1_percent == pytest.approx(100 * sum(bool(s) for s in same) / n)
    assert 50 < d.top1_percent < 100  # the noise flips some argmaxes, not all
    assert d.ln_ppl_ratio == pytest.approx(float(np.mean(nll_f) - np.mean(nll_b)), rel=1e-9)


def test_standard_errors_equal_the_textbook_sums():
    rng = np.random.default_rng(3)
    n = 250
    kld = rng.exponential(0.01, n)
    same = rng.uniform(size=n) < 0.9
    nll_b = rng.normal(3.0, 1.5, n)
    nll_f = nll_b + rng.normal(0.02, 0.1, n)
    d = summarize_divergence(kld, same, nll_f, nll_b)
    mean = sum(kld) / n
    assert d.kld_se == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in kld) / (n - 1) / n), rel=1e-10)
    diff = [f - b for f, b in zip(nll_f, nll_b)]
    dm = sum(diff) / n
    se_d = math.sqrt(sum((x - dm) ** 2 for x in diff) / (n - 1) / n)
    assert d.ln_ppl_ratio_se == pytest.approx(se_d, rel=1e-10)
    assert d.delta_ppl_se_percent == pytest.approx(100 * math.exp(dm) * se_d, rel=1e-10)
    p = int(same.sum()) / n
    assert d.top1_se_percent == pytest.approx(100 * math.sqrt(p * (1 - p) / (n - 1)), rel=1e-10)


def test_standard_errors_predict_the_spread_over_replicates():
    """Each standard error is, on average, the standard deviation of its statistic over fresh draws (±6 %)."""
    rng = np.random.default_rng(11)
    reps, n = 1500, 300
    stats = []
    for _ in range(reps):
        nll_b = rng.normal(3.0, 1.5, n)
        d = summarize_divergence(rng.exponential(0.01, n), rng.uniform(size=n) < 0.8,
                                 nll_b + rng.normal(0.05, 0.2, n), nll_b)
        stats.append((d.kld_mean, d.kld_se, 100 * math.expm1(d.ln_ppl_ratio), d.delta_ppl_se_percent,
                      d.top1_percent, d.top1_se_percent))
    s = np.array(stats)
    for value, se in ((0, 1), (2, 3), (4, 5)):
        assert s[:, se].mean() == pytest.approx(s[:, value].std(ddof=1), rel=0.06)


def test_reference_store_round_trips_rows_in_any_chunking(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(10, 33, generator=g)                    # float32 logits
    top = torch.randint(0, 33, (10,), generator=g)
    nll = torch.rand(10, generator=g, dtype=torch.float64)
    store = ReferenceLogits(33, dir=tmp_path)
    with pytest.raises(ValueError, match="rewind"):
        store.read(1)
    for a, b in ((0, 1), (1, 4), (4, 10)):
        store.append(rows[a:b], top[a:b], nll[a:b])
    assert store.num_positions == 10 and len(list(tmp_path.iterdir())) == 0  # anonymous file: no name on disk
    for chunks in ((3, 3, 4), (1,) * 10):
        store.rewind()
        got, tops, k = [], [], 0
        for m in chunks:
            lp, t = store.read(m)
            got.append(lp)
            tops.append(t)
            k += m
        assert torch.equal(torch.cat(got), rows) and np.array_equal(np.concatenate(tops), top.numpy())
    with pytest.raises(ValueError, match="the reference has 10"):
        store.read(1)
    np.testing.assert_array_equal(store.nll(), nll.numpy())
    with pytest.raises(ValueError, match="append after rewind"):
        store.append(rows[:1], top[:1], nll[:1])
    with pytest.raises(ValueError, match="float32"):
        ReferenceLogits(33).append(rows.double(), top, nll)
    store.close()
    store.close()


def test_spread_positions_keeps_order_and_gap():
    ys = [0.5, 0.5, 0.51, 0.1, 0.98, 0.97]
    out = spread_positions(ys, 0.05)
    order = sorted(range(len(ys)), key=lambda i: (ys[i], i))
    placed = [out[i] for i in order]
    assert all(b - a >= 0.05 - 1e-12 for a, b in zip(placed, placed[1:]))
    assert max(out) <= 1.0 and min(out) >= 0.0
    assert out[3] == 0.1  # a label with room stays at its point
    assert spread_positions([0.2, 0.8], 0.05) == [0.2, 0.8]


def _kld_fake(name: str, bits: float, kld: float) -> PerplexityResult:
    div = summarize_divergence(np.full(63, kld), np.ones(63, dtype=bool), np.full(63, 2.0), np.full(63, 2.0))
    return PerplexityResult(name=name, kv_cache_dtype=name, mode="decode", num_tokens=64, num_predictions=63,
                            nll=2.0, ppl=math.exp(2.0), bits_per_value=bits, kv_bytes_per_token=bits * 720,
                            seconds=1.0, block_size=16, divergence=div)


def test_kld_plot_and_table(tmp_path):
    results = [_kld_fake("auto", 32, 0.0), _kld_fake("int8", 8.25, 1e-3), _kld_fake("fp8", 8.25, 1.1e-3),
               _kld_fake("int4", 4.8, 0.02), _kld_fake("same", 16, 0.0)]
    png = plot_kld_vs_bits(tmp_path / "k.png", results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no compared result"):
        plot_kld_vs_bits(tmp_path / "x.png", results[:1])
    table = format_table(results)
    assert "KLD p99" in table and "top-1 %" in table
    int8_row = next(line for line in table.splitlines() if line.startswith("int8"))
    assert "0.001000" in int8_row and "100.00" in int8_row


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    """`kvpage eval --formats int8` on the tiny random model, 96 tokens: (results.json, stdout, out dir, model)."""
    model = tiny_loaded(seed=5)
    out = tmp_path_factory.mktemp("kld")
    mp = pytest.MonkeyPatch()
    mp.setattr("kvpage.model.loader.load_model", lambda *a, **k: model)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(["eval", "--text", str(GPL3), "--tokens", "96", "--formats", "int8", "--out", str(out),
                       "--threads", "1", "--no-progress"])
    finally:
        mp.undo()
    assert rc == 0
    return json.loads((out / "results.json").read_text()), buf.getvalue(), out, model


def _direct_logits(model, fmt: str, ids: list[int]) -> np.ndarray:
    llm = LLM(model, kv_cache_dtype=fmt, block_size=16, num_blocks=8, enable_prefix_caching=False, progress=False)
    with llm.open_sequence() as seq:
        return np.concatenate([seq.feed([t]).numpy() for t in ids[:-1]])   # [n - 1, vocab] float32


def test_eval_reports_kld_end_to_end(tiny_eval):
    data, printed, out, model = tiny_eval
    assert data["schema_version"] == 2 and (out / "kld_vs_bits.png").is_file() and (out / "ppl_vs_bits.png").is_file()
    auto, int8 = data["results"]
    assert auto["name"] == "auto" and int8["name"] == "int8"
    assert auto["divergence"]["kld_mean"] == 0 and auto["divergence"]["kld_max"] == 0
    assert auto["divergence"]["top1_percent"] == 100
    d = int8["divergence"]
    assert d["num_positions"] == 95 and d["kld_mean"] > 0

    ids = list(GPL3.read_text(encoding="utf-8").encode("utf-8"))[:96]   # the byte tokenizer's ids
    base, q = _direct_logits(model, "auto", ids), _direct_logits(model, "int8", ids)
    ref = _np_kl(base, q)
    assert d["kld_mean"] == pytest.approx(float(ref.mean()), rel=1e-3)
    assert d["kld_p99"] == pytest.approx(_percentile(ref, 99), rel=1e-3)
    assert d["top1_percent"] == pytest.approx(100 * float(np.mean(base.argmax(-1) == q.argmax(-1))))
    tgt = np.array(ids[1:])
    dn = (-_np_log_softmax(q.astype(np.float64))[np.arange(95), tgt]
          + _np_log_softmax(base.astype(np.float64))[np.arange(95), tgt])
    assert d["ln_ppl_ratio"] == pytest.approx(float(dn.mean()), rel=1e-6, abs=1e-9)
    assert int8["delta_ppl_percent"] == pytest.approx(100 * math.expm1(d["ln_ppl_ratio"]), rel=1e-6, abs=1e-9)
    assert d["delta_ppl_se_percent"] == pytest.approx(100 * math.exp(dn.mean()) * dn.std(ddof=1) / math.sqrt(95),
                                                      rel=1e-4)
    assert "KLD" in printed and "top-1 %" in printed and f"{d['kld_mean']:.6f}" in printed
    # results.json rows rebuild the printed table exactly
    table = format_table([PerplexityResult.from_dict(r) for r in data["results"]])
    assert table in printed and f"{d['kld_mean']:.6f}" in table


def test_eval_without_kl_divergence(tmp_path, monkeypatch, capsys):
    model = tiny_loaded(seed=5)
    monkeypatch.setattr("kvpage.model.loader.load_model", lambda *a, **k: model)
    (tmp_path / "kld_vs_bits.png").write_bytes(b"stale")
    rc = main(["eval", "--text", str(GPL3), "--tokens", "40", "--formats", "int8", "--out", str(tmp_path),
               "--threads", "1", "--no-progress", "--no-kl-divergence"])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["divergence"] for r in rows] == [None, None] and rows[1]["delta_ppl_percent"] != 0
    assert not (tmp_path / "kld_vs_bits.png").exists() and (tmp_path / "ppl_vs_bits.png").is_file()
    int8_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("int8"))
    assert int8_row.split()[5:11] == ["-"] * 6


def test_chunked_reference_reads_back_aligned():
    """A second unquantized cache read against the stored baseline in 24-token chunks: every position KL 0."""
    from kvpage.eval import evaluate_formats

    model = tiny_loaded(seed=2)
    ids = list(GPL3.read_text(encoding="utf-8").encode("utf-8"))[:80]
    auto, same, int8 = evaluate_formats(model, ids, ["auto", "float32", "int8"], mode="chunked", chunk_size=24,
                                        progress=False)
    assert same.divergence is not None and int8.divergence is not None
    assert same.divergence.kld_max == 0 and same.divergence.top1_percent == 100
    assert same.divergence.ln_ppl_ratio == 0 and same.ppl == auto.ppl
    assert int8.divergence.kld_mean > 0 and int8.divergence.num_positions == 79
