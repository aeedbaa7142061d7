"""``prefix_caching_hash_algo="sha256_cbor"``: kvpage's block hashes equal vLLM's, so a router recomputes them.

The vectors in ``data/vllm_hash_vectors.json`` were computed by vLLM's own hashing code (vLLM 0.34.0), run
in a separate environment by ``data/make_vllm_hash_vectors.py`` (its docstring has the command): several
chained blocks, with and without ``cache_salt`` / LoRA extra keys / ``PYTHONHASHSEED``, full 32-byte hashes
and their 64-bit form.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import cbor2
import pytest
from _tiny import tiny_loaded

from kvpage import LLM, SamplingParams
from kvpage.cache.hashing import (
    HASH_ALGOS,
    VLLM_DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    hash_block_chain,
    hash_to_int64,
    vllm_none_hash,
)
from kvpage.cache.tiers.stores.base import StoreKey

DOC = json.loads((Path(__file__).parent / "data" / "vllm_hash_vectors.json").read_text())
VECTORS = {v["name"]: v for v in DOC["vectors"]}


def _as_tuple(x):
    """JSON arrays back to the tuples vLLM hashed (CBOR encodes both as arrays)."""
    return tuple(_as_tuple(i) for i in x) if isinstance(x, list) else x


def _extra_keys(v: dict) -> tuple:
    """kvpage's request extra keys for a vector: vLLM 0.34's LoRA key ``("lora", name, path)``."""
    return () if v["lora"] is None else (("lora", v["lora"]["name"], v["lora"]["path"]),)


def test_the_vectors_cover_what_routers_meet() -> None:
    assert DOC["vllm_version"] == "0.34.0"
    assert len(VECTORS) == 8
    assert all(len(v["hashes"]) >= 2 for v in VECTORS.values())  # chains, not single blocks
    assert {v["pythonhashseed"] for v in VECTORS.values()} == {None, "0", "kvpage-test"}
    assert any(v["cache_salt"] and v["lora"] for v in VECTORS.values())


def _use_seed(monkeypatch: pytest.MonkeyPatch, v: dict[str, Any]) -> None:
    """Set ``PYTHONHASHSEED`` as the vector was made (unset where it was ``None``)."""
    if v["pythonhashseed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", v["pythonhashseed"])


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_kvpage_reproduces_vllms_hashes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    v = VECTORS[name]
    _use_seed(monkeypatch, v)
    hasher = BlockHasher("sha256_cbor")  # reads PYTHONHASHSEED now, as vLLM's init_none_hash
    assert hasher.root(v["cache_salt"]).hex() == v["none_hash"]
    hashes = hasher.chain(v["token_ids"], v["block_size"], v["cache_salt"], _extra_keys(v))
    assert [h.hex() for h in hashes] == v["hashes"]
    assert [hash_to_int64(h) for h in hashes] == v["hashes_int64"]
    # the 64-bit form is the last 8 bytes, big-endian (what llm-d's indexer takes from the full digest)
    assert [int.from_bytes(h[-8:], "big") for h in hashes] == v["hashes_int64"]


def test_none_hash_is_sha256_of_the_cbor_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert DOC["default_none_hash_seed"] == VLLM_DEFAULT_NONE_HASH_SEED
    want = hashlib.sha256(cbor2.dumps(VLLM_DEFAULT_NONE_HASH_SEED, canonical=True)).digest()
    assert vllm_none_hash() == want == bytes.fromhex(VECTORS["plain"]["none_hash"])
    assert vllm_none_hash("0").hex() == VECTORS["seed0"]["none_hash"]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_none_hash() == vllm_none_hash("0") != want


def test_extra_keys_are_vllms() -> None:
    v = VECTORS["lora_salt"]
    hasher = BlockHasher("sha256_cbor", seed=VLLM_DEFAULT_NONE_HASH_SEED)
    from kvpage.cache.hashing import vllm_extra_keys

    got = [vllm_extra_keys(i, v["cache_salt"], _extra_keys(v)) for i in range(len(v["hashes"]))]
    assert got == [_as_tuple(e) for e in v["extra_keys"]]
    assert vllm_extra_keys(0, "", ()) is None  # vLLM tests the salt for truth: "" is no salt
    assert hasher.chain(v["token_ids"], 4, "") == hasher.chain(v["token_ids"], 4, None)
    assert hasher.salt_identity("") is None and BlockHasher().salt_identity("") == ""


def test_bad_algo_and_options_are_refused() -> None:
    assert HASH_ALGOS == ("kvpage", "sha256_cbor")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of kvpage, sha256_cbor, got 'md5'"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="hash_fn"):
        BlockHasher("sha256_cbor", hash_fn=lambda p, t, e: p)
    with pytest.raises(ValueError, match="seed"):
        BlockHasher("kvpage", seed="0")
    with pytest.raises(TypeError, match="sha256_cbor"):
        BlockHasher("sha256_cbor", seed="0").chain([1, 2], 2, None, (object(),))  # CBOR cannot encode it


def test_the_two_schemes_never_share_a_store_key() -> None:
    # Stores key a block by (layout fingerprint, block hash). The schemes hash different preimages (kvpage's
    # domain-tagged bytes vs a CBOR array), so the same tokens get other hashes, hence other keys: an instance
    # on one scheme misses, never reads, the other's blocks.
    v = VECTORS["plain"]
    own = hash_block_chain(v["token_ids"], 4)
    vllm = BlockHasher("sha256_cbor", seed=VLLM_DEFAULT_NONE_HASH_SEED).chain(v["token_ids"], 4)
    assert [h.hex() for h in vllm] == v["hashes"]
    assert not set(own) & set(vllm)
    fp = "f" * 64
    assert {StoreKey(fp, h).text for h in own}.isdisjoint(StoreKey(fp, h).text for h in vllm)


def _index_hashes(llm: LLM) -> set[str]:
    """The hashes the engine's prefix index holds, hex."""
    kv = llm._built.kv
    return {h.hex() for b in range(kv.num_blocks) if (h := kv.pool.block_hash(b)) is not None}


