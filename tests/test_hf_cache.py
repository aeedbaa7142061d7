"""``KVPageCache``: kvpage's KV formats as a transformers ``Cache`` under ``model.generate``.

Exactness is tested with the float32 format (the cache stores and returns every value bit for bit, so
generation must equal ``DynamicCache``'s); lossy formats are tested by how far their next-token
distributions drift from ``DynamicCache``'s on the bundled model, teacher-forced on the same tokens (a
measured bound, never an exact greedy comparison: greedy agreement of a lossy format depends on float
rounding at near-tie positions), and by structural facts that do not depend on rounding (a rollback
restores the state exactly, a batch row equals the row alone, bytes equal what the spec says).
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from _hf_cache import bundled_model, forward_logits, generate, tiny_model
from transformers import DynamicCache

from kvpage.errors import StaticScalesError, UnknownKVFormatError
from kvpage.formats import BlockFormat, available_formats
from kvpage.integrations.transformers import KVPageCache, SealedKVPageLayer, calibrate_static_scales

LOSSY_SAMPLE = ["int8", "int4", "int2", "int4_rotated"]


def _spy(cache: KVPageCache, method: str) -> list[tuple]:
    """Record the positional arguments of every call of ``cache.<method>`` (the call still happens)."""
    calls: list[tuple] = []
    real = getattr(cache, method)

    def wrapper(*args):
        calls.append(args)
        return real(*args)

    setattr(cache, method, wrapper)
    return calls


def _scales(model: torch.nn.Module):
    """Static scales of a model, calibrated on 64 random tokens (seeded)."""
    g = torch.Generator().manual_seed(1)
    return calibrate_static_scales(model, torch.randint(3, model.config.vocab_size, (1, 64), generator=g))


# -- exactness: float32 ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "mistral_sliding", "qwen3_hybrid", "gemma3"])
def test_float32_generate_equals_dynamic_cache_on_tiny_models(family: str) -> None:
    """Greedy, 64 new tokens: the same tokens as DynamicCache and logits within float noise.

    Sliding-window models return their context from a block boundary (DynamicCache from the window's
    first token), so SDPA sums over another number of masked keys: logits then agree to ~1e-5, not bit for bit.
    """
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=64, min_new_tokens=64, output_logits=True, return_dict_in_generate=True)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = KVPageCache(model.config, "float32", block_size=8)
    out = generate(model, ids, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-4
    assert cache.get_seq_length() == 12 + 64 - 1   # the last token is never fed
    if family != "qwen3":   # the sliding layers dropped the blocks that slid out of every window
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        assert sliding and all(layer.table.first > 0 for layer in sliding)
        window = model.config.sliding_window
        assert all(layer.table.num_blocks <= math.ceil(window / 8) + 1 for layer in sliding)


# -- every format ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", available_formats())
def test_every_format_generates_and_holds_the_bytes_its_spec_says(fmt: str) -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    scales = _scales(model) if fmt.endswith("_static") else None
    cache = KVPageCache(model.config, fmt, kv_cache_scales=scales)
    out = generate(model, ids, cache, max_new_tokens=24, min_new_tokens=24)
    assert out.shape == (2, 45)
    tokens, rows = cache.get_seq_length(), 2
    assert tokens == 44
    spec = cache.spec
    heads, dim = spec.main.layer.kv_heads, spec.main.layer.head_dim
    for i, layer in enumerate(cache.layers):
        ls = spec.layer(i)
        if isinstance(ls.format, BlockFormat):
            # kvpage's own accounting of one sequence (pool blocks, open block, window, 8-bit first block)
            # (its window copies 16-bit, where the engine keeps int2's as int8 copies: crop reopens blocks from them)
            bits = ls.format.effective_bits_per_value(num_tokens=tokens, block_size=ls.block_size, kv_heads=heads,
                                                      head_dim=dim, residual_tokens=layer.residual_tokens,
                                                      window_bits=16)
            assert layer.kv_bytes() == round(rows * bits * 2 * tokens * heads * dim / 8)
        else:
            assert layer.kv_bytes() == rows * math.ceil(tokens / ls.block_size) * ls.bytes_per_block
    assert cache.kv_bytes() == sum(layer.kv_bytes() for layer in cache.layers)
    # the per-value rate is the codes' (the spec's); the fixed side costs are apart and make up the rest exactly
    code_slots = rows * (tokens // 32 * 32 if isinstance(spec.main.layer.format, BlockFormat) else tokens)
    assert cache.code_bytes() == 2 * code_slots * spec.main.layer.bytes_per_block // spec.block_size
    assert cache.kv_bytes() == cache.code_bytes() + cache.side_bytes() and cache.side_bytes() >= 0
    assert cache.bits_per_value() == pytest.approx(8 * cache.code_bytes() / (2 * code_slots * heads * dim * 2))
    assert cache.bits_per_value() == pytest.approx(spec.main.layer.bits_per_value)
    if fmt in ("auto", "float32"):
        assert cache.kv_format.name == "float32"


def test_a_short_sequence_reports_the_per_value_rate_and_the_side_costs_apart() -> None:
    """At 59 tokens int4's and int2's totals are dominated by fixed side costs (16-bit open block and window,
    8-bit first block): over all values they came to more bits than float16's (the regression: int4 24, int2
    32.7, float16 17.5 reported as "bits per value"). ``bits_per_value`` is now the codes' rate, ordered as the
    formats are, and the side costs are reported apart: ``kv_bytes == code_bytes + side_bytes``."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    report = {}
    for fmt in ("float16", "int4", "int2"):
        cache = KVPageCache(model.config, fmt)
        generate(model, ids, cache, max_new_tokens=40, min_new_tokens=40)
        assert cache.get_seq_length() == 59
        report[fmt] = m = cache.memory()
        heads, dim = cache.spec.main.layer.kv_heads, cache.spec.main.layer.head_dim
        all_values = 2 * 2 * 59 * heads * dim                    # 2 layers x K and V x 59 tokens x 1 row
        assert m.kv_bytes == cache.kv_bytes() == m.code_bytes + m.side_bytes
        assert (m.tokens, m.rows, m.bits_per_value) == (59, 1, cache.bits_per_value())
        assert m.bits_per_value == pytest.approx(cache.spec.main.layer.bits_per_value)
        report[fmt + " total"] = 8 * m.kv_bytes / all_values   # the old figure, everything over every value
        report[fmt + " block"] = cache.spec.main.layer.bytes_per_block
        assert str(m).startswith(f"{fmt}: 59 tokens x 1 row(s) hold {m.kv_bytes:,} bytes = {m.code_bytes:,} of codes")
        assert f"+ {m.side_bytes:,} of fixed side costs" in str(m)
    f16, int4, int2 = report["float16"], report["int4"], report["int2"]
    assert report["int4 total"] > report["float16 total"] and report["int2 total"] > report["int4 total"]  # the trap
    assert int2.bits_per_value < int4.bits_per_value < f16.bits_per_value == 16
    assert f16.side_bytes == 2 * 5 * f16.code_bytes // (2 * 59)   # float16: the 5 unfilled slots of its 4th block
    # int4: one sealed block of 32 in codes; the open block's 27 tokens in 16 bits, its reserved pool block and
    # the first block's 8-bit copy are side costs; int2 adds the 16-bit copy of its window's sealed block
    for m in (int4, int2):
        assert m.code_bytes == 2 * report[m.kv_format + " block"]          # 2 layers x 1 sealed block
    assert int4.side_bytes > int4.code_bytes and int2.side_bytes > int4.side_bytes


