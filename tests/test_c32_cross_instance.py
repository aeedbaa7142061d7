"""Case C32 (LMCache issue 1842 and kin: cross-instance sharing regressions) and issue 32 item 4 (prefill/decode
disaggregation over the shared store, vLLM's ``kv_transfer_config`` roles).

Two instances sharing a store with the same layout serve each other's prefixes; any layout difference (format, block
size, model, head count, layers) never does; a record corrupted or lost in the store is recomputed, never served.
Beside these: ``tests/test_tiers_engine.py`` (two engines share Redis, another ``kv_cache_dtype`` never reads it, a
flipped byte in a disk record, Redis killed mid-run) and ``tests/test_tiers_store.py`` (record checks per store).

P/D: a ``kv_producer`` writes the prompt's blocks through to the store before it answers; a ``kv_consumer`` loads
them as a prefix hit and decodes; two ``kvpage serve`` processes follow vLLM's proxy flow (prefill with
``max_tokens=1`` and ``kv_transfer_params``, decode with what the prefill answered). Redis is a real server.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_tiers_store import block_hash, make_spec, random_block, scales_for
from _forced import assert_greedy_agrees_up_to_a_near_tie
from test_tiers_engine import SYSTEM

from kvpage import LLM, SamplingParams
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest
from kvpage.cache.tiers.disagg import KVTransferConfig
from kvpage.cache.tiers.stores.redis import RedisStore
from kvpage.engine.config import EngineConfig
from kvpage.spec import CacheSpec

#: Top-2 logit gap under which another computation order (block 0 computed alone, then loads) may flip a 4/2-bit
#: cache's greedy token: its codes are rounded from rows that differ in the last bits.
NEAR_TIE = 0.25
PROMPT = SYSTEM + "Question: on which days is the library closed, and when does it open on Saturdays? Answer:"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _transfer(role: str, url: str) -> dict:
    return {"kv_connector": "KVPageStoreConnector", "kv_role": role, "kv_connector_extra_config": {"kv_store": url}}


def _llm(smollm2, fmt: str = "auto", **kw) -> LLM:
    return LLM(smollm2, kv_cache_dtype=fmt, num_blocks=64, progress=False, **kw)


def _hashes(llm: LLM, ids: list[int]) -> list[bytes]:
    req = KVRequest("probe", ids)
    KVCache(1, llm.spec.block_size, prefix_caching_hash_algo=llm.engine_config.prefix_caching_hash_algo).match(req)
    return list(req.block_hashes)


def _redis(llm: LLM) -> RedisStore:
    return llm.kv_connector.offload.stores[0][1]


# -- layouts -------------------------------------------------------------------------------------------------------
def _other_model(fmt: str) -> CacheSpec:
    return CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=128, model_dtype=torch.bfloat16,
                           block_size=16, kv_cache_dtype=fmt, num_draft_layers=1, draft_kv_cache_dtype="bfloat16",
                           model_name="another-model", **scales_for(fmt, 3))


@pytest.mark.parametrize("variant", ["format", "block_size", "kv_heads", "head_dim", "layers", "model"])
def test_c32_a_layout_differing_in_one_field_never_reads_the_others_records(redis_server, variant: str) -> None:
    base = make_spec("int8")
    other = {"format": lambda: make_spec("fp8"), "block_size": lambda: make_spec("int8", block_size=32),
             "kv_heads": lambda: make_spec("int8", kv_heads=4), "head_dim": lambda: make_spec("int8", head_dim=64),
             "layers": lambda: make_spec("int8", layers=3), "model": lambda: _other_model("int8")}[variant]()
    assert other.fingerprint != base.fingerprint
    writer, twin, stranger = (RedisStore(redis_server.url, s) for s in (base, base, other))
    hashes = [block_hash(n) for n in range(3)]
    blocks = [random_block(base, n) for n in range(3)]
    writer.put([(writer.key(h), d) for h, d in zip(hashes, blocks)])
    # the same layout in another instance: served
    got = twin.get([twin.key(h) for h in hashes])
    assert all(g is not None for g in got) and twin.stats.hits == 3
    # another layout asks for other keys: never a hit, never even a rejected read
    assert stranger.exists([stranger.key(h) for h in hashes]) == [False] * 3
    assert stranger.get([stranger.key(h) for h in hashes]) == [None] * 3
    assert (stranger.stats.hits, stranger.stats.rejected) == (0, 0)
    for s in (writer, twin, stranger):
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_byte", "lost"])
def test_c32_a_redis_record_corrupted_or_lost_is_recomputed_never_served(smollm2, redis_server, damage: str) -> None:
    writer = _llm(smollm2, "int8", kv_store=redis_server.url)
    ids = writer.encode(PROMPT)[1]
    writer.generate([{"prompt_token_ids": ids}], GREEDY)
    n = (len(ids) - 1) // writer.spec.block_size
    assert n >= 4
    store = _redis(writer)
    key = store.redis_key(store.key(_hashes(writer, ids)[2]))
    client = redis_server.client()
    if damage == "lost":
        assert client.delete(key) == 1
    else:
        blob = bytearray(client.get(key))
        blob[len(blob) // 2] ^= 0x01
        client.set(key, bytes(blob))
    reader = _llm(smollm2, "int8", kv_store=redis_server.url)
    out = reader.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    s = reader.engine.stats().kv
    assert out.metrics.cached_tokens == 2 * reader.spec.block_size  # blocks 0-1 from Redis, 2.. recomputed
    assert s.tier_hits["redis"] == 2 and s.tiers.store_rejected == (1 if damage == "flipped_byte" else 0)
    # the reference takes the same path: a fresh instance over the store with that record gone (a rejected record
    # is deleted, and the reader wrote its recomputed block 2 back: take it out again)
    client.delete(key)
    again = _llm(smollm2, "int8", kv_store=redis_server.url)
    ref = again.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert ref.metrics.cached_tokens == 2 * again.spec.block_size and _redis(again).stats.rejected == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for llm in (writer, reader, again):
        llm.close()
    client.close()


# -- prefill/decode roles ------------------------------------------------------------------------------------------
def test_kv_transfer_config_is_vllms_spelling_and_bad_values_name_the_field() -> None:
    kt = KVTransferConfig.coerce(json.dumps(_transfer("kv_producer", "redis://h:1/0")))
    assert (kt.is_kv_producer, kt.is_kv_consumer, kt.kv_store) == (True, False, "redis://h:1/0")
    assert KVTransferConfig.coerce({"kv_connector": "KVPageStoreConnector", "kv_role": "kv_both"}).is_kv_consumer
    cfg = EngineConfig(kv_transfer_config=_transfer("kv_consumer", "redis://h:1/0"))
    assert cfg.kv_store == "redis://h:1/0" and (cfg.offload.store_reads, cfg.offload.store_writes) == (True, False)
    for bad, match in [({"kv_role": "prefill"}, "kv_role must be one of"),
                       ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
                       ({"kv_buffer_device": "cuda"}, r"unknown keys \['kv_buffer_device'\]"),
                       ({"kv_connector_extra_config": {"remote_url": "x"}}, "extra_config has unknown keys"),
                       ({"kv_connector_extra_config": {"kv_store": "localhost:6379"}}, "kv_store must be a store URL")]:
        with pytest.raises(ValueError, match=match):
            KVTransferConfig.coerce(bad)
    with pytest.raises(ValueError, match="needs a store the instances share"):
        EngineConfig(kv_transfer_config={"kv_role": "kv_producer"})
    with pytest.raises(ValueError, match="name two stores"):
        EngineConfig(kv_store="redis://a:1/0", kv_transfer_config=_transfer("kv_producer", "redis://b:1/0"))


def test_kv_transfer_config_flag_reaches_the_llm_of_generate_and_serve(monkeypatch) -> None:
    from kvpage.cli import build_parser, engine_flags

    got = {}
    monkeypatch.setattr("kvpage.engine.llm.LLM", lambda model, **kw: got.update(kw))
    for cmd in (["serve"], ["generate", "hi"]):
        got.clear()
        flag = json.dumps(_transfer("kv_both", "redis://h:1/0"))
        args = build_parser().parse_args([*cmd, "--kv-transfer-config", flag])
        engine_flags.build_llm(args)
        assert got["kv_transfer_config"] == _transfer("kv_both", "redis://h:1/0")
    got.clear()
    engine_flags.build_llm(build_parser().parse_args(["serve"]))
    assert "kv_transfer_config" not in got and got["kv_store"] is None


@pytest.mark.slow
def test_c32_producer_writes_before_answering_and_consumer_decodes_from_the_store(smollm2, redis_server) -> None:
    url = redis_server.url
    single = _llm(smollm2, enable_prefix_caching=False)
    ids = single.encode(PROMPT)[1]
    ref = single.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    producer = _llm(smollm2, kv_transfer_config=_transfer("kv_producer", url))
    n = (len(ids) - 1) // producer.spec.block_size
    producer.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0))
    # write-through before the answer: every full block is in Redis when generate returns (no later step ran)
    store = _redis(producer)
    assert store.exists([store.key(h) for h in _hashes(producer, ids)[:n]]) == [True] * n
    consumer = _llm(smollm2, kv_transfer_config=_transfer("kv_consumer", url))
    out = consumer.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert out.metrics.cached_tokens == n * consumer.spec.block_size
    assert consumer.engine.stats().kv.tier_hits["redis"] == n
    assert out.outputs[0].token_ids == ref
    assert _redis(consumer).stats.puts == 0  # a consumer writes nothing
    # a producer never reads the store: a second one computes the prompt although Redis has it
    second = _llm(smollm2, kv_transfer_config=_transfer("kv_producer", url))
    again = second.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert again.metrics.cached_tokens == 0 and _redis(second).stats.hits == 0
    for llm in (producer, consumer, second):
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "int2"])
def test_c32_sealed_formats_consumer_computes_the_first_block_and_loads_the_rest(smollm2, redis_server,
                                                                                 fmt: str) -> None:
    """int4/int2: the sealed blocks travel, the first block's 8-bit copy does not (it stays beside the device
    pool). The consumer computes block 0 (making its copy as it seals), matches again and loads blocks 1.. from
    the store; its greedy output equals a single instance's up to a near-tie."""
    url = redis_server.url
    single = _llm(smollm2, fmt, enable_prefix_caching=False)
    ids = single.encode(PROMPT)[1]
    ref = single.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    producer = _llm(smollm2, fmt, kv_transfer_config=_transfer("kv_producer", url))
    producer.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0))
    bs = producer.spec.block_size
    n = (len(ids) - 1) // bs
    assert n >= 2 and _redis(producer).stats.puts == n
    consumer = _llm(smollm2, fmt, kv_transfer_config=_transfer("kv_consumer", url))
    out = consumer.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert out.metrics.cached_tokens == (n - 1) * bs and consumer.engine.stats().kv.tier_hits["redis"] == n - 1
    # the consumer computes block 0 alone, a single instance the prompt in one pass: float rounding may flip a tie
    assert_greedy_agrees_up_to_a_near_tie(single, ids, ref, out.outputs[0].token_ids, margin=NEAR_TIE)
    assert consumer.engine.scheduler.num_preemptions == 0  # matching again is no preemption
    for llm in (producer, consumer):
        llm.close()


