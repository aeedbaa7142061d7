"""Incremental detokenization (``kvpage.engine.detokenize.IncrementalDetokenizer``) and the engine's use of it.

The text after every token equals ``tokenizer.decode(all, skip_special_tokens=True)`` (a trailing U+FFFD of an
incomplete character included), over random token sequences of the byte tokenizer and of the bundled
byte-level BPE, tokens that split multi-byte characters and special tokens among them; the engine decodes
only short windows, and its final text, stop-string cut and streamed deltas are those of a whole decode.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _tiny import BOS, EOS, ByteTokenizer, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.engine.detokenize import REPLACEMENT, IncrementalDetokenizer, ends_with_split_character


def _check_every_step(tok, ids: list[int]) -> None:
    """``IncrementalDetokenizer`` over ``ids`` equals the whole decode after every token."""
    detok = IncrementalDetokenizer(tok)
    for k, t in enumerate(ids, 1):
        text = detok.append(t)
        assert text == detok.text == tok.decode(ids[:k], skip_special_tokens=True), (k, ids[:k])
    assert not detok.whole  # the window route ran throughout


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255), st.sampled_from([EOS, BOS]),
                          st.sampled_from(list("😀你é\ufffd".encode()))), max_size=60))
def test_byte_tokens_decode_incrementally_as_whole(ids: list[int]) -> None:
    """Random bytes (invalid, truncated and complete UTF-8, a real U+FFFD, special ids between them)."""
    _check_every_step(ByteTokenizer(), ids)


class _Cleanup(ByteTokenizer):
    """A tokenizer whose decode is not prefix-stable: it drops the space before "." (as clean_up_tokenization_spaces)."""

    clean_up_tokenization_spaces = True

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids, skip_special_tokens).replace(" .", ".")


class _Unstable(ByteTokenizer):
    """Like :class:`_Cleanup` without announcing it: the window check must catch it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode(ids, skip_special_tokens).replace(" .", ".")


@pytest.mark.parametrize("cls", [_Cleanup, _Unstable])
def test_a_tokenizer_that_rewrites_earlier_text_is_decoded_whole(cls) -> None:
    tok = cls()
    ids = list("a b .c".encode())
    detok = IncrementalDetokenizer(tok)
    for k, t in enumerate(ids, 1):
        assert detok.append(t) == tok.decode(ids[:k]), k
    assert detok.whole and detok.text == "a b.c"


@pytest.mark.slow
def test_bundled_tokenizer_decodes_incrementally_as_whole(smollm2) -> None:
    """Random sequences of the bundled byte-level BPE: any vocabulary id, the tokens that are single non-ASCII
    bytes (pieces of multi-byte characters), the pieces of emoji/CJK text, and the special ids."""
    tok = smollm2.tokenizer
    vocab = len(tok)
    pieces = tok.convert_ids_to_tokens(list(range(vocab)))
    partial = [i for i, p in enumerate(pieces) if len(p) <= 2 and any(ord(c) >= 0x80 for c in p)]
    assert len(partial) > 50  # the byte alphabet's non-ASCII bytes, alone or as 'Ġ' + byte
    split = tok.encode("😀 你好, 日本語 — naïve café 🤖🚀 ok.", add_special_tokens=False)
    assert REPLACEMENT in tok.decode(split[:1])  # the emoji is split over tokens
    specials = list(tok.all_special_ids)
    rng = random.Random(0)
    for _ in range(150):
        ids = []
        for _ in range(rng.randrange(1, 80)):
            kind = rng.random()
            if kind < 0.35:
                ids.append(rng.randrange(vocab))
            elif kind < 0.75:
                ids.append(rng.choice(partial))
            elif kind < 0.95:
                start = rng.randrange(len(split))
                ids.extend(split[start:start + rng.randrange(1, 6)])
            else:
                ids.append(rng.choice(specials))
        _check_every_step(tok, ids)


class _Recording(ByteTokenizer):
    """The byte tokenizer, noting how many ids each ``decode`` call got."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_engine_decodes_short_windows_with_whole_decode_results() -> None:
    """A 300-token output is decoded a few tokens at a time (the regression: every token decoded the whole
    output, ~54 µs a token on the bundled tokenizer and growing); final text, streamed deltas and a stop
    string's cut are those of the whole decode."""
    llm = LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=16, num_blocks=64, progress=False)
    rec = _Recording()
    llm.engine.tokenizer = rec
    params = dict(max_tokens=300, temperature=1.0, seed=5, ignore_eos=True)

    def run(**extra) -> tuple[object, str]:
        llm.engine.add_request(None, [1, 2, 3], SamplingParams(**params, **extra), request_id="r")
        streamed, final = "", None
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                streamed += out.outputs[0].delta_text
                if out.finished:
                    final = out.outputs[0]
        return final, streamed

    final, streamed = run()
    assert len(final.token_ids) == 300
    # main: one decode of the whole output per token (45,150 ids in all); here a few short windows per token (a
    # window grows only while random bytes keep a character incomplete)
    assert sum(rec.lengths) <= 6 * 300, (sum(rec.lengths), max(rec.lengths))
    whole = ByteTokenizer().decode(final.token_ids)
    split_end = ends_with_split_character(ByteTokenizer(), final.token_ids, whole)
    assert final.text == (whole[:-1] if split_end else whole) and streamed == final.text
    assert len(final.text) > 100

    at = next(i for i in range(150, len(final.text)) if REPLACEMENT not in final.text[i:i + 3])
    stop = final.text[at:at + 3]
    cut = final.text.find(stop)
    final2, streamed2 = run(stop=[stop])
    assert final2.finish_reason == "stop"
    assert final2.text == streamed2 == final.text[:cut]
