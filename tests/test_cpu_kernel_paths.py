"""The cpu backend's two block kernels (AVX-512 and AVX2/portable) against each other, the reference and float64.

One build holds both: ``KVPAGE_CPU_AVX512=0`` (read by the kernels at every call) selects the
AVX2 / portable one, which CPUs without AVX-512 always run. Every format, GQA ratios 1, 3, 4 and
8, head_dim 64, 96, 128 and 256, contexts 1, bs - 1, bs, bs + 1 and longer: each kernel's output
is within 1e-5 (relative to the output's scale) of the reference backend and within the format's
bound of float64 attention (``tests/test_cpu_backend.py``'s ``run_batch``), and the two kernels
agree within 1e-5. On a CPU with AVX-512 the two must also differ somewhere (another summation
order), which shows the switch reaches a second kernel and the agreement is not one kernel twice.

The e4m3 (fp8) decoder is checked exactly, code by code: each of the 254 non-NaN bytes is a value
row of a two-token context whose other row is zero, with q = 0 (equal weights), so the output is
half the decoded value.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_cpu_backend import SEALED_FORMATS, TOKEN_FORMATS, run_batch

from kvpage.cache.controller import CacheController
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends import CpuBackend, ReferenceBackend, select_backend
from kvpage.spec import CacheSpec

pytestmark = pytest.mark.skipif(os.environ.get("KVPAGE_CPU_KERNELS") == "0", reason="KVPAGE_CPU_KERNELS=0")

SHAPES = [(9, 3, 64), (8, 1, 128), (4, 4, 256), (8, 2, 96)]  # (query heads, kv heads, head_dim): GQA 3, 8, 1, 4


def _has_avx512() -> bool:
    """Whether this CPU has the AVX-512 subsets the wide kernel is compiled for (f, bw, vl, dq)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


def _cpu_outputs(fmt: str, wide: bool, **kw: object) -> list[torch.Tensor]:
    """run_batch's checks with the AVX-512 kernel on or off; returns every output the cpu backend gave."""
    seen: list[torch.Tensor] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("forward", "forward_sealed"):
            orig = getattr(CpuBackend, name)

            def record(self, *a, _orig=orig, **k):  # type: ignore[no-untyped-def]
                out = _orig(self, *a, **k)
                seen.append(out.clone())
                return out

            mp.setattr(CpuBackend, name, record)
        if wide:
            mp.delenv("KVPAGE_CPU_AVX512", raising=False)
        else:
            mp.setenv("KVPAGE_CPU_AVX512", "0")
        run_batch(fmt, **kw)  # type: ignore[arg-type]
    return seen


@pytest.mark.parametrize("fmt", TOKEN_FORMATS + SEALED_FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_both_block_kernels_match_the_reference_float64_and_each_other(fmt: str, heads: int, kv_heads: int,
                                                                      head_dim: int) -> None:
    bs = 8 if fmt in SEALED_FORMATS else 16
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 70]
    kw = dict(lens=lens, query_lens=[1, 1, 1, 1, 3, 1], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              block_size=bs, seed=head_dim + heads)
    wide, narrow = _cpu_outputs(fmt, True, **kw), _cpu_outputs(fmt, False, **kw)
    assert len(wide) == len(narrow) >= 1
    for a, b in zip(wide, narrow):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), fmt
    if _has_avx512():
        assert any(not torch.equal(a, b) for a, b in zip(wide, narrow)), "KVPAGE_CPU_AVX512=0 changed nothing"


@pytest.mark.parametrize("fmt", ["fp8_per_token_head"])  # "fp8" stores Hadamard-rotated rows
@pytest.mark.parametrize("wide", [True, False], ids=["avx512", "avx2"])
def test_every_e4m3_code_decodes_exactly(fmt: str, wide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not wide:
        monkeypatch.setenv("KVPAGE_CPU_AVX512", "0")
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 values
    d, bs = 64, 16
    rows = -(-codes.numel() // d)  # one request per value row
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=d, block_size=bs, kv_cache_dtype=fmt)
    cache = CacheController(spec).initialize_kv_cache(rows)[0]
    row = torch.zeros(rows * d, dtype=torch.uint8)
    row[: codes.numel()] = codes
    for name in ("key", "value"):
        cache[name].zero_()
        cache[name][:, 0, 0] = row.view(rows, d)
        cache[name + "_scale"].fill_(1.0)
    meta = AttentionMetadata.build(block_tables=[[r] for r in range(rows)], seq_lens=[2] * rows,
                                   query_lens=[1] * rows, slot_mapping=[r * bs + 1 for r in range(rows)], block_size=bs)
    q, kv = torch.zeros(rows, 2, d), torch.zeros(rows, 1, d)  # q = 0: both tokens weigh 1/2; token 1's row is 0
    layer = spec.layer(0)
    got = select_backend("cpu", layer, "cpu").forward(q, kv, kv, cache, layer, meta, layer_index=0)
    want = 0.5 * row.view(torch.float8_e4m3fn).float().view(rows, 1, d).expand(rows, 2, d)
    assert torch.equal(got, want), (got - want).abs().max()
    ref = ReferenceBackend().forward(q, kv, kv, cache, layer, meta, layer_index=0)
    assert torch.equal(ref, want)
