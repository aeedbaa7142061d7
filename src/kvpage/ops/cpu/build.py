"""Compile-on-first-use of kvpage's CPU kernels (the ``.cpp`` files of this folder), cached per machine.

The kernels are a C++ extension built with ``torch.utils.cpp_extension.load``
(ninja and the system C++ compiler; ``ninja`` is a kvpage dependency). The build
is tuned to the CPU it runs on (``-march=native``), so its cache folder is keyed by
the source, the compiler flags, the torch version and the CPU's feature flags:
a machine with other instructions builds its own copy instead of loading one
that would fault; by where the sources and torch live, which the build file names;
and by the toolchain (:func:`toolchain`). The folder is ``$KVPAGE_EXTENSIONS_DIR``
when set, else ``~/.cache/kvpage/extensions``.

The toolchain is pinned, not left to ``PATH``: ninja is the ``ninja`` package's
binary (a kvpage dependency) and the compiler ``$CXX`` or ``c++`` resolved to an
absolute path. torch runs whichever ``ninja`` comes first on ``PATH``, and ninja
1.11 and 1.13 each discard the other's ``.ninja_log`` (log format v5 against v7),
so ``make demo`` (system ninja) and an activated venv (the venv's ninja)
recompiled everything at every switch (issue 28).

A real compile says so on stderr, before (``compiling ... once per machine``) and
after (``... in N s``); loading a built copy is silent. The install step
(``make demo``/``make test``) builds them ahead with ``kvpage build-kernels``.
When the extension cannot be built (no compiler, no ninja, a failed compile)
:func:`load_kernels` warns once, naming the cause (torch's own compiler-check
warnings are off for this build), and returns ``None``; callers fall back to the
reference PyTorch path. ``KVPAGE_CPU_KERNELS=0`` skips the build altogether (no warning);
:func:`kernels_unavailable_reason` says which of the two left them out, for the messages that need them.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

_HERE = Path(__file__).parent
#: Translation units of the extension (bindings.cpp defines the module) and the header they share.
SOURCES = tuple(_HERE / n for n in ("bindings.cpp", "paged_attention.cpp", "write_rows.cpp", "seal_blocks.cpp",
                                    "fused_ops.cpp", "gguf_matmul.cpp", "amx_linear.cpp"))
HEADERS = (_HERE / "kv_common.h",)
#: Compiler flags: ``-fopenmp`` makes ``at::parallel_for`` run on torch's OpenMP threads (its body is inlined from
#: ATen's headers into the kernels: compiled without OpenMP it silently runs serially, measured 1.0x at 2 threads,
#: 1.73x with it, on the Q8_0 LM head); the extension's libgomp is the one torch has already loaded (same soname),
#: so there is one thread pool. ``-fopenmp-simd`` lets ``#pragma omp simd`` vectorize reductions without fast-math;
#: ``-fno-trapping-math`` (no floating-point traps are used) lets floor and selects vectorize (exp, SiLU).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-std=c++17")
#: Linker flags: OpenMP's runtime (see CFLAGS).
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}  # "mod": what load_kernels returned (module or None)
_why: dict[str, str] = {}                   # "why": the reason when it returned None


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


class ToolchainError(RuntimeError):
    """No C++ compiler or no ninja to build the kernels with; the message names which and what to do."""


@dataclass(frozen=True)
class Toolchain:
    """The two programs a build runs, as absolute paths (independent of the caller's ``PATH`` order).

    Attributes:
        ninja: the ninja binary.
        cxx: the compiler command torch writes into ``build.ninja`` (``$CXX`` or ``c++``, its program made
            absolute; any arguments of ``$CXX``, e.g. ``ccache g++``, kept).
    """

    ninja: str
    cxx: str


def _package_ninja() -> str | None:
    """The ``ninja`` Python package's binary (``ninja.BIN_DIR``), or ``None`` when the package or binary is missing."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", "")
    exe = Path(folder) / ("ninja.exe" if os.name == "nt" else "ninja")
    return str(exe) if folder and exe.is_file() and os.access(exe, os.X_OK) else None


def toolchain() -> Toolchain:
    """The ninja and compiler every kvpage build uses, whatever the ``PATH`` order.

    ninja: the ``ninja`` package's binary (the one kvpage's dependency installs next to the interpreter), else
    the first on ``PATH``. Compiler: ``$CXX`` (default ``c++``) with its program resolved on ``PATH``.

    Raises:
        ToolchainError: no ninja, or no compiler (naming ``$CXX``/``c++`` and how to get one).
    """
    ninja = _package_ninja() or shutil.which("ninja")
    if ninja is None:
        raise ToolchainError("no ninja: the 'ninja' package is missing and no ninja is on PATH "
                             "(reinstall kvpage, or install ninja)")
    raw = os.environ.get("CXX") or "c++"
    words = shlex.split(raw) or ["c++"]
    exe = shutil.which(words[0])
    if exe is None:
        via = f"CXX={raw!r}" if os.environ.get("CXX") else "'c++'"
        raise ToolchainError(f"no C++ compiler: {via} not found on PATH (install g++, e.g. apt-get install g++, "
                             f"or set CXX)")
    return Toolchain(ninja=str(Path(ninja).absolute()), cxx=shlex.join([str(Path(exe).absolute()), *words[1:]]))


def _toolchain_or_none() -> Toolchain | None:
    """:func:`toolchain`, or ``None`` where it is incomplete (the key of a build that cannot run does not matter)."""
    try:
        return toolchain()
    except ToolchainError:
        return None


def build_key(tools: Toolchain | None = None) -> str:
    """A short hash of what the binary and its build file depend on: source, flags, torch version, CPU features,
    where the sources and torch live (torch's ``build.ninja`` names both by absolute path, so a second
    checkout or virtual environment sharing the folder made ninja rebuild at every alternation), and the
    toolchain (``tools``, default :func:`toolchain`): the compiler path is written into ``build.ninja`` and the
    ninja binary owns the folder's ``.ninja_log``, so another of either gets its own folder instead of
    rebuilding this one. Neither depends on ``PATH`` order, so ``make`` and an activated venv share one build."""
    tools = tools or _toolchain_or_none()
    h = hashlib.sha256()
    where = f"{_HERE.resolve()}|{Path(torch.__file__).resolve().parent}"
    tool = f"{tools.ninja}|{tools.cxx}" if tools else "incomplete toolchain"
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(),
                 torch.__version__.encode(), _cpu_flags().encode(), where.encode(), tool.encode()):
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


