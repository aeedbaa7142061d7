"""Accuracy of KV formats: perplexity through the real paged cache (``kvpage eval``).

* :func:`evaluate_perplexity` — one :class:`~kvpage.engine.llm.LLM`, one text, ``decode`` or ``chunked`` mode;
* :func:`evaluate_formats` — several formats on one set of loaded weights;
* :mod:`kvpage.eval.divergence` — KL divergence and top-1 agreement against the unquantized cache;
* :mod:`kvpage.eval.report` — text table, ``results.json``, Δppl- and KLD-vs-bits PNGs;
* :mod:`kvpage.eval.suite` — the evaluation set (texts of several kinds found at run time, one held back),
  summarized by :mod:`kvpage.eval.suite_report`; :mod:`kvpage.eval.command` is ``kvpage eval``;
* :mod:`kvpage.eval.calibrate` — ``kvpage calibrate``: static K/V scales measured on sample text.
"""
from __future__ import annotations

from kvpage.eval.divergence import (
    Divergence,
    ReferenceLogits,
    kl_divergence_rows,
    log_probs,
    summarize_divergence,
)
from kvpage.eval.perplexity import (
    DEFAULT_CHUNK_SIZE,
    MODES,
    KVCost,
    PerplexityResult,
    evaluate_formats,
    evaluate_perplexity,
    kv_cost,
    text_token_ids,
)
from kvpage.eval.report import (
    delta_ppl_percent,
    format_table,
    plot_kld_vs_bits,
    plot_ppl_vs_bits,
    results_payload,
    write_results_json,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MODES",
    "Divergence",
    "KVCost",
    "PerplexityResult",
    "ReferenceLogits",
    "delta_ppl_percent",
    "evaluate_formats",
    "evaluate_perplexity",
    "format_table",
    "kl_divergence_rows",
    "kv_cost",
    "log_probs",
    "plot_kld_vs_bits",
    "plot_ppl_vs_bits",
    "results_payload",
    "summarize_divergence",
    "text_token_ids",
    "write_results_json",
]
