"""Speculative decoding through the engine: each method's greedy output, KV rollback, lookahead, cases C19 and C25.

Tiny random Llamas (``tests/_tiny.py``) with the byte tokenizer; the draft model is another tiny Llama of the
same vocabulary (one with another KV shape, so the draft group's layout is its own). Greedy outputs are compared
with non-speculative greedy token by token up to the first difference, which must fall on a near-tie of the
target (top-1/top-2 logit margin <= 1e-3): verification runs rows in other batches than decoding does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from _engine_kv import tail_tables
from _tiny import ByteTokenizer, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.prefix_cache import BlockStored
from kvpage.engine.config import EngineConfig
from kvpage.engine.scheduler import ScheduledRequestChunk
from kvpage.engine.speculative.config import SpeculativeConfig
from kvpage.engine.speculative.model_drafter import DraftModelDrafter
from kvpage.engine.speculative.proposer import Drafter, Proposal
from kvpage.model.config import ModelConfig
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import LoadedModel

BS = 16
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(n: int = 4, base: int = 37) -> list[dict[str, Any]]:
    # repetitive prompts: prompt lookup finds matches, and random models tend to loop
    out = []
    for i in range(n):
        unit = [(base * i + 5 * j) % 250 + 1 for j in range(7 + i)]
        out.append({"prompt_token_ids": (unit * 6)[: 30 + 9 * i]})
    return out


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_loaded(0, layers=4)


@pytest.fixture(scope="module")
def draft() -> LoadedModel:
    """A draft of the same vocabulary with another KV shape (1 KV head of 32) than the target (2 of 16)."""
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=257, eos_token_id=256)
    hf = HFLlama(cfg).eval()
    config = ModelConfig.from_hf(cfg)
    model = LlamaForCausalLM(config)
    model.load_hf_state_dict({k: v.detach().clone() for k, v in hf.state_dict().items()})
    return LoadedModel(config=config, model=model.eval(), tokenizer=ByteTokenizer(), path=Path("/tiny-draft"))


def _methods(draft: LoadedModel) -> dict[str, dict[str, Any]]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2},
    }


def _llm(loaded: LoadedModel, spec: dict[str, Any] | None = None, **kw: Any) -> LLM:
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", BS)
    return LLM(loaded, speculative_config=spec, progress=False, **kw)


def _margins(llm: LLM, tokens: list[int]) -> list[float]:
    """Top-1 minus top-2 target logit at each position of ``tokens`` (teacher-forced, float32 cache)."""
    with llm.open_sequence() as seq:
        logits = seq.feed(tokens, all_logits=True)                                 # [T, vocab]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _agree_up_to_ties(plain: list[int], spec: list[int], prompt: list[int], ref: LLM) -> None:
    """``spec`` equals ``plain`` until their first difference, and that difference is a near-tie of the target."""
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            margin = _margins(ref, prompt + plain[:i])[-1]
            assert margin <= 1e-3, f"token {i} differs ({a} vs {b}) where the target's margin is {margin:.3g}"
            return
    assert len(plain) == len(spec)


def _pool_idle(llm: LLM) -> None:
    st = llm.kv_cache_stats()
    assert st.num_in_use == 0 and not llm.engine.has_unfinished_requests()
    assert st.num_free + st.num_evictable + st.num_in_use + st.num_side == llm.num_blocks
    for table in tail_tables(llm):  # the scheduler-side tail bookkeeping of each group with a tail pool
        assert table.num_used == 0


def _record_stored(llm: LLM) -> list[BlockStored]:
    seen: list[BlockStored] = []
    llm.engine.kv.subscribe(lambda e: seen.append(e) if isinstance(e, BlockStored) else None)
    return seen


def _only_verified(stored: list[BlockStored], sequences: list[list[int]], bs: int = BS) -> None:
    """Every indexed block's tokens are a block-aligned slice of some final sequence (prompt + output)."""
    chunks = {tuple(s[i:i + bs]) for s in sequences for i in range(0, len(s) - bs + 1, bs)}
    bad = [e.token_ids for e in stored if tuple(e.token_ids) not in chunks]
    assert not bad, f"{len(bad)} indexed blocks hold tokens of no final sequence (drafts or rejected tokens)"


