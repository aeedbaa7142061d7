"""The KV budget in bytes: given (``kv_cache_memory_bytes``), the default, or a fraction of the memory left.

``kv_cache_memory_fraction`` (see :class:`~kvpage.engine.config.EngineConfig`) is
resolved here, once the weights are on their device:

* **CUDA**: the device's free memory (``torch.cuda.mem_get_info``) less the peak a
  profiled forward pass of ``max_num_batched_tokens`` tokens allocates beyond the
  weights (``torch.cuda.max_memory_allocated`` around a dummy pass with causal SDPA
  standing in for paged attention, and the LM head over ``max_num_seqs`` rows, as the
  sampler would), times the fraction;
* **CPU**: the RAM the kernel reports available (``MemAvailable`` in ``/proc/meminfo``,
  else ``psutil.virtual_memory().available``), times the fraction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvpage.engine.config import EngineConfig
    from kvpage.model.attention_fn import CausalLM

GiB = 2**30


@dataclass(frozen=True)
class KVBudget:
    """The KV budget an engine is built with.

    Attributes:
        bytes: budget in bytes (blocks + side pools); ``None`` when ``num_blocks`` fixes the size.
        source: where it came from, for the start-up line (``"kv_cache_memory_bytes"``,
            ``"default"``, ``"num_blocks"`` or ``"0.5 x 12.3 GiB free RAM"``).
    """

    bytes: int | None
    source: str


def available_cpu_memory() -> int:
    """Bytes of RAM available to new allocations now (``MemAvailable``; psutil where there is no /proc).

    Raises:
        RuntimeError: neither source is readable.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        import psutil
    except ImportError as e:
        raise RuntimeError("kv_cache_memory_fraction on the CPU needs /proc/meminfo or psutil") from e
    return int(psutil.virtual_memory().available)


def _sdpa(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one sequence: ``q [T, H, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, H, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).contiguous()


def dummy_forward(model: CausalLM, num_tokens: int, num_rows: int, context: int,
                  device: torch.device) -> torch.Tensor:
    """One forward pass of ``num_tokens`` tokens (id 0, positions ``0..num_tokens-1`` modulo ``context``) as one
    causal sequence, and the LM head on its last ``num_rows`` rows; returns those float32 logits ``[num_rows, V]``."""
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % context
    with torch.inference_mode():
        hidden = model(ids, positions, _sdpa)
        return model.compute_logits(hidden[-num_rows:])


def profile_forward_peak(model: CausalLM, num_tokens: int, num_rows: int, context: int,
                         device: torch.device) -> int:
    """Bytes :func:`dummy_forward` allocates on CUDA ``device`` beyond what is already held (then freed).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    if device.type != "cuda":
        raise ValueError(f"profiling needs a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    logits = dummy_forward(model, num_tokens, num_rows, context, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits
    torch.cuda.empty_cache()
    return max(0, int(peak))


def resolve_kv_budget(config: EngineConfig, model: CausalLM, device: torch.device, context: int) -> KVBudget:
    """The budget ``config`` asks for on ``device``, with ``model`` already loaded there.

    Args:
        config: the engine settings (``kv_cache_memory_fraction``, ``kv_cache_memory_bytes``, ``num_blocks``,
            ``max_num_batched_tokens``, ``max_num_seqs``).
        model: the loaded model (profiled on CUDA when a fraction is asked for).
        device: the device tier's device.
        context: the model's context (positions of the profiled pass stay below it).

    Side effects: on CUDA with a fraction, one forward pass runs and the allocator cache is emptied.
    """
    if config.num_blocks is not None:
        return KVBudget(None, "num_blocks")
    f = config.kv_cache_memory_fraction
    if f is None:
        return KVBudget(config.kv_budget_bytes,
                        "default" if config.kv_cache_memory_bytes is None else "kv_cache_memory_bytes")
    if device.type == "cuda":
        peak = profile_forward_peak(model, config.max_num_batched_tokens,
                                    min(config.max_num_seqs, config.max_num_batched_tokens), context, device)
        free, _total = torch.cuda.mem_get_info(device)
        avail = max(0, int(free) - peak)
        return KVBudget(int(f * avail), f"kv_cache_memory_fraction {f:g} x {avail / GiB:.2f} GiB (free device "
                                        f"memory {free / GiB:.2f} GiB - forward peak {peak / GiB:.2f} GiB)")
    avail = available_cpu_memory()
    return KVBudget(int(f * avail), f"kv_cache_memory_fraction {f:g} x {avail / GiB:.2f} GiB available RAM")
