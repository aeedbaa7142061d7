"""The ``kvpage eval`` sub-command: its flags (:func:`add_eval_parser`) and what it runs (:func:`run_eval`).

``--text FILE`` scores one text per KV format; ``--suite`` scores every member of the evaluation set
(:mod:`kvpage.eval.suite`) on one loaded model and adds a summary with the held-back member apart.
Heavy imports (torch, the model loader) happen inside :func:`run_eval`, after the flags are checked.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from kvpage.engine.args import (DTYPE_HELP, WEIGHTS_DTYPE_HELP, check_output_dir, model_dtype, nonnegative_int,
                               positive_int, read_text_file, threads_help)

#: Tokens scored by ``--text`` unless ``--tokens`` says otherwise (suite members carry their own).
DEFAULT_TEXT_TOKENS = 1024


def add_eval_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser.

    Exactly one of ``--text`` / ``--suite`` is required (argparse exits with status 2 otherwise).
    """
    e = sub.add_parser("eval", help="perplexity and KL divergence of a text (or the evaluation set) per KV format: "
                                    "table, results.json, Δppl- and KLD-vs-bits plots")
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="UTF-8 text file to score (encoded as the model's tokenizer does: BOS first "
                                     "where it adds one; see --bos)")
    what.add_argument("--suite", action="store_true",
                      help="score every member of the evaluation set (kvpage.eval.suite: texts of several kinds "
                           "found on this machine, one held back) and summarize them")
    e.add_argument("--suite-members", default=None,
                   help="with --suite: comma-separated member names to run (default all)")
    e.add_argument("--formats", default="auto,int8,fp8",
                   help="comma-separated KV formats (default auto,int8,fp8); the unquantized cache (auto) "
                        "always runs first as the baseline. A row may give layers other formats (per-layer "
                        "precision) as FORMAT[LAYERS:FORMAT;...], e.g. "
                        "'int3_rotated[17,20:int4_rotated;27:int2_rotated]'; "
                        "its bits are the mean over layers")
    e.add_argument("--tokens", type=positive_int, default=None,
                   help=f"score the text's first N tokens (default {DEFAULT_TEXT_TOKENS}; with --suite each "
                        f"member's own count unless given)")
    e.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="--bos: put the tokenizer's BOS first; --no-bos: no special tokens (default: as the "
                        "tokenizer's configuration says, the distribution the model was trained on); the BOS "
                        "counts among --tokens")
    e.add_argument("--mode", choices=["decode", "chunked"], default="decode",
                   help="decode: one token per step through the cache (default); chunked: --chunk-size tokens "
                        "per step (faster)")
    e.add_argument("--chunk-size", type=positive_int, default=128, help="tokens per step in chunked mode (default 128)")
    e.add_argument("--model", default=None, help="path to a .gguf file or a Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    e.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block (default: each format's, 16; 32 for int4/int3/int2)")
    e.add_argument("--dtype", default="auto", type=model_dtype, help=DTYPE_HELP)
    e.add_argument("--weights-dtype", default="auto", help=WEIGHTS_DTYPE_HELP)
    e.add_argument("--threads", type=positive_int, default=None, help=threads_help())
    e.add_argument("--out", default="kvpage-eval",
                   help="folder for results.json, ppl_vs_bits.png and kld_vs_bits.png (default ./kvpage-eval; "
                        "with --suite one sub-folder of plots per member)")
    e.add_argument("--kl-divergence", action=argparse.BooleanOptionalAction, default=True,
                   help="KL divergence and same-top-token %% against the unquantized cache at every position "
                        "(default on; keeps its log-probs in a temporary file of 4 x vocab bytes per token)")
    e.add_argument("--kv-cache-scales", default=None, help="static KV scales file (for the *_static formats)")
    e.add_argument("--kv-quant-residual-tokens", type=nonnegative_int, default=None,
                   help="full-precision window of quantize-on-seal formats, in tokens (default: the LLM's)")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars (default on)")
    e.set_defaults(func=run_eval)
    return e