# -- configuration ----------------------------------------------------------------------------


def test_config_is_checked_and_names_the_field() -> None:
    sc = SpeculativeConfig.coerce('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.coerce({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}
                                    ).prompt_lookup_min == 1
    for bad, field in [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
         "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 0}, "num_layers"),
        ({"method": "ngram", "num_speculative_tokens": 2, "colour": 1}, "colour"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.coerce(bad)
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.coerce("{method: ngram}")
    with pytest.raises(ValueError, match="draft_kv_cache_dtype"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
                                         "draft_kv_cache_dtype": "int4"})
    with pytest.raises(ValueError, match=r"speculative_config\.draft_kv_cache_dtype.*bogus"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
                                         "draft_kv_cache_dtype": "bogus"})
    with pytest.raises(ValueError, match=r"speculative_config\.model='/nonexistent/x\.gguf': no such file"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                         "model": "/nonexistent/x.gguf"})


def test_layer_skip_needs_fewer_layers_than_the_target(target: LoadedModel) -> None:
    with pytest.raises(ValueError, match="num_layers"):
        _llm(target, {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 4})


def test_draft_model_of_another_vocabulary_is_refused(target: LoadedModel) -> None:
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    config = ModelConfig.from_hf(cfg)
    model = LlamaForCausalLM(config)
    model.load_hf_state_dict({k: v.detach().clone() for k, v in HFLlama(cfg).state_dict().items()})
    other = LoadedModel(config=config, model=model.eval(), tokenizer=ByteTokenizer(), path=Path("/other-vocab"))
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(target, {"method": "draft_model", "num_speculative_tokens": 2, "model": other})


def test_draft_group_has_its_own_layout_c04(target: LoadedModel, draft: LoadedModel) -> None:
    """C04/C06: float32 draft layers beside int8 main layers, in the draft model's own KV shape; the budget
    pays each group by its own bytes per block."""
    llm = _llm(target, {"method": "draft_model", "num_speculative_tokens": 2, "model": draft,
                        "draft_kv_cache_dtype": "float32"}, kv_cache_dtype="int8")
    main, dg = llm.spec.main, llm.spec.draft
    assert dg is not None and (dg.first_layer, dg.num_layers) == (4, 2)
    assert main.layer.format.name == "int8" and dg.layer.format.name == "float32"
    assert (dg.layer.kv_heads, dg.layer.head_dim) == (1, 32) and (main.layer.kv_heads, main.layer.head_dim) == (2, 16)
    for i in dg.layer_indices:
        assert llm.kv_caches[i]["key"].dtype == torch.float32
        assert llm.kv_caches[i]["key"].shape[0] == llm.num_blocks
    assert llm.kv_caches[0]["key"].dtype == torch.uint8
    # C06: the budget pays both groups by their bytes per block
    assert llm.capacity.pool_bytes == llm.num_blocks * (main.bytes_per_block + dg.bytes_per_block)
    # the model-dtype reference holds the draft layers too (float32 here), and the CLI's formula names both groups
    assert llm.capacity.reference_bytes_per_block == BS * (4 * 2 * 2 * 16 * 4 + 2 * 2 * 1 * 32 * 4)
    from kvpage.cli.generate import capacity_lines
    line = capacity_lines(llm)[0]
    assert line.split(" = ", 1)[1].startswith("4 layers x 2 x 2 kv heads x 16 x 1.125 bytes + 2 draft layers x 2 x 1 kv "
                                             "heads x 32 x 4 bytes;")  # 288 + 512 = 800 bytes/token
    assert "800 bytes/token" in line


# -- greedy equals non-speculative greedy (up to near-ties) ------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model", "layer_skip"])
def test_greedy_matches_plain_greedy(target: LoadedModel, draft: LoadedModel, method: str) -> None:
    prompts = _prompts()
    ref = _llm(target, kv_cache_dtype="float32")
    plain = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = _llm(target, _methods(draft)[method], kv_cache_dtype="float32")
    stored = _record_stored(llm)
    outs = llm.generate(prompts, GREEDY)
    for p, a, o in zip(prompts, plain, outs):
        _agree_up_to_ties(a, o.outputs[0].token_ids, p["prompt_token_ids"], ref)
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > 0
    assert st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    _pool_idle(llm)
    _only_verified(stored, [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, outs)])


