"""``ModelRunner``: one forward pass of the model over the paged cache, executing the pass's plan.

It turns the scheduler's view (each request's new tokens, how many of its tokens are already cached, its block
table) into the model's inputs (concatenated ``input_ids`` and ``positions``), and the pass's
:class:`~kvpage.cache.step_plan.PassPlan` (made by :meth:`~kvpage.cache.kv_cache.KVCache.plan_pass` on the
scheduler side) into each group's :class:`~kvpage.engine.group_attention.GroupAttention`; the model gets an
:class:`~kvpage.model.attention_fn.AttentionFn` that sends each layer to its group's. It decides nothing about the
cache: the plan says where every token is written and read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.cache.step_plan import PassPlan, PassRequest
from kvpage.cache.tiers.connector import KVConnectorWorker
from kvpage.engine.group_attention import GroupAttention
from kvpage.model.attention_fn import CausalLM, early_exit, layer_attention
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.staging import to_device
from kvpage.spec import CacheSpec


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a forward pass.

    Attributes:
        token_ids: the new tokens to run (prefill chunk, or the last sampled token in decode).
        num_computed: tokens of the request already in the cache (they precede ``token_ids``).
        block_ids: the request's block table; must cover ``num_computed + len(token_ids)`` tokens.
        request_id: who owns the full-precision window copies of quantize-on-seal formats
            this request makes (only it reads them; :mod:`kvpage.cache.tail`).
        num_prompt_tokens: the request's prompt length: its prompt-only blocks get no window
            copy, so a cached prefix reads the same as a computed one. 0 treats every token
            as generated (``kvpage eval``'s decode mode).
        num_draft: the request's last this many positions after this step are unverified draft tokens
            (speculative decoding): a quantize-on-seal block they fill keeps its 16-bit rows until
            verified. Usually the tail of ``token_ids``; a drafter's later passes reach before them.
        num_logits: logits rows returned for this request: those of its last ``num_logits`` tokens
            (1: the next token; ``1 + num_draft`` to verify drafts).
    """

    token_ids: Sequence[int]
    num_computed: int
    block_ids: Sequence[int]
    request_id: str | None = None
    num_prompt_tokens: int = 0
    num_draft: int = 0
    num_logits: int = 1

    def layout(self) -> PassRequest:
        """What the cache plans for it (its tokens aside)."""
        return PassRequest(self.request_id, self.num_computed, len(self.token_ids), tuple(self.block_ids),
                           self.num_prompt_tokens, self.num_draft)


def pass_requests(batch: Sequence[ScheduledRequest]) -> tuple[PassRequest, ...]:
    """The batch as the cache plans it (:meth:`~kvpage.cache.kv_cache.KVCache.plan_pass`)."""
    return tuple(r.layout() for r in batch)