def _format_list(spec: str, dtype: Any) -> list[str]:
    """``--formats`` as a list starting with ``auto``, duplicates (by canonical name) dropped.

    A row may carry a per-layer format map in brackets (per-layer precision, ``kv_layer_dtypes``' spelling):
    ``int3_rotated[17,20:int4_rotated;27:int2_rotated]``; commas inside the brackets do not split rows.

    Raises:
        ValueError: the list is empty; a bad layer map (unbalanced bracket, bad layer, a layer named twice).
        UnknownKVFormatError: a name no format answers to (the message, prefixed ``--formats 'ROW'``, lists the
            valid ones).
    """
    from kvpage.engine.config import parse_layer_dtypes
    from kvpage.errors import KVPageError, prefix_message
    from kvpage.eval.perplexity import split_format_list, split_format_row
    from kvpage.formats import canonical_format_name

    names = split_format_list(spec)
    if not names:
        raise ValueError("--formats is empty; give e.g. auto,int8,fp8")
    formats, seen = ["auto"], {canonical_format_name("auto", dtype)}  # the unquantized cache first: the Δ baseline
    for n in names:
        base, layer_map = split_format_row(n)
        try:
            c = canonical_format_name(base, dtype)
        except (ValueError, KVPageError) as e:  # "unknown kv_cache_dtype 'int9'": name the flag the user typed
            prefix_message(e, f"--formats {n!r}: ")
            raise
        if layer_map:
            mapping = parse_layer_dtypes(layer_map, f"--formats {n!r}")
            c += "[" + ";".join(f"{i}:{canonical_format_name(f, dtype)}" for i, f in sorted(mapping.items())) + "]"
        if c not in seen:
            formats.append(n)
            seen.add(c)
    return formats


def _check_rows_fit(loaded: Any, formats: list[str], block_size: int | None, llm_kwargs: dict[str, Any]) -> None:
    """Check every ``--formats`` row's cache against the loaded model, without allocating it: a layer map naming a
    layer the model lacks (or a sliding-window or draft layer), a block size a format refuses, missing static
    scales. Each would otherwise fail only when its row's turn came, after the rows before it had run.

    Raises:
        ValueError, KVPageError: the first row that cannot run, the message prefixed with ``--formats 'ROW'``.
    """
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.sizing import build_spec
    from kvpage.errors import KVPageError
    from kvpage.eval.perplexity import split_format_row
    from kvpage.model.attention_fn import layer_attention

    dtype = next(loaded.model.parameters()).dtype
    windows = [layer_attention(loaded.model, i).sliding_window for i in range(loaded.config.num_layers)]
    for row in formats:
        base, layer_map = split_format_row(row)
        try:
            config = EngineConfig(kv_cache_dtype=base, kv_layer_dtypes=layer_map, block_size=block_size, dtype=dtype,
                                  **llm_kwargs)
            build_spec(config, loaded.config, layer_windows=windows)
        except (ValueError, KVPageError) as e:
            if len(e.args) == 1 and isinstance(e.args[0], str):
                e.args = (f"--formats {row!r}: {e.args[0].removeprefix('kv_layer_dtypes: ')}",)
            raise


def _write_plots(out: Path, results: list[Any], title: str) -> list[Path]:
    """``ppl_vs_bits.png`` and, when the results carry KL, ``kld_vs_bits.png`` in ``out`` (a stale one removed)."""
    from kvpage.eval import plot_kld_vs_bits, plot_ppl_vs_bits

    pngs = [plot_ppl_vs_bits(out / "ppl_vs_bits.png", results, title=title)]
    if len(results) > 1 and any(r.divergence is not None for r in results[1:]):
        pngs.append(plot_kld_vs_bits(out / "kld_vs_bits.png", results, title=f"{title}; vs {results[0].name}"))
    else:
        (out / "kld_vs_bits.png").unlink(missing_ok=True)  # never leave an earlier run's plot beside these results
    return pngs


def command_line(args: argparse.Namespace) -> str:
    """The ``kvpage eval ...`` command line that parses to ``args`` (shell-quoted), for ``results.json``'s ``command``.

    Only flags that differ from their defaults are written, except ``--formats``, ``--mode`` and
    ``--out``, which always are (a reader should not need to know the defaults).
    """
    parts = ["kvpage", "eval", *(["--suite"] if args.suite else ["--text", str(args.text)])]
    if args.suite_members is not None:
        parts += ["--suite-members", args.suite_members]
    parts += ["--formats", args.formats]
    if args.tokens is not None:
        parts += ["--tokens", str(args.tokens)]
    if args.bos is not None:
        parts += ["--bos" if args.bos else "--no-bos"]
    parts += ["--mode", args.mode]
    if args.chunk_size != 128:
        parts += ["--chunk-size", str(args.chunk_size)]
    for flag, value in (("--model", args.model), ("--block-size", args.block_size), ("--threads", args.threads),
                        ("--kv-cache-scales", args.kv_cache_scales),
                        ("--kv-quant-residual-tokens", args.kv_quant_residual_tokens)):
        if value is not None:
            parts += [flag, str(value)]
    if args.dtype != "auto":
        parts += ["--dtype", args.dtype]
    if args.weights_dtype != "auto":
        parts += ["--weights-dtype", args.weights_dtype]
    parts += ["--out", str(args.out)]
    parts += [] if args.kl_divergence else ["--no-kl-divergence"]
    parts += [] if args.progress else ["--no-progress"]
    return shlex.join(parts)