def test_ngram_accepts_on_a_copy_task(target: LoadedModel) -> None:
    """A random model that loops is copy-heavy: most n-gram drafts are accepted and steps are saved."""
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3})
    out = llm.generate(_prompts(1), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    st = llm.engine.stats().spec_decoding
    assert st is not None and len(out.outputs[0].token_ids) == 60
    assert st.num_accepted_tokens > 0 and st.acceptance_rate > 0.3, st


# -- rollback under formats, prefix caching, chunked prefill, preemption ------------------------


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_rollback_keeps_the_pool_exact(target: LoadedModel, fmt: str, method: str) -> None:
    """Quantized caches: speculation's outputs agree with plain decoding of the same format up to near-ties,
    blocks are all given back, and no block holds a rejected token in the index."""
    prompts = _prompts(4)
    kw: dict[str, Any] = {"kv_cache_dtype": fmt, "block_size": 32 if fmt == "int4" else BS, "num_blocks": 64}
    plain = _llm(target, **kw).generate(prompts, GREEDY)
    llm = _llm(target, {"method": method, "num_speculative_tokens": 5, **(
        {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"num_layers": 2})}, **kw)
    outs = llm.generate(prompts, GREEDY)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, outs))
    assert same >= 2, "speculation changed most greedy outputs of a quantized cache"
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > st.num_accepted_tokens > 0  # some drafts rejected
    _pool_idle(llm)


def test_int4_seal_boundary_inside_rejected_drafts(target: LoadedModel) -> None:
    """int4 with block 32: drafts that cross a block end and are rejected leave the block open (its 16-bit rows
    in the tail): the continuation reads the same as plain decoding (logits close), every slot comes back."""
    prompts = [{"prompt_token_ids": [(11 * j) % 250 + 1 for j in range(29)]}]  # ends 3 before a block end
    kw: dict[str, Any] = {"kv_cache_dtype": "int4", "block_size": 32, "num_blocks": 32}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = _llm(target, **kw).generate(prompts, params)[0].outputs[0].token_ids
    # a drafter that always proposes 6 wrong tokens (all rejected) across the seal at position 32
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 1}, **kw)
    class Wrong(Drafter):
        def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
            return [Proposal(tuple([259] * c.num_lookahead)) if c.num_lookahead else Proposal() for c in chunks]

    llm.engine.drafter = Wrong()
    out = llm.generate(prompts, params)[0].outputs[0].token_ids
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > 0
    assert out == plain or _first_diff_is_tie(target, prompts[0]["prompt_token_ids"], plain, out)
    _pool_idle(llm)


def _first_diff_is_tie(target: LoadedModel, prompt: list[int], a: list[int], b: list[int]) -> bool:
    ref = _llm(target, kv_cache_dtype="float32")
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return _margins(ref, prompt + a[:i])[-1] <= 0.05  # int4: its own rounding, looser


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_rollback_with_chunked_prefill_prefix_caching_and_preemption(target: LoadedModel, fmt: str) -> None:
    """A pool too small for every request at once: preemption happens while speculating (asserted), chunked
    prefill splits the prompts, prefix caching is on; outputs agree (float32: up to near-ties; quantized: most
    answers equal to plain decoding of the same format), the pool ends idle and exact."""
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    bs = 32 if fmt == "int4" else BS
    kw: dict[str, Any] = {"kv_cache_dtype": fmt, "block_size": bs, "num_blocks": 14 * BS // bs + 2,
                          "max_num_batched_tokens": 24, "enable_chunked_prefill": True}
    ref = _llm(target, kv_cache_dtype="float32")
    plain = [o.outputs[0].token_ids for o in (ref if fmt == "float32" else _llm(target, **{
        **kw, "num_blocks": 96})).generate(prompts, params)]
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3}, **kw)
    stored = _record_stored(llm)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    if fmt == "float32":
        for p, a, o in zip(prompts, plain, outs):
            _agree_up_to_ties(a, o.outputs[0].token_ids, p["prompt_token_ids"], ref)
    else:
        assert sum(a == o.outputs[0].token_ids for a, o in zip(plain, outs)) >= 3
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > st.num_accepted_tokens > 0
    _pool_idle(llm)
    assert stored
    _only_verified(stored, [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, outs)], bs)


