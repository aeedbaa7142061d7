"""The CLI and engine knobs of issue 12: thread rule, memory fraction, shared engine flags, help texts,
block sizes of quantize-on-seal formats, and the tier counters line."""
from __future__ import annotations

import re

import pytest
import torch

from _tiny import tiny_loaded
from kvpage.engine import memory, threads
from kvpage.engine.config import MIN_SEALED_BLOCK_SIZE, EngineConfig
from kvpage.formats import available_formats

MiB = 2**20


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded(0, max_positions=256)


# -- threads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cpus,load,at_import,want", [
    (16, 0.2, 16, 16),    # a dedicated 16-core box gets its cores
    (16, 3.6, 16, 12),    # minus the other load, rounded
    (2, 2.4, 2, 1),       # a busy 2-core box: one thread, never 0
    (32, 0.0, 16, 16),    # at most torch's default (physical cores)
])
def test_thread_rule(monkeypatch, cpus, load, at_import, want) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads, "_AT_IMPORT", at_import)
    monkeypatch.setattr(threads, "_set_by_kvpage", torch.get_num_threads())  # as if kvpage had set it
    monkeypatch.setattr(threads, "usable_cpus", lambda: cpus)  # no cgroup quota on the test machine's account
    choice = threads.default_num_threads()
    assert choice.num_threads == want and f"{cpus} CPUs - load {round(load)}" in choice.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_num_threads() == threads.ThreadChoice(3, "OMP_NUM_THREADS")


def test_thread_rule_keeps_an_explicit_torch_setting_and_llm_applies_it(monkeypatch, tiny) -> None:
    from kvpage.engine.llm import LLM

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "_AT_IMPORT", before + 1)  # torch's count differs from its default...
        monkeypatch.setattr(threads, "_set_by_kvpage", None)    # ...and kvpage did not set it
        assert threads.default_num_threads() == threads.ThreadChoice(before, "torch.set_num_threads")
        monkeypatch.setattr(threads, "default_num_threads", lambda: threads.ThreadChoice(1, "rule: test"))
        llm = LLM(tiny, num_blocks=8, progress=False)  # num_threads=None: the rule, applied process-wide
        assert llm.threads == threads.ThreadChoice(1, "rule: test") and torch.get_num_threads() == 1
        assert LLM(tiny, num_blocks=8, num_threads=1, progress=False).threads.reason == "set"
    finally:
        torch.set_num_threads(before)


def test_usable_cpus_is_the_affinity_mask() -> None:
    assert 1 <= threads.usable_cpus() <= len(threads.os.sched_getaffinity(0))


# -- memory fraction ------------------------------------------------------------------------------

def test_memory_fraction_on_the_cpu_is_a_fraction_of_available_ram(monkeypatch, tiny, capsys) -> None:
    from kvpage.engine.llm import LLM

    monkeypatch.setattr(memory, "available_cpu_memory", lambda: 10 * MiB)
    llm = LLM(tiny, kv_cache_dtype="int8", kv_cache_memory_fraction=0.25, num_threads=1)
    c = llm.capacity
    assert c.budget_bytes == int(0.25 * 10 * MiB) and c.total_bytes <= c.budget_bytes
    assert c.budget_bytes - c.total_bytes < c.bytes_per_block
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[kvpage] engine: 1 torch thread (set); int8 KV cache: ")
    assert f"{c.num_blocks:,} blocks x 16 tokens" in line and "kv_cache_memory_fraction 0.25 x 0.01 GiB" in line


def test_available_cpu_memory_reads_memavailable() -> None:
    psutil = pytest.importorskip("psutil")
    assert memory.available_cpu_memory() == pytest.approx(psutil.virtual_memory().available, rel=0.1)


def test_memory_fraction_on_cuda_subtracts_the_profiled_forward_peak(monkeypatch) -> None:
    monkeypatch.setattr(memory, "profile_forward_peak", lambda model, n, rows, ctx, dev: 2 * 2**30 + n)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * 2**30, 80 * 2**30))
    cfg = EngineConfig(kv_cache_memory_fraction=0.5, max_num_batched_tokens=1024)
    b = memory.resolve_kv_budget(cfg, torch.nn.Identity(), torch.device("cuda"), 2048)
    assert b.bytes == int(0.5 * (10 * 2**30 - 1024)) and "forward peak 2.00 GiB" in b.source


