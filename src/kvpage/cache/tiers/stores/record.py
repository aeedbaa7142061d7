"""Stored block records: one block's :data:`BlockData` as self-describing, checksummed bytes.

A record is a `safetensors <https://github.com/huggingface/safetensors>`_ blob
(header JSON with each tensor's dtype and shape, then raw little-endian bytes;
fp8/uint8 codes, float16 scales, bfloat16 all kept bit-exact). Each layer group's
layers are stacked, one tensor per name: ``"<group>.<tensor>"`` (``"main.key"``,
``"draft.value_scale"``) of shape ``[layers of the group, *per-block shape]``, the
group's layers in :attr:`~kvpage.spec.LayerGroupSpec.layer_indices` order. (Version 1
kept one tensor per layer, ``"<layer>.<tensor>"``: a 30-layer int4 record spent 14 KB,
1.8% of its bytes, on header entries, and its encoding paid per-tensor costs 180 times.)
The header's
``__metadata__`` states the layout explicitly, so no reader ever has to guess
it from a shape (case C11, LMCache issue 4467, where a block's head layout was
inferred from its shape and read back transposed):

===================  ==========================================================
``record``           ``"kvpage-kv-block"``
``record_version``   ``"2"`` (:data:`RECORD_VERSION`)
``fingerprint``      the writer's :attr:`CacheSpec.fingerprint`
``block_hash``       the block hash, hex
``layout``           JSON of :meth:`CacheSpec.describe`: per layer group its
                     global layers (``first_layer``, ``num_layers``), format
                     name and version, kv heads, head_dim, block size, and per
                     tensor its name, shape and dtype
``layers``           JSON list of the global layer indices in the record
``sha256``           SHA-256 over the other metadata and every tensor's name,
                     dtype, shape and bytes (:func:`record_checksum`)
===================  ==========================================================

:func:`decode_record` accepts a record only if it parses, its checksum
matches, it was written under the reader's key (fingerprint and block hash),
its layout equals the reader's spec exactly (and hashes to the fingerprint it
claims) and its tensors are exactly the spec's; otherwise it raises
:class:`RecordRejected` with a reason, which the stores count as ``rejected``.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from kvpage.cache.tiers.stores.base import BlockData, StoreKey
from kvpage.cache.tiers.stores.blocks import validate_block_data
from kvpage.errors import KVCacheLayoutError, KVPageError
from kvpage.spec import CacheSpec

#: Value of the ``record`` metadata field.
RECORD_FORMAT = "kvpage-kv-block"
#: Bumped when the record encoding changes meaning.
RECORD_VERSION = 2
_CHECKSUM_DOMAIN = b"kvpage-kv-block-checksum-v1\0"


class RecordRejected(KVPageError, ValueError):
    """A stored record that must not be used: the block is treated as a miss and recomputed.

    Attributes:
        reason: ``"unreadable"`` (not a well-formed record), ``"checksum"``
            (bytes or metadata changed since writing), ``"key"`` (written under
            another fingerprint or block hash), ``"layout"`` (its layout differs
            from the reader's spec).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"record rejected ({reason}): {message}")
        self.reason = reason


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def record_checksum(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex of a record's metadata (minus ``sha256``) and tensors, in a canonical order.

    Covers every metadata field (as canonical JSON), then for each tensor, in
    name order: its name, dtype, shape and raw bytes. A flipped bit
    anywhere in a record therefore changes the checksum or makes it unreadable.
    """
    names = sorted(tensors)
    h = hashlib.sha256(_CHECKSUM_DOMAIN)
    h.update(_canonical_json({k: v for k, v in metadata.items() if k != "sha256"}).encode())
    h.update(_canonical_json([[n, str(tensors[n].dtype).removeprefix("torch."), list(tensors[n].shape)]
                              for n in names]).encode())
    for n in names:
        h.update(tensors[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def encode_record(key: StoreKey, data: BlockData, spec: CacheSpec) -> bytes:
    """Serialize one block into a record (see the module docstring for the format).

    Args:
        key: the block's store key; its fingerprint must be ``spec``'s.
        data: the block, exactly in the spec's layout (tensors on any device; copied to the CPU).
        spec: the writer's layout.

    Returns:
        the record bytes (tensor bytes plus a few KiB of header).

    Raises:
        ValueError: ``key`` has another fingerprint than ``spec``.
        KVCacheLayoutError: ``data`` disagrees with ``spec`` (layer, tensor, expected, actual).
    """
    if key.fingerprint != spec.fingerprint:
        raise ValueError(f"key {key.text} was not made for this spec (fingerprint {spec.fingerprint})")
    validate_block_data(spec, data, what=f"block {bytes(key.block_hash).hex()[:16]}")
    tensors: dict[str, torch.Tensor] = {}
    for g in spec.groups:
        for t in g.layer.tensors:
            tensors[f"{g.name}.{t.name}"] = torch.stack([data[i][t.name].detach().to("cpu") for i in g.layer_indices])
    metadata = {
        "record": RECORD_FORMAT,
        "record_version": str(RECORD_VERSION),
        "fingerprint": spec.fingerprint,
        "block_hash": bytes(key.block_hash).hex(),
        "layout": _canonical_json(spec.describe()),
        "layers": _canonical_json(list(range(spec.num_layers))),
    }
    metadata["sha256"] = record_checksum(metadata, tensors)
    return safetensors.torch.save(tensors, metadata=metadata)


def record_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a record's safetensors header, unverified (for inspection and tests).

    Raises:
        RecordRejected: ``"unreadable"`` -- the bytes do not start with a safetensors header.
    """
    if len(blob) < 8:
        raise RecordRejected("unreadable", f"{len(blob)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise RecordRejected("unreadable", f"header claims {n} bytes, record has {len(blob) - 8} after the length")
    try:
        header = json.loads(bytes(blob[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordRejected("unreadable", f"header is not JSON ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise RecordRejected("unreadable", "header has no string __metadata__")
    return meta


def decode_record(blob: bytes, spec: CacheSpec, key: StoreKey) -> BlockData:
    """Parse and verify a record read under ``key`` by a reader with layout ``spec``.

    Checks, in order: it parses (safetensors header and data), it is a kvpage
    block record of a known version, its checksum matches, it names ``key``'s
    fingerprint and block hash, its layout metadata equals ``spec.describe()``
    and hashes to ``spec.fingerprint``, and its tensors are exactly the spec's
    (names, dtypes, per-block shapes). The layout always comes from the
    metadata and the spec, never from tensor shapes.

    Returns:
        the block's :data:`BlockData` (CPU tensors, writable).

    Raises:
        RecordRejected: with ``reason`` ``"unreadable"``, ``"checksum"``, ``"key"``
            or ``"layout"``; the message says what differed.
    """
    meta = record_metadata(blob)
    if meta.get("record") != RECORD_FORMAT or meta.get("record_version") != str(RECORD_VERSION):
        raise RecordRejected(
            "unreadable",
            f"not a {RECORD_FORMAT} v{RECORD_VERSION} record (record={meta.get('record')!r}, "
            f"version={meta.get('record_version')!r})",
        )
    try:
        tensors = safetensors.torch.load(bytes(blob))
    except Exception as e:  # safetensors raises SafetensorError / ValueError / RuntimeError on bad bytes
        raise RecordRejected("unreadable", f"safetensors could not parse the record ({type(e).__name__}: {e})") from None
    stored = meta.get("sha256")
    actual = record_checksum(meta, tensors)
    if stored != actual:
        raise RecordRejected("checksum", f"SHA-256 {actual[:16]}... does not match the stored {str(stored)[:16]}...")
    want_hash = bytes(key.block_hash).hex()
    if meta.get("fingerprint") != key.fingerprint or meta.get("block_hash") != want_hash:
        raise RecordRejected(
            "key",
            f"record was written as {meta.get('fingerprint')}:{meta.get('block_hash')}, read as {key.text}",
        )
    if meta["fingerprint"] != spec.fingerprint:
        raise RecordRejected(
            "layout", f"record fingerprint {meta['fingerprint'][:16]}... is not the reader's {spec.fingerprint[:16]}..."
        )
    try:
        layout = json.loads(meta.get("layout", ""))
        layers = json.loads(meta.get("layers", ""))
    except ValueError as e:
        raise RecordRejected("layout", f"layout metadata is not JSON ({e})") from None
    expected = spec.describe()
    if layout != expected:
        raise RecordRejected("layout", _layout_difference(layout, expected))
    if hashlib.sha256(_canonical_json(layout).encode()).hexdigest() != meta["fingerprint"]:
        raise RecordRejected("layout", "layout metadata does not hash to the record's fingerprint")
    if layers != list(range(spec.num_layers)):
        raise RecordRejected("layout", f"record holds layers {layers}, the spec has 0..{spec.num_layers - 1}")
    data: BlockData = {}
    groups = {g.name: g.layer_indices for g in spec.groups}
    for name, t in tensors.items():
        group, _, tensor = name.partition(".")
        layers = groups.get(group)
        if layers is None or not tensor:
            raise RecordRejected("layout", f"tensor name {name!r} is not '<group>.<tensor>' of a group of the spec")
        if t.dim() < 1 or t.shape[0] != len(layers):
            raise RecordRejected("layout", f"tensor {name!r} of shape {tuple(t.shape)} does not stack the "
                                           f"{len(layers)} layers of group {group!r}")
        for layer, x in zip(layers, t.unbind(0)):
            data.setdefault(layer, {})[tensor] = x
    try:
        validate_block_data(spec, data, what="stored record")
    except KVCacheLayoutError as e:
        raise RecordRejected("layout", str(e)) from None
    return data


def _layout_difference(layout: Any, expected: dict[str, Any]) -> str:
    """A short description of where a record's layout differs from the reader's."""
    if not isinstance(layout, dict):
        return f"layout metadata is a {type(layout).__name__}, expected an object"
    for k in sorted(set(layout) | set(expected)):
        if k == "groups":
            continue
        if layout.get(k) != expected.get(k):
            return f"record {k}={layout.get(k)!r}, reader's spec {k}={expected.get(k)!r}"
    got_groups, want_groups = layout.get("groups"), expected["groups"]
    if not isinstance(got_groups, list) or len(got_groups) != len(want_groups):
        return f"record has layer groups {got_groups!r}, reader's spec {want_groups!r}"
    for g, w in zip(got_groups, want_groups):
        if g == w:
            continue
        if isinstance(g, dict):
            diffs = [f"{k}: record {g.get(k)!r}, spec {w.get(k)!r}" for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]
        else:
            diffs = [f"record group {g!r}"]
        first = w["first_layer"]
        return f"layers {first}..{first + w['num_layers'] - 1} ({w['name']} group): " + "; ".join(diffs)
    return "layouts differ"
