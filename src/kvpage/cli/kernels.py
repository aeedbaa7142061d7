"""``kvpage build-kernels``: compile kvpage's CPU kernels now (``make demo``/``make test`` run it at install) instead
of at the first ``generate``/``serve``; a built copy is only loaded."""
from __future__ import annotations

import argparse
import os
from typing import Any


def add_build_kernels_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``build-kernels`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser."""
    b = sub.add_parser("build-kernels",
                       help="compile the CPU attention kernels now (once per machine, ~1-3 min), not on first use")
    b.set_defaults(func=run_build_kernels)
    return b


def run_build_kernels(args: argparse.Namespace) -> int:
    """``kvpage build-kernels``: build (or load the built) CPU kernels and say where they are, on stdout (the
    command's result; the compile's progress lines go to stderr).

    Returns 0 when they are ready or skipped (``KVPAGE_CPU_KERNELS=0``), 1 when they cannot be built (after the
    one warning of :func:`kvpage.ops.cpu.build.load_kernels`, which names the cause).
    """
    if os.environ.get("KVPAGE_CPU_KERNELS", "1") == "0":
        print("kvpage: CPU kernels skipped (KVPAGE_CPU_KERNELS=0)")
        return 0
    from kvpage.ops.cpu.build import build_dir, load_kernels

    if load_kernels() is None:
        return 1
    print(f"kvpage: CPU kernels ready in {build_dir()}")
    return 0