def test_lookahead_is_dropped_before_anyone_is_preempted(target: LoadedModel) -> None:
    """With room for the tokens but not the lookahead, a request decodes without drafts instead of preempting."""
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3}, num_blocks=4, kv_cache_dtype="float32")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7] * 5}], SamplingParams(max_tokens=48, temperature=0.0,
                                                                              ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 48 and llm.engine.stats().num_preemptions == 0
    _pool_idle(llm)


# -- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model", "layer_skip"])
def test_seeded_sampling_is_reproducible(target: LoadedModel, draft: LoadedModel, method: str) -> None:
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in range(3)]
    runs = []
    for _ in range(2):
        llm = _llm(target, _methods(draft)[method], kv_cache_dtype="float32")
        runs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(3), params)])
        _pool_idle(llm)
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1


# -- C19 and C25 ---------------------------------------------------------------------------------


def _nan_pool(llm: LLM) -> None:
    for layer in llm.kv_caches.values():
        for t in layer.values():
            if t.is_floating_point():
                t.fill_(math.nan)


def test_c19_draft_layers_of_cached_prefixes_were_written(target: LoadedModel, draft: LoadedModel) -> None:
    """C19: request 2 hits request 1's 64 cached tokens; every draft-layer slot attention reads was written:
    the pool starts as NaN and no NaN reaches any logits, target's or draft's."""
    llm = _llm(target, {"method": "draft_model", "num_speculative_tokens": 3, "model": draft,
                        "draft_kv_cache_dtype": "bfloat16"}, kv_cache_dtype="float32")
    _nan_pool(llm)
    checked = {"target": 0, "draft": 0}

    def finite(name: str, runner: Any) -> None:
        inner = runner.execute

        def run(batch: Any, **kw: Any) -> torch.Tensor:
            out = inner(batch, **kw)
            assert torch.isfinite(out).all(), f"NaN reached the {name}'s logits"
            checked[name] += 1
            return out

        runner.execute = run

    finite("target", llm.engine.runner)
    drafter = llm.engine.drafter
    assert drafter is not None
    assert isinstance(drafter, DraftModelDrafter)
    finite("draft", drafter.runner)
    shared = [(13 * j) % 250 + 1 for j in range(64)]
    first = llm.generate([{"prompt_token_ids": shared + [3, 4, 5]}], GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": shared + [9, 8]}], GREEDY)[0]
    assert second.metrics.cached_tokens == 64 and first.metrics.cached_tokens == 0
    assert checked["target"] and checked["draft"]
    _pool_idle(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "layer_skip"])
def test_c25_speculation_keeps_the_prefix_hit_rate(target: LoadedModel, draft: LoadedModel, method: str) -> None:
    """C25: a shared-prefix workload hits as many prompt blocks with speculation as without, and no draft or
    rejected token is ever in the index."""
    system = [(17 * j) % 250 + 1 for j in range(48)]
    prompts = [{"prompt_token_ids": system + [(5 * i + j) % 250 + 1 for j in range(10 + i)]} for i in range(5)]

    def run(spec: dict[str, Any] | None) -> tuple[list[int], Any, list[list[int]]]:
        llm = _llm(target, spec, kv_cache_dtype="float32")
        stored = _record_stored(llm)
        cached, seqs = [], []
        for p in prompts:  # one after the other: each finds the earlier ones' blocks
            o = llm.generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
            cached.append(o.metrics.cached_tokens)
            seqs.append(p["prompt_token_ids"] + o.outputs[0].token_ids)
        _pool_idle(llm)
        return cached, stored, seqs

    base, _, _ = run(None)
    cached, stored, seqs = run(_methods(draft)[method])
    assert cached == base and sum(base) >= 4 * 48
    _only_verified(stored, seqs)


def test_stream_deltas_carry_every_emitted_token(target: LoadedModel) -> None:
    """Regression: a step emits a delta for every request that got tokens (several at once when drafts are
    accepted), and the deltas add up to the final output."""
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3}, kv_cache_dtype="float32")
    tokens: dict[str, list[int]] = {}
    finals = {}
    sizes = []
    for out in llm.generate_stream(_prompts(3), GREEDY):
        delta = out.outputs[0].delta_token_ids
        sizes.append(len(delta))
        tokens.setdefault(out.request_id, []).extend(delta)
        if out.finished:
            finals[out.request_id] = out.outputs[0].token_ids
    assert len(finals) == 3 and all(tokens[r] == t and len(t) == 40 for r, t in finals.items())
    assert max(sizes) > 1 and len(sizes) > 3 * 5  # several tokens in some steps, many steps in all


