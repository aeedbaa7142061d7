"""``ForcedSequence``: feed chosen tokens through the real paged cache, outside the scheduler (teacher forcing).

Perplexity, KL and flip-rate measurements (:mod:`kvpage.eval`, the test suite,
``benchmarks/greedy_agreement.py``) need the logits of *given* tokens, computed
exactly as generation computes them: quantized writes into paged blocks, reads
back through the layer's format, one or more tokens per forward pass. A
:class:`ForcedSequence` takes its blocks from the engine's KV cache
(one request that is never prefix-matched nor indexed), runs each
:meth:`~ForcedSequence.feed` as one forward pass, and frees its blocks on
:meth:`~ForcedSequence.close`. It imports nothing above ``kvpage.engine``.
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from kvpage.cache.requests import KVRequest
from kvpage.engine.model_runner import ScheduledRequest, pass_requests
from kvpage.engine.validate import as_int, check_token_ids
from kvpage.errors import OutOfBlocksError

if TYPE_CHECKING:
    from kvpage.cache.kv_cache import KVCache
    from kvpage.engine.worker import Worker


class ForcedSequence:
    """One teacher-forced sequence over an engine's cache; use it as a context manager.

    Token regions (``n`` = :attr:`num_tokens`): ``[0, n)`` holds KV written by
    earlier :meth:`feed` calls; a call writes ``[n, n + len(token_ids))``.

    Args:
        kv: the engine's KV cache (blocks are taken from it; never matched nor indexed; it plans each feed).
        worker: the engine's worker (executes the plans).
        prompt_len: tokens at the start that count as the prompt for quantize-on-seal formats'
            window copies (:mod:`kvpage.cache.tail`); 0 (default) treats every token as generated,
            as decoding does.
        request_id: label of the sequence's blocks; default a fresh unique id.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (``None`` checks only ``>= 0``).
        max_model_len: most tokens the sequence may hold (the model's context; ``None``: no limit
            beyond the cache's blocks). The engine passes its own.

    Raises:
        ValueError: ``prompt_len`` not an int >= 0, or ``max_model_len`` not an int >= 1 nor ``None``.
    """

    def __init__(
        self, kv: KVCache, worker: Worker, *, prompt_len: int = 0, request_id: str | None = None,
        vocab_size: int | None = None, max_model_len: int | None = None,
    ) -> None:
        prompt_len_ = as_int(prompt_len)
        if prompt_len_ is None or prompt_len_ < 0:
            raise ValueError(f"prompt_len must be an integer >= 0, got {prompt_len!r}")
        limit = None if max_model_len is None else as_int(max_model_len)
        if max_model_len is not None and (limit is None or limit < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {max_model_len!r}")
        self._vocab_size = vocab_size
        self._max_model_len = limit
        self._kv = kv
        self._worker = worker
        self._prompt_len = prompt_len_
        self._req = KVRequest(request_id or f"kvpage-forced-{uuid.uuid4().hex}", [])
        self._closed = False

    @property
    def request_id(self) -> str:
        """The id its blocks are held under."""
        return self._req.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far (their KV is in the cache)."""
        return len(self._req.all_token_ids)

    def feed(self, token_ids: Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Run ``token_ids`` at positions ``num_tokens ..`` in one forward pass, writing their KV.

        Args:
            token_ids: one or more token ids.
            all_logits: return the logits of every fed token, not only the last one (a bool).

        Returns:
            ``[1, vocab]`` float32 logits of the last fed token, or ``[len(token_ids), vocab]`` with ``all_logits``.

        Raises:
            TypeError: ``token_ids`` is not a list/tuple/range.
            ValueError: no tokens, a token id that is not an int or lies outside the vocabulary, more tokens
                than ``max_model_len`` in all, ``all_logits`` not a bool (nothing is written then), or the
                sequence is closed.
            OutOfBlocksError: the free and evictable blocks cannot hold the new tokens (nothing is written then).
        """
        if isinstance(token_ids, (list, tuple, range)) and not token_ids:
            raise ValueError("feed needs at least one token")
        ids = check_token_ids(token_ids, "token_ids", self._vocab_size)
        if not isinstance(all_logits, bool):
            raise ValueError(f"all_logits must be a bool, got {all_logits!r}")
        if self._closed:
            raise ValueError(f"sequence {self.request_id!r} is closed")
        start = self.num_tokens
        if self._max_model_len is not None and start + len(ids) > self._max_model_len:
            raise ValueError(
                f"token_ids: {len(ids)} tokens after {start} would make {start + len(ids)}, beyond the model's "
                f"context (max_model_len) of {self._max_model_len} tokens")
        self._kv.begin_step()
        blocks = self._kv.allocate(self._req, len(ids))
        if blocks is None:
            stats = self._kv.stats()
            raise OutOfBlocksError(
                f"no KV blocks left for tokens {start}..{start + len(ids) - 1} of a forced sequence "
                f"({stats.num_free} free, {stats.num_evictable} evictable)"
            )
        self._worker.begin_step(self._kv.step_plan())
        self._req.all_token_ids.extend(ids)
        batch = [ScheduledRequest(ids, start, blocks.block_ids, self.request_id, self._prompt_len)]
        plan = self._kv.plan_pass(pass_requests(batch), groups=self._worker.runner.groups)
        try:
            logits = self._worker.execute(batch, plan, all_logits=all_logits)
        except BaseException:
            self._kv.abort(plan)
            raise
        self._kv.commit(plan)
        return logits

    def close(self) -> None:
        """Free the sequence's blocks (idempotent); :meth:`feed` fails afterwards."""
        if not self._closed:
            self._closed = True
            self._kv.free(self._req)

    def __enter__(self) -> ForcedSequence:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
