"""The CPU kernels' build (issue 28): one pinned toolchain whatever ``PATH`` says, a line on stderr before and after
a real compile and none on a cached load, one warning when there is no compiler.

The compiles here are of a one-function C++ file (``_TINY``, a second or two), never of the real kernels.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import kvpage.ops.cpu.build as cpu_build

SRC = Path(__file__).resolve().parents[1] / "src"

#: A Python extension module without torch headers: what torch's ``load`` builds and imports, in a second.
_TINY = textwrap.dedent("""\
    #include <Python.h>
    #define KV_CAT2(a, b) a##b
    #define KV_CAT(a, b) KV_CAT2(a, b)
    static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
    PyMODINIT_FUNC KV_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
    """)


def _impostor_ninja(folder: Path, log: Path) -> Path:
    """A ``ninja`` in ``folder`` that records each call in ``log``, then runs the real one (any other ninja on
    ``PATH`` first, e.g. /usr/bin's 1.11 ahead of the venv's 1.13, made every switch a full rebuild)."""
    folder.mkdir(parents=True, exist_ok=True)
    real = shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja")
    fake = folder / "ninja"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
    fake.chmod(0o755)
    return fake


def test_the_toolchain_and_key_do_not_depend_on_path_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls"
    fake = _impostor_ninja(tmp_path / "bin", log)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{path}")
    front = cpu_build.toolchain(), cpu_build.build_key()
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{fake.parent}")
    assert (cpu_build.toolchain(), cpu_build.build_key()) == front
    tools = front[0]
    assert tools.ninja != str(fake) and Path(tools.ninja).is_file()
    assert os.path.isabs(tools.cxx.split()[0])
    assert cpu_build.build_key(cpu_build.Toolchain(tools.ninja, "/opt/other/g++")) != front[1]
    assert cpu_build.build_key(cpu_build.Toolchain("/opt/other/ninja", tools.cxx)) != front[1]


def test_torch_runs_the_pinned_ninja_and_compiler_and_the_environment_comes_back(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch's ``['ninja', '-v']`` resolves to at build time, under either PATH order."""
    import torch.utils.cpp_extension as ext

    fake = _impostor_ninja(tmp_path / "bin", tmp_path / "calls")
    path = os.environ["PATH"]
    seen: list[tuple[str | None, str | None, str | None]] = []

    def record(**_: object) -> object:
        seen.append((shutil.which("ninja"), os.environ.get("CXX"), os.environ.get("TORCH_DONT_CHECK_COMPILER_ABI")))
        return object()

    monkeypatch.setattr(ext, "load", record)
    monkeypatch.setenv("KVPAGE_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("CXX", raising=False)
    for order in (f"{fake.parent}{os.pathsep}{path}", f"{path}{os.pathsep}{fake.parent}"):
        monkeypatch.setenv("PATH", order)
        monkeypatch.setattr(cpu_build, "_state", {})
        assert cpu_build.load_kernels() is not None
        assert os.environ["PATH"] == order and "CXX" not in os.environ           # restored
        assert "TORCH_DONT_CHECK_COMPILER_ABI" not in os.environ
    tools = cpu_build.toolchain()
    assert seen == [(tools.ninja, tools.cxx, "1")] * 2


def _ninja_folder(folder: Path, ninja: str) -> None:
    """A trivial build.ninja in ``folder``, built once by ``ninja`` (so a dry run finds no work)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "in.txt").write_text("x")
    (folder / "build.ninja").write_text("rule cp\n  command = cp $in $out\nbuild out.txt: cp in.txt\n")
    subprocess.run([ninja], cwd=folder, check=True, capture_output=True)


def test_a_compile_is_announced_and_a_cached_load_is_silent(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(ext, "load", lambda **_: object())
    monkeypatch.setenv("KVPAGE_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_state", {})
    assert cpu_build.load_kernels() is not None                  # empty folder: no build.ninja, a compile
    err = capsys.readouterr().err
    assert "compiling the CPU kernels (once per machine; ~3-5 min" in err
    assert "CPU kernels compiled in" in err and err.index("compiling") < err.index("compiled in")
    folder = cpu_build.build_dir()
    _ninja_folder(folder, cpu_build.toolchain().ninja)
    monkeypatch.setattr(cpu_build, "_state", {})
    assert cpu_build.load_kernels() is not None                  # ninja -n: no work to do
    assert capsys.readouterr().err == ""
    (folder / "in.txt").write_text("changed")
    later = time.time() + 3600
    os.utime(folder / "in.txt", (later, later))
    monkeypatch.setattr(cpu_build, "_state", {})
    cpu_build.load_kernels()                                     # out of date: a compile again
    assert "compiling the CPU kernels" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["CXX", "PATH"])
def test_no_compiler_gives_one_warning_and_no_torch_block(where: str, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """torch's check printed its ``!! WARNING !!`` block, then kvpage's warning followed (issue 28)."""
    monkeypatch.setenv("KVPAGE_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_build, "_state", {})
    if where == "CXX":
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    else:
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))       # no compiler (and no ninja) on it
    torch_log: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: torch_log.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert cpu_build.load_kernels() is None
    finally:
        logger.removeHandler(handler)
    assert [m for m in torch_log if "WARNING" in m or "compiler" in m] == []
    assert "WARNING !!" not in capfd.readouterr().err
    assert len(got) == 1, [str(w.message) for w in got]
    assert "no C++ compiler" in str(got[0].message) and "reference PyTorch path" in str(got[0].message)


def test_switching_path_order_rebuilds_nothing(tmp_path) -> None:
    """End to end, one process per run as ``make demo`` and an activated venv are: the first run compiles (and
    says so), the next two, with the other order of PATH and back, load the build untouched; the impostor never
    runs."""
    (tmp_path / "tiny.cpp").write_text(_TINY)
    log = tmp_path / "calls"
    fake = _impostor_ninja(tmp_path / "bin", log)
    script = textwrap.dedent(f"""\
        from pathlib import Path
        import kvpage.ops.cpu.build as b
        b.SOURCES, b.HEADERS = (Path({str(tmp_path / 'tiny.cpp')!r}),), ()
        assert b.load_kernels() is not None
        """)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PYTHONPATH=str(SRC), KVPAGE_EXTENSIONS_DIR=str(tmp_path / "ext"))
    orders = [f"{fake.parent}{os.pathsep}{os.environ['PATH']}", f"{os.environ['PATH']}{os.pathsep}{fake.parent}"]
    errs, logs = [], []
    for i in range(3):
        run = subprocess.run([sys.executable, "-c", script], env={**env, "PATH": orders[i % 2]},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        errs.append(run.stderr)
        (folder,) = (tmp_path / "ext").iterdir()
        logs.append((folder / ".ninja_log").read_bytes())
    assert "compiling the CPU kernels" in errs[0] and "compiled in" in errs[0]
    assert errs[1:] == ["", ""]
    assert logs[1:] == [logs[0]] * 2                              # ninja recorded no further command
    assert not log.exists()


def test_build_kernels_says_its_result_on_stdout(tmp_path) -> None:
    """``kvpage build-kernels`` prints its outcome on stdout (the README's Quickstart runs it and a script reads it);
    the compile's progress lines stay on stderr. Regression: both went to stderr, so the command printed nothing."""
    (tmp_path / "tiny.cpp").write_text(_TINY)
    script = textwrap.dedent(f"""\
        import sys
        from pathlib import Path
        import kvpage.ops.cpu.build as b
        b.SOURCES, b.HEADERS = (Path({str(tmp_path / 'tiny.cpp')!r}),), ()
        from kvpage.cli import main
        sys.exit(main(["build-kernels"]))
        """)
    env = {**os.environ, "PYTHONPATH": str(SRC), "KVPAGE_EXTENSIONS_DIR": str(tmp_path / "ext")}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    (folder,) = (tmp_path / "ext").iterdir()
    assert [r.stdout for r in runs] == [f"kvpage: CPU kernels ready in {folder}\n"] * 2
    assert "compiling the CPU kernels" in runs[0].stderr and runs[1].stderr == ""
    skipped = subprocess.run([sys.executable, "-m", "kvpage.cli", "build-kernels"], capture_output=True, text=True,
                             env={**env, "KVPAGE_CPU_KERNELS": "0"}, timeout=120)
    assert (skipped.returncode, skipped.stdout) == (0, "kvpage: CPU kernels skipped (KVPAGE_CPU_KERNELS=0)\n")
