"""transformers' KV caches against kvpage's formats in transformers (``KVPageCache``): perplexity, bytes, speed.

Usage (from the repository root; the peers optimum-quanto and hqq live in the benchmark's own venv)::

    bash benchmarks/hf_cache_env.sh                                   # once: benchmarks/.venv-hf
    benchmarks/.venv-hf/bin/python benchmarks/hf_cache.py             # writes HF_CACHE.md and hf_cache.png
    benchmarks/.venv-hf/bin/python benchmarks/hf_cache.py --tokens 64 --only dynamic,int4 --out /tmp/x.md

The bundled SmolLM2-135M-Instruct GGUF loaded by transformers (``AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)``, float32), the first ``--tokens`` tokens of GPL-3 (no BOS), **decode mode**: one token per
forward pass through the cache under test, teacher-forced, so every cache sees the same tokens. For each cache:
perplexity over the ``tokens - 1`` predictions, Δppl and mean KL(P_DynamicCache ‖ P_cache) against
``DynamicCache`` on the same run order, top-1 agreement, the KV bytes the cache holds after all ``tokens``
tokens (measured from its tensors: codes, scales, zero points, full-precision residual/tail) as effective bits
per cached K/V value, and decode tokens/s (wall time of the forward passes, the cache's own work included).

Rows: ``DynamicCache``; ``QuantizedCache`` with the quanto and HQQ backends at 4 and 2 bits (their defaults:
groups of 64, a 128-token full-precision residual) and with the fp8 backend; every kvpage format through
``KVPageCache`` (the static-scale ones with scales calibrated by ``calibrate_static_scales`` on another text,
the Apache-2.0 license). A peer that is not installed or fails says so in its row. The note (``--out``) is
this script's stdout, verbatim; the plot (``--plot``) is Δppl against effective bits.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [Path("/usr/share/common-licenses/GPL-3"), ROOT / "tests" / "data" / "GPL-3"]
CALIBRATION_TEXT = Path("/usr/share/common-licenses/Apache-2.0")


@dataclass
class Row:
    """One cache's results (``error`` set when it could not run)."""

    name: str
    kind: str                      # "transformers" or "kvpage"
    setting: str
    bits: float = math.nan
    kv_bytes: int = 0
    ppl: float = math.nan
    kld: float = math.nan
    top1: float = math.nan
    tok_s: float = math.nan
    error: str = ""


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable in ``obj`` (tensors, tensor subclasses' inner tensors, dicts, sequences,
    objects' attributes one level down); each storage counted once."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        key = obj.untyped_storage().data_ptr() if obj.numel() else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def transformers_cache_bytes(cache: Any) -> int:
    """Bytes a transformers cache holds: each layer's ``keys``/``values`` and quantized states."""
    total = 0
    for layer in cache.layers:
        for attr in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, attr, None))
    return total