def _load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``), ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run_eval(args: argparse.Namespace) -> int:
    """``kvpage eval``: perplexity and KL divergence per KV format (:mod:`kvpage.eval`); table, JSON, PNGs.

    Every flag is checked before the model loads, ``--text`` read as UTF-8 and ``--out`` checked writable
    (:func:`~kvpage.engine.args.check_output_dir`) among them. Side effects: writes ``results.json`` (with the
    :func:`command_line`, the CPU and the load average before and after the run) and the plots under
    ``--out``; with ``--suite`` also one folder of plots per member, and a warning on stderr for each
    member whose text's sha256 differs from the one the suite recorded. Texts scoring more than
    :data:`~kvpage.eval.divergence.DEPTH_SPLIT` positions also get a KLD-by-depth table.

    Returns:
        0 (errors raise: ``ValueError``, ``FileNotFoundError`` and ``KVPageError`` become status 2 in
        :func:`kvpage.cli.main`).
    """
    import platform
    import time

    import torch

    from kvpage.engine.config import resolve_dtype
    from kvpage.engine.threads import apply_num_threads
    from kvpage.eval.report import cpu_model_name
    from kvpage.model.loader import load_model
    from kvpage.model.quantized_linear import check_weights_dtype

    dtype = resolve_dtype(args.dtype)
    check_weights_dtype(args.weights_dtype)  # bad flags fail before the model loads
    formats = _format_list(args.formats, dtype)
    if args.suite_members is not None and not args.suite:
        raise ValueError("--suite-members needs --suite")
    if args.suite:
        from kvpage.eval.suite import SUITE, check_suite, resolve_member, select_members

        members = select_members(args.suite_members)
        resolved = [resolve_member(m) for m in members]          # FileNotFoundError before the model loads
        for r in resolved:
            warning = r.mismatch_warning()
            if warning is not None:
                print(f"[kvpage] warning: {warning}", file=sys.stderr, flush=True)
        check_suite(SUITE)
    else:
        text = Path(args.text)
        read_text_file(text, "--text")  # a missing, non-file or non-UTF-8 --text fails here, not after the load
    out = check_output_dir(args.out, "--out")  # a file or unwritable --out fails now, not after the whole run
    llm_kwargs: dict[str, object] = {}
    if args.kv_cache_scales is not None:
        llm_kwargs["kv_cache_scales"] = args.kv_cache_scales
    if args.kv_quant_residual_tokens is not None:
        llm_kwargs["kv_quant_residual_tokens"] = args.kv_quant_residual_tokens
    threads = apply_num_threads(args.threads)  # once, so every format's engine runs with the same count
    loaded = load_model(args.model, dtype=dtype, progress=args.progress, weights_dtype=args.weights_dtype)
    _check_rows_fit(loaded, formats, args.block_size, llm_kwargs)  # before the first row runs, not at its turn
    label = "decode, 1 token per step" if args.mode == "decode" else f"chunked, {args.chunk_size} tokens per step"
    setup = (f"{label}; {Path(loaded.path).name}, {str(dtype).removeprefix('torch.')}, "
             f"block {args.block_size or 'per format'}, {threads.num_threads} torch thread(s) ({threads.reason})")
    where = dict(model=str(loaded.path), dtype=str(dtype).removeprefix("torch."))
    how = dict(mode=args.mode, chunk_size=args.chunk_size if args.mode == "chunked" else 1,
               block_size=args.block_size, threads=threads.num_threads)
    machine = dict(torch=torch.__version__, machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                   cpu=cpu_model_name(), cpu_count=os.cpu_count(), python=platform.python_version(),
                   date=time.strftime("%Y-%m-%d %H:%M:%S %z"), load_average=_load_average(),
                   command=command_line(args))
    run = dict(formats=formats, mode=args.mode, chunk_size=args.chunk_size, block_size=args.block_size,
               num_threads=threads.num_threads, progress=args.progress, llm_kwargs=llm_kwargs,
               kl_divergence=args.kl_divergence)
    if args.suite:
        return _run_suite(loaded, resolved, args.tokens, args.bos, out, setup, {**where, **how}, machine, run)
    from kvpage.eval import evaluate_formats, format_table, text_token_ids, write_results_json
    from kvpage.eval.report import format_depth_table
    from kvpage.model.encode import bos_words, starts_with_bos

    ids = text_token_ids(loaded.tokenizer, text, args.tokens or DEFAULT_TEXT_TOKENS, bos=args.bos)
    print(f"[kvpage] eval: first {len(ids)} tokens of {text} ({bos_words(loaded.tokenizer, ids)}), {setup}",
          flush=True)
    start = time.perf_counter()
    results = evaluate_formats(loaded, ids, **run)
    total = time.perf_counter() - start
    print(format_table(results))
    depth = format_depth_table(results)
    if depth is not None:
        print(f"\nKLD by depth:\n{depth}")
    json_path = write_results_json(out / "results.json", results, **where, text=str(text), num_tokens=len(ids),
                                   bos=starts_with_bos(loaded.tokenizer, ids), **how, total_seconds=total, **machine,
                                   load_average_end=_load_average())
    pngs = _write_plots(out, results, f"{Path(loaded.path).name}: {text.name}, {len(ids)} tokens, {args.mode} mode")
    print(f"[kvpage] wrote {json_path} and {', '.join(map(str, pngs))} ({total:.1f} s)")
    return 0