def test_static_formats_need_scales_and_name_the_fix() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(StaticScalesError, match="kv_cache_scales"):
        KVPageCache(model.config, "int8_static")


def test_calibrated_scales_round_trip_through_a_file(tmp_path) -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    scales = _scales(model)
    assert sorted(scales.key) == [0, 1] and scales.kind == "absmax"
    assert tuple(scales.key[0].shape) == (2, 16) and bool((scales.value[1] > 0).all())
    scales.save(tmp_path / "scales.safetensors")
    a = KVPageCache(model.config, "fp8_static", kv_cache_scales=tmp_path / "scales.safetensors")
    b = KVPageCache(model.config, "fp8_static", kv_cache_scales=scales)
    assert a.spec.fingerprint == b.spec.fingerprint


# -- rollback: crop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4", "int3", "int2", "int2_rotated"])
def test_crop_then_continue_equals_never_having_generated(fmt: str) -> None:
    """Feed 13 prompt tokens and 30 decode tokens, then 25 more that are cropped away, then 6 more: every
    logit after the crop equals a cache that never saw the 25 (the state was restored exactly; block size 8,
    so the cut reopens a block sealed two blocks back)."""
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(4)
    base = torch.randint(3, 128, (43,), generator=g).tolist()
    extra = torch.randint(3, 128, (25,), generator=g).tolist()
    after = torch.randint(3, 128, (6,), generator=g).tolist()
    ref_cache = KVPageCache(model.config, fmt, block_size=8)
    ref = forward_logits(model, ref_cache, base + after, [13] + [1] * 36)
    cache = KVPageCache(model.config, fmt, block_size=8)
    forward_logits(model, cache, base, [13] + [1] * 30)
    cache.activate_past_recording()   # what assisted generation does before its steps
    forward_logits(model, cache, extra, [5] * 5)
    cache.crop(-len(extra))
    assert cache.get_seq_length() == len(base)
    got = forward_logits(model, cache, after, [1] * 6)
    assert torch.allclose(got, ref[len(base):], atol=1e-5, rtol=0)
    cache.crop(0)                     # settles the last step: rows held for a rollback are let go
    assert cache.kv_bytes() == ref_cache.kv_bytes()


