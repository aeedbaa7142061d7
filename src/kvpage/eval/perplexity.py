"""Perplexity of a text through the engine's real paged-cache path, per KV format.

Perplexity is ``exp(mean NLL)`` of each token given all earlier ones, the
quantity llama.cpp's ``perplexity`` tool and transformers' ``QuantizedCache``
evaluations report. Two ways to feed the text:

* ``decode`` (the one to quote): one token per forward pass, as in
  transformers' QuantizedCache evaluation (``model(input_ids=tok,
  past_key_values=cache)`` in a loop). Token ``t`` is written to the cache
  through the format's quantizer and attends to tokens ``0..t`` read back
  from their blocks, exactly what generation does. Unlike llama.cpp's tool
  (which scores only the second half of each window from a batched prefill),
  every token after the first is scored.
* ``chunked`` (faster, labelled as such): prompt chunks of ``chunk_size``
  tokens, each chunk's tokens attending to the cached chunks before it and
  causally to each other, as chunked prefill does. The unquantized cache gives
  decode mode's perplexity to float rounding (tested to 1e-4). Quantized
  formats see the same semantics, but K/V computed in a batch of 128 differ
  from batch-of-1 K/V in the last float bits, which flips some codes: on the
  GPL-3 text (1,024 tokens) int8 scores +0.42 % in decode mode and +0.24 % in
  chunked mode, so quote decode mode and treat Δ under ~0.3 % as noise.
  Formats whose stored bytes depend on when a block is sealed may differ more.

Both feed the text through :meth:`LLM.open_sequence <kvpage.engine.llm.LLM.open_sequence>`:
the engine's real blocks, model and attention backends, never a simulation.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvpage.errors import OutOfBlocksError

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM
    from kvpage.model.loader import LoadedModel

#: Feeding modes of :func:`evaluate_perplexity`.
EvalMode = Literal["decode", "chunked"]
MODES: tuple[str, ...] = ("decode", "chunked")
#: Tokens per forward pass in ``chunked`` mode unless told otherwise.
DEFAULT_CHUNK_SIZE = 128


@dataclass(frozen=True)
class KVCost:
    """What one sequence's KV cache costs in a format, everything the format keeps counted.

    Attributes:
        bits_per_value: effective bits per cached K or V value (codes, scales, zero points and,
            for quantize-on-seal formats, the full-precision tail/window and the 8-bit first block),
            averaged over all layer groups (main and draft).
        kv_bytes_per_token: bytes per token over all layers, K and V:
            ``bits_per_value * 2 * kv_heads * head_dim * num_layers / 8`` (summed over groups).
    """

    bits_per_value: float
    kv_bytes_per_token: float


def kv_cost(llm: LLM, num_tokens: int) -> KVCost:
    """The effective KV cost of a ``num_tokens``-token sequence in ``llm``'s cache format.

    Each layer group's format answers through
    :meth:`~kvpage.formats.KVFormat.effective_bits_per_value` (the per-token formats return their
    fixed :meth:`~kvpage.formats.KVFormat.bits_per_value`; quantize-on-seal formats add their tail,
    window of ``llm.kv_quant_residual_tokens`` tokens, if the LLM has that setting, and first block).

    Raises:
        ValueError: ``num_tokens < 1``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    residual = int(getattr(llm, "kv_quant_residual_tokens", 0) or 0)
    total_bits = 0.0
    total_values = 0
    for group in llm.spec.groups:
        layer = group.layer
        bits = layer.format.effective_bits_per_value(
            num_tokens=num_tokens,
            block_size=layer.block_size,
            kv_heads=layer.kv_heads,
            head_dim=layer.head_dim,
            residual_tokens=residual,
        )
        values = 2 * layer.kv_heads * layer.head_dim * group.num_layers  # K and V values per token
        total_bits += bits * values
        total_values += values
    return KVCost(bits_per_value=total_bits / total_values, kv_bytes_per_token=total_bits / 8)


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of one text in one KV format (from :func:`evaluate_perplexity`).

    Attributes:
        name: the format as asked for (e.g. ``auto``); the label of tables and plots.
        kv_cache_dtype: its canonical name (``auto`` resolved to the model dtype, e.g. ``float32``).
        mode: ``decode`` (one token per step) or ``chunked`` (``chunk_size`` tokens per step).
        num_tokens: tokens of the text evaluated.
        num_predictions: tokens scored: ``num_tokens - 1`` (the first token predicts nothing).
        nll: mean negative log-likelihood per scored token, in nats.
        ppl: ``exp(nll)``.
        bits_per_value: effective bits per cached value over ``num_tokens`` tokens (:func:`kv_cost`).
        kv_bytes_per_token: KV bytes per token over all layers, K and V (:func:`kv_cost`).
        seconds: wall time of the forward passes and scoring, in seconds (model load excluded).
        block_size: tokens per KV block.
        residual_tokens: the full-precision window of quantize-on-seal formats, in tokens (0: none/unused).
        chunk_size: tokens per forward pass (1 in decode mode).
    """

    name: str
    kv_cache_dtype: str
    mode: str
    num_tokens: int
    num_predictions: int
    nll: float
    ppl: float
    bits_per_value: float
    kv_bytes_per_token: float
    seconds: float
    block_size: int
    residual_tokens: int = 0
    chunk_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _check_tokens(llm: LLM, token_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens (the first predicts nothing), got {len(ids)}")
    vocab = llm.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) > llm.max_model_len:
        raise ValueError(f"{len(ids)} tokens exceed the model's context (max_model_len {llm.max_model_len})")
    st = llm.kv_cache_stats()
    need = llm.spec.blocks_for_tokens(len(ids) - 1)
    have = st.num_free + st.num_evictable
    if need > have:
        raise OutOfBlocksError(
            f"perplexity over {len(ids)} tokens needs {need} KV blocks of {llm.spec.block_size} tokens; "
            f"only {have} are free. Give the LLM more num_blocks / kv_cache_memory_bytes, or fewer tokens."
        )
    return ids


def _nll_sum(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Summed NLL in nats of ``targets`` under ``logits`` ``[n, vocab]`` (log-softmax in float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)                                    # [n, vocab] float64
    tgt = torch.as_tensor(list(targets), dtype=torch.long, device=logits.device)         # [n]
    return float(-logp.gather(1, tgt[:, None]).sum())


def evaluate_perplexity(
    llm: LLM,
    token_ids: Sequence[int],
    *,
    mode: EvalMode = "decode",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: bool = True,
    name: str | None = None,
) -> PerplexityResult:
    """Perplexity of ``token_ids`` through ``llm``'s paged KV cache in its format.

    One teacher-forced sequence (:meth:`~kvpage.engine.llm.LLM.open_sequence`; one more slot per step, as the
    scheduler's decode does; prefix caching is not used: nothing is matched or indexed), each step
    runs the model over the real cache (quantized write, dequantized read), and the
    blocks are freed at the end, also on error. The last token is never fed (its logits would
    predict nothing), so ``num_tokens - 1`` positions are run and scored. Token ``t + 1`` is scored
    by ``log_softmax`` (float64) of the float32 logits at position ``t``. Other requests the engine
    holds keep their blocks; don't run ``llm.engine.step()`` concurrently.

    Args:
        llm: the engine; its format, block size and (if set) ``kv_quant_residual_tokens`` are used.
        token_ids: the text's token ids (no BOS is added; prepend one yourself if wanted).
        mode: ``decode`` (one token per forward pass, what generation does) or ``chunked``
            (``chunk_size`` tokens per forward pass; faster, labelled as such in results).
        chunk_size: tokens per forward pass in ``chunked`` mode (>= 1; ignored in ``decode``).
        progress: show a tqdm progress bar over tokens (on stderr).
        name: label of the result; default the canonical format name.

    Returns:
        A :class:`PerplexityResult`.

    Raises:
        ValueError: fewer than 2 tokens, a token outside the vocabulary, more tokens than
            ``llm.max_model_len``, an unknown ``mode`` or ``chunk_size < 1``.
        OutOfBlocksError: the free blocks cannot hold ``num_tokens - 1`` tokens.
    """
    from tqdm import tqdm

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    ids = _check_tokens(llm, token_ids)
    step = 1 if mode == "decode" else chunk_size
    canonical = llm.spec.main.layer.kv_format
    label = name or canonical
    n_run = len(ids) - 1                  # positions fed: 0 .. n-2; position t predicts token t + 1
    total = 0.0
    start = time.perf_counter()
    bar = tqdm(total=n_run, desc=f"{label} ({mode})", unit="tok", disable=not progress, leave=False)
    try:
        with llm.open_sequence() as seq:
            for a in range(0, n_run, step):
                b = min(a + step, n_run)
                logits = seq.feed(ids[a:b], all_logits=mode != "decode")    # [1 or b - a, vocab] float32
                total += _nll_sum(logits, ids[a + 1 : b + 1])
                bar.update(b - a)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    nll = total / n_run
    cost = kv_cost(llm, len(ids))
    return PerplexityResult(
        name=label,
        kv_cache_dtype=canonical,
        mode=mode,
        num_tokens=len(ids),
        num_predictions=n_run,
        nll=nll,
        ppl=math.exp(nll),
        bits_per_value=cost.bits_per_value,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        seconds=seconds,
        block_size=llm.spec.block_size,
        residual_tokens=int(getattr(llm, "kv_quant_residual_tokens", 0) or 0),
        chunk_size=step,
    )


def text_token_ids(tokenizer: Any, path: str | Path, num_tokens: int | None = None) -> list[int]:
    """The first ``num_tokens`` token ids of a UTF-8 text file, without BOS or other special tokens.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the text has fewer than ``num_tokens`` tokens (or fewer than 2), or ``num_tokens < 2``.
    """
    if num_tokens is not None and num_tokens < 2:
        raise ValueError(f"need at least 2 tokens, got {num_tokens}")
    text = Path(path).read_text(encoding="utf-8")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if num_tokens is None:
        num_tokens = len(ids)
    if len(ids) < max(num_tokens, 2):
        raise ValueError(f"{path} has only {len(ids)} tokens; asked for {num_tokens}")
    return ids[:num_tokens]


def evaluate_formats(
    model: LoadedModel,
    token_ids: Sequence[int],
    formats: Iterable[str],
    *,
    mode: EvalMode = "decode",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    block_size: int | None = None,
    num_threads: int | None = None,
    progress: bool = True,
    llm_kwargs: dict[str, Any] | None = None,
) -> list[PerplexityResult]:
    """:func:`evaluate_perplexity` for each format, in order, on one set of loaded weights.

    Each format gets its own :class:`~kvpage.engine.llm.LLM` over ``model`` with just the blocks
    the text needs (prefix caching off), freed before the next one is built.

    Args:
        model: the loaded weights (its dtype is the compute dtype and ``auto``'s cache dtype).
        formats: ``kv_cache_dtype`` names; each result's ``name`` is the spelling given.
        block_size: tokens per block for every format; ``None`` = each format's own default
            (16; 32 for the quantize-on-seal ``int4``/``int2``, as ``LLM`` chooses).
        llm_kwargs: extra :class:`~kvpage.engine.llm.LLM` arguments (e.g. ``kv_cache_scales``).

    Raises:
        UnknownKVFormatError: an unknown format (raised before any evaluation when checked up front
            by the caller; here when its LLM is built).
        ValueError, OutOfBlocksError: as :func:`evaluate_perplexity`.
    """
    from kvpage.engine.llm import LLM

    from kvpage.formats import canonical_format_name, get_format

    dtype = next(model.model.parameters()).dtype
    out: list[PerplexityResult] = []
    for fmt in formats:
        bs = block_size or get_format(canonical_format_name(fmt, dtype)).preferred_block_size
        num_blocks = -(-len(token_ids) // bs) + 1
        llm = LLM(model, kv_cache_dtype=fmt, block_size=bs, num_blocks=num_blocks, dtype=dtype,
                  num_threads=num_threads, progress=False, enable_prefix_caching=False, **(llm_kwargs or {}))
        out.append(evaluate_perplexity(llm, token_ids, mode=mode, chunk_size=chunk_size, progress=progress, name=fmt))
        del llm
    return out
