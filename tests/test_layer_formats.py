"""Per-layer precision (issue 34 item 1d): ``kv_layer_dtypes`` gives chosen full-attention layers another KV format.

Each distinct format's layers form a ``main@<format>`` group beside ``main`` (:meth:`CacheSpec.build`); these tests
check the spec's layout per layer against each format's own, that a layer's pool holds exactly what its format
writes, the eval's bits, the refusals of bad maps and that specs without a map are unchanged.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from _tiny import tiny_loaded
from kvpage import LLM
from kvpage.cache.controller import CacheController
from kvpage.engine.config import EngineConfig, parse_layer_dtypes
from kvpage.engine.sampling import SamplingParams
from kvpage.errors import StaticScalesError, UnknownKVFormatError
from kvpage.spec import CacheSpec

MIX = {1: "int4_rotated", 4: "int2_rotated", 5: "int4_rotated", 2: "int3_rotated"}  # 2 is the base format


def _spec(fmt: str = "int3_rotated", **kw) -> CacheSpec:
    return CacheSpec.build(num_layers=6, num_kv_heads=2, head_dim=64, block_size=32, kv_cache_dtype=fmt, **kw)


def test_groups_follow_the_map() -> None:
    spec = _spec(layer_formats=MIX)
    assert [(g.name, list(g.layer_indices), g.layer.kv_format) for g in spec.groups] == [
        ("main", [0, 2, 3], "int3_rotated"),
        ("main@int4_rotated", [1, 5], "int4_rotated"),
        ("main@int2_rotated", [4], "int2_rotated"),
    ]
    assert spec.format_label == "int3_rotated[1,5:int4_rotated;4:int2_rotated]"
    assert spec.main.name == "main" and spec.model_groups == spec.groups and spec.draft is None


def test_each_layer_is_laid_out_as_its_own_format_and_bytes_add_up() -> None:
    spec = _spec(layer_formats=MIX)
    caches = CacheController(spec, device=torch.device("meta")).allocate_device(5)
    total = 0
    for i in range(6):
        fmt = MIX.get(i, "int3_rotated")
        own = _spec(fmt)
        assert spec.layer(i) == own.layer(i), i
        own_cache = CacheController(own, device=torch.device("meta")).allocate_device(5)[i]
        assert {k: (t.dtype, tuple(t.shape)) for k, t in caches[i].items()} == \
               {k: (t.dtype, tuple(t.shape)) for k, t in own_cache.items()}, i
        total += own.main.layer.bytes_per_block
    assert spec.bytes_per_block == total


def test_no_map_specs_are_unchanged() -> None:
    """Fingerprints computed on main (e40fb31) before per-layer precision existed: a spec without a map (or an
    empty one, or one naming only the base format) is byte-identical."""
    expected = {
        "auto": "f1d6b253dee0e8846fa3e426225411c5ea42c22033806f612c4270e32ca49a3f",
        "int3_rotated": "9f177b66ff0aa704b85ffa008922b8a09d3530c99b5ba75161146a81ed00e4e9",
        "int4": "22137c1df254e08b4c85d03a8d5895edbee39e6d985bf37e6bda3bd71e3f89b1",
        "int8": "77a189d24224ccd00e01ef4aeba9a677add9ebba6e8688321db804016e5f4f3a",
    }
    for fmt, fp in expected.items():
        for lf in (None, {}, {0: fmt}):
            s = CacheSpec.build(num_layers=4, num_kv_heads=2, head_dim=64, block_size=32, kv_cache_dtype=fmt,
                                model_name="tiny", layer_formats=lf)
            assert s.fingerprint == fp, (fmt, lf)
            assert [g.name for g in s.groups] == ["main"]
    gemma = CacheSpec.build(num_layers=6, num_kv_heads=2, head_dim=64, block_size=32, kv_cache_dtype="int4",
                            model_name="g", layer_windows=[8, 8, None, 8, 8, None], num_draft_layers=1)
    assert gemma.fingerprint == "7545306e8017c54c8d9d2ab86e30856a203f9bbad3b7e893686d07b42d5194ba"


def test_the_fingerprint_covers_the_map() -> None:
    fps = {_spec().fingerprint, _spec(layer_formats=MIX).fingerprint,
           _spec(layer_formats={1: "int4_rotated"}).fingerprint, _spec(layer_formats={2: "int4_rotated"}).fingerprint,
           _spec(layer_formats={1: "int2_rotated"}).fingerprint}
    assert len(fps) == 5


@pytest.mark.parametrize("layer_formats, match", [
    ({9: "int4"}, r"kv_layer_dtypes: layer 9 is out of range"),
    ({6: "int4"}, r"kv_layer_dtypes: layer 6 is a draft layer"),
    ({0: "int4", 1: "int4", 2: "int4", 3: "int4", 4: "int4", 5: "int4"}, r"kv_layer_dtypes gives every layer"),
])
def test_bad_maps_are_refused_by_the_spec(layer_formats, match) -> None:
    with pytest.raises(ValueError, match=match):
        _spec("int8", layer_formats=layer_formats, num_draft_layers=1)


def test_sliding_layers_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_layer_dtypes: layer\(s\) \[0\] are sliding-window layers"):
        _spec("int4", layer_formats={0: "int8"}, layer_windows=[8, None, 8, None, 8, None])


def test_bad_maps_are_refused_by_the_config() -> None:
    with pytest.raises(UnknownKVFormatError, match="kv_layer_dtypes: layer 3"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes={3: "int5"})
    with pytest.raises(ValueError, match="kv_layer_dtypes: layer 3 is named twice"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes="3,4:int4;3:int2")
    with pytest.raises(ValueError, match="kv_layer_dtypes: layer index -1"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes={-1: "int4"})
    with pytest.raises(ValueError, match="kv_layer_dtypes: 'int4' is not LAYERS:FORMAT"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes="int4")
    with pytest.raises(ValueError, match="kv_layer_dtypes must be a mapping"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes=[(1, "int4")])
    with pytest.raises(StaticScalesError, match=r"layer 1 \(main@int8_static group\)"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes={1: "int8_static"})
    assert parse_layer_dtypes("17,20 :int4_rotated; 27:int2_rotated") == {17: "int4_rotated", 20: "int4_rotated",
                                                                          27: "int2_rotated"}
    cfg = EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes={0: "int4", 1: "int8"})
    assert {i: f.name for i, f in cfg.kv_layer_formats.items()} == {0: "int4"}
    assert cfg.block_size_resolved == 32  # the block-wise layers' preferred block
    assert cfg.residual_tokens_for("main@int2") == 0 and cfg.residual_tokens_for("main") == 0
    cfg2 = EngineConfig(kv_cache_dtype="int3_rotated", kv_layer_dtypes={0: "int2_rotated"})
    assert cfg2.residual_tokens_for("main@int2_rotated") == 32 and cfg2.residual_tokens_for("main") == 0


@pytest.fixture(scope="module")
def tiny4():
    return tiny_loaded(0, layers=4)


PROMPT = "hello world, this is a prompt of some length to seal a block or two of the cache ok" * 2


def _layer0(loaded, **kw) -> dict[str, torch.Tensor]:
    # 24 blocks: too few to carve tails from the pool, so both engines use the same block ids for the prompt
    llm = LLM(loaded, num_blocks=24, progress=False, **kw)
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    return {k: v.clone() for k, v in llm._built.caches[0].items()}


@pytest.mark.parametrize("mixed, uniform", [
    (dict(kv_cache_dtype="int3_rotated", kv_layer_dtypes={0: "int4_rotated", 3: "int2_rotated"}), "int4_rotated"),
    (dict(kv_cache_dtype="int3_rotated", kv_layer_dtypes={1: "int4_rotated", 2: "int2_rotated"}), "int3_rotated"),
    (dict(kv_cache_dtype="int8", kv_layer_dtypes={0: "fp8", 2: "int8_rotated"}), "fp8"),
])
def test_a_layers_pool_holds_what_its_format_writes(tiny4, mixed, uniform) -> None:
    """Layer 0's inputs do not depend on the other layers' formats, so its pool bytes equal those of an engine with
    layer 0's format everywhere."""
    a, b = _layer0(tiny4, **mixed), _layer0(tiny4, kv_cache_dtype=uniform)
    assert a.keys() == b.keys()
    assert any(t.any() for t in a.values())
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_mixed_engine_generates_and_reports(tiny4) -> None:
    llm = LLM(tiny4, kv_cache_dtype="int3_rotated", kv_layer_dtypes="1:int4_rotated;3:int2_rotated", num_blocks=64,
              progress=False)
    assert llm.capacity.kv_format == "int3_rotated[1:int4_rotated;3:int2_rotated]"
    out = llm.generate([PROMPT, PROMPT[:50]], SamplingParams(max_tokens=20, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 20 for o in out)
    # a repeat is served from the prefix cache and gives the same tokens
    again = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_eval_row_bits_are_the_layer_mean(tiny4) -> None:
    from kvpage.eval import evaluate_formats

    ids = list((b"The quick brown fox jumps over the lazy dog. " * 6)[:250])
    mix = "int3_rotated[1:int4_rotated;3:int2_rotated]"
    rows = evaluate_formats(tiny4, ids, formats=["auto", "int3_rotated", "int4_rotated", "int2_rotated", mix],
                            mode="chunked", chunk_size=32, progress=False)
    bits = {r.name: r.bits_per_value for r in rows}
    assert bits[mix] == pytest.approx((2 * bits["int3_rotated"] + bits["int4_rotated"] + bits["int2_rotated"]) / 4)
    assert rows[-1].kv_cache_dtype == mix and rows[-1].divergence is not None


@pytest.mark.parametrize("text", ["", " ", ";", " ; ", "1:int4;", ";1:int4", "1:int4;;2:int2"])
def test_empty_maps_and_items_are_refused_naming_the_option(text) -> None:
    """``""``, ``";"``, ``"1:int4;"`` were accepted silently (an empty map, or its empty items dropped): a typo
    ran as a cache other than the one meant. Each is refused, named as the caller spells the option."""
    with pytest.raises(ValueError, match=r"^kv_layer_dtypes: .*empty"):
        parse_layer_dtypes(text)
    with pytest.raises(ValueError, match=r"^kv_layer_dtypes: .*empty"):
        EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes=text)
    assert EngineConfig(kv_cache_dtype="int8", kv_layer_dtypes={}).kv_layer_formats is None  # a computed empty map


