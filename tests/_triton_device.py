"""Where the Triton tests' kernels run, and Triton's interpreter switch around their imports.

The CPU suite runs the kernels under Triton's interpreter; ``KVPAGE_TRITON_TEST_DEVICE=cuda`` (the device check,
``benchmarks/gpu_check.sh``) runs them compiled on CUDA, with ``TRITON_INTERPRET`` unset. Triton decides
interpreted or compiled when a kernel is decorated, so a test module imports its kernels inside
:func:`interpreted_imports` (``TRITON_INTERPRET=1`` set on the CPU for the imports only, restored after: other test
files collected into the same pytest-xdist worker do not inherit it) and turns the switch on for its own tests
with the autouse fixture :func:`interpreter` (import it into the module).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

#: Where the kernels run: the CPU under the interpreter (the suite), or ``cuda`` (compiled; a GPU machine's check).
DEVICE = torch.device(os.environ.get("KVPAGE_TRITON_TEST_DEVICE", "cpu"))
#: The kernels run interpreted on the CPU.
ON_CPU = DEVICE.type == "cpu"


def skip_module_without_device() -> None:
    """Skip the calling test module when ``KVPAGE_TRITON_TEST_DEVICE=cuda`` names a device torch does not see.

    Side effect: raises pytest's module-level skip; call it at module level, before the kernel imports.
    """
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVPAGE_TRITON_TEST_DEVICE=cuda but torch sees no CUDA device", allow_module_level=True)


@contextmanager
def interpreted_imports() -> Iterator[None]:
    """Within the block, ``TRITON_INTERPRET=1`` on the CPU (left as found on CUDA); afterwards exactly as before.

    Side effect: sets and restores the process's ``TRITON_INTERPRET`` environment variable.
    """
    before = os.environ.get("TRITON_INTERPRET")
    if ON_CPU:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's switch, on for the importing module's tests on the CPU only (the backend refuses the CPU
    without it)."""
    if ON_CPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
