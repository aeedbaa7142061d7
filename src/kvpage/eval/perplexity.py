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
the engine's real blocks, model and attention backends, never a simulation. With a reference
(:class:`~kvpage.eval.divergence.ReferenceLogits`, kept by the baseline run), each format's result
also carries the KL divergence of its next-token distributions from the baseline's at every scored
position, the same-top-token rate and the paired standard errors (:mod:`kvpage.eval.divergence`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kvpage.errors import OutOfBlocksError
from kvpage.model.encode import encode_text
from kvpage.eval.divergence import Divergence, ReferenceLogits, kl_divergence_rows, log_probs, summarize_divergence

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
        steady_bits_per_value: bits per value of the codes, scales and zero points alone, what
            ``bits_per_value`` approaches on long texts (the side parts' share shrinks); equal to it for
            token-wise formats.
        full_precision_tokens: tokens of the sequence the main group also holds in 16 bits (the open block
            and the window of quantize-on-seal formats; 0 for the others); with per-layer precision the most
            that any of the model's format groups holds.
    """

    bits_per_value: float
    kv_bytes_per_token: float
    steady_bits_per_value: float
    full_precision_tokens: int


def split_format_row(row: str) -> tuple[str, str | None]:
    """An eval format row ``BASE`` or ``BASE[MAP]`` as ``(BASE, MAP or None)``, ``MAP`` in ``--kv-layer-dtypes``'
    spelling: ``int3_rotated[17,20:int4_rotated;27,13:int2_rotated]`` is ``int3_rotated`` with layers 17 and 20
    in ``int4_rotated`` and 27 and 13 in ``int2_rotated`` (per-layer precision). No side effects.

    Raises:
        ValueError: an unbalanced bracket, text after it, or an empty map (``int3_rotated[]``: it would run as plain
            ``int3_rotated`` under a label promising a map).
    """
    row = row.strip()
    if "[" not in row and "]" not in row:
        return row, None
    base, sep, rest = row.partition("[")
    if not sep or not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1] or not base.strip():
        raise ValueError(f"--formats: {row!r} is not FORMAT or FORMAT[LAYERS:FORMAT;...]")
    if not rest[:-1].strip():
        raise ValueError(f"--formats: {row!r} has an empty layer map: give FORMAT[LAYERS:FORMAT;...], e.g. "
                         f"'{base.strip()}[17,20:int4_rotated]', or plain '{base.strip()}'")
    return base.strip(), rest[:-1].strip()


def split_format_list(text: str) -> list[str]:
    """``--formats``' comma-separated rows, commas inside a row's ``[...]`` layer map kept. No side effects."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [r.strip() for r in out if r.strip()]


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
    cfg = getattr(llm, "engine_config", None)
    total_bits = steady_bits = 0.0
    total_values = 0
    for group in llm.spec.groups:   # per-layer precision: each main@<format> group at its own bits and window
        layer = group.layer
        bits = layer.format.effective_bits_per_value(
            num_tokens=num_tokens,
            block_size=layer.block_size,
            kv_heads=layer.kv_heads,
            head_dim=layer.head_dim,
            residual_tokens=residual if cfg is None else cfg.residual_tokens_for(group.name),
        )
        values = 2 * layer.kv_heads * layer.head_dim * group.num_layers  # K and V values per token
        total_bits += bits * values
        steady_bits += layer.bits_per_value * values
        total_values += values
    full = max(g.layer.format.full_precision_tokens(
        num_tokens=num_tokens, block_size=g.layer.block_size,
        residual_tokens=residual if cfg is None else cfg.residual_tokens_for(g.name))
        for g in (llm.spec.main, *llm.spec.format_groups))
    return KVCost(bits_per_value=total_bits / total_values, kv_bytes_per_token=total_bits / 8,
                  steady_bits_per_value=steady_bits / total_values, full_precision_tokens=full)


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
        seconds: wall time of the forward passes and scoring (KL included), in seconds (model load excluded).
        block_size: tokens per KV block.
        steady_bits_per_value: bits per value of the codes, scales and zero points alone, which
            ``bits_per_value`` approaches on long texts (:func:`kv_cost`); ``None`` in rows written before it.
        full_precision_tokens: of the ``num_tokens``, how many the format also held in 16 bits (open block and
            window of quantize-on-seal formats, :func:`kv_cost`).
        residual_tokens: the full-precision window of quantize-on-seal formats, in tokens (0: none/unused).
        chunk_size: tokens per forward pass (1 in decode mode).
        divergence: KL divergence, top-1 agreement and the paired standard errors against the
            baseline run (:class:`~kvpage.eval.divergence.Divergence`); the baseline's own is against
            itself (KL 0, top-1 100 %); ``None`` when no reference was kept or compared. Its ``depth``
            holds the same means over the first :data:`~kvpage.eval.divergence.DEPTH_SPLIT` scored
            positions and over the rest.
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
    divergence: Divergence | None = None
    steady_bits_per_value: float | None = None
    full_precision_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``divergence`` a nested dict or ``None``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> PerplexityResult:
        """Rebuild a result from :meth:`to_dict`'s dict or a ``results.json`` row (unknown keys such as
        ``delta_ppl_percent`` are ignored; ``divergence`` becomes a :class:`~kvpage.eval.divergence.Divergence`,
        with ``depth=None`` when the row predates the depth split).

        Raises:
            TypeError: a field is missing.
        """
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in row.items() if k in names}
        if kw.get("divergence") is not None:
            kw["divergence"] = Divergence.from_dict(kw["divergence"])
        return cls(**kw)


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


def _token_nll(logp: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """``[n]`` float64 NLL in nats of each of ``targets`` under float64 log-probs ``logp`` ``[n, vocab]``."""
    tgt = torch.as_tensor(list(targets), dtype=torch.long, device=logp.device)           # [n]
    return -logp.gather(1, tgt[:, None])[:, 0]


def evaluate_perplexity(
    llm: LLM,
    token_ids: Sequence[int],
    *,
    mode: EvalMode = "decode",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: bool = True,
    name: str | None = None,
    record: ReferenceLogits | None = None,
    reference: ReferenceLogits | None = None,
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
        token_ids: the text's token ids, scored as given (:func:`text_token_ids` makes them, BOS first where
            the tokenizer adds one).
        mode: ``decode`` (one token per forward pass, what generation does) or ``chunked``
            (``chunk_size`` tokens per forward pass; faster, labelled as such in results).
        chunk_size: tokens per forward pass in ``chunked`` mode (>= 1; ignored in ``decode``).
        progress: show a tqdm progress bar over tokens (on stderr).
        name: label of the result; default the canonical format name.
        record: this is the baseline run: append every position's float32 logits, their argmax and
            token NLL to this empty store (side effect: ~``4 * vocab`` bytes per position on disk); the
            result's ``divergence`` is then against itself.
        reference: compare to this baseline store (filled by a ``record`` run over the same tokens, same
            mode and chunk size): per position ``KL(P_base || P_fmt)`` (float64 log-softmax of both float32
            logits, :func:`~kvpage.eval.divergence.kl_divergence_rows`), argmax agreement and the
            token-by-token NLL differences, summarized into the result's ``divergence``.

    Returns:
        A :class:`PerplexityResult`.

    Raises:
        ValueError: fewer than 2 tokens, a token outside the vocabulary, more tokens than
            ``llm.max_model_len``, an unknown ``mode`` or ``chunk_size < 1``; both ``record`` and
            ``reference``, a non-empty ``record``, or a ``reference`` of another length or vocabulary.
        OutOfBlocksError: the free blocks cannot hold ``num_tokens - 1`` tokens.
    """
    from tqdm import tqdm

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    ids = _check_tokens(llm, token_ids)
    if record is not None and reference is not None:
        raise ValueError("give record (the baseline run) or reference (a compared run), not both")
    if record is not None and record.num_positions:
        raise ValueError(f"record must be an empty store; it holds {record.num_positions} positions")
    if reference is not None and (reference.num_positions != len(ids) - 1
                                  or reference.vocab_size != llm.config.vocab_size):
        raise ValueError(f"the reference holds {reference.num_positions} positions of vocabulary "
                         f"{reference.vocab_size}; this text needs {len(ids) - 1} of {llm.config.vocab_size}")
    step = 1 if mode == "decode" else chunk_size
    canonical = llm.spec.format_label
    label = name or canonical
    n_run = len(ids) - 1                  # positions fed: 0 .. n-2; position t predicts token t + 1
    nll_tok: list[np.ndarray] = []   # per-position NLL; KL and top-1 agreement only when compared to a reference
    kld: list[np.ndarray] = []
    same_top: list[np.ndarray] = []
    if reference is not None:
        reference.rewind()
    start = time.perf_counter()
    bar = tqdm(total=n_run, desc=f"{label} ({mode})", unit="tok", disable=not progress, leave=False)
    try:
        with llm.open_sequence() as seq:
            for a in range(0, n_run, step):
                b = min(a + step, n_run)
                logits = seq.feed(ids[a:b], all_logits=mode != "decode")    # [1 or b - a, vocab] float32
                logp = log_probs(logits)                                    # [b - a, vocab] float64
                nll = _token_nll(logp, ids[a + 1 : b + 1])                  # [b - a] float64
                nll_tok.append(nll.cpu().numpy())
                if record is not None:
                    record.append(logits, logits.argmax(dim=-1), nll)
                elif reference is not None:
                    base_logits, top_base = reference.read(b - a)             # [b - a, vocab] float32 (CPU), [b - a]
                    kld.append(kl_divergence_rows(log_probs(base_logits.to(logp.device)), logp).cpu().numpy())
                    same_top.append(logits.argmax(dim=-1).cpu().numpy() == top_base)
                bar.update(b - a)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    token_nll = np.concatenate(nll_tok)                                              # [n_run] float64
    nll_mean = float(token_nll.sum()) / n_run
    divergence = None
    if record is not None:   # the baseline against itself: zero KL, full agreement, zero Δ
        divergence = summarize_divergence(np.zeros(n_run), np.ones(n_run, dtype=bool), token_nll, token_nll)
    elif reference is not None:
        divergence = summarize_divergence(np.concatenate(kld), np.concatenate(same_top), token_nll, reference.nll())
    cost = kv_cost(llm, len(ids))
    return PerplexityResult(
        name=label,
        kv_cache_dtype=canonical,
        mode=mode,
        num_tokens=len(ids),
        num_predictions=n_run,
        nll=nll_mean,
        ppl=math.exp(nll_mean),
        bits_per_value=cost.bits_per_value,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        seconds=seconds,
        block_size=llm.spec.block_size,
        residual_tokens=int(getattr(llm, "kv_quant_residual_tokens", 0) or 0),
        chunk_size=step,
        divergence=divergence,
        steady_bits_per_value=cost.steady_bits_per_value,
        full_precision_tokens=cost.full_precision_tokens,
    )


def text_token_ids(tokenizer: Any, path: str | Path, num_tokens: int | None = None, *,
                   bos: bool | None = None) -> list[int]:
    """The first ``num_tokens`` token ids of a UTF-8 text file, encoded by :func:`~kvpage.model.encode.encode_text`.

    ``bos``: ``None`` (default) as the tokenizer's configuration says (BOS first where it adds one, as the
    model saw its training text); ``False`` no special tokens; ``True`` exactly one BOS first. The BOS
    counts among the ``num_tokens``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the text has fewer than ``num_tokens`` tokens (or fewer than 2), or ``num_tokens < 2``;
            ``bos=True`` with a tokenizer that has no BOS token.
    """
    if num_tokens is not None and num_tokens < 2:
        raise ValueError(f"need at least 2 tokens, got {num_tokens}")
    text = Path(path).read_text(encoding="utf-8")
    ids = encode_text(tokenizer, text, bos=bos)
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
    kl_divergence: bool = True,
    reference_dir: str | Path | None = None,
) -> list[PerplexityResult]:
    """:func:`evaluate_perplexity` for each format, in order, on one set of loaded weights.

    Each format gets its own :class:`~kvpage.engine.llm.LLM` over ``model`` with just the blocks
    the text needs (prefix caching off), freed before the next one is built. With ``kl_divergence``
    the first format is the baseline: its log-probs stream to a temporary file
    (:class:`~kvpage.eval.divergence.ReferenceLogits`, ``4 * vocab`` bytes per scored token: 201 MB
    for 1,024 SmolLM2 tokens; deleted on return, also on error) and every later result carries its
    ``divergence`` against them.

    Args:
        model: the loaded weights (its dtype is the compute dtype and ``auto``'s cache dtype).
        formats: ``kv_cache_dtype`` names; each result's ``name`` is the spelling given.
        block_size: tokens per block for every format; ``None`` = each format's own default
            (16; 32 for the quantize-on-seal ``int4``/``int2``, as ``LLM`` chooses).
        llm_kwargs: extra :class:`~kvpage.engine.llm.LLM` arguments (e.g. ``kv_cache_scales``).
        kl_divergence: keep the first format's distributions and compare the others to them.
        reference_dir: folder of that temporary file (default the system's, ``$TMPDIR``).

    Raises:
        UnknownKVFormatError: an unknown format (raised before any evaluation when checked up front
            by the caller; here when its LLM is built).
        ValueError, OutOfBlocksError: as :func:`evaluate_perplexity`.
    """
    from kvpage.engine.llm import LLM

    from kvpage.engine.config import parse_layer_dtypes
    from kvpage.formats import canonical_format_name, get_format

    dtype = next(model.model.parameters()).dtype
    out: list[PerplexityResult] = []
    store = ReferenceLogits(model.config.vocab_size, dir=reference_dir) if kl_divergence else None
    try:
        for i, fmt in enumerate(formats):
            base, layer_map = split_format_row(fmt)
            names = [base, *(parse_layer_dtypes(layer_map, "--formats").values() if layer_map else ())]
            bs = block_size or max(get_format(canonical_format_name(n, dtype)).preferred_block_size for n in names)
            num_blocks = -(-len(token_ids) // bs) + 1
            llm = LLM(model, kv_cache_dtype=base, block_size=bs, num_blocks=num_blocks, dtype=dtype,
                      num_threads=num_threads, progress=False, enable_prefix_caching=False,
                      **({"kv_layer_dtypes": layer_map} if layer_map else {}), **(llm_kwargs or {}))
            out.append(evaluate_perplexity(llm, token_ids, mode=mode, chunk_size=chunk_size, progress=progress,
                                           name=fmt, record=store if i == 0 else None,
                                           reference=store if i > 0 else None))
            del llm
    finally:
        if store is not None:
            store.close()
    return out
