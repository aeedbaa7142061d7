"""``DiskStore``: one record file per KV block under a cache directory, size-capped with LRU eviction.

Layout on disk::

    <directory>/<spec fingerprint>/<first 2 hex of block hash>/<block hash hex>.safetensors

Each file is one :mod:`~kvpage.cache.tiers.stores.record` (safetensors with layout
metadata and a SHA-256 checksum). This is the shape of LMCache's local-disk
backend and vLLM's ``OffloadingConnector`` file tier: content-addressed files,
written to a temporary name in the same directory and ``os.replace``-d into
place, so a reader sees a whole record or none (a crash leaves at most a stray
``.tmp`` file, cleaned up on the next start).

The size cap counts the exact bytes of every record file this instance knows
of (all fingerprints under the directory: files of an old layout are evicted
too, so switching ``kv_cache_dtype`` never grows the directory past the cap).
Recency is kept in memory and mirrored in file mtimes (touched on each hit),
and rebuilt from the mtimes on start, so the LRU order and every block survive
restarts. Several processes may share a directory safely (atomic renames,
checksums, missing files are misses); each one's cap accounting only sees the
other processes' files that existed when it started or that it has read.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvpage.cache.tiers.stores.base import BlockData, FailureLog, KVStore, StoreKey
from kvpage.cache.tiers.stores.record import RecordRejected, decode_record, encode_record
from kvpage.spec import CacheSpec

logger = logging.getLogger(__name__)

#: Suffix of record files.
RECORD_SUFFIX = ".safetensors"
_TMP_MARK = ".tmp."
#: Temporary files older than this at start-up are leftovers of a crashed writer.
STALE_TMP_SECONDS = 600.0


class DiskStore(KVStore):
    """KV blocks as checksummed record files under ``directory``, LRU-capped at ``max_bytes``.

    Args:
        directory: cache directory (created if missing).
        spec: layout of the blocks this instance reads and writes.
        max_bytes: cap on the record files' total size in bytes (``None`` = no cap).
            A record larger than the cap is not stored.
        fsync: ``fsync`` each record before renaming it into place (durable
            across power loss; slower). Atomicity does not depend on it.

    Attributes:
        directory: the cache directory.
        max_bytes: the cap.

    Raises:
        ValueError: ``max_bytes`` is negative.
        OSError: the directory cannot be created or listed (at construction only).
    """

    def __init__(self, directory: str | os.PathLike[str], spec: CacheSpec, max_bytes: int | None = None,
                 fsync: bool = False) -> None:
        super().__init__(spec)
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._lock = threading.RLock()
        #: relative path -> file size in bytes, least recently used first.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._failures = FailureLog(logger, f"disk KV store {self.directory}")
        self._warned_too_big = False
        self._last_ns = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. the path is a file: a clear error at startup, not a traceback
            raise ValueError(f"kv_disk_dir {str(self.directory)!r} cannot be used as a directory: {e}") from e
        self._scan()
        with self._lock:
            self._evict_to(self.max_bytes)

    # -- index --------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the LRU index from the record files' mtimes; drop stale temp files."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for fp_dir in self.directory.iterdir():
            if not fp_dir.is_dir():
                continue
            for shard in fp_dir.iterdir():
                if not shard.is_dir():
                    continue
                for entry in os.scandir(shard):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if _TMP_MARK in entry.name:
                        if now - st.st_mtime > STALE_TMP_SECONDS:
                            _unlink(entry.path)
                        continue
                    if entry.name.endswith(RECORD_SUFFIX) and entry.is_file(follow_symlinks=False):
                        rel = os.path.relpath(entry.path, self.directory)
                        found.append((st.st_mtime_ns, rel, st.st_size))
        found.sort()
        with self._lock:
            self._lru.clear()
            for _, rel, size in found:
                self._lru[rel] = size
            self._used = sum(self._lru.values())

    @property
    def used_bytes(self) -> int:
        """Total size in bytes of the record files in the index."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Number of record files in the index."""
        with self._lock:
            return len(self._lru)

    def path_for(self, key: StoreKey) -> Path:
        """The record file of ``key`` (it may not exist)."""
        h = bytes(key.block_hash).hex()
        return self.directory / key.fingerprint / h[:2] / f"{h}{RECORD_SUFFIX}"

    def _rel(self, key: StoreKey) -> str:
        h = bytes(key.block_hash).hex()
        return os.path.join(key.fingerprint, h[:2], f"{h}{RECORD_SUFFIX}")

    def _forget(self, rel: str) -> None:
        size = self._lru.pop(rel, None)
        if size is not None:
            self._used -= size

    def _remember(self, rel: str, size: int) -> None:
        self._forget(rel)
        self._lru[rel] = size
        self._used += size

    def _evict_to(self, limit: int | None) -> None:
        """Remove least recently used records until the index holds at most ``limit`` bytes."""
        if limit is None:
            return
        while self._used > limit and self._lru:
            rel, _ = next(iter(self._lru.items()))
            self._forget(rel)
            _unlink(self.directory / rel)
            self._count(evictions=1)

    # -- the interface ------------------------------------------------------------------------
    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key's record file exists (a ``stat``; the record is not verified).

        See :meth:`KVStore.exists`.
        """
        self._check_keys(keys)
        out = []
        for k in keys:
            try:
                st = os.stat(self.path_for(k))
            except FileNotFoundError:
                out.append(False)
                with self._lock:
                    self._forget(self._rel(k))
                continue
            except OSError as e:
                self._failures.failed("stat", e)
                self._count(errors=1)
                out.append(False)
                continue
            out.append(True)
            with self._lock:
                rel = self._rel(k)
                if rel not in self._lru:  # written by another process: adopt it into the cap
                    self._remember(rel, st.st_size)
                    self._lru.move_to_end(rel, last=False)
        return out

    def get(self, keys: Sequence[StoreKey]) -> list[BlockData | None]:
        """Read and verify each key's record file; a rejected record is counted and deleted.

        See :meth:`KVStore.get`. A hit becomes the most recently used record
        (in memory and in the file's mtime).
        """
        self._check_keys(keys)
        out: list[BlockData | None] = []
        for k in keys:
            path, rel = self.path_for(k), self._rel(k)
            try:
                with open(path, "rb") as f:
                    blob = f.read()
            except FileNotFoundError:
                with self._lock:
                    self._forget(rel)
                self._count(misses=1)
                out.append(None)
                continue
            except OSError as e:
                self._failures.failed("read", e)
                self._count(misses=1, errors=1)
                out.append(None)
                continue
            try:
                data = decode_record(blob, self.spec, k)
            except RecordRejected as e:
                logger.warning("disk KV store: %s: %s; deleting it", path, e)
                with self._lock:
                    self._forget(rel)
                    _unlink(path)
                self._count(misses=1, rejected=1)
                out.append(None)
                continue
            self._failures.succeeded()
            with self._lock:
                self._remember(rel, len(blob))
                self._touch(path)
            self._count(hits=1, bytes_read=len(blob))
            out.append(data)
        return out

    def put(self, items: Sequence[tuple[StoreKey, BlockData]]) -> list[bool]:
        """Write each block as a record file (temp file + ``os.replace``), evicting LRU records to stay under the cap.

        A key whose file already exists is not rewritten (records are content
        addressed); it becomes the most recently used one. See :meth:`KVStore.put`
        (``False`` for a record over ``max_bytes`` or a failed write).
        """
        self._check_keys([k for k, _ in items])
        blobs = [(k, encode_record(k, data, self.spec)) for k, data in items]  # validates all before writing
        held = [False] * len(blobs)
        for i, (k, blob) in enumerate(blobs):
            path, rel = self.path_for(k), self._rel(k)
            with self._lock:
                try:
                    size = path.stat().st_size
                except OSError:
                    size = None
                if size is not None:  # already stored (possibly by another process): keep it, mark it used
                    self._remember(rel, size)
                    held[i] = True
                    continue
                if self.max_bytes is not None and len(blob) > self.max_bytes:
                    if not self._warned_too_big:
                        logger.warning(
                            "disk KV store %s: a %d-byte record exceeds max_bytes=%d; not storing blocks",
                            self.directory, len(blob), self.max_bytes,
                        )
                        self._warned_too_big = True
                    continue
                self._evict_to(None if self.max_bytes is None else self.max_bytes - len(blob))
                try:
                    self._write_atomic(path, blob)
                except OSError as e:
                    self._failures.failed("write", e)
                    self._count(errors=1)
                    continue
                self._remember(rel, len(blob))
                self._touch(path)
            self._failures.succeeded()
            self._count(puts=1, bytes_written=len(blob))
            held[i] = True
        return held

    def _touch(self, path: Path) -> None:
        """Set ``path``'s mtime to now, with nanosecond precision and strictly increasing within this
        process (the kernel's own file timestamps are jiffy-coarse), so the LRU order survives restarts."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except OSError:
            pass

    def _write_atomic(self, path: Path, blob: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def clear(self) -> None:
        """Delete every record file in the index (all fingerprints)."""
        with self._lock:
            for rel in list(self._lru):
                _unlink(self.directory / rel)
            self._lru.clear()
            self._used = 0

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r}, used={self.used_bytes}, max_bytes={self.max_bytes})"


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.debug("could not remove %s: %s", path, e)
