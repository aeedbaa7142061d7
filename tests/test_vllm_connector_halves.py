"""The vLLM connector's two halves without vLLM: what the scheduler half loads and saves, what the worker half
writes into vLLM-shaped caches, and how a missing or corrupt record becomes a load error (issue 33).

The caches here are real tensors in vLLM's CPU_ATTN layout and the store is kvpage's real disk store; only vLLM's
scheduler is played by the test, with the calls it makes (``tests_vllm/`` runs the real one).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvpage.integrations.vllm.cache_layout import CpuAttnBlocks
from kvpage.integrations.vllm.records import VLLMLayout, record_specs
from kvpage.integrations.vllm.scheduler import ConnectorScheduler
from kvpage.integrations.vllm.stores import RecordStores
from kvpage.integrations.vllm.worker import ConnectorWorker

BS = 16
LAYOUT = VLLMLayout("tiny", num_layers=3, num_kv_heads=2, head_size=64, block_size=BS, dtype=torch.bfloat16)
NUM_BLOCKS = 12


def _caches(seed: int | None = None) -> list[torch.Tensor]:
    """Per layer ``[NUM_BLOCKS, heads, bs, 2 * head_size]`` bf16: random (a computed cache) or zeros (a fresh one)."""
    shape = (NUM_BLOCKS, LAYOUT.num_kv_heads, BS, 2 * LAYOUT.head_size)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


def _engine(tmp_path, storage: str = "auto", caches=None, save_async: bool = False):
    """One 'vLLM instance': scheduler half, worker half and its caches, on the disk store in ``tmp_path``."""
    specs = record_specs(LAYOUT, storage)
    sched = ConnectorScheduler(RecordStores(str(tmp_path), specs), BS)
    worker = ConnectorWorker(specs, RecordStores(str(tmp_path), specs), torch.bfloat16, save_async=save_async)
    caches = caches if caches is not None else _caches()
    worker.register(caches, CpuAttnBlocks(LAYOUT.num_kv_heads, LAYOUT.head_size, BS))
    return sched, worker, caches


PROMPT = list(range(1000, 1000 + 5 * BS + 3))          # 5 full blocks and 3 tokens


def _cold_run(tmp_path, storage: str = "auto", chunks=(5 * BS + 3,)):
    """A first instance computes PROMPT (block ids 2..7) in prefill chunks and saves its full blocks."""
    sched, worker, caches = _engine(tmp_path, storage, _caches(seed=1))
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 0
    ids = [2, 3, 4, 5, 6, 7]
    sched.update_state_after_alloc("r", ids, 0)
    computed, saved = 0, []
    for i, n in enumerate(chunks):
        step = (sched.build_connector_meta([("r", ids, 0)], [], {"r": n}) if i == 0 else
                sched.build_connector_meta([], [("r", None, False, computed)], {"r": n}))
        assert step.loads == []
        worker.save(step.saves)
        saved += [b for t in step.saves for b in t.block_ids]
        computed += n
    worker.close()
    return caches, ids, saved


def test_a_second_instance_loads_the_stored_prefix_byte_exact(tmp_path):
    """Instance 1 saves the prompt's 5 full blocks; instance 2 (fresh halves, fresh zeroed cache) is offered 5
    blocks, loads them into its own block ids, and holds bit-identical KV there; the 6th block is not touched."""
    src, src_ids, saved = _cold_run(tmp_path)
    assert saved == src_ids[:5]
    sched, worker, caches = _engine(tmp_path)
    assert sched.get_num_new_matched_tokens("q", PROMPT, 0) == 5 * BS
    dst_ids = [9, 1, 0, 11, 10, 8]
    sched.update_state_after_alloc("q", dst_ids, 5 * BS)
    step = sched.build_connector_meta([("q", dst_ids, 5 * BS)], [], {"q": 3})
    assert [(t.block_ids, t.first_index) for t in step.loads] == [(tuple(dst_ids[:5]), 0)]
    assert step.saves == []                                   # what it loaded is stored already
    worker.load(step.loads)
    assert worker.take_load_errors() == set()
    for s, d in zip(src, caches):
        assert torch.equal(d[dst_ids[:5]].view(torch.int16), s[src_ids[:5]].view(torch.int16))
        assert d[dst_ids[5]].abs().sum() == 0
    worker.close()


def test_loads_never_cover_the_last_token_and_stop_at_the_first_missing_block(tmp_path):
    """A prompt of exactly 5 blocks gets 4 (vLLM must compute its last token); a stored run with a gap is cut at
    the gap; vLLM's own hits are skipped."""
    _cold_run(tmp_path)
    sched, worker, _ = _engine(tmp_path)
    assert sched.get_num_new_matched_tokens("a", PROMPT[:5 * BS], 0) == 4 * BS
    assert sched.get_num_new_matched_tokens("b", PROMPT, 2 * BS) == 3 * BS      # blocks 2..4 after 2 device hits
    other = PROMPT[:2 * BS] + [7] * (3 * BS + 3)                                  # diverges at block 2
    assert sched.get_num_new_matched_tokens("c", other, 0) == 2 * BS
    assert sched.get_num_new_matched_tokens("d", PROMPT, 0, cache_salt="tenant-2") == 0
    assert sched.get_num_new_matched_tokens("e", PROMPT, 0, lora_name="adapter") == 0
    assert sched.get_num_new_matched_tokens("f", PROMPT, 0, cacheable=False) == 0
    worker.close()