@pytest.mark.parametrize("value, words", [
    ("", "empty layer map ''"),
    ("1:int4;", "has an empty item"),
    ("int4", "'int4' is not LAYERS:FORMAT"),
    ("1:int4;1:int2", "layer 1 is named twice"),
])
def test_cli_names_kv_layer_dtypes_once(value, words, capsys) -> None:
    """A syntax error printed the flag twice (``argument --kv-layer-dtypes: --kv-layer-dtypes: ...``) and later
    errors said ``kv_layer_dtypes``: the CLI says ``--kv-layer-dtypes`` once, always."""
    from kvpage.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--kv-layer-dtypes", value, "hi"])
    assert e.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("kvpage generate: error: argument --kv-layer-dtypes: ") and words in first, first
    assert first.count("-kv-layer-dtypes") == 1 and "kv_layer_dtypes" not in first


def test_cli_engine_errors_name_the_flag(tiny4, monkeypatch, capsys) -> None:
    """Errors found when the engine is built (a format unknown, a layer the model lacks) name ``--kv-layer-dtypes``
    too, not the Python field."""
    from kvpage.cli import main
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny4)
    for value, words in (("3:int5", "--kv-layer-dtypes: layer 3: "), ("9:int4", "--kv-layer-dtypes: layer 9 is out")):
        assert main(["generate", "--kv-cache-dtype", "int8", "--kv-layer-dtypes", value, "--num-blocks", "32",
                     "--threads", "1", "hi"]) == 2
        err = capsys.readouterr().err
        assert f"kvpage: error: {words}" in err and "kv_layer_dtypes" not in err, err


