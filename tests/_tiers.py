"""A test harness for the tiers: a :class:`~kvpage.cache.kv_cache.KVCache` with both halves of the tier connector,
driven through steps the way the engine drives them.

The engine's step (``kvpage.engine.engine.LLMEngine._step``)::

    kv.begin_step(); ...match / allocate...; plan = kv.step_plan()    # the scheduler side decides
    worker.start_load_kv(plan.connector); copy_blocks(plan.copies)   # the worker performs (saves before loads)
    update = kv.poll(worker.get_finished())                          # what finished; requests ready or cut short

:class:`Tiers` runs those calls and nothing else: every copy a test observes went through a
:class:`~kvpage.cache.step_plan.TransferOp` the worker performed and reported. A worker built with ``load_delay=k``
performs and reports loads ``k`` ``get_finished()`` calls late (in-flight states); saves it performs as soon as it is
handed them, and they are acknowledged (host blocks readable, freed) only once a poll processes its report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.cache.controller import CacheController
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest, KVUpdate
from kvpage.cache.step_plan import KVStepPlan, TransferReport
from kvpage.cache.tiers.connector import TieredConnector
from kvpage.cache.tiers.host import TieredWorker
from kvpage.cache.tiers.offload import OffloadManager


def merge(a: KVUpdate, b: KVUpdate) -> KVUpdate:
    """``a`` then ``b`` (a later cut of the same request wins)."""
    return KVUpdate(a.ready + b.ready, {**a.cut_short, **b.cut_short}, a.recompute + b.recompute)


@dataclass
class Tiers:
    """The scheduler side (``kv`` with ``connector``) and the worker side (``worker`` over ``controller``).

    Attributes:
        updates: every :class:`KVUpdate` a poll returned, in order.
    """

    controller: CacheController
    kv: KVCache
    connector: TieredConnector
    worker: TieredWorker
    updates: list[KVUpdate] = field(default_factory=list)

    @property
    def offload(self) -> OffloadManager:
        return self.connector.offload

    def hand_out(self) -> KVStepPlan:
        """End the scheduling pass: the step plan goes to the worker (its transfers in order, then the
        copy-on-write copies); a new scheduling pass begins (``begin_step``). Nothing is polled."""
        plan = self.kv.step_plan()
        self.worker.start_load_kv(plan.connector)
        if plan.copies or plan.window_copies:
            self.controller.copy_blocks(plan.copies, plan.window_copies)
        self.kv.begin_step()
        return plan

    def poll(self, report: TransferReport | None = None) -> KVUpdate:
        """Hand the cache the worker's report (default: ``worker.get_finished()``, which also performs the loads
        whose delay ran out)."""
        up = self.kv.poll(self.worker.get_finished() if report is None else report)
        self.updates.append(up)
        return up

    def step(self) -> KVUpdate:
        """One step boundary: :meth:`hand_out`, then :meth:`poll`."""
        self.hand_out()
        return self.poll()

    def settle(self, max_steps: int = 64) -> KVUpdate:
        """Steps until a step hands the worker nothing new and it holds no deferred load: every transfer issued so
        far was performed and its report processed (saves issued by those acknowledgements included), except
        reports a test took from the worker itself. Returns their updates merged."""
        out = KVUpdate()
        for _ in range(max_steps):
            plan = self.hand_out()
            out = merge(out, self.poll())
            if not plan.connector and not self.worker.num_deferred:
                return out
        raise AssertionError(f"the tiers did not settle in {max_steps} steps")

    def admit(self, req: KVRequest) -> tuple[tuple[int, ...], int]:
        """Admit ``req`` for all its tokens in a step of its own and let every transfer finish; return its block
        table and the tokens served from the device and the tiers (fewer than promised when a load was cut short).
        """
        self.kv.begin_step()
        match = self.kv.match(req)
        blocks = self.kv.allocate(req, len(req.all_token_ids) - match.num_computed_tokens, match)
        assert blocks is not None
        up = self.settle()
        assert not self.kv.is_loading(req)
        return blocks.block_ids, up.cut_short.get(req.request_id, blocks.num_computed_tokens)
