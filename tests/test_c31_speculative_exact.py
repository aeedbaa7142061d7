"""Case C31: speculative decoding is exact -- verification reads, at every position, what plain decoding reads there.

A test drafter (:class:`PlainGreedyDrafter`, put in place of the engine's drafter) proposes the plain-greedy
continuation, computed first by a run without speculation in the same format. Every draft is then correct, so
for every KV format and draft length ``k`` every draft must be accepted and the output must be plain greedy's,
token for token: a verification pass that reads another 16-bit / quantized mix than decoding (issue 29 item 4:
the quantize-on-seal formats' full-precision window followed the pass's last query, so its earlier queries read
blocks quantized that decoding reads from their 16-bit copy) rejects correct drafts and changes the output.
The real methods (``ngram``, ``draft_model``, ``layer_skip``) must give plain greedy's output too. Below the
engine, one quantize-on-seal layer fed the same K/V by verification passes and by decoding must give every position
the same attention output (float rounding apart), which also holds where a model's greedy tokens would not show it.

Tiny random Llamas with the byte tokenizer (:mod:`_tiny`); outputs of 120 tokens cross several blocks, seals and
window moves; the quantize-on-seal formats run at their defaults (block 32; ``int2``'s window of 32 tokens is the
issue's case) and with block 16 and residual windows of 0 and 16 tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.controller import CacheController
from kvpage.cache.groups import manager_for
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest
from kvpage.cache.step_plan import PassRequest
from kvpage.cache.tail.pool import TailPool
from kvpage.engine.group_attention import GroupAttention, group_attention_for
from kvpage.engine.scheduler import ScheduledRequestChunk
from kvpage.engine.speculative.config import METHODS
from kvpage.engine.speculative.proposer import Drafter, Proposal
from kvpage.formats import BlockFormat, available_formats, get_format
from kvpage.model.loader import LoadedModel
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends import AttentionBackend, ReferenceBackend
from kvpage.ops.backends.cpu import cpu_backend
from kvpage.scales import StaticScales
from kvpage.spec import CacheSizing, CacheSpec

LAYERS = 4
MAX_TOKENS = 120
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# two prompts that end at different offsets in a block, so drafts cross block ends at different phases
PROMPTS = [[(37 * i + 5 * j) % 250 + 1 for j in range(21 + 10 * i)] for i in range(2)]
FORMATS = [f for f in available_formats() if f != "auto"]
SEALED = [f for f in FORMATS if isinstance(get_format(f), BlockFormat)]


def _cases() -> list[Any]:
    """(format, engine keywords) of every format; the quantize-on-seal ones with several residual windows."""
    out = []
    for f in FORMATS:
        if f not in SEALED:
            out.append(pytest.param(f, {}, id=f))
            continue
        out.append(pytest.param(f, {}, id=f"{f}-default"))  # block 32, the format's window (int4 0, int2 32)
        for r in (0, 16):
            out.append(pytest.param(f, {"block_size": 16, "kv_quant_residual_tokens": r}, id=f"{f}-bs16-r{r}"))
    return out


class PlainGreedyDrafter(Drafter):
    """Proposes the next ``num_lookahead`` tokens of each request's plain-greedy sequence (always correct).

    Args:
        plain: prompt token ids -> the plain-greedy sequence (prompt + output) of that prompt.
    """

    def __init__(self, plain: dict[tuple[int, ...], list[int]]) -> None:
        self.plain = plain

    def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
        """The plain continuation after each speculating request's tokens (deterministic drafts)."""
        out = []
        for c in chunks:
            if not c.num_lookahead:
                out.append(Proposal())
                continue
            have = c.request.all_token_ids
            full = self.plain[tuple(c.request.prompt_token_ids)]
            out.append(Proposal(tuple(full[len(have):len(have) + c.num_lookahead])))
        return out


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0, layers=LAYERS)


@pytest.fixture(scope="module")
def draft() -> LoadedModel:
    return tiny_loaded(1, layers=1)


def _kw(fmt: str, extra: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"kv_cache_dtype": fmt, "num_blocks": 128, "progress": False, **extra}
    if fmt in ("int8_static", "fp8_static"):
        kw["kv_cache_scales"] = StaticScales.uniform(LAYERS, 0.05, 0.05)
    return kw


_PLAIN: dict[tuple[str, str], list[list[int]]] = {}


def _plain(target: LoadedModel, fmt: str, extra: dict[str, Any]) -> list[list[int]]:
    """Plain greedy outputs of :data:`PROMPTS` in this format (computed once per format and settings)."""
    key = (fmt, repr(sorted(extra.items())))
    if key not in _PLAIN:
        outs = LLM(target, **_kw(fmt, extra)).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        _PLAIN[key] = [o.outputs[0].token_ids for o in outs]
    return _PLAIN[key]


