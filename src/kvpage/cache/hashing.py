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

vLLM's ``sha256_cbor`` (``prefix_caching_hash_algo="sha256_cbor"``, :class:`BlockHasher`) is the other
scheme offered, so that a KV-aware router (llm-d's KV cache indexer, ...) can recompute the hashes
kvpage indexes and publishes from token ids alone, as it does for vLLM::

    root  = sha256(cbor(seed))        # vLLM's NONE_HASH; seed = $PYTHONHASHSEED, else "vllm-none-hash"
    block = sha256(cbor((parent(32 bytes), tuple(token ids), extra)))

with ``cbor`` the canonical CBOR encoding (``cbor2``) and ``extra`` vLLM's per-block extra keys: the
request's extra keys, then ``("cache_salt", salt)`` on the first block only when the salt is non-empty
(:func:`vllm_extra_keys`), or ``None`` when there are none. The 64-bit form routers and vLLM's integer
event hashes use is the low 64 bits of each full hash (:func:`hash_to_int64`); the chain itself always
runs on the full 32 bytes.
"""
from __future__ import annotations

import hashlib
import operator
import os
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
    return BlockHasher(hash_fn=hash_fn).chain(token_ids, block_size, cache_salt, extra_keys)


#: ``prefix_caching_hash_algo`` values: kvpage's own scheme (``kvpage-block-v1``, the default) and vLLM's
#: ``sha256_cbor`` (SHA-256 of canonical CBOR, which routers recompute).
HASH_ALGOS: tuple[str, ...] = ("kvpage", "sha256_cbor")

#: The default ``prefix_caching_hash_algo``.
DEFAULT_HASH_ALGO = "kvpage"

#: The seed of vLLM's root hash (``NONE_HASH``) when ``PYTHONHASHSEED`` is not set (vLLM's
#: ``DEFAULT_NONE_HASH_SEED`` for cryptographic algorithms).
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_INT64_MASK = (1 << 64) - 1


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (vLLM's ``sha256_cbor``).

    Args:
        obj: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, tuples/lists and dicts of these.

    Returns:
        A 32-byte digest.

    Raises:
        TypeError: ``obj`` holds a value CBOR cannot encode (the message names its type).
    """
    import cbor2  # only this scheme needs it; the default scheme stays import-light

    try:
        raw = cbor2.dumps(obj, canonical=True)
    except cbor2.CBOREncodeError as e:
        raise TypeError(f"cannot hash {obj!r} with sha256_cbor: {e}") from None
    return hashlib.sha256(raw).digest()


def vllm_none_hash(seed: str | None = None) -> bytes:
    """vLLM's root hash ``NONE_HASH`` for ``sha256_cbor``: ``sha256_cbor(seed)``.

    Args:
        seed: the seed; ``None`` reads ``PYTHONHASHSEED`` from the environment as vLLM does at start-up
            (set but empty counts as the seed ``""``), falling back to :data:`VLLM_DEFAULT_NONE_HASH_SEED`.
            A router must use the same seed (llm-d: ``hashSeed``) to recompute the hashes.

    Returns:
        A 32-byte digest.

    Raises:
        TypeError: ``seed`` is neither ``None`` nor a ``str``.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            seed = VLLM_DEFAULT_NONE_HASH_SEED
    if not isinstance(seed, str):
        raise TypeError(f"seed must be a str or None, got {type(seed).__name__}")
    return sha256_cbor(seed)


def vllm_extra_keys(block_index: int, cache_salt: str | None, extra_keys: tuple = ()) -> tuple | None:
    """vLLM's extra keys of block ``block_index``: ``extra_keys``, then the salt on the first block.

    vLLM (``generate_block_hash_extra_keys``) orders a block's keys LoRA, multimodal, ``cache_salt``,
    prompt embeds; kvpage's ``extra_keys`` stand for the keys before the salt, verbatim (a LoRA request
    in vLLM 0.34's form is ``("lora", name, path)``).

    Args:
        block_index: the block's index in its request (0 = first).
        cache_salt: the request's salt; ``None`` or ``""`` adds nothing (vLLM tests it for truth).
        extra_keys: the request's extra keys, mixed into every block.

    Returns:
        The tuple of keys, or ``None`` when there are none (as vLLM passes it to the hash).
    """
    keys = tuple(extra_keys)
    if block_index == 0 and cache_salt:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def hash_block_tokens_cbor(parent_hash: bytes, token_ids: Sequence[int], extra: tuple | None = None) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256_cbor``: ``sha256_cbor((parent, tuple(token_ids), extra))``.

    Args:
        parent_hash: the previous block's hash, or :func:`vllm_none_hash` for block 0 (:data:`HASH_SIZE` bytes).
        token_ids: the block's token ids (anything with ``__index__``; numpy ints become Python ints).
        extra: the block's extra keys as :func:`vllm_extra_keys` gives them (``None`` = none).

    Returns:
        A 32-byte digest.

    Raises:
        ValueError: ``parent_hash`` has the wrong length.
        TypeError: a token id is not an integer, or an extra key CBOR cannot encode.
    """
    if len(parent_hash) != HASH_SIZE:
        raise ValueError(f"parent_hash must be {HASH_SIZE} bytes, got {len(parent_hash)}")
    return sha256_cbor((bytes(parent_hash), tuple(map(operator.index, token_ids)), extra))


def hash_to_int64(block_hash: bytes) -> int:
    """The 64-bit form of a block hash: its low 64 bits, big-endian, as an unsigned int.

    This is what vLLM publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` and what llm-d's indexer keys
    blocks by (``int.from_bytes(h, "big") & (2**64 - 1)``, i.e. the last 8 bytes).

    Args:
        block_hash: a full block hash.

    Returns:
        An int in ``[0, 2**64)``.
    """
    return int.from_bytes(block_hash, "big") & _INT64_MASK


class BlockHasher:
    """One block hash scheme: the root of a request's chain and the hash of each next block.

    ``"kvpage"``: root :func:`root_hash` (from the salt), blocks ``hash_fn`` (default
    :func:`hash_block_tokens`) over the request's extra keys. ``"sha256_cbor"``: vLLM's -- root
    :func:`vllm_none_hash`, resolved once here (so ``PYTHONHASHSEED`` is read when the engine starts, as
    vLLM does), blocks :func:`hash_block_tokens_cbor` over :func:`vllm_extra_keys` (the salt enters the
    first block's extra keys, not the root).

    Args:
        algo: one of :data:`HASH_ALGOS`.
        hash_fn: ``"kvpage"`` only: the block hash function (tests pass colliding ones).
        seed: ``"sha256_cbor"`` only: the root's seed (``None`` = ``PYTHONHASHSEED`` / vLLM's default).

    Raises:
        ValueError: an unknown ``algo``, or ``hash_fn`` / ``seed`` given to the scheme that takes none.
    """

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, *, hash_fn: BlockHashFn | None = None,
                 seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
        if algo != "kvpage" and hash_fn is not None:
            raise ValueError(f"hash_fn replaces kvpage's own block hash; prefix_caching_hash_algo={algo!r} takes none")
        if algo == "kvpage" and seed is not None:
            raise ValueError("seed sets sha256_cbor's root; kvpage's scheme derives its root from cache_salt")
        self.algo = algo
        self._hash_fn: BlockHashFn = hash_block_tokens if hash_fn is None else hash_fn
        self._none_hash = vllm_none_hash(seed) if algo == "sha256_cbor" else b""

    def __repr__(self) -> str:
        return f"BlockHasher({self.algo!r})"

    def root(self, cache_salt: str | None) -> bytes:
        """The parent hash of a request's first block (32 bytes).

        Raises:
            TypeError: ``cache_salt`` is neither ``None`` nor a ``str``.
        """
        if self.algo == "kvpage":
            return root_hash(cache_salt)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        return self._none_hash

    def block(self, parent_hash: bytes, token_ids: Sequence[int], block_index: int, cache_salt: str | None,
              extra_keys: tuple = ()) -> bytes:
        """The hash of block ``block_index`` of a request, chained after ``parent_hash``.

        Args:
            parent_hash: the previous block's hash, or :meth:`root` for block 0.
            token_ids: the block's token ids.
            block_index: the block's index in the request (the salt enters block 0 under ``sha256_cbor``).
            cache_salt: the request's salt.
            extra_keys: the request's extra keys.

        Returns:
            A 32-byte digest (for ``hash_fn`` overrides, whatever they return).

        Raises:
            ValueError / TypeError: as the scheme's block function raises them.
        """
        if self.algo == "kvpage":
            return self._hash_fn(parent_hash, token_ids, extra_keys)
        return hash_block_tokens_cbor(parent_hash, token_ids, vllm_extra_keys(block_index, cache_salt, extra_keys))

    def salt_identity(self, cache_salt: str | None) -> str | None:
        """The salt as the scheme tells tenants apart: ``sha256_cbor`` treats ``""`` as no salt (as vLLM does).

        The prefix index keys blocks by it, so two salts that hash alike also compare alike.
        """
        return (cache_salt or None) if self.algo == "sha256_cbor" else cache_salt

    def chain(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
              extra_keys: tuple = ()) -> list[bytes]:
        """Hashes of every *full* block of ``token_ids`` (see :func:`hash_block_chain`).

        Raises:
            ValueError: ``block_size <= 0`` or a bad token id.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        out: list[bytes] = []
        parent = self.root(cache_salt)
        for i in range(len(token_ids) // block_size):
            parent = self.block(parent, token_ids[i * block_size : (i + 1) * block_size], i, cache_salt, extra_keys)
            out.append(parent)
        return out