def test_server_streams_and_exports_speculation(target: LoadedModel) -> None:
    """``kvpage serve --speculative-config``'s path: a streamed completion equals the non-streamed one, and
    ``/metrics`` mirrors the engine's speculative counters."""
    import httpx
    from openai import OpenAI

    from kvpage.server.app import ServerThread, build_app
    from test_server import metric, wait_idle

    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3}, kv_cache_dtype="float32")
    app = build_app(llm, "tiny")
    prompt = "abcabcabcabcabcabc"
    with ServerThread(app) as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True})
        parts = [c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True})]
        assert "".join(parts) == full.choices[0].text and full.usage.completion_tokens == 30
        samples = wait_idle(srv.url)
        st = llm.engine.stats().spec_decoding
        assert st is not None and st.num_draft_tokens > 0
        assert metric(samples, "kvpage:spec_decode_num_draft_tokens_total") == st.num_draft_tokens
        assert metric(samples, "kvpage:spec_decode_num_accepted_tokens_total") == st.num_accepted_tokens
        assert metric(samples, "kvpage:generation_tokens_total") == 60
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_c19_draft_layers_of_prefixes_loaded_from_the_host_tier(target: LoadedModel, draft: LoadedModel) -> None:
    """C19 through a tier: the 64 cached tokens come back from the host tier (device copies evicted) with their
    draft layers; on a NaN-filled pool no NaN reaches the draft's logits."""
    llm = _llm(target, {"method": "draft_model", "num_speculative_tokens": 3, "model": draft},
               kv_cache_dtype="float32", swap_space=0.01)
    _nan_pool(llm)
    drafter = llm.engine.drafter
    assert isinstance(drafter, DraftModelDrafter)
    inner = drafter.runner.execute
    finite: list[bool] = []

    def run(batch: Any, **kw: Any) -> torch.Tensor:
        out = inner(batch, **kw)
        finite.append(bool(torch.isfinite(out).all()))
        return out

    setattr(drafter.runner, "execute", run)
    shared = [(13 * j) % 250 + 1 for j in range(64)]
    llm.generate([{"prompt_token_ids": shared + [3, 4, 5]}], GREEDY)
    assert llm.reset_prefix_cache() > 0
    out = llm.generate([{"prompt_token_ids": shared + [9, 8]}], GREEDY)[0]
    assert out.metrics.cached_tokens == 64
    tiers = llm.kv_cache_stats().tier_hits
    assert tiers.get("host", 0) >= 4, tiers
    assert finite and all(finite)
    _pool_idle(llm)


def test_a_stop_inside_accepted_drafts_ends_the_output_and_counts_them_accepted(target: LoadedModel) -> None:
    """An oracle drafter proposes the plain greedy continuation; a stop token among the drafts ends the output
    there (nothing after it is appended or indexed) while the metrics count the drafts verification accepted."""
    prompt = _prompts(1)[0]
    plain = _llm(target, kv_cache_dtype="float32").generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop = next(i for i in range(3, len(plain)) if plain[i] not in plain[:i])
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                        "prompt_lookup_max": 1}, kv_cache_dtype="float32")
    n_prompt = len(prompt["prompt_token_ids"])

    class Oracle(Drafter):
        def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
            out = []
            for c in chunks:
                j = c.request.num_tokens - n_prompt
                out.append(Proposal(tuple(plain[j:j + c.num_lookahead])) if c.num_lookahead else Proposal())
            return out

    llm.engine.drafter = Oracle()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[plain[stop]])
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == plain[: stop + 1] and out.finish_reason == "stop"
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_drafts >= 1
    assert st.num_accepted_tokens == st.num_draft_tokens  # the oracle is always right
    assert st.num_emitted_tokens == len(out.token_ids) - 1 < st.num_accepted_tokens + st.num_drafts
    _pool_idle(llm)