def _speculate(target: LoadedModel, fmt: str, extra: dict[str, Any], spec: dict[str, Any],
               drafter: Drafter | None = None) -> tuple[list[list[int]], Any]:
    llm = LLM(target, speculative_config=spec, **_kw(fmt, extra))
    if drafter is not None:
        llm.engine.drafter = drafter
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    st = llm.engine.stats().spec_decoding
    assert st is not None
    return [o.outputs[0].token_ids for o in outs], st


def test_c31_cases_cover_every_format() -> None:
    assert len(FORMATS) >= 11 and {"float32", "bfloat16", "int8", "fp8", "int4", "int2"} <= set(FORMATS)
    assert set(SEALED) == {"int4", "int3", "int2", "int4_rotated", "int3_rotated", "int2_rotated"}
    assert set(METHODS) == {"ngram", "draft_model", "layer_skip"}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(("fmt", "extra"), _cases())
def test_c31_correct_drafts_are_all_accepted(target: LoadedModel, fmt: str, extra: dict[str, Any], k: int) -> None:
    plain = _plain(target, fmt, extra)
    full = {tuple(p): p + o for p, o in zip(PROMPTS, plain)}
    outs, st = _speculate(target, fmt, extra, {"method": "ngram", "num_speculative_tokens": k},
                          PlainGreedyDrafter(full))
    assert st.num_draft_tokens >= len(PROMPTS) * (MAX_TOKENS - 2 * k) * k // (k + 1)  # drafts ran all along
    assert (st.num_accepted_tokens, st.acceptance_rate) == (st.num_draft_tokens, 1.0), (
        f"{st.num_draft_tokens - st.num_accepted_tokens} of {st.num_draft_tokens} correct drafts rejected")
    for i, (a, b) in enumerate(zip(plain, outs)):
        diff = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"prompt {i}: speculative output differs from plain greedy at token {diff}"



@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_c31_sliding_window_layers_accept_every_correct_draft(fmt: str, k: int,
                                                              tmp_path_factory: pytest.TempPathFactory,
                                                              smollm2: Any) -> None:
    """A Gemma-3-style model (sliding-window layers of 32 tokens beside a full one; int4/int2 seal codes into window
    slots and keep a 16-token residual window): correct drafts are all accepted, the output is plain greedy's."""
    from test_sliding_window import _gemma_folder

    folder = _gemma_folder(tmp_path_factory.mktemp(f"c31_window_{fmt}"), smollm2.tokenizer, window=32, context=300)
    kw: dict[str, Any] = {"kv_cache_dtype": fmt, "num_blocks": 96, "block_size": 16, "progress": False}
    if fmt in SEALED:
        kw["kv_quant_residual_tokens"] = 16
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in LLM(str(folder), **kw).generate(prompts, GREEDY)]
    llm = LLM(str(folder), speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kw)
    llm.engine.drafter = PlainGreedyDrafter({tuple(p): p + o for p, o in zip(PROMPTS, plain)})
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > 0
    assert (st.num_accepted_tokens, st.acceptance_rate) == (st.num_draft_tokens, 1.0), (
        f"{st.num_draft_tokens - st.num_accepted_tokens} of {st.num_draft_tokens} correct drafts rejected")
    assert outs == plain

def _method(name: str, draft: LoadedModel) -> dict[str, Any]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft,
                        "draft_kv_cache_dtype": "int8"},  # (draft layers take token-wise formats only)
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2},
    }[name]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("fmt", "extra"), [
    pytest.param("int2", {}, id="int2-default"),
    pytest.param("int4", {"block_size": 16, "kv_quant_residual_tokens": 16}, id="int4-bs16-r16"),
])
def test_c31_every_method_gives_plain_greedy(target: LoadedModel, draft: LoadedModel, fmt: str,
                                             extra: dict[str, Any], method: str) -> None:
    plain = _plain(target, fmt, extra)
    outs, st = _speculate(target, fmt, extra, _method(method, draft))
    assert st.num_draft_tokens > 0
    for i, (a, b) in enumerate(zip(plain, outs)):
        diff = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"prompt {i}: {method} output differs from plain greedy at token {diff}"


# -- one quantize-on-seal layer: verification passes vs decoding, position by position -------------------------


