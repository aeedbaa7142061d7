"""How many torch CPU threads the engine runs with: one rule for ``LLM()`` and every ``kvpage`` sub-command.

The rule (:func:`default_num_threads`), applied when ``num_threads`` / ``--threads`` is not given:

1. ``OMP_NUM_THREADS``, when set to a positive integer (the user chose);
2. torch's current count, when code called ``torch.set_num_threads`` after kvpage's engine
   was imported (the user chose; a count kvpage set itself does not count);
3. otherwise the CPUs this process may use -- ``os.sched_getaffinity`` (a container's
   cpuset), further capped by a cgroup CPU quota (``/sys/fs/cgroup/cpu.max``) --
   minus the other load on the machine: the 1-minute load average, rounded (a process
   that just started adds almost nothing to it; one that ran for a minute counts itself,
   which errs on the side of not oversubscribing), at least 1 and at most torch's
   default (its count when this module was imported: the physical cores, unless set
   before).

So a dedicated 16-core box gets its 16 physical cores, and a busy shared box gets
what is left (on a 2-core box with a load of 2, one thread: a second intra-op
thread there made small ops up to 100x slower whenever anything else ran), and
``torch.set_num_threads(4); LLM()`` runs with 4.

Nothing here runs at import: :func:`apply_num_threads` sets torch's threads when an
engine is built (``torch.set_num_threads`` is process-wide).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

#: One line for ``--help`` texts and docstrings.
RULE_HELP = ("default: OMP_NUM_THREADS if set, else the CPUs this process may use minus the other load "
             "on the machine (1-minute load average, rounded), at least 1, at most torch's default (physical cores)")

_set_by_kvpage: int | None = None  # the value apply_num_threads last gave torch
_AT_IMPORT = torch.get_num_threads()  # torch's default (read, never set, at import)


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count an engine runs with and why.

    Attributes:
        num_threads: torch intra-op threads (>= 1).
        reason: how it was chosen, for the start-up line (e.g. ``"rule: 16 CPUs - load 0"``).
    """

    num_threads: int
    reason: str


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota when one is set (>= 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max", encoding="ascii").read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def other_load() -> int:
    """Busy CPUs on the machine: the 1-minute load average, rounded (>= 0; 0 where it is unknown, not Unix)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0
    return max(0, round(load))


def default_num_threads() -> ThreadChoice:
    """The thread rule of the module docstring, evaluated now (reads the environment, torch, affinity and load).

    Returns:
        the chosen count and the reason, e.g. ``ThreadChoice(1, "rule: 2 CPUs - load 1, at most torch's 2")``.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    current = torch.get_num_threads()
    if current != _AT_IMPORT and current != _set_by_kvpage:
        return ThreadChoice(current, "torch.set_num_threads")
    cpus, load = usable_cpus(), other_load()
    n = min(_AT_IMPORT, max(1, cpus - load))
    return ThreadChoice(n, f"rule: {cpus} CPUs - load {load}, at most torch's {_AT_IMPORT}")


def resolve_num_threads(num_threads: int | None) -> ThreadChoice:
    """``num_threads`` as given (``"set"``), or :func:`default_num_threads` for ``None``.

    Raises:
        ValueError: ``num_threads`` is not a positive integer.
    """
    if num_threads is None:
        return default_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer or None (the rule), got {num_threads!r}")
    return ThreadChoice(num_threads, "set")


def apply_num_threads(num_threads: int | None) -> ThreadChoice:
    """Resolve ``num_threads`` (see :func:`resolve_num_threads`) and give it to ``torch.set_num_threads``.

    Side effect: torch's intra-op thread count changes for the whole process.
    """
    global _set_by_kvpage
    choice = resolve_num_threads(num_threads)
    torch.set_num_threads(choice.num_threads)
    _set_by_kvpage = choice.num_threads
    return choice
