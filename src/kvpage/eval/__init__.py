"""Accuracy of KV formats: perplexity through the real paged cache (``kvpage eval``).

* :func:`evaluate_perplexity` — one :class:`~kvpage.engine.llm.LLM`, one text, ``decode`` or ``chunked`` mode;
* :func:`evaluate_formats` — several formats on one set of loaded weights;
* :mod:`kvpage.eval.report` — text table, ``results.json``, Δppl-vs-bits PNG.
"""
from __future__ import annotations

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
    plot_ppl_vs_bits,
    results_payload,
    write_results_json,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MODES",
    "KVCost",
    "PerplexityResult",
    "delta_ppl_percent",
    "evaluate_formats",
    "evaluate_perplexity",
    "format_table",
    "kv_cost",
    "plot_ppl_vs_bits",
    "results_payload",
    "text_token_ids",
    "write_results_json",
]
