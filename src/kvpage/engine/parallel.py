"""Parallel sampling (``n > 1``): one request, ``n`` completions over the prompt's shared KV blocks.

A request with ``SamplingParams(n=k)`` becomes a *parent* of ``k`` child requests (vLLM's ``ParentRequest``):
the first child computes the prompt; the others wait for its logits, each samples its first token from them
with its own generator (as vLLM samples ``n`` tokens from one prompt pass), then *forks* from it
(:meth:`~kvpage.cache.kv_cache.KVCache.fork`): it shares the whole prompt's blocks by reference, a partial last
block copied on write by every holder but the last writer; the prompt is computed once and held once. (int4/int2
groups share whole blocks: each child recomputes the prompt tokens of a partial last block with its first
token; a child that cannot fork is admitted as a new request and hits the prompt's cached blocks; if the first
child ends before its prompt's logits, the others are admitted on their own.) Greedy completions are identical
by definition, so a greedy parent runs one child and returns its completion ``k`` times. The engine turns the
children's outputs into one :class:`~kvpage.engine.outputs.RequestOutput` per parent with ``k`` completions.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.engine.sequence import Request, RequestStatus


def child_request_id(parent_id: str, index: int) -> str:
    """The engine-internal id of completion ``index`` of ``parent_id``."""
    return f"{parent_id}#{index}"


@dataclass
class ParentRequest:
    """The ``n`` completions of one request, and what the caller has been shown of them.

    Attributes:
        request_id: the id the caller knows.
        n: completions the caller asked for.
        children: the computed child requests, in completion order (one for a greedy parent, whose single
            completion stands for all ``n``).
        held: children not yet admitted: they wait for ``children[0]``'s prompt logits.
        latest: completion index -> the last :class:`CompletionOutput` reported of it (deltas cleared once shown).
    """

    request_id: str
    n: int
    children: list[Request]
    held: list[Request] = field(default_factory=list)
    latest: dict[int, CompletionOutput] = field(default_factory=dict)

    @property
    def replicated(self) -> bool:
        """Whether one computed completion stands for all ``n`` (greedy)."""
        return len(self.children) == 1 and self.n > 1

    @property
    def finished(self) -> bool:
        """Whether every completion has ended."""
        return not self.held and all(c.is_finished for c in self.children)

    def ready_to_release(self) -> bool:
        """Whether the held children must be admitted on their own: the first child ended before its prompt's
        logits came (aborted, failed); otherwise they start from those logits (:meth:`ParallelSampling.take_held`)."""
        return bool(self.held) and self.children[0].is_finished

    def index_of(self, child_id: str) -> int:
        """The completion index of one of the children.

        Raises:
            KeyError: not a child of this parent.
        """
        for i, c in enumerate(self.children):
            if c.request_id == child_id:
                return i
        raise KeyError(f"{child_id!r} is not a child of request {self.request_id!r}")

    def _unreported(self, index: int) -> CompletionOutput:
        """A completion with no output yet: empty, with its child's finish reason if it ended (aborted while held)."""
        child = self.children[0 if self.replicated else index]
        return CompletionOutput(index, "", [], child.finish_reason if child.is_finished else None)

    def merge(self, child_outputs: list[RequestOutput]) -> RequestOutput:
        """One output for the parent: every completion, the deltas of those in ``child_outputs`` (no side effects
        on the children; updates :attr:`latest`)."""
        for i in list(self.latest):  # what was shown before: no delta any more
            self.latest[i] = replace(self.latest[i], delta_text="", delta_token_ids=[])
        for out in child_outputs:
            i = self.index_of(out.request_id)
            for j in (range(self.n) if self.replicated else (i,)):
                self.latest[j] = replace(out.outputs[0], index=j)
        first = self.children[0]
        completions = [self.latest.get(i) or self._unreported(i) for i in range(self.n)]
        ttft = [c.first_token_time - c.arrival_time for c in self.children if c.first_token_time is not None]
        done = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=done,
            metrics=RequestMetrics(
                prompt_tokens=first.num_prompt_tokens,
                output_tokens=sum(len(c.token_ids) for c in completions),
                cached_tokens=max(first.num_cached_tokens, 0),
                time_to_first_token_s=min(ttft) if ttft else None,
                total_time_s=(max((c.finish_time or 0.0) for c in self.children) - first.arrival_time) if done
                else None,
                num_preemptions=sum(c.num_preemptions for c in self.children),
            ),
        )