def load(threads: int) -> tuple[Any, Any]:
    """The bundled GGUF through transformers (model in float32, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpage.model.loader import default_model_path

    torch.set_num_threads(threads)
    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                     dtype=torch.float32)
    return model.eval(), tok


def make_caches(config: Any, scales: Any) -> dict[str, tuple[str, str, Callable[[], Any]]]:
    """name -> (kind, setting, factory) of every row, in table order."""
    from transformers import DynamicCache, QuantizedCache

    from kvpage.formats import available_formats
    from kvpage.integrations.transformers import KVPageCache

    rows: dict[str, tuple[str, str, Callable[[], Any]]] = {
        "dynamic": ("transformers", "DynamicCache (float32)", lambda: DynamicCache(config=config)),
    }
    for backend in ("quanto", "hqq"):
        for bits in (4, 2):
            rows[f"hf-{backend}-int{bits}"] = (
                "transformers", f"QuantizedCache {backend} int{bits} (group 64, 128-token fp residual)",
                lambda b=backend, n=bits: QuantizedCache(backend=b, config=config, nbits=n))
    rows["hf-fp8"] = ("transformers", "QuantizedCache fp8 (per-tensor scale from the first step)",
                   lambda: QuantizedCache(backend="fp8", config=config))
    for fmt in available_formats():
        setting = f"KVPageCache {fmt}" + (" (scales: Apache-2.0)" if fmt.endswith("_static") else "")
        rows[fmt] = ("kvpage", setting,
                     lambda f=fmt: KVPageCache(config, f, kv_cache_scales=scales if f.endswith("_static") else None))
    return rows


def run_one(model: Any, ids: Any, cache: Any, base_logp: Any | None) -> tuple[float, float, float, float, Any]:
    """Teacher-forced decode of ``ids`` ``[1, T]`` through ``cache``.

    Returns ``(nll, kld, top1, seconds, logp)``: mean NLL of tokens ``1..T-1``, mean KL and top-1 agreement
    against ``base_logp`` (nan without it), wall seconds of the ``T`` forward passes, and the ``[T-1, vocab]``
    float32 log-probabilities (kept only for the baseline).
    """
    import torch

    from kvpage.integrations.transformers.calibrate import cache_kwarg

    name = cache_kwarg(model)
    n = ids.shape[1]
    logps = []
    nll = kl = same = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(n):
            logits = model(input_ids=ids[:, t:t + 1], use_cache=True, **{name: cache}).logits[0, -1].float()
            if t == n - 1:
                break
            lp = logits.double().log_softmax(-1)
            nll -= float(lp[ids[0, t + 1]])
            if base_logp is None:
                logps.append(lp.float())
            else:
                b = base_logp[t].double()
                kl += float((b.exp() * (b - lp)).sum())
                same += float(lp.argmax() == b.argmax())
    seconds = time.perf_counter() - start
    m = n - 1
    if base_logp is None:
        return nll / m, 0.0, 100.0, seconds, torch.stack(logps)
    return nll / m, kl / m, 100.0 * same / m, seconds, None


def table(rows: list[Row], base_ppl: float, tokens: int) -> list[str]:
    """The Markdown table of every row."""
    out = ["| cache | setting | effective bits/value | KV bytes | ppl | Δppl | KLD | top-1 % | decode tok/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            out.append(f"| `{r.name}` | {r.setting} | — | — | — | — | — | — | — (not run: {r.error}) |")
            continue
        dppl = 100 * (r.ppl / base_ppl - 1)
        out.append(f"| `{r.name}` | {r.setting} | {r.bits:.3f} | {r.kv_bytes:,} | {r.ppl:.3f} | {dppl:+.2f}% | "
                   f"{r.kld:.5f} | {r.top1:.2f} | {r.tok_s:.1f} |")
    return out


def verdict(rows: list[Row], base_ppl: float) -> list[str]:
    """Whether kvpage's int4 and int2 beat every transformers row of equal or more effective bits on Δppl."""
    lines = []
    ok = {r.name: r for r in rows if not r.error}
    peers = [r for r in ok.values() if r.kind == "transformers" and r.name != "dynamic"]
    for name in ("int4", "int2"):
        r = ok.get(name)
        if r is None:
            lines.append(f"- `{name}`: not run")
            continue
        rivals = [p for p in peers if p.bits >= r.bits]
        beaten_by = [p for p in rivals if p.ppl <= r.ppl]
        d = 100 * (r.ppl / base_ppl - 1)
        if beaten_by:
            who = ", ".join(f"`{p.name}` ({p.bits:.2f} bits, {100 * (p.ppl / base_ppl - 1):+.2f}%)" for p in beaten_by)
            lines.append(f"- `{name}` ({r.bits:.2f} bits, {d:+.2f}%): **missed**: at least as good at equal or more bits: {who}")
        else:
            who = ", ".join(f"`{p.name}`" for p in rivals) or "none"
            lines.append(f"- `{name}` ({r.bits:.2f} bits, {d:+.2f}%): met: lower Δppl than every transformers row "
                         f"of equal or more bits ({who})")
    return lines