@contextlib.contextmanager
def _pinned_env(tools: Toolchain) -> Iterator[None]:
    """Point torch's build at ``tools`` for the duration: ``tools.ninja``'s folder first on ``PATH`` (torch runs
    plain ``ninja``), ``CXX`` set to ``tools.cxx``, and torch's compiler checks off (``TORCH_DONT_CHECK_COMPILER_ABI``:
    :func:`toolchain` has found the compiler, and a failed compile is reported by :func:`load_kernels`'s one
    warning instead of torch's ``!! WARNING !!`` blocks). Side effect: changes ``os.environ`` of the whole
    process until the block ends, then restores it."""
    names = ("PATH", "CXX", "TORCH_DONT_CHECK_COMPILER_ABI")
    saved = {n: os.environ.get(n) for n in names}
    os.environ["PATH"] = os.pathsep.join([str(Path(tools.ninja).parent), *filter(None, [saved["PATH"]])])
    os.environ["CXX"] = tools.cxx
    os.environ["TORCH_DONT_CHECK_COMPILER_ABI"] = "1"
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _needs_compile(folder: Path, ninja: str) -> bool:
    """Whether a build in ``folder`` will compile: no ``build.ninja`` yet, or ``ninja -n`` (a dry run, which
    writes nothing) has work to do. Errors count as work: the real build will then report them."""
    if not (folder / "build.ninja").is_file():
        return True
    try:
        done = subprocess.run([ninja, "-n"], cwd=folder, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return done.returncode != 0 or "no work to do" not in done.stdout


def _say(message: str) -> None:
    """One progress line on stderr (flushed: it precedes minutes of silence)."""
    print(f"kvpage: {message}", file=sys.stderr, flush=True)


def load_kernels() -> ModuleType | None:
    """The compiled CPU kernels module, building it on first use; ``None`` (after one warning) when it cannot be built.

    Thread-safe; the result (module or failure) is remembered for the process, and later calls (the
    decoder's fused ops ask on every call) return it without taking the lock. Side effects: the first
    call may compile for ~3-5 min, saying so on stderr before and after (a built copy loads silently),
    writes the build folder (:func:`build_dir`), and sets ``PATH``/``CXX`` while torch builds
    (:func:`_pinned_env`).
    """
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod: ModuleType | None = None
        if os.environ.get("KVPAGE_CPU_KERNELS", "1") == "0":
            _why["why"] = DISABLED_REASON
            _state["mod"] = None
            return None
        try:
            from torch.utils.cpp_extension import load

            tools = toolchain()
            key = build_key(tools)
            folder = build_dir(key)
            with _build_lock(folder), _pinned_env(tools):
                compiling = _needs_compile(folder, tools.ninja)
                if compiling:
                    _say(f"compiling the CPU kernels (once per machine; ~3-5 min, longer on a busy machine) "
                         f"in {folder} ...")
                start = time.monotonic()
                mod = load(
                    name=f"kvpage_cpu_{key}",
                    sources=[str(p) for p in SOURCES],
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),
                    build_directory=str(folder),
                    verbose=False,
                )
                if compiling:
                    _say(f"CPU kernels compiled in {time.monotonic() - start:.0f} s")
        except Exception as e:  # noqa: BLE001 - any build failure means: use the reference path
            cause = str(e) if isinstance(e, ToolchainError) else f"{type(e).__name__}: {_tail(str(e))}"
            warnings.warn(
                f"kvpage's CPU attention kernels could not be built ({cause}); "
                f"attention falls back to the reference PyTorch path (slower, same results)",
                RuntimeWarning,
                stacklevel=2,
            )
            mod = None
            _why["why"] = BUILD_FAILED_REASON
        _state["mod"] = mod
        return mod


#: :func:`kernels_unavailable_reason` when ``KVPAGE_CPU_KERNELS=0`` turned the kernels off (no warning is printed).
DISABLED_REASON = "they are turned off by KVPAGE_CPU_KERNELS=0 (unset it to build and use them)"
#: :func:`kernels_unavailable_reason` when the build failed (after :func:`load_kernels`' warning naming the cause).
BUILD_FAILED_REASON = "they could not be built on this machine (see the warning above)"


def kernels_unavailable_reason() -> str | None:
    """Why :func:`load_kernels` returned ``None``, as a clause for messages ("... kernels, which <reason>"):
    :data:`DISABLED_REASON` or :data:`BUILD_FAILED_REASON`; ``None`` when they loaded.

    Calls :func:`load_kernels` (so it may build them, with its side effects) when nothing was tried yet.
    """
    if load_kernels() is not None:
        return None
    return _why.get("why", BUILD_FAILED_REASON)