def test_chunked_prefill_saves_each_block_once_when_it_fills(tmp_path):
    """Chunks of 20, 20 and 43 tokens: blocks 0, then 1, then 2..4 are saved, each exactly once."""
    _, ids, saved = _cold_run(tmp_path, chunks=(20, 20, 43))
    assert saved == ids[:5]


def test_corrupt_and_missing_records_become_load_errors_never_bytes(tmp_path):
    """Block 2's record corrupted on disk (one flipped byte): blocks 0-1 load; blocks 2-4 are reported as load
    errors and stay untouched (zeros), so vLLM recomputes them; the corrupt record is dropped from the store."""
    _cold_run(tmp_path)
    sched, worker, caches = _engine(tmp_path)
    assert sched.get_num_new_matched_tokens("q", PROMPT, 0) == 5 * BS
    h2 = sched.hashes(PROMPT)[2]
    path = worker.stores.blocks.path_for(worker.stores.blocks.key(h2))
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0x40
    path.write_bytes(bytes(blob))
    dst = [0, 1, 2, 3, 4, 5]
    sched.update_state_after_alloc("q", dst, 5 * BS)
    step = sched.build_connector_meta([("q", dst, 5 * BS)], [], {"q": 3})
    worker.load(step.loads)
    assert worker.take_load_errors() == {2, 3, 4}
    assert worker.take_load_errors() == set()                     # reported once
    for c in caches:
        assert c[[0, 1]].abs().sum() > 0 and c[[2, 3, 4, 5]].abs().sum() == 0
    assert worker.stores.stats()["rejected"] == 1 and not path.exists()
    # the next instance's probe no longer offers the dropped block
    assert ConnectorScheduler(worker.stores, BS).get_num_new_matched_tokens("z", PROMPT, 0) == 2 * BS
    worker.close()


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_loads_are_close_and_int4_first_block_is_int8(tmp_path, storage):
    """Quantized records load within the format's error: int8 about 0.5% relative, int4 (blocks 1..) about 10%,
    with block 0 at int8 precision in both."""
    src, src_ids, _ = _cold_run(tmp_path, storage)
    sched, worker, caches = _engine(tmp_path, storage)
    assert sched.get_num_new_matched_tokens("q", PROMPT, 0) == 5 * BS
    dst = [6, 7, 8, 9, 10, 11]
    sched.update_state_after_alloc("q", dst, 5 * BS)
    worker.load(sched.build_connector_meta([("q", dst, 5 * BS)], [], {"q": 3}).loads)
    assert worker.take_load_errors() == set()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    first = max(rel(d[dst[0]], s[src_ids[0]]) for s, d in zip(src, caches))
    rest = max(rel(d[dst[1:5]], s[src_ids[1:5]]) for s, d in zip(src, caches))
    assert 0 < first < 0.02
    assert (0 < rest < 0.02) if storage == "int8" else (0.03 < rest < 0.15), rest
    worker.close()


