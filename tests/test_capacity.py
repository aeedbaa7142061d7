"""Case C26: every capacity figure (tokens that fit, blocks, bytes, max concurrency, "x more tokens")
equals what the engine really allocates, for every format, side pools included."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from _tiny import tiny_loaded
from kvpage.engine.sizing import SMOLLM2_SHAPE, BudgetTooSmallError, kv_capacity
from kvpage.engine.format_table import format_rows, markdown_table
from kvpage.engine.config import EngineConfig
from kvpage.formats import BlockFormat, StaticScaleFormat, available_formats, get_format
from kvpage.model.loader import LoadedModel
from kvpage.scales import StaticScales

MiB = 2**20
LAYERS = 2


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The suite's random 2-layer Llama (2 KV heads of 16 channels, byte tokenizer; tests/_tiny.py) in ``dtype``."""
    loaded = tiny_loaded(seed, layers=LAYERS, max_positions=256)
    return replace(loaded, model=loaded.model.to(dtype).eval())


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_model()


@pytest.fixture(scope="module")
def tiny_bf16() -> LoadedModel:
    return tiny_model(dtype=torch.bfloat16)


def _scales() -> StaticScales:
    return StaticScales({i: 0.05 for i in range(LAYERS)}, {i: 0.05 for i in range(LAYERS)})


# every registered format (auto = the model dtype), the quantize-on-seal ones with default and
# non-default windows, the static-scale ones with a scales object
CASES = [dict(kv_cache_dtype=n) for n in available_formats()
         if not isinstance(get_format(n), StaticScaleFormat)]
CASES += [dict(kv_cache_dtype=n, kv_cache_scales=_scales()) for n in available_formats()
          if isinstance(get_format(n), StaticScaleFormat)]
CASES += [dict(kv_cache_dtype="int4", kv_quant_residual_tokens=64),
          dict(kv_cache_dtype="int2", kv_quant_residual_tokens=0),
          dict(kv_cache_dtype="int2", kv_quant_residual_tokens=100, block_size=8),
          dict(kv_cache_dtype="int8", dtype="bfloat16", block_size=8)]


def _id(case: dict) -> str:
    return "-".join(f"{v}" for k, v in case.items() if k != "kv_cache_scales")


def _real(llm) -> tuple[int, int, int, dict[str, int]]:
    """(pool bytes, side pool bytes, blocks, group -> blocks) from the tensors really allocated."""
    pool = sum(t.numel() * t.element_size() for c in llm.controller.device_caches.values() for t in c.values())
    pool_storages = {t.untyped_storage().data_ptr() for c in llm.controller.device_caches.values() for t in c.values()}
    # tail tensors that are views of the block pool (slots carved from it) are the pool's bytes, not more
    side = sum(t.numel() * t.element_size() for tail in llm._built.tails.values()
               for layer in tail.layers.values() for t in layer.values()
               if t.untyped_storage().data_ptr() not in pool_storages)
    blocks = {g.name: {t.shape[0] for i in g.layer_indices for t in llm.controller.device_caches[i].values()}
              for g in llm.spec.groups}
    for name, counts in blocks.items():
        assert len(counts) == 1, f"group {name}: layers disagree on the block count {counts}"
    per_group = {name: counts.pop() for name, counts in blocks.items()}
    return pool, side, llm.engine.kv.num_blocks, per_group


@pytest.mark.parametrize("budget", [3 * MiB, 7 * MiB + 12_345])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_c26_capacity_equals_the_real_allocation(tiny, tiny_bf16, case, budget) -> None:
    from kvpage.engine.llm import LLM

    cfg = EngineConfig(kv_cache_memory_bytes=budget, max_num_seqs=8, num_threads=1, **case)
    predicted = kv_capacity(cfg, tiny.config)            # before anything is allocated
    llm = LLM(tiny_bf16 if cfg.torch_dtype == torch.bfloat16 else tiny, config=cfg, progress=False)
    pool, side, blocks, per_group = _real(llm)
    c = llm.capacity
    assert c == predicted
    for name, n in per_group.items():                    # within one block per layer group
        assert abs(n - c.num_blocks) <= 1, name
    assert abs(blocks - c.num_blocks) <= 1
    assert abs(pool + side - c.total_bytes) <= 0.01 * (pool + side)
    assert abs(side - c.side_pool_bytes) <= 0.01 * max(side, 1)
    assert (side > 0) == isinstance(get_format(case["kv_cache_dtype"]), BlockFormat)  # int4/int3/int2 keep tails
    assert abs(blocks * llm.spec.block_size - c.tokens) <= 0.01 * c.tokens
    assert c.tokens == llm.max_cache_tokens
    # honest: what is allocated fits the budget, and one more block would not
    real_per_block = pool // blocks
    assert pool + side <= budget < pool + side + real_per_block
    assert c.max_concurrency == pytest.approx(blocks / math.ceil(llm.max_model_len / llm.spec.block_size))


