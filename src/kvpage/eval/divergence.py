"""KL divergence and top-1 agreement of a KV format's next-token distributions against the unquantized cache's.

What ``llama-perplexity --kl-divergence`` reports, computed at every scored position: the baseline run
streams its float32 logits to a :class:`ReferenceLogits` file, each later format reads them back
position by position and :func:`summarize_divergence` turns the per-position values into a :class:`Divergence`,
with the same figures over the first :data:`DEPTH_SPLIT` scored positions and over the rest (:class:`DepthSplit`).
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]`` float64 ``log_softmax`` of ``logits`` ``[n, vocab]`` (any float dtype), taken in float64.

    Both sides of a KL divergence go through this one function, so identical logits give bit-identical
    log-probabilities (KL exactly 0). (Rounding the log-probs to float32 instead would move a KL by up
    to ~1e-7 nats, as measured on random logits; the raw float32 logits are kept for that reason.)
    """
    return torch.log_softmax(logits.double(), dim=-1)                              # [n, vocab] float64


def kl_divergence_rows(lp_base: torch.Tensor, lp_fmt: torch.Tensor) -> torch.Tensor:
    """Per-row ``KL(P_base || P_fmt) = sum_v p_base(v) * (log p_base(v) - log p_fmt(v))`` in nats.

    Args:
        lp_base: ``[n, vocab]`` log-probabilities of the reference distribution (float64, :func:`log_probs`;
            float32 is accepted and widened).
        lp_fmt: ``[n, vocab]`` log-probabilities of the compared distribution, same shape.

    Returns:
        ``[n]`` float64, each ``>= 0``: the sum runs in float64 and the tiny negative values float rounding
        can leave (|KL| ~ 1e-9 for near-identical rows) are clamped to 0. A vocabulary entry with
        ``p_base == 0`` contributes 0 (also where ``lp_fmt`` is ``-inf``).

    Raises:
        ValueError: the shapes differ or are not 2-D.
    """
    if lp_base.shape != lp_fmt.shape or lp_base.dim() != 2:
        raise ValueError(f"need two [n, vocab] tensors of one shape, got {tuple(lp_base.shape)} "
                         f"and {tuple(lp_fmt.shape)}")
    b = lp_base.double()                                                            # [n, vocab] float64
    p = torch.exp(b)                                                                # [n, vocab] float64
    terms = torch.where(p > 0, p * (b - lp_fmt.double()), torch.zeros((), dtype=torch.float64))
    return terms.sum(dim=-1).clamp_min(0.0)                                         # [n] float64


#: Scored positions in the "first" part of :class:`DepthSplit`; the rest are the deeper ones.
DEPTH_SPLIT = 1024


@dataclass(frozen=True)
class DepthPart:
    """Mean KLD and Δppl over a contiguous range ``[start, stop)`` of scored positions (position ``t`` predicts token ``t + 1``).

    Standard errors as :class:`Divergence`'s (sample standard deviation over ``sqrt(n)``; binomial for top-1).

    Attributes:
        start: first scored position of the part (0-based).
        stop: one past its last.
        num_positions: ``stop - start``.
        kld_mean: mean per-position ``KL(P_base || P_fmt)`` over the part, in nats.
        kld_se: its standard error, in nats.
        top1_percent: same-top-token rate over the part, in percent.
        ln_ppl_ratio: mean per-token NLL difference (format minus baseline) over the part, in nats:
            ``ln(PPL_fmt / PPL_base)`` of these tokens alone.
        ln_ppl_ratio_se: its standard error, in nats.
        delta_ppl_percent: ``100 * (exp(ln_ppl_ratio) - 1)``: Δppl % of the part's tokens.
        delta_ppl_se_percent: its standard error (delta method), in percentage points.
    """

    start: int
    stop: int
    num_positions: int
    kld_mean: float
    kld_se: float
    top1_percent: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    delta_ppl_percent: float
    delta_ppl_se_percent: float


