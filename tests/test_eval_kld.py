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
from kvpage.eval.divergence import DEPTH_SPLIT, Divergence
from kvpage.eval.report import DEPTH_KLD_RATIO_FLAG, format_depth_table, spread_positions

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


def _np_part(kld, same, nll_f, nll_b, a: int, b: int) -> dict[str, float]:
    """One depth part's figures the long way: numpy on slices of the per-position arrays."""
    k, d = kld[a:b], nll_f[a:b] - nll_b[a:b]
    m = d.sum() / (b - a)
    se_d = np.sqrt(((d - m) ** 2).sum() / (b - a - 1) / (b - a))
    return dict(kld_mean=k.sum() / (b - a), kld_se=np.sqrt(((k - k.mean()) ** 2).sum() / (b - a - 1) / (b - a)),
                top1_percent=100 * np.count_nonzero(same[a:b]) / (b - a), ln_ppl_ratio=m,
                delta_ppl_percent=100 * (np.exp(m) - 1), delta_ppl_se_percent=100 * np.exp(m) * se_d)


def test_depth_split_matches_numpy_on_the_position_arrays():
    rng = np.random.default_rng(21)
    n = 3000
    kld = np.r_[rng.exponential(0.01, DEPTH_SPLIT), rng.exponential(0.035, n - DEPTH_SPLIT)]  # deeper: 3.5x
    same = rng.uniform(size=n) < np.r_[np.full(DEPTH_SPLIT, 0.95), np.full(n - DEPTH_SPLIT, 0.85)]
    nll_b = rng.normal(3.0, 1.5, n)
    nll_f = nll_b + rng.normal(0.0, 0.1, n) + np.r_[np.zeros(DEPTH_SPLIT), np.full(n - DEPTH_SPLIT, 0.05)]
    dep = summarize_divergence(kld, same, nll_f, nll_b).depth
    assert DEPTH_SPLIT == 1024 and dep is not None and dep.split == 1024 and dep.rest is not None
    assert (dep.first.start, dep.first.stop, dep.first.num_positions) == (0, 1024, 1024)
    assert (dep.rest.start, dep.rest.stop, dep.rest.num_positions) == (1024, 3000, 1976)
    for part, (a, b) in ((dep.first, (0, 1024)), (dep.rest, (1024, 3000))):
        for key, want in _np_part(kld, same, nll_f, nll_b, a, b).items():
            assert getattr(part, key) == pytest.approx(want, rel=1e-9, abs=1e-12), key
    assert dep.rest.delta_ppl_percent == pytest.approx(5.1, abs=1.5) and abs(dep.first.delta_ppl_percent) < 1.5
    assert dep.kld_ratio() == pytest.approx(kld[1024:].mean() / kld[:1024].mean(), rel=1e-12)
    assert 2.8 < dep.kld_ratio() < 4.2
    # the parts weigh up to the whole
    whole = summarize_divergence(kld, same, nll_f, nll_b)
    assert (1024 * dep.first.kld_mean + 1976 * dep.rest.kld_mean) / n == pytest.approx(whole.kld_mean, rel=1e-12)
    # another split point, given explicitly
    dep7 = summarize_divergence(kld, same, nll_f, nll_b, depth_split=7).depth
    assert dep7 is not None and dep7.rest is not None and dep7.first.num_positions == 7
    assert dep7.first.kld_mean == pytest.approx(kld[:7].mean(), rel=1e-12)
    with pytest.raises(ValueError, match="depth_split"):
        summarize_divergence(kld, same, nll_f, nll_b, depth_split=0)


