"""Block hashing: canonical encoding, chaining, salts, extra keys, full blocks only."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvpage.cache.hashing import HASH_SIZE, encode_key, hash_block_chain, hash_block_tokens, root_hash


def test_digest_follows_the_documented_encoding() -> None:
    """Recompute the digests by hand from the module docstring's byte layout."""
    root = hashlib.sha256(b"kvpage-root-v1" + b"N").digest()
    assert root_hash(None) == root
    salted = hashlib.sha256(b"kvpage-root-v1" + b"S" + struct.pack("<I", 5) + b"alice").digest()
    assert root_hash("alice") == salted
    tokens = [1, -2, 2**40]
    extra = ("lora-7", 3)
    raw = (
        b"kvpage-block-v1"
        + root
        + struct.pack("<I", 3)
        + struct.pack("<3q", *tokens)
        + b"L" + struct.pack("<I", 2)
        + b"S" + struct.pack("<I", 6) + b"lora-7"
        + b"I" + struct.pack("<I", 1) + b"\x03"
    )
    assert hash_block_tokens(root, tokens, extra) == hashlib.sha256(raw).digest()
    assert len(hash_block_tokens(root, tokens)) == HASH_SIZE


def test_encode_key_is_unambiguous() -> None:
    distinct = [
        None, True, False, 0, 1, -1, 256, 2**70, -(2**70), 1.0, -0.5, "1", "", b"", b"1",
        (), ("ab", "c"), ("a", "bc"), ("abc",), (("a",), "bc"), (1, 2), ((1, 2),), (None,),
    ]
    encodings = [encode_key(x) for x in distinct]
    assert len(set(encodings)) == len(distinct)
    assert encode_key([1, "x"]) == encode_key((1, "x"))  # a list is a tuple
    assert encode_key(bytearray(b"ab")) == encode_key(b"ab")
    for bad in ({1: 2}, {1}, object(), 1j):
        with pytest.raises(TypeError, match="canonically"):
            encode_key(bad)
    with pytest.raises(TypeError):
        encode_key(("ok", {"no": 1}))


def test_bad_inputs() -> None:
    root = root_hash()
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block_tokens(root[:16], [1, 2])
    for bad in ([1.5], [2**63], [-(2**63) - 1], ["7"]):
        with pytest.raises(ValueError, match="token ids"):
            hash_block_tokens(root, bad)
    assert hash_block_tokens(root, [2**63 - 1, -(2**63)])  # the int64 range itself is fine
    with pytest.raises(TypeError):
        root_hash(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hash_block_chain([1, 2], 0)


def test_numpy_and_python_ints_hash_alike() -> None:
    root = root_hash()
    assert hash_block_tokens(root, np.arange(5, dtype=np.int64)) == hash_block_tokens(root, [0, 1, 2, 3, 4])
    assert hash_block_tokens(root, np.arange(5, dtype=np.int32)) == hash_block_tokens(root, [0, 1, 2, 3, 4])


def test_chain_only_full_blocks_and_prefix_dependence() -> None:
    tokens = list(range(100, 140))  # 40 tokens
    hashes = hash_block_chain(tokens, 16)
    assert len(hashes) == 2  # tokens 32..39 form a partial block: not hashed
    assert hash_block_chain(tokens[:31], 16) == hashes[:1]
    assert hash_block_chain(tokens[:32], 16) == hashes
    assert hash_block_chain(tokens[:15], 16) == []
    # block 1's hash is the chain of block 0's
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:32])
    # same block-1 tokens after a different block 0: a different hash
    other = [7] + tokens[1:]
    assert hash_block_chain(other, 16)[1] != hashes[1]
    # a change in block 1 leaves block 0's hash alone
    changed = tokens[:20] + [0] + tokens[21:]
    h2 = hash_block_chain(changed, 16)
    assert h2[0] == hashes[0] and h2[1] != hashes[1]


def test_position_order_and_length_matter() -> None:
    root = root_hash()
    base = list(range(8))
    seen = {hash_block_tokens(root, base)}
    for variant in (base[::-1], base[1:] + base[:1], [0, 2, 1, 3, 4, 5, 6, 7], base + [0], base[:-1], [0] + base[:-1]):
        h = hash_block_tokens(root, variant)
        assert h not in seen
        seen.add(h)


def test_salt_and_extra_keys_separate_chains() -> None:
    tokens = list(range(64))
    plain = hash_block_chain(tokens, 16)
    alice = hash_block_chain(tokens, 16, cache_salt="alice")
    bob = hash_block_chain(tokens, 16, cache_salt="bob")
    empty = hash_block_chain(tokens, 16, cache_salt="")
    lora = hash_block_chain(tokens, 16, extra_keys=("lora-1",))
    lora2 = hash_block_chain(tokens, 16, extra_keys=("lora-2",))
    chains = [plain, alice, bob, empty, lora, lora2]
    all_hashes = [h for c in chains for h in c]
    assert len(set(all_hashes)) == len(all_hashes) == 6 * 4  # no block hash shared by any two chains
    assert hash_block_chain(tokens, 16, cache_salt="alice") == alice  # deterministic


def test_custom_hash_fn_is_used() -> None:
    calls = []

    def fn(parent: bytes, toks, extra) -> bytes:
        calls.append(tuple(toks))
        return bytes(32)

    assert hash_block_chain([1, 2, 3, 4, 5], 2, hash_fn=fn) == [bytes(32)] * 2
    assert calls == [(1, 2), (3, 4)]
