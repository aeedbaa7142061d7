"""The tiers' policy knobs: host write policies, preemption modes and the directions tier bytes are counted in.

Plain validated values, imported by the tier connector (:mod:`kvpage.cache.tiers.connector`), the factory
(:mod:`kvpage.cache.tiers.host`) and the engine's argument checks; imports nothing from ``kvpage``.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Host write policies (SGLang HiCache names).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
#: Preemption modes (vLLM's ``preemption_mode``).
PREEMPTION_MODES = ("recompute", "swap")

#: Directions of :attr:`~kvpage.cache.tiers.connector.OffloadStats.tier_bytes`.
DIRECTIONS = ("device_to_host", "host_to_device", "store_read", "store_write")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Policy knobs of the tiers.

    Attributes:
        write_policy: one of :data:`WRITE_POLICIES` (how blocks reach the host tier).
        write_through_threshold: uses of a block before ``write_through_selective`` backs it up (>= 1).
        preemption_mode: ``"recompute"`` (free and recompute later) or ``"swap"`` (copy to host blocks).
        load_deadline_s: seconds an aborted request's loading device blocks are held
            waiting for their load before they return to the pool anyway (case C10).
        store_reads: probe and load the stores on a prefix miss (``False`` for a ``kv_producer``).
        store_writes: write newly cached blocks to the stores (``False`` for a ``kv_consumer``).

    Raises:
        ValueError: an unknown policy or mode, a threshold < 1, or a deadline < 0.
    """

    write_policy: str = "write_through"
    write_through_threshold: int = 2
    preemption_mode: str = "recompute"
    load_deadline_s: float = 30.0
    store_reads: bool = True
    store_writes: bool = True

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {', '.join(WRITE_POLICIES)}; got {self.write_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {self.preemption_mode!r}")
        if isinstance(self.write_through_threshold, bool) or int(self.write_through_threshold) != self.write_through_threshold \
                or self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be an integer >= 1, got {self.write_through_threshold!r}")
        if not self.load_deadline_s >= 0:
            raise ValueError(f"load_deadline_s must be >= 0 seconds, got {self.load_deadline_s!r}")