@pytest.mark.parametrize("n", [1023, 1024, 1025])
def test_depth_rest_is_none_up_to_the_split(n):
    """A 1,024-token text scores 1,023 positions, a 1,025-token one 1,024: no rest; one more gives a 1-position rest."""
    rng = np.random.default_rng(n)
    kld, same = rng.exponential(0.01, n), rng.uniform(size=n) < 0.9
    nll_b = rng.normal(3.0, 1.0, n)
    nll_f = nll_b + rng.normal(0.01, 0.1, n)
    d = summarize_divergence(kld, same, nll_f, nll_b)
    assert d.depth is not None and d.depth.first.num_positions == min(n, 1024)
    if n <= 1024:
        assert d.depth.rest is None and d.depth.kld_ratio() is None
        assert d.depth.first.kld_mean == pytest.approx(d.kld_mean, rel=1e-12)
        assert d.depth.first.ln_ppl_ratio == pytest.approx(d.ln_ppl_ratio, rel=1e-12)
        assert d.depth.first.delta_ppl_se_percent == pytest.approx(d.delta_ppl_se_percent, rel=1e-12)
    else:
        rest = d.depth.rest
        assert rest is not None and (rest.start, rest.num_positions, rest.kld_se) == (1024, 1, 0.0)
        assert rest.kld_mean == kld[-1] and rest.ln_ppl_ratio == pytest.approx(nll_f[-1] - nll_b[-1], rel=1e-12)
    # JSON round trip, and a schema-2 row (no depth) still loads
    back = Divergence.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back == d
    old = d.to_dict()
    del old["depth"]
    assert Divergence.from_dict(old).depth is None and Divergence.from_dict(old).kld_mean == d.kld_mean


def test_depth_table_values_and_flag():
    rng = np.random.default_rng(5)
    n = 1500

    def res(name: str, kld: np.ndarray) -> PerplexityResult:
        nll_b = rng.normal(3.0, 1.0, n)
        div = summarize_divergence(kld, np.ones(n, dtype=bool), nll_b + 0.01, nll_b)
        return PerplexityResult(name=name, kv_cache_dtype=name, mode="decode", num_tokens=n + 1, num_predictions=n,
                                nll=3.0, ppl=math.exp(3.0), bits_per_value=8.0, kv_bytes_per_token=1.0, seconds=1.0,
                                block_size=16, divergence=div)

    flat = res("flat", np.full(n, 0.002))
    deep = res("deep", np.r_[np.full(1024, 0.001), np.full(n - 1024, 0.0031)])
    table = format_depth_table([res("auto", np.zeros(n)), flat, deep])
    assert table is not None and "first 1,024 positions" in table and "positions 1,024-1,499" in table
    lines = {line.split()[0]: line for line in table.splitlines()[3:-1]}
    assert lines["auto"].split()[-1] == "-"                      # 0 / 0: no ratio for the baseline
    assert lines["flat"].split()[-1] == "1.00" and "0.002000" in lines["flat"]
    assert lines["deep"].endswith("3.10 !") and "0.001000" in lines["deep"] and "0.003100" in lines["deep"]
    assert "+1.01" in lines["deep"]                             # Δppl of a constant 0.01-nat Δ NLL: 100 (e^0.01 - 1)
    assert DEPTH_KLD_RATIO_FLAG == 2.0
    old = PerplexityResult.from_dict({**deep.to_dict(), "divergence": {**deep.to_dict()["divergence"], "depth": None}})
    assert format_depth_table([old]) is None and format_depth_table([_kld_fake("x", 8, 0.1)]) is None


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
    mp.setattr("kvpage.eval.divergence.DEPTH_SPLIT", 64)      # the tiny model's context is 512: split at 64
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
    assert data["schema_version"] == 3 and (out / "kld_vs_bits.png").is_file() and (out / "ppl_vs_bits.png").is_file()
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
    # by depth: positions 0-63 and 64-94, against numpy on the direct logits' per-position arrays
    dep = d["depth"]
    assert dep["split"] == 64 and dep["first"]["num_positions"] == 64 and dep["rest"]["num_positions"] == 31
    nll_q = -_np_log_softmax(q.astype(np.float64))[np.arange(95), tgt]
    nll_a = -_np_log_softmax(base.astype(np.float64))[np.arange(95), tgt]
    same = base.argmax(-1) == q.argmax(-1)
    for key in ("first", "rest"):
        a, b = (0, 64) if key == "first" else (64, 95)
        for field, want in _np_part(ref, same, nll_q, nll_a, a, b).items():
            assert dep[key][field] == pytest.approx(want, rel=2e-3, abs=1e-9), (key, field)
    assert auto["divergence"]["depth"]["rest"]["kld_mean"] == 0
    assert "KLD by depth" in printed and f"{dep['rest']['kld_mean']:.6f}" in printed
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