def _run_suite(loaded: Any, resolved: list[Any], tokens: int | None, bos: bool | None, out: Path, setup: str,
               meta: dict[str, Any], machine: dict[str, Any], run: dict[str, Any]) -> int:
    """``kvpage eval --suite`` once the model is loaded: every member through :func:`evaluate_formats`.

    Args:
        loaded: the :class:`~kvpage.model.loader.LoadedModel` every member reuses.
        resolved: the members' :class:`~kvpage.eval.suite.ResolvedText`, in suite order.
        tokens: ``--tokens`` (``None``: each member's own count).
        bos: ``--bos``/``--no-bos`` (``None``: as the tokenizer's configuration says).
        out: the output folder: ``results.json`` there, ``<member>/ppl_vs_bits.png`` and
            ``<member>/kld_vs_bits.png`` below it.
        setup: the mode/model/threads words of the start line.
        meta, machine: ``results.json`` fields before and after the members' totals.
        run: :func:`evaluate_formats` keyword arguments (formats, mode, ...).

    Raises:
        ValueError: a member's text has fewer tokens than asked for (checked for every member before
            the first is scored), or more than the model's context.
    """
    import time

    from kvpage.eval import evaluate_formats, format_table
    from kvpage.eval.divergence import DEPTH_SPLIT
    from kvpage.eval.report import format_depth_table
    from kvpage.eval.suite import member_token_ids
    from kvpage.eval.suite_report import (
        LONG_CONTEXT_TOKENS,
        depth_rows,
        format_depth_summary,
        format_summary_table,
        summarize_suite,
        write_suite_json,
    )

    from kvpage.model.encode import bos_words, starts_with_bos

    ids = [member_token_ids(loaded.tokenizer, r, tokens, bos=bos) for r in resolved]  # every count checked up front
    context = loaded.config.max_position_embeddings
    long = [f"{r.member.name} ({len(i)})" for r, i in zip(resolved, ids) if len(i) > context]
    if long:
        raise ValueError(f"suite member(s) {', '.join(long)} score more tokens than the model's context of {context}; "
                         f"give --tokens {context} or fewer")
    held = next((r.member.name for r in resolved if r.member.held_back), None)
    print(f"[kvpage] eval --suite: {len(resolved)} member(s) ({', '.join(r.member.name for r in resolved)}; "
          f"held back: {held or 'not run'}), {bos_words(loaded.tokenizer, ids[0])}, {setup}", flush=True)
    runs, pngs = [], []
    start = time.perf_counter()
    for r, member_ids in zip(resolved, ids):
        m = r.member
        print(f"\n## {m.name}{' (held back)' if m.held_back else ''}: {m.kind}, first {len(member_ids)} tokens "
              f"of {r.origin} (sha256 {r.sha256[:12]})", flush=True)
        results = evaluate_formats(loaded, member_ids, **run)
        print(format_table(results), flush=True)
        depth = format_depth_table(results)
        if depth is not None:
            print(f"\nKLD by depth:\n{depth}", flush=True)
        runs.append((r, results))
        title = f"{Path(loaded.path).name}: {m.name} ({m.kind}), {len(member_ids)} tokens, {run['mode']} mode"
        pngs += _write_plots(out / m.name, results, title)
    total = time.perf_counter() - start
    print(f"\n## summary over the tuning members; {held or 'no held-back member'} apart")
    print(format_summary_table(summarize_suite(runs), held))
    deep = format_depth_summary(depth_rows(runs))
    if deep is not None:
        print(f"\n## KLD by depth: members of >= {LONG_CONTEXT_TOKENS:,} tokens, the first {DEPTH_SPLIT:,} scored "
              f"positions vs the rest\n{deep}")
    json_path = write_suite_json(out / "results.json", runs, **meta, bos=starts_with_bos(loaded.tokenizer, ids[0]),
                                 total_seconds=total, **machine, load_average_end=_load_average())
    print(f"[kvpage] wrote {json_path} and {len(pngs)} plots under {out} ({total:.1f} s)")
    return 0
