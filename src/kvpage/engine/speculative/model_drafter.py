"""Drafters that run a model: a separate draft model (its own layer group) or the target's early exit.

Both propose autoregressively inside the step, before verification: pass 1 feeds each speculating
request's last sampled token (the draft model also catches up on every token the target computes this
step), each later pass feeds the previous draft token; pass ``i`` writes the draft layers' K/V at
position ``num_computed + i - 1``, inside the request's lookahead slots. Every pass is one batched
forward over the requests still drafting (SpecInfer/vLLM's draft loop, without tree drafts), planned by the
cache (:meth:`~kvpage.cache.kv_cache.KVCache.plan_pass`, not the step's final pass over its layers) and run
by the drafter's runner.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from kvpage.cache.kv_cache import KVCache
from kvpage.engine.model_runner import ModelRunner, ScheduledRequest, pass_requests
from kvpage.engine.scheduler import ScheduledRequestChunk
from kvpage.engine.speculative.proposer import Drafter, Proposal, draw


class ModelDrafter(Drafter):
    """The draft loop over a :class:`~kvpage.engine.model_runner.ModelRunner`; subclasses say what pass 1 runs.

    Args:
        runner: runs the draft model over its layers of the paged cache.
        kv: the cache, which plans each draft pass.
        num_layers: run only the runner's model's first this many layers (an early exit), or ``None``.
    """

    def __init__(self, runner: ModelRunner, kv: KVCache, num_layers: int | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.num_layers = num_layers

    @abstractmethod
    def first_pass(self, chunks: Sequence[ScheduledRequestChunk]) -> tuple[list[ScheduledRequest], list[int]]:
        """Pass 1's batch, and for each chunk the index of its row in it (-1: not in the pass).

        A speculating chunk's row must end with its last sampled token at position ``num_computed``.
        """

    def _run(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """One draft pass: planned (not the step's final pass over these layers), run, settled."""
        plan = self.kv.plan_pass(pass_requests(batch), groups=self.runner.groups, final=False)
        try:
            logits = self.runner.execute(batch, plan=plan, num_layers=self.num_layers)            # [B, vocab]
        except BaseException:
            self.kv.abort(plan)
            raise
        self.kv.commit(plan)
        return logits

    def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
        """Up to ``num_lookahead`` drafts per speculating chunk, each drawn from the draft's distribution."""
        batch, where = self.first_pass(chunks)
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        if batch:
            logits = self._run(batch)
            for i, c in enumerate(chunks):
                if c.num_lookahead and where[i] >= 0:
                    t, p = draw(logits[where[i]], c.request.params, c.request.generator)
                    tokens[i].append(t)
                    if p is not None:
                        probs[i].append(p)
        for step in range(1, max((c.num_lookahead for c in chunks), default=0)):
            live = [i for i, c in enumerate(chunks) if c.num_lookahead > step and len(tokens[i]) == step]
            if not live:
                break
            rows = [ScheduledRequest([tokens[i][-1]], chunks[i].num_computed + step, chunks[i].block_ids,
                                     chunks[i].request.request_id, chunks[i].request.num_prompt_tokens,
                                     num_draft=step) for i in live]  # positions past num_computed are drafts
            logits = self._run(rows)
            for row, i in enumerate(live):
                c = chunks[i]
                t, p = draw(logits[row], c.request.params, c.request.generator)
                tokens[i].append(t)
                if p is not None:
                    probs[i].append(p)
        return [Proposal(tuple(t), torch.stack(p) if p else None) if t else Proposal() for t, p in zip(tokens, probs)]


class DraftModelDrafter(ModelDrafter):
    """A separate draft model whose layers are the spec's ``draft`` group (shared block table, same budget).

    Its KV must exist for every token the target has computed, so that a prefix hit's blocks hold it
    (case C19): pass 1 runs every chunk of the step from where the draft's KV ends, and blocks are
    indexed only up to :meth:`index_limit` (a fully accepted draft's last token has no draft KV yet; the
    next step's pass 1 writes it).

    Args:
        runner: the draft model's runner over the ``draft`` group (``layer_offset`` = the group's first layer).
        kv: the cache, which plans each draft pass.
    """

    def __init__(self, runner: ModelRunner, kv: KVCache) -> None:
        super().__init__(runner, kv)
        self._done: dict[str, int] = {}  # request id -> tokens whose draft KV is written

    def first_pass(self, chunks: Sequence[ScheduledRequestChunk]) -> tuple[list[ScheduledRequest], list[int]]:
        """Every chunk, from the end of its draft KV (at most its ``num_computed``) to the end of its new tokens."""
        batch: list[ScheduledRequest] = []
        where: list[int] = []
        for c in chunks:
            req = c.request
            start = min(self._done.get(req.request_id, c.num_computed), c.num_computed)
            end = c.num_computed + c.num_new_tokens
            where.append(len(batch))
            batch.append(ScheduledRequest(req.all_token_ids[start:end], start, c.block_ids, req.request_id,
                                          req.num_prompt_tokens))
        return batch, where

    def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
        """As :meth:`ModelDrafter.propose`; afterwards the draft KV covers each chunk's new tokens."""
        out = super().propose(chunks)
        for c in chunks:
            self._done[c.request.request_id] = c.num_computed + c.num_new_tokens
        return out

    def index_limit(self, request_id: str) -> int | None:
        """Tokens whose draft KV is written (0 for a request this drafter has not run yet)."""
        return self._done.get(request_id, 0)

    def on_verified(self, request_id: str, num_computed: int, num_drafted: int, num_accepted: int) -> None:
        """Accepted drafts keep the draft KV pass ``i + 1`` wrote for them (all but the last draft)."""
        if num_drafted:
            self._done[request_id] = num_computed + 1 + min(num_accepted, num_drafted - 1)

    def forget(self, request_id: str) -> None:
        """Drop the request's draft progress."""
        self._done.pop(request_id, None)


class LayerSkipDrafter(ModelDrafter):
    """The target's first ``num_layers`` layers, final norm and LM head as its own draft (no extra weights or KV).

    The self-draft's K/V for a token are the target's K/V of those layers for the same token, so it
    reads the target's cache: pass 1 feeds only the last sampled token, and the verification pass
    rewrites the draft positions of those layers with the same values (accepted) or they are dropped
    with the rejected slots. Its passes are not the step's final pass over the main layers: the step's
    promised tail slots stay for verification.

    Args:
        runner: the target's runner (over the main group).
        kv: the cache, which plans each draft pass.
        num_layers: layers of the self-draft (fewer than the target's).
    """

    def __init__(self, runner: ModelRunner, kv: KVCache, num_layers: int) -> None:
        super().__init__(runner, kv, num_layers)

    def first_pass(self, chunks: Sequence[ScheduledRequestChunk]) -> tuple[list[ScheduledRequest], list[int]]:
        """The speculating chunks' last sampled tokens (verified tokens; the verification pass rewrites their
        K/V in every layer, from the same slots)."""
        batch: list[ScheduledRequest] = []
        where: list[int] = []
        for c in chunks:
            if not c.num_lookahead:
                where.append(-1)
                continue
            req = c.request
            where.append(len(batch))
            batch.append(ScheduledRequest(req.all_token_ids[c.num_computed:c.num_computed + 1], c.num_computed,
                                          c.block_ids, req.request_id, req.num_prompt_tokens))
        return batch, where