class ParallelSampling:
    """The engine's parents: which child belongs to whom, admitting held children, merging outputs.

    Tensor-free; the engine calls :meth:`release` after each step and :meth:`fan_in` on each step's outputs.
    """

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self._owner: dict[str, str] = {}  # child id -> parent id

    def add(self, parent: ParentRequest) -> None:
        """Register a parent and its children (the caller queued ``children[0]``; the others are ``held``)."""
        self.parents[parent.request_id] = parent
        for c in parent.children:
            self._owner[c.request_id] = parent.request_id

    def in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished parent or one of its children."""
        return request_id in self.parents or request_id in self._owner

    def owner_of(self, request_id: str) -> str | None:
        """The parent id of child ``request_id`` of an unfinished parent, else ``None`` (a parent's own id too)."""
        return self._owner.get(request_id) if request_id not in self.parents else None

    @property
    def has_held(self) -> bool:
        """Whether some child still waits for its prompt to be computed."""
        return any(p.held for p in self.parents.values())

    def holds_for(self, first: Request) -> bool:
        """Whether ``first`` is the first child of a parent whose other children wait for its prompt's logits (no
        side effects)."""
        pid = self._owner.get(first.request_id)
        parent = None if pid is None else self.parents.get(pid)
        return parent is not None and bool(parent.held) and parent.children[0] is first

    def take_held(self, first: Request) -> list[Request]:
        """The children waiting for ``first``'s prompt (none unless :meth:`holds_for`); they are no longer held
        (the caller starts them from that prompt's logits)."""
        if not self.holds_for(first):
            return []
        parent = self.parents[self._owner[first.request_id]]
        out, parent.held = parent.held, []
        return out

    def release(self) -> list[Request]:
        """The held children whose first sibling ended before its prompt's logits came: admit them as new requests
        (they are no longer held)."""
        out: list[Request] = []
        for p in self.parents.values():
            if p.ready_to_release():
                out.extend(p.held)
                p.held.clear()
        return out

    def fan_in(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs become one output per parent (in the order of their first child output); other
        outputs pass through. A parent whose completions all ended is forgotten after its final output."""
        result: list[RequestOutput] = []
        groups: dict[str, list[RequestOutput]] = {}
        order: list[str | RequestOutput] = []
        for out in outputs:
            pid = self._owner.get(out.request_id)
            if pid is None:
                order.append(out)
                continue
            if pid not in groups:
                groups[pid] = []
                order.append(pid)
            groups[pid].append(out)
        for item in order:
            if isinstance(item, RequestOutput):
                result.append(item)
                continue
            parent = self.parents[item]
            result.append(parent.merge(groups[item]))
            if parent.finished:
                self._forget(parent)
        return result

    def abort(self, request_id: str, finish: Callable[[Request], RequestOutput | None]) -> RequestOutput | None:
        """Abort every completion of parent ``request_id`` (``finish`` ends one child and returns its output;
        held children are ended as aborted without running); the parent's final output, or ``None``."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        outs = []
        for c in parent.held:
            c.status, c.finish_reason = RequestStatus.FINISHED, "abort"
        parent.held.clear()
        for c in parent.children:
            out = finish(c)
            if out is not None:
                outs.append(out)
        merged = parent.merge(outs)
        self._forget(parent)
        return merged

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self._owner.pop(c.request_id, None)
