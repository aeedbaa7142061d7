"""``Worker``: the engine's worker side, executing what the scheduler side planned (vLLM's worker and model runner).

It holds the tensors' owner (:class:`~kvpage.cache.controller.CacheController`), the tier connector's worker half
and the model runner, and executes plain-data plans: a step's :class:`~kvpage.cache.step_plan.KVStepPlan` (tier
transfers, then copy-on-write copies) and each pass's :class:`~kvpage.cache.step_plan.PassPlan` (the model over
the paged cache). It keeps no bookkeeping and consults none: the same plans replayed on another worker built from
the same spec leave the same bytes in its cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.step_plan import KVStepPlan, PassPlan, TransferReport
from kvpage.cache.tiers.connector import KVConnectorWorker
from kvpage.engine.model_runner import ModelRunner, ScheduledRequest


class Worker:
    """Executes step plans and passes over one engine's cache tensors.

    Args:
        runner: runs the model's passes (its groups: the model's own layers).
        controller: owns the device (and host) tensors; copies blocks.
        connector: the tier connector's worker half, or ``None`` (no tiers).
    """

    def __init__(self, runner: ModelRunner, controller: CacheController,
                 connector: KVConnectorWorker | None = None) -> None:
        self.runner = runner
        self.controller = controller
        self.connector = connector

    def begin_step(self, plan: KVStepPlan) -> None:
        """Start the step's tier transfers (saves read their blocks first), then copy the forked blocks the step
        writes into."""
        if self.connector is not None and plan.connector:
            self.connector.start_load_kv(plan.connector)
        if plan.copies or plan.window_copies:
            self.controller.copy_blocks(plan.copies, plan.window_copies)

    def get_finished(self) -> TransferReport:
        """The tier transfers finished since the last call (nothing without tiers)."""
        return TransferReport() if self.connector is None else self.connector.get_finished()

    def execute(self, batch: Sequence[ScheduledRequest], plan: PassPlan, *, all_logits: bool = False,
                num_layers: int | None = None) -> torch.Tensor:
        """One forward pass of the model as ``plan`` says (see :meth:`ModelRunner.execute`)."""
        return self.runner.execute(batch, plan=plan, all_logits=all_logits, num_layers=num_layers)