def test_eval_empty_bracket_map_is_refused_naming_formats(tmp_path, capsys, monkeypatch) -> None:
    """``--formats "int3_rotated[]"`` ran as plain int3_rotated under a label promising a map; empty items inside
    the brackets were dropped. Both are refused before the model loads, naming ``--formats``."""
    from kvpage.cli import main
    from kvpage.eval.command import _format_list

    for row in ("int3_rotated[]", "int3_rotated[ ]"):
        with pytest.raises(ValueError, match=r"^--formats: .*empty layer map"):
            _format_list(row, torch.float32)
    with pytest.raises(ValueError, match=r"^--formats 'int3_rotated\[1:int4;\]': .*empty item"):
        _format_list("int3_rotated[1:int4;]", torch.float32)

    def no_load(*a, **k):
        raise AssertionError("the model must not load when --formats is bad")

    monkeypatch.setattr("kvpage.model.loader.load_model", no_load)
    text = tmp_path / "t.txt"
    text.write_text("hello " * 50)
    assert main(["eval", "--text", str(text), "--formats", "int3_rotated[]", "--out", str(tmp_path / "o")]) == 2
    assert "kvpage: error: --formats: 'int3_rotated[]' has an empty layer map" in capsys.readouterr().err


def test_eval_rows_are_checked_against_the_model_before_the_first_runs(tiny4, tmp_path, capsys, monkeypatch) -> None:
    """A row naming a layer the model lacks failed only at its turn, after the rows before it had run."""
    from kvpage.cli import main
    from kvpage.eval import perplexity

    def no_eval(*a, **k):
        raise AssertionError("no row may run when a later one cannot")

    monkeypatch.setattr("kvpage.model.loader.load_model", lambda *a, **k: tiny4)
    monkeypatch.setattr(perplexity, "evaluate_perplexity", no_eval)
    text = tmp_path / "t.txt"
    text.write_text("hello " * 50)
    assert main(["eval", "--text", str(text), "--formats", "int8,int3_rotated[9:int4_rotated]", "--out",
                 str(tmp_path / "o"), "--no-progress", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvpage: error: --formats 'int3_rotated[9:int4_rotated]': layer 9 is out of range" in err, err
    assert not (tmp_path / "o").exists()


def test_eval_format_list_keeps_bracketed_maps() -> None:
    from kvpage.eval.command import _format_list

    got = _format_list("int3_rotated, int3_rotated[17,20:int4_rotated;27,13:int2_rotated],int8", torch.float32)
    assert got == ["auto", "int3_rotated", "int3_rotated[17,20:int4_rotated;27,13:int2_rotated]", "int8"]
    with pytest.raises(ValueError, match="layer 17 is named twice"):
        _format_list("int3[17:int4;17:int2]", torch.float32)
    with pytest.raises(UnknownKVFormatError):
        _format_list("int3[17:int5]", torch.float32)


def test_cli_flag(tiny4, capsys) -> None:
    from kvpage.cli import build_parser
    from kvpage.cli.engine_flags import build_llm

    p = build_parser()
    args = p.parse_args(["generate", "--kv-cache-dtype", "int3_rotated", "--kv-layer-dtypes",
                         "1:int4_rotated;3:int2_rotated", "--num-blocks", "32", "hi"])
    assert args.kv_layer_dtypes == {1: "int4_rotated", 3: "int2_rotated"}
    args.model = tiny4
    llm = build_llm(args)
    assert [g.name for g in llm.spec.groups] == ["main", "main@int4_rotated", "main@int2_rotated"]
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--kv-layer-dtypes", "1:int4;1:int2", "hi"])
    assert "--kv-layer-dtypes" in capsys.readouterr().err
    args = p.parse_args(["generate", "--kv-layer-dtypes", "9:int4", "--num-blocks", "32", "hi"])
    args.model = tiny4
    with pytest.raises(ValueError, match="^--kv-layer-dtypes: layer 9 is out of range"):  # the CLI's name, as above
        build_llm(args)
    assert isinstance(p, argparse.ArgumentParser)


@pytest.mark.parametrize("base, layer_map", [("int4_rotated", {1: "int2_rotated"}), ("int4", {2: "int3"}),
                                             ("int3_rotated", {1: "int4_rotated", 3: "int2_rotated"})])
def test_sealed_groups_carve_together_or_not_at_all(tiny4, base, layer_map) -> None:
    """Several quantize-on-seal groups share one pool: their tails are all carved from it or all fixed pools, as
    capacity counted them, and many requests run through."""
    from kvpage.cache.groups import SealedGroupManager

    llm = LLM(tiny4, kv_cache_dtype=base, kv_layer_dtypes=layer_map, kv_cache_memory_bytes=2 * 2**20,
              max_num_seqs=4, progress=False)
    carved = llm.capacity.side_blocks_per_slot > 0
    sealed = [m for m in llm._built.groups if isinstance(m, SealedGroupManager)]
    assert len(sealed) == len(llm.spec.groups)
    assert {m.layout.carved for m in sealed} == {carved}
    prompts = [PROMPT[: 40 + 13 * i] for i in range(8)]
    out = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)


def test_tiers_carry_a_mixed_cache_and_never_share_it_with_another_map(tiny4, tmp_path) -> None:
    """Host tier and disk store round-trip every group's bytes (same greedy tokens from each tier); an engine with
    another map (another fingerprint) finds nothing in the same store."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mix = {1: "fp8", 3: "int8_rotated"}

    def run(llm: LLM) -> list[int]:
        return llm.generate([PROMPT], params)[0].outputs[0].token_ids

    ref = run(LLM(tiny4, kv_cache_dtype="int8", kv_layer_dtypes=mix, num_blocks=64, progress=False,
                  enable_prefix_caching=False))
    a = LLM(tiny4, kv_cache_dtype="int8", kv_layer_dtypes=mix, num_blocks=64, progress=False, swap_space=0.01,
            kv_disk_dir=tmp_path)
    n = (len(PROMPT) - 1) // a.spec.block_size
    assert run(a) == ref
    a.reset_prefix_cache()
    assert run(a) == ref and a.engine.stats().kv.tier_hits["host"] == n
    a.close()
    disk = LLM(tiny4, kv_cache_dtype="int8", kv_layer_dtypes=mix, num_blocks=64, progress=False, kv_disk_dir=tmp_path)
    assert run(disk) == ref and disk.engine.stats().kv.tier_hits == {"device": 0, "disk": n}
    other = LLM(tiny4, kv_cache_dtype="int8", kv_layer_dtypes={1: "fp8"}, num_blocks=64, progress=False,
                kv_disk_dir=tmp_path)
    run(other)
    assert other.engine.stats().kv.tier_hits.get("disk", 0) == 0
