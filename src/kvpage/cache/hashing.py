"""Chained, process-stable block hashes for the prefix cache.

A block's hash is SHA-256 over a canonical byte encoding of
``(parent hash, the block's token ids, extra keys)``; the first block's parent
is a *root* hash derived from the request's ``cache_salt``. So

* a hash names a block's whole prefix, not just its own tokens (vLLM v1's
  ``hash_block_tokens``, FastDeploy's radix-tree block hash, SGLang's L3 page
  hash chains all chain the same way);
* it is the same in every process and on every machine: nothing here calls
  Python's ``hash()``, which is salted per process by ``PYTHONHASHSEED``
  (case C13, vLLM issue 12621, LMCache issue 2979);
* two tenants with different salts never produce the same chain, so they never
  share a block even for identical prompts (C13, vLLM CVE-2025-46570 / PR 17045);
* every token's exact value and position enter the digest, so no rearrangement
  of a block's tokens keeps its hash (C14, Megatron-LM issue 4158).

Only *full* blocks are hashed (:func:`hash_block_chain` drops a trailing
partial block): a partial block's contents are still changing (C15).

The hash is only the prefix index's lookup key. The index additionally stores
each block's tokens and parent block and compares them on every hit (see
:mod:`kvpage.cache.prefix_cache`), so even a forced collision never returns
another prefix's KV.

Encoding (version ``kvpage-block-v1``)::

    root  = sha256(b"kvpage-root-v1" + enc(cache_salt))
    block = sha256(b"kvpage-block-v1" + parent(32 bytes) + u32(n) + n * i64(token) + enc(extra_keys))

with ``enc`` a type-tagged, length-prefixed encoding of ``None``, ``bool``,
``int``, ``float``, ``str``, ``bytes`` and (nested) tuples/lists.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

#: Bytes in a block hash (a SHA-256 digest).
HASH_SIZE = 32

#: A block hash function: ``(parent_hash, token_ids, extra_keys) -> 32-byte digest``.
#: :func:`hash_block_tokens` is the default; tests pass colliding ones to prove
#: that the prefix index never trusts a hash alone.
BlockHashFn = Callable[[bytes, Sequence[int], tuple], bytes]

_ROOT_DOMAIN = b"kvpage-root-v1"
_BLOCK_DOMAIN = b"kvpage-block-v1"
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def encode_key(obj: Any) -> bytes:
    """Canonical, deterministic bytes of an extra key (or a salt).

    Supported: ``None``, ``bool``, ``int`` (any size), ``float``, ``str``
    (UTF-8), ``bytes``/``bytearray`` and tuples/lists of these, nested. Each
    value is type-tagged and length-prefixed, so ``("ab", "c")`` and
    ``("a", "bc")``, ``1`` and ``"1"`` and ``True`` all encode differently.

    Args:
        obj: the value to encode.

    Returns:
        The encoding; equal values give equal bytes in every process.

    Raises:
        TypeError: an unsupported type (e.g. a dict or set, whose iteration
            order would not be canonical).
    """
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):  # before int: bool is an int subclass
        out += b"T" if obj else b"F"
    elif isinstance(obj, int):
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "big", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, float):
        out += b"D" + struct.pack("<d", obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += b"S" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, (bytes, bytearray)):
        out += b"B" + struct.pack("<I", len(obj)) + bytes(obj)
    elif isinstance(obj, (tuple, list)):
        out += b"L" + struct.pack("<I", len(obj))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(
            f"extra key of type {type(obj).__name__} cannot be hashed canonically; "
            "use None, bool, int, float, str, bytes or tuples of these"
        )


_EMPTY_EXTRA = encode_key(())


def root_hash(cache_salt: str | None = None) -> bytes:
    """The parent hash of a request's first block, derived from its ``cache_salt``.

    Args:
        cache_salt: per-tenant salt (vLLM's ``cache_salt``); ``None`` means no salt.
            Requests with different salts get different roots, hence different
            hashes for every block of identical prompts.

    Returns:
        A 32-byte digest.

    Raises:
        TypeError: ``cache_salt`` is neither ``None`` nor a ``str``.
    """
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    return hashlib.sha256(_ROOT_DOMAIN + encode_key(cache_salt)).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 of one block: its parent's hash, its token ids and its extra keys.

    Args:
        parent_hash: the previous block's hash, or :func:`root_hash` for block 0
            (exactly :data:`HASH_SIZE` bytes).
        token_ids: the block's token ids (ints in the signed 64-bit range;
            anything with ``__index__``, e.g. numpy ints, works).
        extra_keys: anything else the block's KV depends on (adapter/LoRA id,
            multimodal content digests, ...); see :func:`encode_key`.

    Returns:
        A 32-byte digest.

    Raises:
        ValueError: ``parent_hash`` has the wrong length, or a token id is not
            an integer in the signed 64-bit range.
        TypeError: an extra key of an unsupported type.
    """
    if len(parent_hash) != HASH_SIZE:
        raise ValueError(f"parent_hash must be {HASH_SIZE} bytes, got {len(parent_hash)}")
    n = len(token_ids)
    try:
        packed = _packer(n).pack(n, *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [{_I64_MIN}, {_I64_MAX}]: {e}") from None
    extra = _EMPTY_EXTRA if not extra_keys else encode_key(tuple(extra_keys))
    return hashlib.sha256(_BLOCK_DOMAIN + parent_hash + packed + extra).digest()


@lru_cache(maxsize=256)
def _packer(n: int) -> struct.Struct:
    """``u32(n)`` then ``n`` little-endian int64s (cached per block length)."""
    return struct.Struct(f"<I{n}q")


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    extra_keys: tuple = (),
    *,
    hash_fn: BlockHashFn = hash_block_tokens,
) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``, chained from :func:`root_hash`.

    A trailing partial block (``len(token_ids) % block_size`` tokens) is not
    hashed: its KV is still being written (case C15).

    Args:
        token_ids: a request's tokens (prompt, then output).
        block_size: tokens per block (> 0).
        cache_salt: per-tenant salt, mixed into the root.
        extra_keys: keys mixed into every block (see :func:`hash_block_tokens`).
        hash_fn: the block hash function.

    Returns:
        ``len(token_ids) // block_size`` digests; element ``i`` names blocks ``0..i``.

    Raises:
        ValueError: ``block_size <= 0`` or a bad token id.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out: list[bytes] = []
    parent = root_hash(cache_salt)
    for i in range(len(token_ids) // block_size):
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        out.append(parent)
    return out