@dataclass(frozen=True)
class DepthSplit:
    """A divergence split by depth: the first ``split`` scored positions and the ones after them.

    Quantization error can grow with depth (more keys to mis-rank, more rounded values summed), so a
    long text's mean hides how its deep positions fare; :meth:`kld_ratio` compares the two parts.

    Attributes:
        split: scored positions in ``first`` at most (:data:`DEPTH_SPLIT` unless told otherwise).
        first: positions ``[0, min(n, split))``.
        rest: positions ``[split, n)``; ``None`` when ``n <= split`` (a text of ``split + 1`` tokens or fewer).
    """

    split: int
    first: DepthPart
    rest: DepthPart | None

    def kld_ratio(self) -> float | None:
        """``rest.kld_mean / first.kld_mean``: > 1 when deep positions diverge more; ``None`` without a
        rest or when the first part's KLD is 0 (the baseline against itself)."""
        if self.rest is None or self.first.kld_mean <= 0:
            return None
        return self.rest.kld_mean / self.first.kld_mean

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DepthSplit:
        """Rebuild from :func:`dataclasses.asdict`'s nested dict (``results.json``)."""
        rest = d.get("rest")
        return cls(split=int(d["split"]), first=DepthPart(**d["first"]), rest=DepthPart(**rest) if rest else None)


