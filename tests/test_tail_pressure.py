"""Running out of tail slots preempts or defers like running out of blocks; it never fails a forward pass (issue 13.5).

Quantize-on-seal formats (``int4``, ``int2``) keep each running request's open block and window
copies in a pool of 16-bit tail slots sized ``max_num_seqs * (1 + window)``. A chunked prefill that
continues a partial block and ends mid-block needs two slots in one step (the block it seals, whose
earlier tokens every layer's seal gather reads, and its new open block), so with every sequence slot
running the tail was one short and the plan raised ``OutOfBlocksError: tail pool is full``; the
scheduler now counts each chunk's tail slots (:meth:`TailTable.slots_to_take`) against what the
next plan can take (:meth:`TailTable.num_takeable`) and cuts the chunk back to a block boundary,
preempts, or lets a waiting request wait.
"""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from _engine_kv import tail_tables
from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.tail import TailTable
from kvpage.engine.scheduler import SchedulerConfig
from kvpage.errors import OutOfBlocksError


def _record(llm: LLM) -> tuple[dict[str, dict[int, torch.Tensor]], list[BaseException]]:
    """Wrap the runner: per request, the logits row of every step (keyed by the context length after it),
    and every exception a forward pass raised (fault isolation would otherwise re-run and hide it)."""
    rows: dict[str, dict[int, torch.Tensor]] = {}
    failures: list[BaseException] = []
    execute = llm.engine.runner.execute

    def recorded(batch: Any, **kw: Any) -> torch.Tensor:
        try:
            out = execute(batch, **kw)
        except Exception as exc:
            failures.append(exc)
            raise
        for r, row in zip(batch, out):
            rows.setdefault(r.request_id, {})[r.num_computed + len(r.token_ids)] = row.clone()
        return out

    setattr(llm.engine.runner, "execute", recorded)  # noqa: B010 (an instance attribute shadows the method)
    return rows, failures


def _tables(llm: LLM) -> list[TailTable]:
    return tail_tables(llm)


def _agree_up_to_near_ties(tokens: list[int], ref_tokens: list[int], ref_rows: dict[int, torch.Tensor],
                           prompt_len: int, tol: float) -> None:
    """Greedy tokens equal, except that they may part at a position whose reference top-2 margin is below ``tol``."""
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            top2 = ref_rows[prompt_len + i].topk(2).values
            assert float(top2[0] - top2[1]) < tol, f"token {i} differs ({a} vs {b}) at a clear margin"
            return
    assert len(tokens) == len(ref_tokens)


@pytest.mark.parametrize("fmt", ["int4", "int2"])
@pytest.mark.parametrize(("max_num_seqs", "max_num_batched_tokens", "num_prompts", "tight_blocks"),
                         [(4, 100, 4, 48), (8, 512, 8, 64)])