class ModelRunner:
    """Runs a model family on the paged cache, one group attention per layer group, each pass from its plan.

    Args:
        model: has ``forward(input_ids [T], positions [T], attn) -> hidden [T, hidden]``
            and ``compute_logits(hidden [N, hidden]) -> float32 [N, vocab]``.
        spec: the cache layout.
        backends: one per layer group the model runs (:func:`~kvpage.engine.group_attention.group_attention_for`).
        device: where inputs are built.
        groups: names of the layer groups ``model`` runs (default every group of ``spec``): the target
            runs ``("main",)`` (and ``"sliding"``) beside a draft model, whose own runner runs ``("draft",)``.
        layer_offset: added to the model's layer index to get the global one (a draft model counts
            its layers from 0; its group starts after the main layers).
        connector: the tier connector's worker half, told of each layer (``wait_for_layer_load`` before it reads,
            ``save_kv_layer`` after it wrote) and of the pass's end (``wait_for_save``); ``None``: no tiers.

    Raises:
        ValueError: the backends do not cover every layer of those groups exactly once.
    """

    def __init__(
        self,
        model: CausalLM,
        spec: CacheSpec,
        backends: Sequence[GroupAttention],
        device: torch.device,
        *,
        groups: Sequence[str] | None = None,
        layer_offset: int = 0,
        connector: KVConnectorWorker | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.backends = tuple(backends)
        self.device = device
        self.layer_offset = layer_offset
        self.connector = connector
        self._by_layer: dict[int, GroupAttention] = {}
        for b in self.backends:
            for i in b.group.layer_indices:
                if i in self._by_layer:
                    raise ValueError(f"layer {i} has two attention backends")
                self._by_layer[i] = b
        names = [g.name for g in spec.groups] if groups is None else list(groups)
        self.groups: tuple[str, ...] = tuple(names)
        wanted = [i for g in spec.groups if g.name in names for i in g.layer_indices]
        missing = [i for i in wanted if i not in self._by_layer]
        if missing:
            raise ValueError(f"layers {missing} have no attention backend")
        # each layer's scale, sliding window and soft-cap, as the model family states them (global index)
        self._params = {i: layer_attention(model, i - layer_offset) for i in wanted}

    def inputs(self, batch: Sequence[ScheduledRequest], plan: PassPlan) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 AttentionMetadata]:
        """``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 and the pass's attention metadata (block ids).

        Raises:
            ValueError: the plan is not this batch's (requests, positions or lengths differ).
        """
        if len(plan.requests) != len(batch) or any(
                p.num_computed != r.num_computed or p.num_new != len(r.token_ids) or p.block_ids != tuple(r.block_ids)
                for p, r in zip(plan.requests, batch)):
            raise ValueError(f"pass plan {plan.plan_id} was made for another batch "
                             f"({[(p.num_computed, p.num_new) for p in plan.requests]} vs "
                             f"{[(r.num_computed, len(r.token_ids)) for r in batch]})")
        ids = [t for r in batch for t in r.token_ids]
        pos = [p for r in batch for p in range(r.num_computed, r.num_computed + len(r.token_ids))]
        meta = AttentionMetadata.build(block_tables=plan.block_tables, seq_lens=plan.seq_lens,
                                       query_lens=plan.query_lens, slot_mapping=plan.slot_mapping,
                                       block_size=plan.block_size, device=self.device)
        return to_device(ids, torch.long, self.device), to_device(pos, torch.long, self.device), meta

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest], plan: PassPlan, *, all_logits: bool = False,
                num_layers: int | None = None) -> torch.Tensor:
        """Run ``batch`` as ``plan`` says, writing every new token's K/V to the cache.

        Args:
            batch: the requests' new tokens, cached lengths and block tables.
            plan: the pass's plan (:meth:`~kvpage.cache.kv_cache.KVCache.plan_pass` of ``pass_requests(batch)`` over
                this runner's groups); the caller commits or aborts it after.
            all_logits: return the logits of every new token, not only each request's last one (for perplexity over
                a prompt chunk, :mod:`kvpage.eval`; the lm_head then runs on all ``T`` tokens, so leave it off for
                generation).
            num_layers: run only the model's first this many layers, then its final norm and LM head (the
                ``layer_skip`` self-draft; the model needs ``forward_layers``). Default all.

        Returns:
            ``[sum(num_logits), vocab]`` float32 logits: each request's last ``num_logits`` new tokens (one row each
            by default: ``[len(batch), vocab]``), in batch order; or with ``all_logits`` ``[T, vocab]`` for all ``T``
            new tokens in batch order (request ``i``'s rows are ``query_start_loc[i]:query_start_loc[i+1]``).

        Raises:
            ValueError: a request's ``num_logits`` outside ``[1, len(token_ids)]``; a plan of another batch, or one
                that does not plan a group this runner runs.
        """
        input_ids, positions, meta = self.inputs(batch, plan)
        by_layer, offset, params, conn = self._by_layer, self.layer_offset, self._params, self.connector

        def attn(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
            i = layer_index + offset
            if conn is not None:
                conn.wait_for_layer_load(i)
            out = by_layer[i].attend(i, q, k, v, params[i])
            if conn is not None:
                conn.save_kv_layer(i)
            return out

        rows: list[int] | None = None
        if not all_logits and any(r.num_logits != 1 for r in batch):
            rows = []
            for r, end in zip(batch, meta.query_start_loc[1:]):
                if not 1 <= r.num_logits <= len(r.token_ids):
                    raise ValueError(f"num_logits={r.num_logits} must be in [1, {len(r.token_ids)}] "
                                     f"(request {r.request_id!r})")
                rows.extend(range(int(end) - r.num_logits, int(end)))
        planned = {g.group: g for g in plan.groups}
        missing = [b.group.name for b in self.backends if b.group.name not in planned]
        if missing:
            raise ValueError(f"pass plan {plan.plan_id} does not plan layer groups {missing} this runner runs")
        try:
            for b in self.backends:
                b.prepare(plan, planned[b.group.name], meta, self.device)
            if num_layers is None:
                hidden = self.model(input_ids, positions, attn)              # [T, hidden]
            else:
                hidden = early_exit(self.model)(input_ids, positions, attn, num_layers)
            if all_logits:
                logits = self.model.compute_logits(hidden)                    # [T, vocab]
            else:
                pick = to_device([q - 1 for q in meta.query_start_loc[1:]] if rows is None else rows, torch.long,
                                 self.device)
                logits = self.model.compute_logits(hidden[pick])             # [B or sum(num_logits), vocab]
            if conn is not None:
                conn.wait_for_save()
        finally:
            for b in self.backends:
                b.finish()
        return logits