def plot(rows: list[Row], base_ppl: float, path: Path, tokens: int) -> None:
    """Δppl (symlog) against effective bits per value, transformers and kvpage rows in two colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for kind, colour, marker in (("transformers", "tab:orange", "s"), ("kvpage", "tab:blue", "o")):
        pts = [r for r in rows if r.kind == kind and not r.error and math.isfinite(r.ppl)]
        ax.scatter([r.bits for r in pts], [100 * (r.ppl / base_ppl - 1) for r in pts], c=colour, marker=marker,
                   label="transformers caches" if kind == "transformers" else "kvpage formats (KVPageCache)")
        for r in pts:
            ax.annotate(r.name, (r.bits, 100 * (r.ppl / base_ppl - 1)), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=colour)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("effective bits per cached K/V value (everything the cache holds)")
    ax.set_ylabel("Δppl vs DynamicCache, % (symlog)")
    ax.set_title(f"SmolLM2-135M in transformers, GPL-3 first {tokens} tokens, decode mode")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run every row, print the note (Markdown) and write it to ``--out``, the plot to ``--plot``; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the text (default 1024)")
    parser.add_argument("--only", default="", help="comma-separated row names (default: every row)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on 2 shared cores a second thread slows small ops down)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "HF_CACHE.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "hf_cache.png")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from kvpage.integrations.transformers import calibrate_static_scales
    from kvpage.model.loader import default_model_path

    started = time.time()
    load_before = os.getloadavg()
    model, tok = load(args.threads)
    text_path = next(p for p in TEXTS if p.is_file())
    ids = tok.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False)[: args.tokens]
    ids_t = torch.tensor([ids])
    cal = tok.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[:2048]
    scales = calibrate_static_scales(model, torch.tensor([cal]), source=str(CALIBRATION_TEXT))
    factories = make_caches(model.config, scales)
    names = [n for n in factories if not args.only or n in args.only.split(",")]
    if "dynamic" not in names:
        names.insert(0, "dynamic")
    cfg = model.config
    values = 2 * len(ids) * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * cfg.num_hidden_layers
    rows: list[Row] = []
    base_logp = None
    base_ppl = math.nan
    for name in names:
        kind, setting, factory = factories[name]
        row = Row(name, kind, setting)
        rows.append(row)
        try:
            cache = factory()
            nll, kld, top1, seconds, logp = run_one(model, ids_t, cache, base_logp)
        except Exception as e:  # a peer that cannot install or run here: say so in its row
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(f"[hf_cache] {name}: {row.error}", file=sys.stderr, flush=True)
            continue
        if base_logp is None:
            base_logp, base_ppl = logp, math.exp(nll)
        row.kv_bytes = cache.kv_bytes() if kind == "kvpage" else transformers_cache_bytes(cache)
        row.bits = 8 * row.kv_bytes / values
        row.ppl, row.kld, row.top1, row.tok_s = math.exp(nll), kld, top1, len(ids) / seconds
        print(f"[hf_cache] {name}: ppl {row.ppl:.3f} bits {row.bits:.3f} KLD {kld:.5f} {row.tok_s:.1f} tok/s",
              file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    wall = time.time() - started
    plot(rows, base_ppl, args.plot, len(ids))
    try:
        import hqq  # noqa: F401
        hqq_v = __import__("importlib.metadata").metadata.version("hqq")
    except Exception:
        hqq_v = "not installed"
    try:
        quanto_v = __import__("importlib.metadata").metadata.version("optimum-quanto")
    except Exception:
        quanto_v = "not installed"
    cmd = "benchmarks/.venv-hf/bin/python benchmarks/hf_cache.py" + (" " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:])).rstrip()
    lines = [
        "# kvpage formats in Hugging Face transformers: `KVPageCache` against transformers' KV caches",
        "",
        "<!-- Generated by benchmarks/hf_cache.py; edit that script, not this file. -->",
        "",
        f"`{cmd.strip()}` on {default_model_path().name} loaded by transformers {transformers.__version__} "
        f"(`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, float32), torch {torch.__version__}, "
        f"{args.threads} threads, optimum-quanto {quanto_v}, hqq {hqq_v}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} at the start and {load_after[0]:.2f} at the end; "
        f"wall time {wall / 60:.1f} min.",
        "",
        f"Text: `{text_path}`, first {len(ids):,} tokens (no BOS). **Decode mode**: one token per forward pass "
        f"through the cache, teacher-forced; {len(ids) - 1:,} predictions scored. Δppl and KLD (mean "
        f"KL(P_DynamicCache ‖ P_cache), nats) are against `DynamicCache` on the same tokens; top-1 = positions "
        f"whose most likely token is DynamicCache's. KV bytes: everything the cache holds after the "
        f"{len(ids):,} tokens (codes, scales, zero points, full-precision residual/tail/window, 8-bit first block), "
        f"all 30 layers; effective bits = 8 x bytes / (2 x tokens x KV heads x head_dim x layers). Decode tok/s: "
        f"tokens / wall time of the forward passes (model + cache), {args.threads} threads, not isolated from "
        f"other load.",
        "",
        *table(rows, base_ppl, len(ids)),
        "",
        "kvpage's low-bit rows against every transformers row of equal or more effective bits:",
        "",
        *verdict(rows, base_ppl),
        "",
        f"![Δppl against effective bits per value]({args.plot.name})",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