def test_profiled_dummy_forward_runs_the_model(tiny) -> None:
    """The pass profiled on CUDA (run here on the CPU): max_num_batched_tokens tokens past the context wrap."""
    logits = memory.dummy_forward(tiny.model, 300, 4, tiny.config.max_position_embeddings, torch.device("cpu"))
    assert logits.shape == (4, tiny.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="CUDA"):
        memory.profile_forward_peak(tiny.model, 8, 1, 256, torch.device("cpu"))


@pytest.mark.parametrize("other", [dict(kv_cache_memory_bytes=MiB), dict(num_blocks=4)])
def test_memory_fraction_excludes_the_other_sizes(other) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_memory_fraction and {next(iter(other))}"):
        EngineConfig(kv_cache_memory_fraction=0.5, **other)
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction must be a number in"):
            EngineConfig(kv_cache_memory_fraction=bad)


# -- block sizes of quantize-on-seal formats ----------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4", "int3", "int2", "kivi4"])
def test_sealed_formats_need_blocks_of_at_least_8_tokens(fmt) -> None:
    for bs in (1, 7):
        with pytest.raises(ValueError, match=rf"block_size={bs} is too small for kv_cache_dtype='int[432]'"):
            EngineConfig(kv_cache_dtype=fmt, block_size=bs)
    assert EngineConfig(kv_cache_dtype=fmt, block_size=MIN_SEALED_BLOCK_SIZE).block_size_resolved == 8
    assert EngineConfig(kv_cache_dtype="int8", block_size=1).block_size_resolved == 1  # token-wise: any size


# -- flags and help -----------------------------------------------------------------------------------

def test_help_lists_every_format_float16_and_the_thread_rule() -> None:
    from kvpage.cli import build_parser

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for name in ("generate", "serve", "eval", "calibrate"):
        helps = {a.dest: a.help for a in subs[name]._actions}
        assert "float16" in helps["dtype"], name
        assert "1-minute load average" in helps["threads"] and subs[name].get_default("threads") is None
    for name in ("generate", "serve"):
        helps = {a.dest: a.help for a in subs[name]._actions}
        assert all(f in helps["kv_cache_dtype"] for f in available_formats()), name
        args = subs[name].parse_args(["x"] if name == "generate" else [])
        assert (args.max_num_seqs, args.max_model_len, args.kv_cache_memory_fraction) == (64, None, None)


def test_generate_passes_max_num_seqs_and_max_model_len(tiny, monkeypatch, capsys) -> None:
    from kvpage import cli
    from kvpage.cli import generate
    from kvpage.model import loader

    built = []
    real_build = generate.build_llm
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(generate, "build_llm", lambda args, **kw: built.append(real_build(args, **kw)) or built[-1])
    assert cli.main(["generate", "abc", "--no-chat", "--max-tokens", "2", "--max-num-seqs", "3",
                     "--max-model-len", "100", "--num-blocks", "20", "--threads", "1"]) == 0
    cfg = built[0].engine_config
    assert (cfg.max_num_seqs, cfg.max_model_len, built[0].max_model_len) == (3, 100, 100)
    assert cli.main(["generate", "abc", "--kv-cache-dtype", "int4", "--block-size", "7"]) == 2
    assert "--block-size=7 is too small for --kv-cache-dtype='int4'" in capsys.readouterr().err


# -- tier counters ------------------------------------------------------------------------------------