@dataclass(frozen=True)
class Divergence:
    """How far one format's next-token distributions are from the baseline's, over ``n`` scored positions.

    Standard errors follow llama.cpp's ``perplexity --kl-divergence``: the standard error of a mean is the
    sample standard deviation (``n - 1``) over ``sqrt(n)``; the top-1 rate's is the binomial
    ``sqrt(p (1 - p) / (n - 1))``. Positions are treated as independent (they are not quite: neighbouring
    tokens of a text correlate), so read the errors as a lower bound of the noise.

    Attributes:
        num_positions: ``n``, the positions compared (``num_predictions`` of the result).
        kld_mean: mean ``KL(P_base || P_fmt)`` per position, in nats.
        kld_se: its standard error, in nats.
        kld_median: median per-position KL, in nats.
        kld_p99: 99th percentile (linear interpolation, ``numpy.percentile``'s default), in nats.
        kld_max: largest per-position KL, in nats.
        top1_percent: positions where ``argmax`` of the format's logits equals the baseline's, in percent.
        top1_se_percent: its binomial standard error, in percentage points.
        ln_ppl_ratio: ``mean_t (nll_fmt(t) - nll_base(t)) = ln(PPL_fmt / PPL_base)``, in nats.
        ln_ppl_ratio_se: standard error of that mean of per-token differences, in nats.
        delta_ppl_se_percent: the standard error of ``Δppl % = 100 (PPL_fmt / PPL_base - 1)``, propagated
            from ``ln_ppl_ratio_se`` (delta method: ``100 * exp(ln_ppl_ratio) * ln_ppl_ratio_se``), in
            percentage points. Pairing the two runs token by token is what makes it small: it measures the
            format's effect, not the text's own variance.
        depth: the same means over the first :data:`DEPTH_SPLIT` scored positions and the rest
            (:class:`DepthSplit`); ``None`` in results written before it existed (``results.json``
            schema 2).
    """

    num_positions: int
    kld_mean: float
    kld_se: float
    kld_median: float
    kld_p99: float
    kld_max: float
    top1_percent: float
    top1_se_percent: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    delta_ppl_se_percent: float
    depth: DepthSplit | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``depth`` a nested dict or ``None``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Divergence:
        """Rebuild from :meth:`to_dict`'s dict; one without ``depth`` (schema 2) gets ``depth=None``.

        Raises:
            TypeError: a field is missing or unknown.
        """
        kw = dict(d)
        depth = kw.pop("depth", None)
        return cls(**kw, depth=DepthSplit.from_dict(depth) if depth else None)


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of ``values`` ``[n]``: ``std(values, ddof=1) / sqrt(n)``; 0.0 when ``n < 2``."""
    n = int(values.size)
    if n < 2:
        return 0.0
    return float(np.std(values, ddof=1) / math.sqrt(n))


def _depth_part(k: np.ndarray, same_top: np.ndarray, d: np.ndarray, start: int, stop: int) -> DepthPart:
    """:class:`DepthPart` of positions ``[start, stop)`` of per-position KLD ``k``, top-1 hits and Δ NLL ``d`` (all ``[n]``)."""
    kp, dp = k[start:stop], d[start:stop]
    ln_ratio, ln_se = float(dp.mean()), standard_error(dp)
    return DepthPart(start=start, stop=stop, num_positions=stop - start, kld_mean=float(kp.mean()),
                     kld_se=standard_error(kp),
                     top1_percent=100.0 * float(np.count_nonzero(same_top[start:stop])) / (stop - start),
                     ln_ppl_ratio=ln_ratio, ln_ppl_ratio_se=ln_se, delta_ppl_percent=100.0 * math.expm1(ln_ratio),
                     delta_ppl_se_percent=100.0 * math.exp(ln_ratio) * ln_se)


def summarize_divergence(kld: np.ndarray, same_top: np.ndarray, nll_fmt: np.ndarray,
                         nll_base: np.ndarray, *, depth_split: int | None = None) -> Divergence:
    """A :class:`Divergence` from per-position values, with its :class:`DepthSplit` at ``depth_split``.

    Args:
        kld: ``[n]`` float per-position ``KL(P_base || P_fmt)``, in nats (:func:`kl_divergence_rows`).
        same_top: ``[n]`` bool, the format's argmax equals the baseline's.
        nll_fmt: ``[n]`` float, the format's negative log-likelihood of each scored token, in nats.
        nll_base: ``[n]`` float, the baseline's for the same tokens.
        depth_split: scored positions in the depth split's first part (``>= 1``; ``None``: the module's
            :data:`DEPTH_SPLIT`, read at call time); the rest is ``None`` when ``n <= depth_split``.

    Raises:
        ValueError: empty or differently sized inputs, or ``depth_split < 1``.
    """
    depth_split = DEPTH_SPLIT if depth_split is None else depth_split
    if depth_split < 1:
        raise ValueError(f"depth_split must be >= 1, got {depth_split}")
    n = int(kld.size)
    if n == 0 or not (same_top.size == nll_fmt.size == nll_base.size == n):
        raise ValueError(f"need four non-empty arrays of one length, got {kld.size}, {same_top.size}, "
                         f"{nll_fmt.size}, {nll_base.size}")
    k = kld.astype(np.float64)
    d = nll_fmt.astype(np.float64) - nll_base.astype(np.float64)                   # [n] per-token Δ NLL, nats
    p = float(np.count_nonzero(same_top)) / n
    ln_ratio, ln_se = float(d.mean()), standard_error(d)
    first = min(n, depth_split)
    depth = DepthSplit(split=depth_split, first=_depth_part(k, same_top, d, 0, first),
                       rest=_depth_part(k, same_top, d, depth_split, n) if n > depth_split else None)
    return Divergence(
        num_positions=n,
        kld_mean=float(k.mean()),
        kld_se=standard_error(k),
        kld_median=float(np.median(k)),
        kld_p99=float(np.percentile(k, 99)),
        kld_max=float(k.max()),
        top1_percent=100.0 * p,
        top1_se_percent=100.0 * math.sqrt(p * (1.0 - p) / (n - 1)) if n > 1 else 0.0,
        ln_ppl_ratio=ln_ratio,
        ln_ppl_ratio_se=ln_se,
        delta_ppl_se_percent=100.0 * math.exp(ln_ratio) * ln_se,
        depth=depth,
    )


class ReferenceLogits:
    """The baseline's float32 logits ``[n_positions, vocab]``, streamed to an anonymous temporary file.

    The model's float32 logits are kept as they are, so the baseline's float64 log-probs are recomputed
    exactly on reading (no precision is lost; float16 log-probs would round by ~1e-3 nats near -2, as
    large as the 8-bit formats' whole KL). Why a file and not memory: SmolLM2's vocabulary of 49,152
    makes 196,608 bytes per position, 201 MB for 1,024 positions and 1.6 GB for 8,192 — more than the
    model's own weights. Rows are written with ``file.write`` and read back with ``file.read`` (no memory
    map, so the bytes live in the OS page cache, never in the process's RSS). Measured (``/usr/bin/time``,
    512 SmolLM2 tokens, ``--formats int8``): peak RSS 1,269 MB with KL divergence and 1,269 MB without
    (within 1 MB), where keeping the 511 rows in memory would add 100 MB.
    Also kept, in memory: each position's argmax token (int64) and the baseline NLL of the scored token.

    Use: the baseline run calls :meth:`append` once per forward pass, in order; each later format calls
    :meth:`rewind` then :meth:`read` once per forward pass (any row counts summing to at most the total).
    :meth:`close` (or the context manager, or garbage collection) deletes the file.

    Args:
        vocab_size: columns per row.
        dir: folder for the temporary file (default: the system's temporary folder, ``$TMPDIR``).
    """

    def __init__(self, vocab_size: int, dir: str | Path | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self._file = tempfile.TemporaryFile(dir=dir)
        self._rows = 0
        self._read = 0
        self._sealed = False
        self._argmax: list[np.ndarray] = []
        self._nll: list[np.ndarray] = []

    @property
    def num_positions(self) -> int:
        """Rows written so far."""
        return self._rows

    def append(self, logits: torch.Tensor, top: torch.Tensor, nll: torch.Tensor) -> None:
        """Store the next ``m`` positions.

        Args:
            logits: ``[m, vocab]`` float32 logits.
            top: ``[m]`` integer ``argmax`` of the logits.
            nll: ``[m]`` negative log-likelihood of each scored token, in nats.

        Raises:
            ValueError: wrong shapes or dtype, or :meth:`rewind` was called already (the reference is complete).
        """
        m = logits.shape[0] if logits.dim() == 2 else -1
        if m < 1 or logits.shape[1] != self.vocab_size or logits.dtype != torch.float32 or top.shape != (m,) \
                or nll.shape != (m,):
            raise ValueError(f"need float32 [m, {self.vocab_size}] logits, [m] argmax and [m] NLLs, got "
                             f"{logits.dtype} {tuple(logits.shape)}, {tuple(top.shape)} and {tuple(nll.shape)}")
        if self._sealed:
            raise ValueError("append after rewind: the reference is complete once a comparison has started")
        self._file.seek(0, 2)
        self._file.write(logits.detach().cpu().contiguous().numpy().tobytes())
        self._argmax.append(top.detach().cpu().long().numpy())
        self._nll.append(nll.detach().double().cpu().numpy())
        self._rows += m

    def rewind(self) -> None:
        """Start reading from position 0 (before each compared format); no :meth:`append` afterwards."""
        if not self._sealed:
            self._argmax = [np.concatenate(self._argmax) if self._argmax else np.empty(0, dtype=np.int64)]
            self._sealed = True
        self._read = 0

    def read(self, m: int) -> tuple[torch.Tensor, np.ndarray]:
        """The next ``m`` rows: ``([m, vocab]`` float32 logits, ``[m]`` int64 argmax token ids``)``.

        Raises:
            ValueError: :meth:`rewind` was not called first, or fewer than ``m`` rows remain.
        """
        if not self._sealed:
            raise ValueError("call rewind() before reading the reference")
        if m < 1 or self._read + m > self._rows:
            raise ValueError(f"asked for {m} rows at position {self._read}; the reference has {self._rows}")
        nbytes = m * self.vocab_size * 4
        self._file.seek(self._read * self.vocab_size * 4)
        data = self._file.read(nbytes)
        if len(data) != nbytes:
            raise ValueError("the reference file is shorter than its row count (was it truncated?)")
        buf = np.frombuffer(data, dtype=np.float32).reshape(m, self.vocab_size).copy()    # [m, vocab], writable
        top = self._argmax[0][self._read : self._read + m]
        self._read += m
        return torch.from_numpy(buf), top

    def nll(self) -> np.ndarray:
        """``[num_positions]`` float64: the baseline's NLL of each scored token, in nats."""
        return np.concatenate(self._nll) if self._nll else np.empty(0)

    def close(self) -> None:
        """Delete the temporary file (idempotent)."""
        self._file.close()

    def __enter__(self) -> ReferenceLogits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