@pytest.mark.parametrize("name", ["plain", "seed0", "salt_seed0"])
def test_engine_prefix_index_holds_vllms_hashes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    v = VECTORS[name]
    _use_seed(monkeypatch, v)
    llm = LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=v["block_size"], num_blocks=32,
              prefix_caching_hash_algo="sha256_cbor", progress=False)
    llm.engine.add_request(None, v["token_ids"], SamplingParams(max_tokens=1, temperature=0.0),
                           cache_salt=v["cache_salt"])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert _index_hashes(llm) == set(v["hashes"])  # 14 prompt tokens: 3 full blocks of 4
    # the same prompt again is a prefix hit on those blocks (the index still checks tokens on hits)
    out = llm.generate({"prompt_token_ids": v["token_ids"]}, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.metrics.cached_tokens == (12 if v["cache_salt"] is None else 0)  # a salted prefix is not shared


def test_engine_default_scheme_is_kvpages_own() -> None:
    v = VECTORS["plain"]
    llm = LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=4, num_blocks=32, progress=False)
    llm.generate({"prompt_token_ids": v["token_ids"]}, SamplingParams(max_tokens=1, temperature=0.0))
    assert _index_hashes(llm) == {h.hex() for h in hash_block_chain(v["token_ids"], 4)}


def test_bad_algo_is_refused_before_the_model_loads() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of kvpage, sha256_cbor, got 'xxhash'"):
        LLM(tiny_loaded(0), prefix_caching_hash_algo="xxhash", progress=False)


def test_cli_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import kvpage.engine.llm
    from kvpage.cli.engine_flags import add_engine_args, build_llm

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).prefix_caching_hash_algo == "kvpage"
    args = p.parse_args(["--prefix-caching-hash-algo", "sha256_cbor"])
    seen: dict = {}
    monkeypatch.setattr(kvpage.engine.llm, "LLM", lambda model, **kw: seen.update(kw))
    build_llm(args)
    assert seen["prefix_caching_hash_algo"] == "sha256_cbor"
    with pytest.raises(SystemExit):
        p.parse_args(["--prefix-caching-hash-algo", "sha1"])
