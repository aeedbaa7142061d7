"""``ModelRunner``: one forward pass of the model over the paged cache for a batch of scheduled requests.

It turns the scheduler's view (each request's new tokens, how many of its
tokens are already cached, its block table) into the model's inputs
(concatenated ``input_ids`` and ``positions``) and the attention op's
:class:`~kvpage.ops.attention.AttentionMetadata`, and hands the model an
:class:`~kvpage.model.attention_fn.AttentionFn` that sends each layer to its
group's :class:`~kvpage.engine.group_attention.GroupAttention`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.engine.group_attention import GroupAttention, StepLayout
from kvpage.model.attention_fn import CausalLM, early_exit, layer_attention
from kvpage.ops.attention import AttentionMetadata
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


class ModelRunner:
    """Runs a model family on the paged cache, one attention backend per layer group.

    Args:
        model: has ``forward(input_ids [T], positions [T], attn) -> hidden [T, hidden]``
            and ``compute_logits(hidden [N, hidden]) -> float32 [N, vocab]``.
        spec: the cache layout.
        backends: one per layer group of ``spec`` (:func:`~kvpage.engine.group_attention.group_attention_for`); each
            :meth:`execute` begins and ends a step on every backend and routes each layer to its group's.
        device: where inputs are built.
        groups: names of the layer groups ``model`` runs (default every group of ``spec``): the target
            runs ``("main",)`` beside a draft model, whose own runner runs ``("draft",)``.
        layer_offset: added to the model's layer index to get the global one (a draft model counts
            its layers from 0; its group starts after the main layers).

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
    ) -> None:
        self.model = model
        self.spec = spec
        self.backends = tuple(backends)
        self.device = device
        self.layer_offset = layer_offset
        self._by_layer: dict[int, GroupAttention] = {}
        for b in self.backends:
            for i in b.group.layer_indices:
                if i in self._by_layer:
                    raise ValueError(f"layer {i} has two attention backends")
                self._by_layer[i] = b
        names = [g.name for g in spec.groups] if groups is None else list(groups)
        wanted = [i for g in spec.groups if g.name in names for i in g.layer_indices]
        missing = [i for i in wanted if i not in self._by_layer]
        if missing:
            raise ValueError(f"layers {missing} have no attention backend")
        # each layer's scale, sliding window and soft-cap, as the model family states them (global index)
        self._params = {i: layer_attention(model, i - layer_offset) for i in wanted}

    def build_metadata(self, batch: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 and the attention metadata for ``batch``."""
        bs = self.spec.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for r in batch:
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            rng = range(r.num_computed, r.num_computed + n)
            pos.extend(rng)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in rng)
        meta = AttentionMetadata.build(
            block_tables=[r.block_ids for r in batch],
            seq_lens=[r.num_computed + len(r.token_ids) for r in batch],
            query_lens=[len(r.token_ids) for r in batch],
            slot_mapping=slots,
            block_size=bs,
            device=self.device,
        )
        as_long = lambda xs: torch.as_tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_long(ids), as_long(pos), meta

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest], *, all_logits: bool = False,
                num_layers: int | None = None, final: bool = True) -> torch.Tensor:
        """Run ``batch``, writing every new token's K/V to the cache.

        Args:
            batch: the requests' new tokens, cached lengths and block tables.
            all_logits: return the logits of every new token, not only each request's
                last one (for perplexity over a prompt chunk, :mod:`kvpage.eval`; the
                lm_head then runs on all ``T`` tokens, so leave it off for generation).
            num_layers: run only the model's first this many layers, then its final norm and LM head
                (the ``layer_skip`` self-draft; the model needs ``forward_layers``). Default all.
            final: ``False`` for a draft pass before the step's verification pass over the same
                layers: the step's promised tail slots stay for that pass.

        A forward pass that raises leaves the cache fit for running the same requests' tokens again
        (each backend's ``abort_step``): the engine re-runs them to find which request failed.

        Returns:
            ``[sum(num_logits), vocab]`` float32 logits: each request's last ``num_logits`` new tokens
            (one row each by default: ``[len(batch), vocab]``), in batch order; or with
            ``all_logits`` ``[T, vocab]`` for all ``T`` new tokens in batch order (request
            ``i``'s rows are ``query_start_loc[i]:query_start_loc[i+1]``).

        Raises:
            ValueError: a request's ``num_logits`` outside ``[1, len(token_ids)]``.
        """
        input_ids, positions, meta = self.build_metadata(batch)
        step = StepLayout(
            meta=meta,
            block_tables=tuple(r.block_ids for r in batch),
            owners=tuple(r.request_id for r in batch),
            prompt_lens=tuple(r.num_prompt_tokens for r in batch),
            draft_lens=tuple(r.num_draft for r in batch),
            final=final,
        )
        by_layer, offset, params = self._by_layer, self.layer_offset, self._params

        def attn(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
            i = layer_index + offset
            return by_layer[i].attend(i, q, k, v, params[i])

        rows: list[int] | None = None
        if not all_logits and any(r.num_logits != 1 for r in batch):
            rows = []
            for r, end in zip(batch, meta.query_start_loc[1:]):
                if not 1 <= r.num_logits <= len(r.token_ids):
                    raise ValueError(f"num_logits={r.num_logits} must be in [1, {len(r.token_ids)}] "
                                     f"(request {r.request_id!r})")
                rows.extend(range(int(end) - r.num_logits, int(end)))

        started: list[GroupAttention] = []
        ran = False
        try:
            for b in self.backends:
                b.begin_step(step, self.device)
                started.append(b)
            if num_layers is None:
                hidden = self.model(input_ids, positions, attn)              # [T, hidden]
            else:
                hidden = early_exit(self.model)(input_ids, positions, attn, num_layers)
            if all_logits:
                logits = self.model.compute_logits(hidden)                    # [T, vocab]
            else:
                pick = (torch.as_tensor(meta.query_start_loc[1:], device=self.device) - 1 if rows is None
                        else torch.as_tensor(rows, dtype=torch.long, device=self.device))
                logits = self.model.compute_logits(hidden[pick])             # [B or sum(num_logits), vocab]
            ran = True
        finally:
            for b in started:
                if ran:
                    b.end_step()
                else:
                    b.abort_step()  # a re-run of the same batch (or of one request of it) must still work
        return logits
