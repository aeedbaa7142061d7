"""Compile-on-first-use of kvpage's CPU kernels (the ``.cpp`` files of this folder), cached per machine.

The kernels are a C++ extension built with ``torch.utils.cpp_extension.load``
(ninja and the system C++ compiler; ``ninja`` is a kvpage dependency). The build
is tuned to the CPU it runs on (``-march=native``), so its cache folder is keyed by
the source, the compiler flags, the torch version and the CPU's feature flags:
a machine with other instructions builds its own copy instead of loading one
that would fault; and by where the sources and torch live, which the build file names. The folder is ``$KVPAGE_EXTENSIONS_DIR`` when set, else
``~/.cache/kvpage/extensions``.

When the extension cannot be built (no compiler, no ninja, a failed compile)
:func:`load_kernels` warns once, naming the cause, and returns ``None``; callers
fall back to the reference PyTorch path. ``KVPAGE_CPU_KERNELS=0`` skips the
build altogether.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

_HERE = Path(__file__).parent
#: Translation units of the extension (bindings.cpp defines the module) and the header they share.
SOURCES = tuple(_HERE / n for n in ("bindings.cpp", "paged_attention.cpp", "write_rows.cpp", "fused_ops.cpp"))
HEADERS = (_HERE / "kv_common.h",)
#: Compiler flags: ``-fopenmp-simd`` lets ``#pragma omp simd`` vectorize reductions without fast-math;
#: ``-fno-trapping-math`` (no floating-point traps are used) lets floor and selects vectorize (exp, SiLU).
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-std=c++17")

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def _cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or the platform's description where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _tail(message: str, lines: int = 6) -> str:
    """The last lines of a build error (where the compiler or linker says what failed), on one line."""
    return " | ".join(line.strip() for line in message.strip().splitlines()[-lines:])[-800:]


def build_key() -> str:
    """A short hash of what the binary and its build file depend on: source, flags, torch version, CPU features,
    and where the sources and torch live (torch's ``build.ninja`` names both by absolute path, so a second
    checkout or virtual environment sharing the folder made ninja rebuild at every alternation)."""
    h = hashlib.sha256()
    where = f"{_HERE.resolve()}|{Path(torch.__file__).resolve().parent}"
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 _cpu_flags().encode(), where.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_dir(key: str | None = None) -> Path:
    """Where the compiled extension of this machine lives (created when missing); ``key`` defaults to :func:`build_key`."""
    root = Path(os.environ.get("KVPAGE_EXTENSIONS_DIR") or Path.home() / ".cache" / "kvpage" / "extensions")
    d = root / f"cpu_kernels_{key or build_key()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold an OS file lock on ``folder`` while torch builds or loads there, and clear a stale torch ``lock``.

    torch's own ``lock`` file is a plain file that a build killed half-way leaves behind, after which every later
    build waits on it forever. The OS lock (``flock``) dies with its process, so whoever holds it knows no other
    process is building in ``folder``: a torch ``lock`` left there is stale and is removed. Without ``fcntl``
    (Windows) only torch's lock is used.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(folder / ".kvpage-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_kernels() -> ModuleType | None:
    """The compiled CPU kernels module, building it on first use; ``None`` (after one warning) when it cannot be built.

    Thread-safe; the result (module or failure) is remembered for the process, and later calls (the
    decoder's fused ops ask on every call) return it without taking the lock. Side effect: the first
    call may compile for ~30-60 s and writes the build folder (:func:`build_dir`).
    """
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod: ModuleType | None = None
        if os.environ.get("KVPAGE_CPU_KERNELS", "1") == "0":
            _state["mod"] = None
            return None
        try:
            from torch.utils.cpp_extension import load

            key = build_key()
            folder = build_dir(key)
            with _build_lock(folder):
                mod = load(
                    name=f"kvpage_cpu_{key}",
                    sources=[str(p) for p in SOURCES],
                    extra_cflags=list(CFLAGS),
                    build_directory=str(folder),
                    verbose=False,
                )
        except Exception as e:  # noqa: BLE001 - any build failure means: use the reference path
            warnings.warn(
                f"kvpage's CPU attention kernels could not be built ({type(e).__name__}: {_tail(str(e))}); "
                f"attention falls back to the reference PyTorch path (slower, same results)",
                RuntimeWarning,
                stacklevel=2,
            )
            mod = None
        _state["mod"] = mod
        return mod