def test_crop_without_recording_cannot_reopen_a_sealed_block() -> None:
    model = tiny_model("qwen3")
    cache = KVPageCache(model.config, "int4", block_size=8)
    forward_logits(model, cache, list(range(3, 24)), [20, 1])
    cache.crop(-3)                     # within the open block: fine
    assert cache.get_seq_length() == 18
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-6)                 # into sealed block 1 (tokens 8..15), whose rows are gone


def test_crop_right_after_a_multi_token_step_is_exact_without_recording() -> None:
    """The verification step of assisted generation in transformers before 5.2x: several tokens, then a crop,
    no activate_past_recording. The blocks that step sealed kept their 16-bit rows until the next update."""
    model = tiny_model("qwen3")
    ids = list(range(3, 40))
    ref = forward_logits(model, KVPageCache(model.config, "int4", block_size=8), ids[:20] + ids[30:33], [20, 1, 1, 1])
    cache = KVPageCache(model.config, "int4", block_size=8)
    forward_logits(model, cache, ids[:30], [20, 10])     # the second step seals block 2 (tokens 16..23)
    cache.crop(-10)
    got = forward_logits(model, cache, ids[30:33], [1, 1, 1])
    assert torch.allclose(got, ref[20:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_prompt_lookup_assisted_generation_runs(fmt: str) -> None:
    """Prompt lookup drafts from the prompt and verifies several tokens per step, then crops the rejected ones;
    with float32 the tokens equal plain greedy generation's."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]])
    plain = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=24, min_new_tokens=24)
    cache = KVPageCache(model.config, fmt, block_size=8)
    cuts: list[int] = []
    real_crop = cache.crop

    def crop(n: int) -> None:
        before = cache.get_seq_length()
        real_crop(n)
        cuts.append(before - cache.get_seq_length())

    setattr(cache, "crop", crop)   # a spy on this instance only
    out = generate(model, ids, cache, max_new_tokens=24, min_new_tokens=24, prompt_lookup_num_tokens=3)
    assert out.shape == plain.shape
    assert any(c > 0 for c in cuts)   # some drafted tokens were rejected and rolled back
    assert cache.get_seq_length() == out.shape[1] - 1
    if fmt == "float32":
        assert torch.equal(out, plain)


def test_assistant_model_generation_equals_greedy_with_float32() -> None:
    model, assistant = tiny_model("llama", seed=0), tiny_model("llama", seed=1, num_hidden_layers=1)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    plain = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=20)
    for fmt in ("float32", "int4"):
        cache = KVPageCache(model.config, fmt, block_size=8)
        out = generate(model, ids, cache, max_new_tokens=20, assistant_model=assistant)
        assert out.shape == plain.shape
        if fmt == "float32":
            assert torch.equal(out, plain)


# -- batches: left padding, beams ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "mistral_sliding"])
def test_left_padded_batch_equals_each_row_alone(family: str) -> None:
    model = tiny_model(family)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(3, 128, (1, 14), generator=g), torch.randint(3, 128, (1, 9), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 14), torch.cat([torch.zeros(1, 5), torch.ones(1, 9)], 1)]).long()
    kw = dict(max_new_tokens=30, min_new_tokens=30, output_logits=True, return_dict_in_generate=True)
    both = generate(model, batch, KVPageCache(model.config, "float32", block_size=8), attention_mask=mask, **kw)
    for row, ids in enumerate((a, b)):
        alone = generate(model, ids, KVPageCache(model.config, "float32", block_size=8), **kw)
        assert torch.equal(both.sequences[row, -30:], alone.sequences[0, -30:])
        diff = max((x[row] - y[0]).abs().max().item() for x, y in zip(both.logits, alone.logits))
        assert diff < 1e-4, (row, diff)
    cache = KVPageCache(model.config, "int4", block_size=8)   # a quantized batch runs the same path
    out = generate(model, batch, cache, attention_mask=mask, max_new_tokens=30, min_new_tokens=30)
    assert out.shape == (2, 44) and cache.layers[0].table.num_rows == 2


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_beam_search_reorders_the_cache(fmt: str) -> None:
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=20, min_new_tokens=20, num_beams=3, num_return_sequences=3)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = KVPageCache(model.config, fmt, block_size=8)
    reorders = _spy(cache, "reorder_cache")
    out = generate(model, ids, cache, **kw)
    assert out.shape == ref.shape
    assert any(len(set(b.tolist())) < 3 for (b,) in reorders)   # a beam was dropped and another one forked
    if fmt == "float32":
        assert torch.equal(out, ref)
    # beams share the blocks they have in common: fewer pool blocks than rows x blocks per row
    table = cache.layers[0].table
    assert table.num_rows == 3 and table.blocks_in_use() <= table.num_rows * table.num_blocks


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_format_lists_the_valid_names() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(UnknownKVFormatError, match="int4"):
        KVPageCache(model.config, "int5")


def test_import_does_not_import_the_engine_or_server() -> None:
    code = ("import sys, kvpage.integrations.transformers as t; "
            "bad = [m for m in sys.modules if m.startswith(('kvpage.engine', 'kvpage.server'))]; "
            "assert not bad, bad; print(t.SUPPORTED_TRANSFORMERS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# -- the bundled model (transformers' own Llama on its weights) --------------------------------------------


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_reference):
    return bundled_model(smollm2_reference)


@pytest.fixture(scope="module")
def gpl3_ids(smollm2) -> list[int]:
    from pathlib import Path

    text = (Path(__file__).parent / "data" / "GPL-3").read_text(encoding="utf-8")
    return list(smollm2.tokenizer.encode(text, add_special_tokens=False))[:104]


@pytest.mark.slow
def test_bundled_model_float32_generate_equals_dynamic_cache(hf_smollm2, gpl3_ids) -> None:
    ids = torch.tensor([gpl3_ids[:40]])
    ref = generate(hf_smollm2, ids, DynamicCache(config=hf_smollm2.config), max_new_tokens=64, min_new_tokens=64)
    cache = KVPageCache(hf_smollm2.config, "float32")
    out = generate(hf_smollm2, ids, cache, max_new_tokens=64, min_new_tokens=64)
    assert torch.equal(out, ref)
    layer = cache.spec.main.layer
    assert cache.kv_bytes() == 30 * math.ceil(103 / layer.block_size) * layer.bytes_per_block


@pytest.mark.slow
def test_bundled_model_lossy_formats_track_dynamic_cache(hf_smollm2, gpl3_ids) -> None:
    """Teacher-forced on 64 tokens after a 40-token prompt (prefill, then one token per step), against
    DynamicCache on the same tokens. Measured on this machine: int8 0 flips, mean KL 0.0032; int4 0 / 0.0054;
    int2 0 / 0.0018 (its window and 8-bit first block cover most of 104 tokens); int4_rotated (sealed and
    unsealed in the original basis here) 6 / 0.0118: its 8-bit copy holds the first token alone, so 31 of the
    104 tokens that int4's copy keeps in 8 bits are read at 4 here (1 / 0.0042 when it copied the whole block,
    at 2.5 more bits per value at this length). A wrong block, scale or rotation gives KL of whole nats."""
    chunks = [40] + [1] * 63
    ids = gpl3_ids[:103]                # row t predicts token t + 1; the last token predicts nothing
    ref = forward_logits(hf_smollm2, DynamicCache(config=hf_smollm2.config), ids, chunks)[39:]
    bounds = {"int8": (2, 0.01), "int4": (3, 0.03), "int2": (6, 0.1), "int4_rotated": (9, 0.03)}
    for fmt in LOSSY_SAMPLE:
        cache = KVPageCache(hf_smollm2.config, fmt)
        got = forward_logits(hf_smollm2, cache, ids, chunks)[39:]
        flips = int((got.argmax(-1) != ref.argmax(-1)).sum())
        kl = torch.nn.functional.kl_div(got.double().log_softmax(-1), ref.double().log_softmax(-1),
                                        log_target=True, reduction="none").sum(-1).mean().item()
        max_flips, max_kl = bounds[fmt]
        assert flips <= max_flips and kl < max_kl, (fmt, flips, kl)
        assert isinstance(cache.layers[0], SealedKVPageLayer) == (fmt != "int8")