def _layer(fmt: str, bs: int, w: int, k: int, ops: AttentionBackend) -> tuple[KVCache, GroupAttention, dict[str, Any]]:
    """A KV cache with one quantize-on-seal layer group (window ``w`` blocks, lookahead ``k``) and its attention."""
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=16, block_size=bs, kv_cache_dtype=fmt)
    group = manager_for(spec.main, CacheSizing(max_num_seqs=1, residual_tokens=w * bs, max_model_len=64,
                                               num_lookahead_tokens=k))
    m = KVCache(64, bs, groups=[group])
    caches = CacheController(spec).initialize_kv_cache(64)
    tail = TailPool(spec, group.layout, torch.float32, layers=list(group.layers), caches=caches)
    return m, group_attention_for(spec, spec.main, caches, ops=ops, tail=tail), caches[0]


def _step(m: KVCache, attn: GroupAttention, req: KVRequest, pos: int, q: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, d: int, keep: int | None = None) -> torch.Tensor:
    """One step of ``len(q)`` tokens at ``pos``, the last ``d`` of them drafts: allocate, plan, attend, commit,
    keep the first ``keep`` tokens (default all; the rest are rejected and rolled back)."""
    n, bs = q.shape[0], m.block_size
    m.begin_step()
    if m.has_request(req.request_id):
        blocks = m.allocate(req, n - d, num_lookahead=d, num_computed=pos)
    else:
        blocks = m.allocate(req, n - d, m.match(req), num_lookahead=d)
    assert blocks is not None
    plan = m.plan_pass([PassRequest(req.request_id, pos, n, blocks.block_ids, req.num_prompt_tokens or 0, d)])
    meta = AttentionMetadata.build(block_tables=plan.block_tables, seq_lens=plan.seq_lens,
                                   query_lens=plan.query_lens, slot_mapping=plan.slot_mapping, block_size=bs)
    attn.prepare(plan, plan.group(attn.group.name), meta, torch.device("cpu"))
    try:
        out = attn.attend(0, q, k, v)
    finally:
        attn.finish()
    m.commit(plan)
    m.rollback(req, pos + (n if keep is None else keep))
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("accept", ["all", "some"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("w", [0, 1, 3])
@pytest.mark.parametrize("fmt", SEALED)
def test_c31_verification_reads_what_decoding_reads(fmt: str, w: int, k: int, accept: str, backend: str) -> None:
    """Block size 4, a prompt of 5, then 35 tokens decoded one by one -- or verified ``k + 1`` at a time, keeping
    all ``k`` drafts, or (``some``) the first ``0, 1, .., k`` correct ones in turn, the others wrong and rolled
    back: every kept position's attention output equals decoding's (atol 1e-5; a block read quantized instead of
    from its 16-bit copy, or a rejected draft's rows left in a seal, is off by the format's rounding or more),
    and so do the sealed pool bytes."""
    ops = ReferenceBackend() if backend == "reference" else cpu_backend()
    assert ops is not None, "kvpage's CPU kernels did not build"
    torch.manual_seed(0)
    total, plen, bs = 40, 5, 4
    q, kk, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    kk[:, :, 3] *= 20  # an outlier key channel: quantized blocks read far from their 16-bit copies
    wrong = torch.randn(k, 4, 16), 5 * torch.randn(k, 2, 16), torch.randn(k, 2, 16)  # rejected drafts' q, k, v
    runs = []
    for lookahead in (0, k):
        m, attn, cache = _layer(fmt, bs, w, k, ops)
        req = KVRequest("r", list(range(total)), num_prompt_tokens=plen)
        _step(m, attn, req, 0, q[:plen], kk[:plen], v[:plen], 0)
        outs, pos, step = {}, plen, 0
        while pos < total:
            n = min(lookahead + 1, total - pos)
            good = n if accept == "all" else 1 + min(step % (k + 1), n - 1)  # the last sampled token + drafts kept
            o = _step(m, attn, req, pos, *(torch.cat([x[pos:pos + good], bad[:n - good]])
                                            for x, bad in zip((q, kk, v), wrong)), n - 1, good)
            outs.update({pos + i: o[i] for i in range(good)})
            pos, step = pos + good, step + 1
        table = list(m.block_ids("r"))[: total // bs]
        runs.append((outs, {name: t[table].clone() for name, t in cache.items()}))
    (dec, dec_pool), (ver, ver_pool) = runs
    err = {p: (ver[p] - dec[p]).abs().max().item() for p in range(plen, total)}
    worst = max(err, key=err.__getitem__)
    assert err[worst] < 1e-5, f"position {worst} reads another mix than decoding (max abs difference {err[worst]:.3g})"
    for name in dec_pool:
        assert torch.equal(ver_pool[name].view(torch.uint8), dec_pool[name].view(torch.uint8)), name