# -- two `kvpage serve` processes ------------------------------------------------------------------------------------
def _serve(role: str, url: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpage.cli", "serve", "--port", "0", "--num-blocks", "48", "--threads", "1",
         "--log-level", "warning", "--kv-transfer-config", json.dumps(_transfer(role, url))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc


def _wait_url(proc: subprocess.Popen, deadline: float) -> str:
    assert proc.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"on (http://\S+)/v1", line)
        if m:
            return m.group(1)
    raise AssertionError(f"kvpage serve did not start:\n{''.join(lines)}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_c32_two_serve_processes_prefill_then_decode_through_redis(smollm2, redis_server) -> None:
    procs = [_serve(role, redis_server.url) for role in ("kv_producer", "kv_consumer")]
    try:
        deadline = time.monotonic() + 120
        prefill_url, decode_url = (_wait_url(p, deadline) for p in procs)
        single = _llm(smollm2, enable_prefix_caching=False)
        ids = single.encode(PROMPT)[1]
        want = single.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].text
        n = (len(ids) - 1) // single.spec.block_size
        name = httpx.get(f"{prefill_url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        # vLLM's proxy flow: the prefill request (max_tokens 1, do_remote_decode), then the decode request with the
        # kv_transfer_params the prefill answered
        pre = httpx.post(f"{prefill_url}/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                            "remote_engine_id": None, "remote_block_ids": None}})
        assert pre.status_code == 200, pre.text
        params = pre.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        dec = httpx.post(f"{decode_url}/v1/completions", timeout=60, json={**body, "kv_transfer_params": params})
        assert dec.status_code == 200, dec.text
        got = dec.json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n * 16
        assert got["choices"][0]["text"] == want
        assert got["kv_transfer_params"] is None
        # a consumer is not a prefill instance: named 400
        bad = httpx.post(f"{decode_url}/v1/completions", timeout=60,
                         json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_kv_transfer_params_are_checked_against_the_servers_role(smollm2, redis_url: str) -> None:
    from _tiny_model import tiny_random_model

    from kvpage.server.app import ServerThread, build_app

    tiny = tiny_random_model(smollm2, max_position_embeddings=128)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    plain = LLM(tiny, num_blocks=16, max_model_len=64, progress=False)
    producer = LLM(tiny, num_blocks=16, max_model_len=64, progress=False,
                   kv_transfer_config=_transfer("kv_producer", redis_url))
    with ServerThread(build_app(plain, "tiny")) as a, ServerThread(build_app(producer, "tiny")) as p, \
            httpx.Client(timeout=60) as http:
        for path, extra in (("/v1/completions", {"prompt": [1, 2, 3]}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            req = {**{k: v for k, v in body.items() if k != "prompt"}, **extra}
            r = http.post(a.url + path, json={**req, "kv_transfer_params": {"do_remote_decode": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
            assert "without --kv-transfer-config" in r.json()["error"]["message"]
            ok = http.post(p.url + path, json={**req, "kv_transfer_params": {"do_remote_decode": True,
                                                                              "remote_host": None}})
            assert ok.status_code == 200 and ok.json()["kv_transfer_params"]["do_remote_prefill"] is True
            assert http.post(p.url + path, json=req).json()["kv_transfer_params"] is None
        for params, status, words in [({"do_remote_prefill": True}, 400, "needs kv_role kv_consumer"),
                                      ({"do_remote_decode": "yes"}, 400, "do_remote_decode")]:
            r = http.post(p.url + "/v1/completions", json={**body, "kv_transfer_params": params})
            assert r.status_code == status and words in json.dumps(r.json()["error"]), r.text
        r = http.post(p.url + "/v1/completions",
                      json={**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and "needs stream false" in r.json()["error"]["message"]
    producer.close()