def test_generate_prints_tier_counters_with_swap_space(tiny, monkeypatch, capsys) -> None:
    from kvpage import cli
    from kvpage.cli import generate
    from kvpage.model import loader

    built = []
    real_build = generate.build_llm
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(generate, "build_llm", lambda args, **kw: built.append(real_build(args, **kw)) or built[-1])
    prompt = "the quick brown fox jumps over the lazy dog " * 2  # 88 byte tokens: 5 full blocks
    assert cli.main(["generate", prompt, "--no-chat", "--max-tokens", "4", "--kv-cache-dtype", "int8",
                     "--num-blocks", "32", "--swap-space", "0.01", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[kvpage\] 88 prompt tokens, 4 output tokens \(length\); time to first token", out)
    (line,) = [x for x in out.splitlines() if x.startswith("[kvpage] tiers:")]
    stats = built[0].kv_cache_stats()
    stored = stats.tiers.tier_bytes["device_to_host"] // built[0].spec.bytes_per_block
    assert stored >= 5 and stats.tiers.backups == stored  # write_through backed up every cached block
    assert f"host 0 hits, 0 blocks loaded, {stored} stored ({stored} backups, 0 swapped out)" in line
    assert re.search(rf"{stored} of \d+ host blocks used", line) and "device 0 block hits" in line
    # without tiers there is no such line
    assert cli.main(["generate", prompt, "--no-chat", "--max-tokens", "2", "--num-blocks", "32", "--threads", "1"]) == 0
    assert "[kvpage] tiers:" not in capsys.readouterr().out


def test_tier_line_reports_the_tier_counters_of_a_disk_store(tiny, monkeypatch, capsys, tmp_path) -> None:
    """The store part of the tiers line is what ``kv_cache_stats()`` says (hits per tier, blocks loaded/stored),
    not the store's own lookup/put counters: on an empty dir 0 hits and every cached block stored; a second
    run on the same dir is served from disk."""
    from kvpage import cli
    from kvpage.cli import generate
    from kvpage.model import loader

    built = []
    real_build = generate.build_llm
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(generate, "build_llm", lambda args, **kw: built.append(real_build(args, **kw)) or built[-1])
    prompt = "the quick brown fox jumps over the lazy dog " * 2  # 88 byte tokens: 5 full blocks
    argv = ["generate", prompt, "--no-chat", "--max-tokens", "4", "--kv-cache-dtype", "int8", "--num-blocks", "32",
            "--swap-space", "0.01", "--kv-disk-dir", str(tmp_path / "kv"), "--threads", "1"]
    lines = []
    for _ in range(2):
        assert cli.main(argv) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[kvpage] tiers:")]
        lines.append(line)
    for line, llm in zip(lines, built):
        stats = llm.kv_cache_stats()
        bpb = llm.spec.bytes_per_block
        hits, read, written = (stats.tier_hits.get("disk", 0), stats.tiers.tier_bytes["store_read"] // bpb,
                               stats.tiers.tier_bytes["store_write"] // bpb)
        assert f"disk {hits} hits, {read} blocks loaded, {written} stored" in line, line
    first, second = (llm.kv_cache_stats() for llm in built)
    assert first.tier_hits.get("disk", 0) == 0
    assert first.tiers.tier_bytes["store_write"] >= 5 * built[0].spec.bytes_per_block
    assert second.tier_hits["disk"] >= 5 and "disk 0 hits" not in lines[1]


@pytest.mark.parametrize("argv,words", [
    (["generate", "x", "--max-num-seqs", "0"], "argument --max-num-seqs: must be a positive integer, got 0"),
    (["generate", "x", "--threads", "abc"], "argument --threads: must be a positive integer, got 'abc'"),
    (["serve", "--port", "70000"], "argument --port: a TCP port is 0-65535, got 70000"),
    (["generate"], "the following arguments are required: prompt"),
    (["bogus"], "invalid choice: 'bogus'"),
    # a flag no parser knows, said by the sub-command's parser (it was the top-level one, hinting 'kvpage --help')
    (["generate", "x", "--kv-cache-dtpye", "int8"], "unrecognized arguments: --kv-cache-dtpye int8"),
    (["formats", "--budget", "1", "extra"], "unrecognized arguments: extra"),
    (["generate", "x", "--dtype", "float8"], "argument --dtype: must be one of auto, float32, bfloat16, float16; got"),
    (["generate", "x", "--seed", str(2**64)], "argument --seed: must be an integer in [-2**63, 2**64 - 1], got"),
])
def test_argparse_errors_are_one_line_and_a_help_hint(argv, words, capsys) -> None:
    """A flag argparse rejects prints ``kvpage <cmd>: error: ...`` and a --help hint (not the 20-line usage), exit 2."""
    from kvpage import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    prog = "kvpage" if argv[0] == "bogus" else f"kvpage {argv[0]}"
    assert captured.out == ""
    first, hint = captured.err.splitlines()  # exactly two lines
    assert first.startswith(f"{prog}: error: ") and words in first
    assert hint == f"run '{prog} --help' for the options" and "usage:" not in captured.err


# -- rough edges of issue 28: Ctrl-C, the serve socket ------------------------------------------------

def test_ctrl_c_during_generate_exits_130_with_one_line_and_no_traceback() -> None:
    """A real SIGINT while ``kvpage generate`` works (here: while it builds the engine) ends the process with
    status 130 and one ``kvpage: interrupted`` line on stderr, not Python's traceback."""
    import signal
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from kvpage import cli\n"
            "from kvpage.cli import generate\n"
            "def slow(args, **kw):\n"
            "    print('building', flush=True)\n"
            "    time.sleep(60)\n"
            "generate.build_llm = slow\n"
            "sys.exit(cli.main(['generate', 'hi', '--no-chat']))\n")
    def as_from_a_shell() -> None:
        # the child starts with SIGINT delivered and at its default, as a user's shell starts it: a test worker
        # may have it blocked or ignored, and both are inherited across exec (the child then never sees it)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_shell)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "building\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err == "kvpage: interrupted\n"


def test_main_turns_keyboard_interrupt_into_status_130(monkeypatch, capsys) -> None:
    from kvpage import cli
    from kvpage.cli import generate

    def interrupted(args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "build_llm", interrupted)
    assert cli.main(["generate", "hi"]) == cli.EXIT_INTERRUPTED == 130
    captured = capsys.readouterr()
    assert captured.err == "kvpage: interrupted\n" and "Traceback" not in captured.err


def test_a_closed_stdout_pipe_ends_quietly() -> None:
    """``kvpage formats | head -3`` ended in a BrokenPipeError traceback (twice: the write and the interpreter's last
    flush). It ends quietly with status 141 (128 + SIGPIPE), as C tools do."""
    import os
    import subprocess
    import sys

    code = "import sys; from kvpage.cli import main; sys.exit(main(['formats']))"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before kvpage writes (head -3 after its lines, deterministically)
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr.decode()) == (141, "")


@pytest.mark.parametrize("argv, words", [
    (["--stop", ""], "--stop must not contain an empty string"),
    (["--stop", "a", "--stop", ""], "--stop must not contain an empty string"),
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
])
def test_generate_bad_sampling_flags_name_the_flag_before_loading(monkeypatch, capsys, argv, words) -> None:
    """``kvpage generate --stop ""`` dropped the empty stop string silently (the server answers 400); now it is
    status 2 before the model loads, and every sampling error names the flag, not the Python field."""
    from kvpage import cli
    from kvpage.cli import generate

    def no_load(*a, **k):
        raise AssertionError("the model must not load when a sampling flag is bad")

    monkeypatch.setattr(generate, "build_llm", no_load)
    assert cli.main(["generate", "hi", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvpage: error: {words}"), line


def test_serve_on_a_busy_port_is_one_error_before_the_model_loads(monkeypatch, capsys) -> None:
    import socket

    from kvpage import cli
    from kvpage.cli import serve

    def no_load(*a, **k):
        raise AssertionError("the model must not load when the port is busy")

    monkeypatch.setattr(serve, "build_llm", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"kvpage: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in line and "--port 0" in line


def test_serve_port_0_prints_the_bound_port_and_serves_on_that_socket(tiny, monkeypatch, capsys) -> None:
    """``--port 0``: the printed URL carries the port the system picked, and uvicorn serves on the socket
    bound before the model loaded (a real ``GET /health`` at the printed URL answers 200)."""
    import threading
    import time

    import httpx
    import uvicorn

    from kvpage import cli
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    seen: dict[str, object] = {}
    real_run = uvicorn.Server.run

    def run_and_probe(self, sockets=None):
        url = re.search(r" on (http://\S+)/v1$", capsys.readouterr().out.strip()).group(1)
        seen["url"], seen["port"] = url, sockets[0].getsockname()[1]
        thread = threading.Thread(target=real_run, args=(self, sockets), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not self.started and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["health"] = httpx.get(f"{url}/health", timeout=10).status_code
        self.should_exit = True
        thread.join(30)

    monkeypatch.setattr(uvicorn.Server, "run", run_and_probe)
    assert cli.main(["serve", "--port", "0", "--num-blocks", "16", "--threads", "1", "--log-level", "warning"]) == 0
    assert seen["port"] != 0 and seen["url"] == f"http://127.0.0.1:{seen['port']}"
    assert seen["health"] == 200


def test_generate_refuses_max_tokens_beyond_the_context(tiny, monkeypatch, capsys) -> None:
    """``kvpage generate`` follows the one max_tokens policy (the server's 400, ``LLM``'s PromptTooLongError):
    prompt + --max-tokens beyond --max-model-len is one error line naming max_tokens and the room, status 2.
    The regression: the CLI cut it silently and answered."""
    from kvpage import cli
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    argv = ["generate", "abc", "--no-chat", "--max-model-len", "100", "--num-blocks", "16", "--threads", "1"]
    assert cli.main([*argv, "--max-tokens", "1000"]) == 2
    captured = capsys.readouterr()
    (line,) = [x for x in captured.err.splitlines() if not x.startswith("[kvpage] engine:")]  # the start-up line
    assert line.startswith("kvpage: error: prompt of 3 tokens + --max-tokens 1000 = 1003 tokens exceed")
    assert "--max-model-len) of 100" in line and "at most 97" in line and captured.out == ""
    assert cli.main([*argv, "--max-tokens", "97"]) == 0
    assert "3 prompt tokens, 97 output tokens (length)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--kv-cache-memory-fraction", "2"], "--kv-cache-memory-fraction must be a number in (0, 1]"),
    (["--swap-space", "-1"], "--swap-space must be a finite number of GiB >= 0"),
    (["--max-model-len", "100000"], "--max-model-len=100000 exceeds the model's context of 256 tokens"),
    (["--kv-cache-memory-bytes", "10"], "(--kv-cache-memory-bytes); raise it"),
    (["--num-blocks", "1", "--max-tokens", "40"], "Raise --kv-cache-memory-bytes/--num-blocks, pick a smaller "
                                                  "--kv-cache-dtype, or lower --max-tokens"),
])
def test_generate_engine_errors_name_the_flags(tiny, monkeypatch, capsys, argv, words) -> None:
    """Errors found when the engine is built, or when it checks the request, named the Python fields
    (``swap_space must be ...``, ``Raise kv_cache_memory_bytes/num_blocks``) on the command line: every field
    ``build_llm`` passes from a flag is named as the flag, in one error line, status 2."""
    from kvpage import cli
    from kvpage.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: tiny)
    assert cli.main(["generate", "abc", "--no-chat", "--threads", "1", *argv]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvpage: error:")]
    assert words in line, line
    assert not re.search(r"(?<![\w-])(swap_space|num_blocks|kv_cache_memory_\w+|max_model_len|max_tokens|kv_cache_dtype)",
                         line), line


def test_every_named_engine_flag_is_a_flag_of_generate_and_serve() -> None:
    """:data:`~kvpage.cli.engine_flags.ENGINE_FLAGS` names only flags the commands have."""
    from kvpage.cli import build_parser
    from kvpage.cli.engine_flags import ENGINE_FLAGS

    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for cmd in ("generate", "serve"):
        flags = {o for a in sub[cmd]._actions for o in a.option_strings}
        assert set(ENGINE_FLAGS.values()) <= flags, (cmd, set(ENGINE_FLAGS.values()) - flags)