@pytest.mark.parametrize("fmt", ["int4", "int2", "int8", "fp8_static", "int4_rotated"])
def test_c26_ratio_is_the_real_token_ratio_at_the_same_budget(tiny, fmt) -> None:
    from kvpage.engine.llm import LLM

    budget = 5 * MiB
    scales = _scales() if fmt == "fp8_static" else None
    llm = LLM(tiny, kv_cache_dtype=fmt, kv_cache_scales=scales, kv_cache_memory_bytes=budget, num_threads=1,
              progress=False)
    ref = LLM(tiny, kv_cache_dtype="auto", kv_cache_memory_bytes=budget, num_threads=1, progress=False)
    real_ratio = _real(llm)[2] * llm.spec.block_size / (_real(ref)[2] * ref.spec.block_size)
    assert llm.capacity.ratio == pytest.approx(real_ratio, rel=0.01)
    assert llm.capacity.reference_tokens == pytest.approx(ref.max_cache_tokens, rel=0.01)
    if isinstance(get_format(fmt), BlockFormat):  # the side pools make it less than the bytes-per-token ratio
        assert llm.capacity.ratio < 0.97 * llm.model_dtype_kv_bytes_per_token / llm.kv_bytes_per_token


def test_c26_cli_ratio_for_int4_is_within_1pct_of_the_real_one(tiny, capsys, monkeypatch) -> None:
    from kvpage import cli
    from kvpage.engine.llm import LLM
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    budget = 6 * MiB
    rc = cli.main(["generate", "hello there", "--no-chat", "--kv-cache-dtype", "int4", "--max-tokens", "3",
                   "--kv-cache-memory-bytes", str(budget), "--threads", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    printed = float(re.search(r"\(([\d.]+)x more tokens per byte", out.out).group(1))
    real = LLM(tiny, kv_cache_dtype="int4", kv_cache_memory_bytes=budget, num_threads=1, progress=False)
    ref = LLM(tiny, kv_cache_memory_bytes=budget, num_threads=1, progress=False)
    real_ratio = real.engine.kv.num_blocks * 32 / (ref.engine.kv.num_blocks * 16)
    assert abs(printed - real_ratio) <= 0.01 * real_ratio
    assert f"{real.max_cache_tokens:,} vs {ref.max_cache_tokens:,} tokens" in out.out
    assert re.search(r"\[kvpage\] engine: 1 torch thread \(set\); int4 KV cache: [\d,]+ blocks", out.err)


def test_c26_smollm2_figures_of_the_issue() -> None:
    """SmolLM2 at 512 MiB: float32 11,648 tokens; int4/int2 carve their tail slots from the pool on demand, so
    their tokens are the most blocks whose codes plus the first-block copies' scales fit (67,104 and 106,720
    tokens, 5.76x and 9.16x, with the fixed side pools for 64 requests; 79,520 and 142,016 when carving began,
    before the formats' bytes per block moved)."""
    rows = {r.name: r for r in format_rows(SMOLLM2_SHAPE, 512 * MiB)}
    assert rows["float32"].report.tokens == 11_648
    for fmt, r in (("int4", 4), ("int2", 8)):
        c = rows[fmt].report
        assert c.side_blocks_per_slot == r and c.tail_open_bytes == c.tail_window_bytes == 0
        # beside the pool only the scales: 30 layers x (K, V) x 2 copies per r-block group x 32 tokens x 3 heads x fp16
        assert c.side_pool_bytes == 30 * 2 * 2 * (c.num_blocks // r) * 32 * 3 * 2
        assert c.total_bytes <= 512 * MiB < c.total_bytes + c.bytes_per_block + 30 * 2 * 2 * 32 * 3 * 2
        assert c.tokens == c.num_blocks * 32 and c.ratio > 0.97 * 46_080 / c.bytes_per_token
    table = markdown_table(list(rows.values()))
    c = rows["int4"].report
    assert (f"| `int4` | 32 | {c.bytes_per_token:,.0f} | {c.side_pool_bytes / MiB:.1f} | {c.tokens:,} "
            f"| {c.ratio:.2f}x |") in table


def test_cli_says_a_model_dtype_cache_saves_nothing(tiny, capsys, monkeypatch) -> None:
    """With the default cache (the model's dtype) the comparison line says so and the tokens it holds, instead of
    "0.0% less KV memory ... (1.00x more tokens per byte)"; a quantized cache keeps its comparison."""
    from kvpage import cli
    from kvpage.engine.llm import LLM
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    argv = ["generate", "hello there", "--no-chat", "--max-tokens", "2", "--kv-cache-memory-bytes", str(6 * MiB),
            "--threads", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    tokens = LLM(tiny, kv_cache_memory_bytes=6 * MiB, num_threads=1, progress=False).capacity.tokens
    assert f"[kvpage] the cache is in the model's dtype (float32): {tokens:,} tokens in 6.0 MiB; " in out
    assert "less KV memory" not in out and "more tokens per byte" not in out
    assert cli.main([*argv, "--kv-cache-dtype", "int8"]) == 0
    c = LLM(tiny, kv_cache_dtype="int8", kv_cache_memory_bytes=6 * MiB, num_threads=1, progress=False).capacity
    assert f"{1 - c.bytes_per_token / c.reference_bytes_per_token:.1%} less KV memory per cached token" in (
        capsys.readouterr().out)


def test_rotated_sealed_formats_hold_what_their_base_formats_hold() -> None:
    """Same bytes per block and side pools as int4/int3/int2 (only the rows' basis differs): the same capacity."""
    rows = {r.name: r.report for r in format_rows(SMOLLM2_SHAPE, 256 * MiB)}
    for base in ("int4", "int3", "int2"):
        rot, plain = rows[base + "_rotated"], rows[base]
        assert rot is not None and plain is not None
        assert (rot.tokens, rot.bytes_per_block, rot.side_pool_bytes, rot.total_bytes) == (
            plain.tokens, plain.bytes_per_block, plain.side_pool_bytes, plain.total_bytes)


@pytest.mark.parametrize(("fmt", "floor"), [("int4", 3.3), ("int2", 5.5)])
def test_c26_issue_floor_at_256_mib_from_the_engines_own_allocation(fmt: str, floor: float) -> None:
    """Issue 13.5: at 256 MiB with the default max_num_seqs, int4 >= 3.3x and int2 >= 5.5x the bfloat16 cache's
    tokens. Measured from an engine built on a tiny model with SmolLM2's KV shape (30 layers x 3 KV heads x 64):
    the blocks its pool tensors really hold, its block table's count, and the bytes of every tensor."""
    from kvpage.engine.llm import LLM

    from transformers import LlamaConfig

    from _tiny import BOS, EOS, VOCAB, ByteTokenizer
    from kvpage.model.config import ModelConfig
    from kvpage.model.llama import LlamaForCausalLM

    s = SMOLLM2_SHAPE
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=32, num_hidden_layers=s.num_layers,
                     num_attention_heads=s.num_kv_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                     max_position_embeddings=s.max_position_embeddings, bos_token_id=BOS, eos_token_id=EOS)
    config = ModelConfig.from_hf(hf)
    model = LlamaForCausalLM(config).to_empty(device="cpu").to(torch.bfloat16).eval()  # never run: only its KV shape
    loaded = LoadedModel(config=config, model=model, tokenizer=ByteTokenizer(), path=tiny_loaded(0).path)

    def engine(kv: str) -> LLM:
        return LLM(loaded, kv_cache_dtype=kv, kv_cache_memory_bytes=256 * MiB, dtype="bfloat16", num_threads=1,
                   progress=False)

    ref, llm = engine("auto"), engine(fmt)
    pool, side, blocks, _ = _real(llm)
    ref_pool, _, ref_blocks, _ = _real(ref)
    tokens, ref_tokens = blocks * llm.spec.block_size, ref_blocks * ref.spec.block_size
    assert ref_tokens == 11_648 and pool + side <= 256 * MiB and ref_pool <= 256 * MiB
    assert tokens / ref_tokens >= floor, f"{fmt}: {tokens:,} tokens, {tokens / ref_tokens:.2f}x"
    assert llm.capacity.tokens == tokens and llm.capacity.ratio == pytest.approx(tokens / ref_tokens, rel=1e-3)


def test_c26_formats_lists_tokens_that_fit(capsys) -> None:
    from kvpage import cli

    assert cli.main(["formats"]) == 0
    out = capsys.readouterr().out
    int4 = kv_capacity(EngineConfig(kv_cache_dtype="int4"), SMOLLM2_SHAPE).tokens
    assert re.search(rf"^int4 .* {int4:,} ", out, re.M) and re.search(r"^float32 .* 11,648 ", out, re.M)
    assert cli.main(["formats", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
                     "--budget-bytes", str(3 * MiB), "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    cfg = EngineConfig(kv_cache_dtype="int2", kv_cache_memory_bytes=3 * MiB, max_num_seqs=8)
    assert re.search(rf"^int2 .* {kv_capacity(cfg, tiny_model().config).tokens:,} ", out, re.M)


def test_c26_budget_below_the_side_pools_names_both_byte_counts(tiny) -> None:
    """A pool too small to carve tail slots from (one request beside its side space) keeps fixed side pools,
    and a budget below them says so."""
    from kvpage.engine.llm import LLM

    cfg = EngineConfig(kv_cache_dtype="int4", kv_cache_memory_bytes=20_000, max_num_seqs=8)
    side = kv_capacity(EngineConfig(kv_cache_dtype="int4", num_blocks=1, max_num_seqs=8), tiny.config).side_pool_bytes
    assert side > 20_000
    with pytest.raises(BudgetTooSmallError, match=rf"side pools of int4 need {side:,} bytes.*20,000 bytes given"):
        LLM(tiny, config=cfg, progress=False)
    with pytest.raises(ValueError, match="one block of int8 needs"):
        LLM(tiny, kv_cache_dtype="int8", kv_cache_memory_bytes=100, progress=False)


def test_c26_budget_too_small_message_reads_well(tiny) -> None:
    """Each byte count once, plural only when due: "one block of float32 needs N bytes; 1 byte given"; with side
    pools, their sum, the block and the total, each named."""
    bpb = kv_capacity(EngineConfig(kv_cache_dtype="float32", num_blocks=1), tiny.config).bytes_per_block
    with pytest.raises(BudgetTooSmallError) as e:
        kv_capacity(EngineConfig(kv_cache_dtype="float32", kv_cache_memory_bytes=1), tiny.config)
    assert str(e.value) == (f"KV budget too small: one block of float32 needs {bpb:,} bytes; 1 byte given "
                            f"(kv_cache_memory_bytes); raise it")
    rep = kv_capacity(EngineConfig(kv_cache_dtype="int4", num_blocks=1, max_num_seqs=8), tiny.config)
    with pytest.raises(BudgetTooSmallError) as e:
        kv_capacity(EngineConfig(kv_cache_dtype="int4", kv_cache_memory_bytes=20_000, max_num_seqs=8), tiny.config)
    msg = str(e.value)
    total = rep.side_pool_bytes + rep.bytes_per_block
    assert msg.startswith(f"KV budget too small: the side pools of int4 need {rep.side_pool_bytes:,} bytes (")
    assert f"for max_num_seqs=8) plus {rep.bytes_per_block:,} bytes for one block, {total:,} bytes in all; " in msg
    assert msg.endswith("20,000 bytes given (kv_cache_memory_bytes); raise it or lower max_num_seqs")
    assert "i.e." not in msg and msg.count(f"{total:,}") == 1


@pytest.mark.slow
def test_c26_bundled_model_shape_and_cli_line(smollm2, capsys, monkeypatch) -> None:
    from kvpage import cli
    from kvpage.model import loader

    c = smollm2.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (
        SMOLLM2_SHAPE.num_layers, SMOLLM2_SHAPE.num_kv_heads, SMOLLM2_SHAPE.head_dim,
        SMOLLM2_SHAPE.max_position_embeddings)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: smollm2)
    assert cli.main(["generate", "Hi", "--kv-cache-dtype", "int4", "--max-tokens", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    c = kv_capacity(EngineConfig(kv_cache_dtype="int4"), SMOLLM2_SHAPE)
    assert f"{c.tokens:,} vs 11,648 tokens in the same 512.0 MiB ({c.ratio:.2f}x more tokens per byte" in out
