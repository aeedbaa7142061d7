"""Numbers of any integral/real type at the engine boundary, fields named in every TypeError, seeds whose every bit
counts, and ForcedSequence's context limit (issue 12 follow-ups).

* ``SamplingParams`` and the token-id checks take numpy/torch integer scalars (``operator.index``) and
  real numbers (``numbers.Real``), store plain ``int``/``float``, and still reject bools, strings and
  floats where an integer is due; an int too large for a float is a ``ValueError`` naming the field.
* A float tensor as a token id, ``LLM(model=5)`` and ``abort_request(["x"])`` name the field.
* torch's CPU generator uses only the low 32 bits of a seed; the engine derives the generator's seed
  so that 0, 2**32, 2**63 and -(2**63) give different samples.
* ``ForcedSequence.feed`` refuses to go past ``max_model_len`` and a non-bool ``all_logits``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _tiny import VOCAB, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.engine.sampling import generator_seed


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=16, num_blocks=48, max_model_len=64,
               progress=False)


# -- numpy scalars --------------------------------------------------------------------------------


def test_sampling_params_take_numpy_scalars_and_store_plain_numbers() -> None:
    p = SamplingParams(max_tokens=np.int64(5), top_k=np.int32(3), seed=np.int64(3), stop_token_ids=[np.int64(2)],
                       top_p=np.int64(1), temperature=np.float32(0.5))
    assert (p.max_tokens, p.top_k, p.seed, p.stop_token_ids, p.top_p, p.temperature) == (5, 3, 3, (2,), 1.0, 0.5)
    for value in (p.max_tokens, p.top_k, p.seed, *p.stop_token_ids):
        assert type(value) is int
    assert type(p.top_p) is float and type(p.temperature) is float
    assert SamplingParams(seed=np.uint64(2**64 - 1), max_tokens=torch.tensor(4)).seed == 2**64 - 1


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens="5"), dict(max_tokens=True), dict(max_tokens=5.0), dict(max_tokens=np.float64(5)),
    dict(top_k=np.float32(3)), dict(seed=1.0), dict(seed=np.bool_(True)), dict(stop_token_ids=[np.float64(2)]),
    dict(stop_token_ids=[torch.tensor(2.0)]), dict(temperature="1"), dict(temperature=True),
    dict(top_p=np.bool_(True)), dict(temperature=torch.tensor(0.5)),
])
def test_sampling_params_still_reject_strings_bools_and_floats_for_ints(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_an_int_too_large_for_a_float_is_a_value_error_naming_the_field(field) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: 10**400})


def test_float_tensor_token_id_names_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] must be an integer token id"):
        llm.generate({"prompt_token_ids": [torch.tensor(1.0)]}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] must be an integer token id"):
        llm.generate({"prompt_token_ids": [1, torch.tensor([1, 2])]}, SamplingParams(max_tokens=1))
    out = llm.generate({"prompt_token_ids": [torch.tensor(1), np.int16(2)]}, SamplingParams(max_tokens=1))
    assert out[0].prompt_token_ids == [1, 2]


# -- TypeErrors that name the field -------------------------------------------------------------------


@pytest.mark.parametrize("model", [5, b"/x.gguf", 1.5])
def test_llm_model_of_the_wrong_type_names_model(model) -> None:
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(model=model, progress=False)


def test_abort_request_of_the_wrong_type_names_request_id(llm: LLM) -> None:
    for rid in (["x"], 5, None):
        with pytest.raises(TypeError, match="request_id must be a str"):
            llm.engine.abort_request(rid)
    assert llm.engine.abort_request("no-such-request") is None


# -- seeds ----------------------------------------------------------------------------------------------


def test_torch_cpu_generator_uses_only_the_low_32_bits() -> None:
    """Why :func:`generator_seed` exists (if torch ever changes this, the mix is still correct, just needless)."""
    a = torch.rand(4, generator=torch.Generator().manual_seed(0))
    b = torch.rand(4, generator=torch.Generator().manual_seed(2**32))
    assert torch.equal(a, b)


SEEDS = [0, 2**32, 2**63, -(2**63), -1, 2**64 - 1, 1]


def test_generator_seed_separates_seeds_torch_would_alias() -> None:
    derived = [generator_seed(s) for s in SEEDS]
    assert len(set(derived)) == len(SEEDS) and all(0 <= d < 2**32 for d in derived)
    assert [generator_seed(s) for s in SEEDS] == derived  # a pure function


def test_distinct_64_bit_seeds_give_distinct_samples_and_a_seed_reproduces(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    outs = {seed: run(seed) for seed in (0, 2**32, 2**63, -(2**63))}
    assert len({tuple(o) for o in outs.values()}) == 4, outs
    assert run(2**63) == outs[2**63] and run(0) == outs[0]


# -- ForcedSequence ---------------------------------------------------------------------------------------


def test_forced_sequence_stops_at_max_model_len(llm: LLM) -> None:
    assert llm.max_model_len == 64
    with llm.open_sequence() as seq:
        with pytest.raises(ValueError, match="max_model_len"):
            seq.feed(list(range(65)))
        assert seq.num_tokens == 0  # nothing written
        seq.feed(list(range(60)))
        with pytest.raises(ValueError, match=r"after 60 would make 65.*max_model_len\) of 64"):
            seq.feed([1, 2, 3, 4, 5])
        assert seq.feed([1, 2, 3, 4]).shape == (1, VOCAB) and seq.num_tokens == 64
    assert llm.kv_cache_stats().num_in_use == 0


@pytest.mark.parametrize("all_logits", ["yes", 1, None])
def test_forced_sequence_all_logits_must_be_a_bool(llm: LLM, all_logits) -> None:
    with llm.open_sequence() as seq:
        with pytest.raises(ValueError, match="all_logits must be a bool"):
            seq.feed([1, 2], all_logits=all_logits)
        assert seq.num_tokens == 0
        assert seq.feed([1, 2], all_logits=True).shape == (2, VOCAB)