def test_async_saves_are_written_by_close(tmp_path):
    """With ``save_async`` the blocks are copied out at once (the cache may change right after) and written by
    the background thread; ``close`` waits for them."""
    sched, worker, caches = _engine(tmp_path, caches=_caches(seed=5), save_async=True)
    sched.get_num_new_matched_tokens("r", PROMPT, 0)
    sched.update_state_after_alloc("r", [0, 1, 2, 3, 4, 5], 0)
    step = sched.build_connector_meta([("r", [0, 1, 2, 3, 4, 5], 0)], [], {"r": len(PROMPT)})
    expect = [c[0].clone() for c in caches]
    worker.save(step.saves)
    for c in caches:
        c.zero_()                                                 # vLLM reuses the blocks
    worker.close()
    sched2, worker2, caches2 = _engine(tmp_path)
    assert sched2.get_num_new_matched_tokens("q", PROMPT, 0) == 5 * BS
    sched2.update_state_after_alloc("q", [3, 4, 5, 6, 7, 8], 5 * BS)
    worker2.load(sched2.build_connector_meta([("q", [3, 4, 5, 6, 7, 8], 5 * BS)], [], {"q": 3}).loads)
    for e, c in zip(expect, caches2):
        assert torch.equal(c[3], e)
    worker2.close()


def test_a_preempted_request_resumes_from_the_store_into_its_new_blocks(tmp_path):
    """Preempted after its first 40 tokens (blocks 0-1 saved), a request comes back with other block ids: vLLM asks
    again, the store holds 2 blocks, they load into the new ids, and the blocks it computes next are read from the
    new ids, not the freed ones."""
    sched, worker, caches = _engine(tmp_path, caches=_caches(seed=6))
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 0
    sched.update_state_after_alloc("r", [0, 1, 2], 0)
    step = sched.build_connector_meta([("r", [0, 1, 2], 0)], [], {"r": 40})
    assert [t.block_ids for t in step.saves] == [(0, 1)]
    worker.save(step.saves)
    # preempted: vLLM frees blocks 0-2; on resume it asks again from 0 computed tokens
    assert sched.get_num_new_matched_tokens("r", PROMPT, 0) == 2 * BS
    new_ids = [9, 10, 11, 4, 5, 6]
    sched.update_state_after_alloc("r", new_ids, 2 * BS)
    step = sched.build_connector_meta([], [("r", new_ids, True, 2 * BS)], {"r": len(PROMPT) - 2 * BS})
    assert [(t.block_ids, t.first_index) for t in step.loads] == [((9, 10), 0)]
    assert [(t.block_ids, t.first_index) for t in step.saves] == [((11, 4, 5), 2)]
    worker.close()


# -- vLLM stays optional -----------------------------------------------------------------------------

def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_kvpage_never_imports_vllm():
    """``import kvpage``, ``kvpage.integrations`` and ``kvpage.integrations.vllm`` (and its vLLM-free parts) import
    no vLLM (checked with vLLM made unimportable, so the test means the same with or without it installed)."""
    r = _run("import sys; sys.modules['vllm'] = None\n"
             "import kvpage, kvpage.integrations, kvpage.integrations.vllm as v\n"
             "import kvpage.integrations.vllm.scheduler, kvpage.integrations.vllm.worker\n"
             "assert v.CONNECTOR_NAME == 'KVPageConnector' and v.MODULE_PATH == 'kvpage.integrations.vllm'\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' and sys.modules[m] is not None))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_connector_without_vllm_says_how_to_install():
    """Asking for the connector class where vLLM is missing raises ImportError naming the install command."""
    r = _run("import sys; sys.modules['vllm'] = None\n"
             "import kvpage.integrations.vllm as v\n"
             "try:\n    v.KVPageConnector\nexcept ImportError as e:\n    print('ERR', e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "pip install --no-deps" in r.stdout and "vLLM" in r.stdout, r.stdout