def test_issue_repro_completes_like_a_run_with_ample_tail(fmt: str, max_num_seqs: int, max_num_batched_tokens: int,
                                                          num_prompts: int, tight_blocks: int) -> None:
    """Prompts of 70 tokens with every sequence slot running: no forward pass fails, nobody ends in "error",
    and the outputs are those of an engine whose tail has 64 requests' worth of slots (same batching limits).

    Exact equality of greedy tokens holds here because the tail moves a chunk's end back only to the
    block boundary before it, where the same blocks are sealed when each token reads them; the logits
    still differ by float rounding of other batch shapes, so they are compared within 1e-4 and tokens
    may part only at a near-tie.
    """
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(70)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = []
    for ample in (False, True):
        llm = LLM(tiny_loaded(0), kv_cache_dtype=fmt, max_num_seqs=max_num_seqs, num_blocks=512 if ample else tight_blocks, max_model_len=128,
                  max_num_batched_tokens=max_num_batched_tokens, progress=False)
        rows, failures = _record(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append((llm, outs, rows, failures))
    (tight, outs, rows, failures), (_, ref_outs, ref_rows, ref_failures) = runs
    assert failures == [] and ref_failures == []
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * num_prompts
    assert all(t.side is not None for t in _tables(tight))
    st = tight.engine.kv.stats()
    assert st.num_free + st.num_evictable + st.num_in_use + st.num_side == tight_blocks
    for out, ref in zip(outs, ref_outs):
        mine, theirs = rows[out.request_id], ref_rows[ref.request_id]
        common = sorted(set(mine) & set(theirs))
        assert len(common) >= 16
        assert max(float((mine[k] - theirs[k]).abs().max()) for k in common) <= 1e-4
        _agree_up_to_near_ties(out.outputs[0].token_ids, ref.outputs[0].token_ids, theirs, 70, 1e-4)
    for t in _tables(tight):
        assert (t.num_used, t.num_free) == (0, t.num_slots)


def test_randomized_schedules_never_fail_and_give_every_tail_slot_back() -> None:
    """Seeded random engines and workloads: int4/int2, block sizes, windows, max_num_seqs, token budgets,
    prompt lengths (shared prefixes for prefix hits), chunked prefill on and off, small pools (block
    preemption): every request finishes by "length" or "stop", no forward pass raises, and at the end
    every 16-bit tail slot is free again."""
    rng = random.Random(13)
    loaded = tiny_loaded(0)
    for trial in range(120):
        fmt = rng.choice(["int4", "int2"])
        bs = rng.choice([8, 16, 32])
        seqs = rng.randint(1, 6)
        budget = rng.randint(bs // 2, 3 * bs)
        chunked = rng.random() < 0.85
        cfg: dict[str, Any] = dict(kv_cache_dtype=fmt, block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                   enable_chunked_prefill=chunked, kv_quant_residual_tokens=rng.choice([0, 0, bs, 2 * bs]),
                                   max_model_len=192, progress=False,
                                   # tight pools preempt for blocks too
                                   num_blocks=rng.randint(192 // bs + 1, 3 * 192 // bs) if rng.random() < 0.5 else 64)
        llm = LLM(loaded, **cfg)
        _, failures = _record(llm)
        shared = [rng.randrange(256) for _ in range(rng.randint(0, 40))]
        prompts = []
        for _ in range(rng.randint(seqs, seqs + 6)):
            own = [rng.randrange(256) for _ in range(rng.randint(1, 100))]
            prompts.append((shared if rng.random() < 0.5 else []) + own)
        params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        where = f"trial {trial}: {cfg}"
        assert failures == [], where
        assert {o.outputs[0].finish_reason for o in outs} <= {"length", "stop"}, where
        for t in _tables(llm):
            assert (t.num_used, t.num_free) == (0, t.num_slots), where


# -- the tail table's own accounting --------------------------------------------------------------


def test_slots_to_take_is_what_the_plan_takes_and_a_request_peaks_at_window_plus_two() -> None:
    """Random chunkings of one request (generated tokens after a random prompt): before each plan,
    ``slots_to_take`` equals the growth of used slots the plan makes (0 when it frees more than it takes),
    and no plan holds more than
    ``1 + window + 1`` slots (open block, window, the sealed block the seal gather still reads)."""
    rng = random.Random(5)
    for _ in range(200):
        bs, w = rng.choice([2, 4]), rng.randint(0, 3)
        t = TailTable(block_size=bs, num_slots=w + 2, num_sink_slots=1, window_blocks=w)
        table = list(range(64))
        plen, done = rng.randint(0, 40), 0
        while done < 60:
            n = rng.randint(1, 12)
            before = t.num_used
            need = t.slots_to_take(table, done, n, plen, "r")
            assert need <= t.num_takeable(lambda b: True, lambda b: True)
            t.plan([table], [done + n], [n], owners=["r"], prompt_lens=[plen])
            assert need == max(0, t.num_used - before) and t.num_used <= w + 2
            t.finish()
            done += n
        t.release(table)
        assert (t.num_used, t.num_free) == (0, w + 2)


def test_a_recomputed_chunk_frees_its_old_window_before_taking_new_copies() -> None:
    """A second chunk of recomputed generated tokens pushes the first chunk's window copies out: they go
    before its new copies take slots (they were freed only after the step, so the plan raised
    "tail pool is full" with 1 + window + 1 slots)."""
    t = TailTable(block_size=2, num_slots=4, num_sink_slots=0, window_blocks=2)
    t.plan([list(range(8))], [7], [7])            # blocks 0..2 sealed (1, 2 keep copies), 3 open
    t.finish()
    assert t.num_used == 3
    t.plan([list(range(8))], [15], [8])           # 3 sealed from its slot, window 5, 6, 7 open
    assert t.num_used == 4 and t.slot_of(1) is None and t.slot_of(2) is None
    t.finish()
    assert [b for b in range(8) if t.slot_of(b) is not None] == [5, 6, 7]


def test_freed_requests_give_their_slots_back_at_once_and_takeable_counts_only_unreferenced_blocks() -> None:
    t = TailTable(block_size=4, num_slots=3, num_sink_slots=0, window_blocks=1)
    t.plan([[0, 1], [2]], [6, 2], [6, 2], owners=["a", "b"])  # a: window copy of 0, open 1; b: open 2
    t.finish()
    assert (t.num_used, t.num_free) == (3, 0)
    in_use = {0, 1, 2}
    assert t.num_takeable(lambda b: b in in_use, lambda b: True) == 0
    in_use -= {0, 1}                              # a finished, its blocks cached (live, unreferenced)
    assert t.num_takeable(lambda b: b in in_use, lambda b: True) == 1   # the window copy; the open slot is not
    assert t.num_takeable(lambda b: b in in_use, lambda b: b in {2}) == 2  # dead: both
    t.release([0, 1])
    assert (t.num_used, t.num_free) == (1, 2)
    with pytest.raises(OutOfBlocksError, match="tail pool is full"):
        t.plan([[2], [3], [4], [5]], [3, 1, 1, 1], [1, 1, 1, 1])  # four open blocks, three slots: the plan's own guard
