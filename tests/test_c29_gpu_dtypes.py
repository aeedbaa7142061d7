"""Case C29 (FastDeploy PR 7757, the seed, on the device it happened on): an ``int8`` or ``fp8`` cache with draft/MTP
layers allocates every main and draft tensor in the spec's storage dtype, never the model dtype, and the Triton
kernels refuse a cache tensor whose dtype disagrees, naming layer, expected and actual.

In the CPU suite the allocation runs on ``meta`` and the kernels under Triton's interpreter; with
``KVPAGE_TRITON_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``) the allocation also runs on CUDA and the kernels
compiled. The refusal is :meth:`kvpage.spec.LayerSpec.validate`, the one check every backend calls before it writes.
"""
from __future__ import annotations


import pytest
import torch

from _triton_device import DEVICE, ON_CPU, interpreter, skip_module_without_device  # noqa: F401  (interpreter: autouse)

skip_module_without_device()

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.cache.tail import TailTable  # noqa: E402
from kvpage.cache.tail.pool import TailPool  # noqa: E402
from kvpage.errors import KVCacheLayoutError  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.spec import CacheSpec, TailLayout  # noqa: E402
from _spec_alloc import check_quantized_main_and_draft_allocation  # noqa: E402

#: The seed's formats (fp8 as vLLM names its per-token-head variant too).
SEED_FORMATS = ["int8", "fp8", "fp8_per_token_head"]



@pytest.mark.parametrize("device", ["meta"] + ([] if ON_CPU else [DEVICE.type]))
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", SEED_FORMATS)
def test_c29_main_and_draft_tensors_take_the_spec_dtype_never_the_model_dtype(
        fmt: str, model_dtype: torch.dtype, device: str) -> None:
    """The seed's scenario on ``meta`` (and on CUDA in the device check): case C01's check, for the seed's formats."""
    check_quantized_main_and_draft_allocation(fmt, model_dtype, device)


def _draft_layer_in_the_model_dtype(fmt: str) -> tuple[CacheSpec, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two model layers and one draft layer (global index 2) in ``fmt``; the draft layer's ``key`` replaced by a tensor
    allocated as the seed's bug did -- in the model dtype (bfloat16), one value per element. Returns the spec, the
    good cache and the bad one (sharing every other tensor)."""
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=64, block_size=8, kv_cache_dtype=fmt,
                           num_draft_layers=1, model_dtype=torch.bfloat16)
    good = dict(CacheController(spec, DEVICE).allocate_device(4)[2])
    bad = dict(good, key=torch.zeros(4, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE))
    return spec, good, bad


def _step() -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]]:
    meta = AttentionMetadata.build(block_tables=[[1]], seq_lens=[1], query_lens=[1], slot_mapping=[8], block_size=8,
                                   device=DEVICE)
    return meta, tuple(torch.randn(1, h, 64, device=DEVICE, dtype=torch.bfloat16) for h in (4, 2, 2))


def _bytes(cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.uint8).clone() for n, t in cache.items()}


@pytest.mark.parametrize("fmt", SEED_FORMATS)
def test_c29_triton_write_and_attention_refuse_a_draft_cache_in_the_model_dtype(fmt: str) -> None:
    """Token-wise formats: the draft layer's spec-shaped cache is served (write + attention); the same call over a
    ``key`` in bfloat16 raises naming layer 2, ``key``, uint8 and bfloat16, before any byte is written."""
    TritonBackend = pytest.importorskip("kvpage.ops.backends.triton").TritonBackend
    spec, good, bad = _draft_layer_in_the_model_dtype(fmt)
    meta, (q, k, v) = _step()
    out = TritonBackend().forward(q, k, v, good, spec.layer(2), meta, layer_index=2)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()
    before = _bytes(bad)
    with pytest.raises(KVCacheLayoutError, match=r"layer 2: cache tensor 'key' expected dtype torch\.uint8 .*"
                                                 r"got dtype torch\.bfloat16"):
        TritonBackend().forward(q, k, v, bad, spec.layer(2), meta, layer_index=2)
    assert all(torch.equal(before[n], t.view(torch.uint8)) for n, t in bad.items())


def test_c29_triton_sealed_path_refuses_a_draft_cache_in_the_model_dtype() -> None:
    """``int4`` (write, seal, sealed-block attention): as above through ``forward_sealed``."""
    TritonBackend = pytest.importorskip("kvpage.ops.backends.triton").TritonBackend
    spec, good, bad = _draft_layer_in_the_model_dtype("int4")
    meta, (q, k, v) = _step()
    layout = TailLayout(num_slots=4, num_sink_slots=1, window_blocks=0)

    def ctx():  # a fresh tail and plan per call (a plan is consumed by its step)
        table = TailTable(8, num_slots=4, num_sink_slots=1, window_blocks=0)
        return TailPool(spec, layout, torch.bfloat16, DEVICE).context(table.plan([[1]], [1], [1]))

    out = TritonBackend().forward_sealed(q, k, v, good, spec.layer(2), meta, ctx(), layer_index=2)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()
    before = _bytes(bad)
    with pytest.raises(KVCacheLayoutError, match=r"layer 2: cache tensor 'key' expected dtype torch\.uint8 .*"
                                                 r"got dtype torch\.bfloat16"):
        TritonBackend().forward_sealed(q, k, v, bad, spec.layer(2), meta, ctx(), layer_index=2)
    assert all(torch.equal(before[n], t.view(torch.uint8)) for n, t in bad.items())
