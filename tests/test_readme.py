"""The README says what the code does: its format table, its CLI flags, its ``LLM(...)`` settings, and
every code block in it runs as written (issue 28: an example with an undefined name, another that
sampled nonsense at temperature 1.0).

Stale documentation is a bug a user hits first (issue 12: a flag the README promised for
``generate`` that it did not have, a help text listing half the formats, an alias table that
missed aliases), so the README's checkable claims are checked against the code here.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvpage.cli import build_parser
from kvpage.engine.config import EngineConfig
from kvpage.formats import available_formats, format_aliases

README = Path(__file__).resolve().parents[1] / "README.md"

#: pip's and vLLM's flags, not kvpage's (the vLLM connector's section quotes vLLM's command line).
NOT_KVPAGE = {"--no-deps", "--no-build-isolation", "--kv-transfer-config"}  # pip's and vLLM's flags


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _format_rows() -> dict[str, set[str]]:
    """``kv_cache_dtype`` -> aliases, from the README's "KV formats" table."""
    rows: dict[str, set[str]] = {}
    section = _section(README.read_text(encoding="utf-8"), "KV formats")
    table = section[section.index("| `kv_cache_dtype` |"):].split("\n\n")[0]  # the table, up to its blank line
    for line in table.splitlines()[2:]:  # past the header and the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        assert m, f"not a format row: {line}"
        rows[m.group(1)] = set(re.findall(r"`([a-z0-9_]+)`", cells[1]))
    return rows


def test_format_table_lists_every_format_with_all_its_aliases() -> None:
    rows = _format_rows()
    assert set(rows) == set(available_formats())
    expected: dict[str, set[str]] = {name: set() for name in available_formats()}
    for alias, canon in format_aliases().items():
        expected[canon].add(alias)
    for name in available_formats():
        assert rows[name] == expected[name], f"README row of {name}: aliases {sorted(rows[name])}, code {sorted(expected[name])}"


def test_capacity_table_is_the_format_tables_output() -> None:
    """The README's capacity table is ``python -m kvpage.engine.format_table``'s, row for row (it had lost the
    ``int3`` and ``_rotated`` rows that the command prints)."""
    from kvpage.engine.format_table import format_rows, markdown_table

    text = README.read_text(encoding="utf-8")
    start = text.index("| format | block | bytes/token (pool) | side pools (MiB) | tokens in 512 MiB |")
    assert text[start:].split("\n\n")[0].strip() == markdown_table(format_rows()).strip()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
    return out


def test_every_cli_flag_in_the_readme_exists() -> None:
    flags = _flags(build_parser())
    # the benchmark scripts' own flags (the README quotes their command lines)
    for script in (README.parent / "benchmarks").glob("*.py"):
        flags |= set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", script.read_text(encoding="utf-8")))
    # BooleanOptionalAction flags have a --no- form
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README.read_text(encoding="utf-8"))) - NOT_KVPAGE
    assert mentioned, "the README mentions no flag: the pattern is broken"
    missing = sorted(f for f in mentioned if f not in flags)
    assert not missing, f"README mentions flags kvpage does not have: {missing}"


def test_flags_the_readme_says_work_for_generate_do() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    generate, serve = _flags(sub.choices["generate"]), _flags(sub.choices["serve"])
    text = README.read_text(encoding="utf-8")
    m = re.search(r"kvpage serve [^\n]*#\s*([^\n]*)as for generate", text)
    assert m, "the README's serve line no longer says which flags work as for generate"
    for flag in re.findall(r"--[a-z][a-z0-9-]*", m.group(1)):
        assert flag in generate and flag in serve, flag


def test_llm_signature_in_the_readme_names_real_settings() -> None:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"`LLM\(model=None, (.*?)\)`:", text, flags=re.S)
    assert m, "the README's LLM(...) signature line is gone"
    names = re.findall(r"(?:^|,\s*|\|\s*)([a-z_]+)=", m.group(1))
    assert len(names) >= 10
    unknown = sorted(set(names) - set(EngineConfig.field_names()))
    assert not unknown, f"README's LLM(...) names settings EngineConfig does not have: {unknown}"


# -- every code block of the README runs (issue 28) ---------------------------------------------------
#
# Each fenced block is extracted from README.md and run on the bundled model: Python blocks as a script,
# shell blocks one command at a time (``kvpage ...`` as ``python -m kvpage.cli ...``; ``kvpage serve`` as a
# live server on a free port, asked one greedy question; ``curl`` against the README's server). A block that
# cannot run in the suite says so right above its fence, with the reason:
#
#     <!-- readme-test: skip: sets up the environment the suite runs in -->
#
# Anything else (a new block, a new command) runs, or the classification test below fails and names it.
# ``text`` blocks (sample output, diagrams) are not code; a fence without a language is an error.

PYTHON_LANGS = {"python"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TEXT_LANGS = {"text"}
#: Commands a shell block may contain without a skip marker: the runner knows how to run these.
RUNNABLE_COMMANDS = {"kvpage", "curl"}
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<body>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[^\s`]*)\s*$")

#: The README's placeholders and what they stand for in the suite (textual replacements): the bundled
#: model for a model path, a test folder for the user's cache folder, the test's own Redis and server.
PLACEHOLDER_MODEL = "/path/to/model.gguf"
PLACEHOLDER_CACHE_DIR = "~/.cache/kvpage"
PLACEHOLDER_REDIS = "redis://127.0.0.1:6379/0"
PLACEHOLDER_SERVER = "127.0.0.1:8000"
#: Flags appended (when the line does not give them) only to keep the suite short; the line's own
#: flags still parse and run as written. ``eval`` scores 64 tokens instead of 1,024 (x5 formats, one
#: token per step), ``calibrate`` reads 256 tokens instead of 2,048.
FASTER: dict[str, dict[str, str]] = {"eval": {"--tokens": "64"}, "calibrate": {"--tokens": "256"}}
#: Seconds one command (or one server's start) may take: the first use in a checkout may compile the
#: CPU kernels (minutes on a busy 2-core machine).
COMMAND_TIMEOUT_S = 600


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of the README.

    Attributes:
        line: 1-based line number of its opening fence (for messages and test ids).
        lang: the fence's language (``python``, ``bash``, ``text``, ...; ``""`` when missing).
        code: the block's text, without the fences.
        skip: the reason of a ``<!-- readme-test: skip: reason -->`` marker right above the fence, else ``None``.
    """

    line: int
    lang: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        """``L<line>-<lang>``: the pytest id."""
        return f"L{self.line}-{self.lang or 'none'}"

    def commands(self) -> list[str]:
        """A shell block's commands: ``\\``-continued lines joined, ``$ `` prompts dropped, blank and comment-only
        lines skipped (an inline ``# comment`` stays; :func:`_argv` drops it)."""
        out: list[str] = []
        pending = ""
        for raw in self.code.splitlines():
            line = pending + raw
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1] + " "
                continue
            pending = ""
            line = line.strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                out.append(line)
        return out


def readme_snippets(text: str | None = None) -> list[Snippet]:
    """Every fenced code block of the README (or of ``text``), in order.

    Raises:
        ValueError: an unterminated fence, or a ``readme-test`` marker that is not right above a fence
            or is not ``skip: <reason>``.
    """
    text = README.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines()
    out: list[Snippet] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"README line {i + 1}: fence never closed")
        skip = None
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        if marker:
            used_markers.add(i - 1)
            kind, _, reason = marker.group("body").partition(":")
            if kind.strip() != "skip" or not reason.strip():
                raise ValueError(f"README line {i}: a readme-test marker is `skip: <reason>`, got {marker.group(0)!r}")
            skip = reason.strip()
        out.append(Snippet(i + 1, m.group("lang"), "\n".join(lines[i + 1:end]), skip))
        i = end + 1
    stray = [n + 1 for n, line in enumerate(lines) if MARKER.fullmatch(line.strip()) and n not in used_markers]
    if stray:
        raise ValueError(f"README lines {stray}: a readme-test marker must sit on the line right above a fence")
    return out


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    """``(env assignments, argv)`` of one shell command: shell words, ``# comments`` dropped, leading
    ``NAME=value`` words taken as environment variables."""
    words = shlex.split(command, comments=True)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _runnable(snippet: Snippet) -> bool:
    return snippet.skip is None and (snippet.lang in PYTHON_LANGS or snippet.lang in SHELL_LANGS)


def _run_units() -> list[tuple[Snippet, str]]:
    """``(snippet, text)`` of everything the suite runs: a Python block's code, each shell command."""
    units: list[tuple[Snippet, str]] = []
    for s in readme_snippets():
        if not _runnable(s):
            continue
        units.extend([(s, s.code)] if s.lang in PYTHON_LANGS else [(s, c) for c in s.commands()])
    return units


def _client_server_command() -> str:
    """The README's ``kvpage serve`` line that listens on 8000: the server its client examples talk to."""
    for s, unit in _run_units():
        if s.lang in SHELL_LANGS and _argv(unit)[1][:2] == ["kvpage", "serve"] and "--port 8000" in unit:
            return unit
    raise AssertionError("the README has no `kvpage serve ... --port 8000` line for its client examples")


# -- running ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """What one snippet or command did: its text as in the README and as run (placeholders filled in), its
    output, its working folder and, for ``kvpage serve``, the server (stdout: its answer; stderr: its log)."""

    command: str
    substituted: str
    stdout: str
    stderr: str
    cwd: Path
    server: Server | None = None


class Server:
    """``kvpage serve`` in its own process on a free loopback port (``--port`` appended), up once ``/health`` answers.

    Raises:
        AssertionError: the process exits, or ``/health`` does not answer within :data:`COMMAND_TIMEOUT_S`
            (the message has the log's tail).
    """

    def __init__(self, argv: list[str], env: dict[str, str], workdir: Path) -> None:
        from redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"serve-{self.port}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvpage.cli", *argv[1:], "--port", str(self.port)],
                                         cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"`{' '.join(argv)}` exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"`{' '.join(argv)}` did not come up in {COMMAND_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's combined stdout/stderr."""
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]

    def chat(self, content: str, max_tokens: int = 16) -> str:
        """A greedy one-message chat completion's text (HTTP 200 asserted)."""
        model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text)."""
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def stop(self) -> None:
        """Terminate the process (kill after 30 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The snippets' environment: this checkout's kvpage first on ``PYTHONPATH``, no hub access, one
    torch thread unless ``OMP_NUM_THREADS`` is set (the suite shares small machines)."""
    import kvpage

    env = dict(os.environ)
    src = str(Path(kvpage.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


class Runner:
    """Runs README snippets and commands in a test folder, with the placeholders filled in.

    The Redis server and the README's client-facing ``kvpage serve`` start on first need; both live
    as long as the runner (one per module). Other servers stop once their command is checked.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._client_server: Server | None = None
        self._servers: list[Server] = []

    def client_server(self) -> Server:
        """The README's own client-facing server (its ``kvpage serve ... --port 8000`` line), started once."""
        if self._client_server is None:
            env, argv = _argv(_client_server_command())
            self._client_server = Server(argv, _env(env), self.workdir)
        return self._client_server

    def substitute(self, text: str, cwd: Path, request: pytest.FixtureRequest) -> str:
        """``text`` with the README's placeholders replaced by the suite's model, folders, Redis and server
        (``request``: the test's, for its ``redis_url`` fixture)."""
        if PLACEHOLDER_MODEL in text:
            from kvpage.model.loader import default_model_path

            text = text.replace(PLACEHOLDER_MODEL, str(default_model_path()))
        text = text.replace(PLACEHOLDER_CACHE_DIR, str(cwd / "kvpage-cache"))
        if PLACEHOLDER_REDIS in text:
            text = text.replace(PLACEHOLDER_REDIS, request.getfixturevalue("redis_url"))
        if PLACEHOLDER_SERVER in text:
            text = text.replace(PLACEHOLDER_SERVER, f"127.0.0.1:{self.client_server().port}")
        return text

    def python(self, code: str, cwd: Path, request: pytest.FixtureRequest) -> Run:
        """Run a Python block as a script in ``cwd`` (exit status 0 asserted)."""
        script = cwd / "snippet.py"
        substituted = self.substitute(code, cwd, request)
        script.write_text(substituted, encoding="utf-8")
        return self._run(code, substituted, [sys.executable, str(script)], {}, cwd)

    def command(self, command: str, cwd: Path, request: pytest.FixtureRequest) -> Run:
        """Run one shell command of a block in ``cwd``: ``kvpage serve`` as a server asked one greedy
        question (its answer is the run's stdout; it runs until :meth:`stop_servers`), other ``kvpage``
        commands as ``python -m kvpage.cli``."""
        substituted = self.substitute(command, cwd, request)
        env, argv = _argv(substituted)
        assert argv and argv[0] in RUNNABLE_COMMANDS, f"cannot run README command {command!r}"
        if argv[0] == "curl":
            return self._run(command, substituted, argv, env, cwd)
        if argv[1] == "serve":
            if command == _client_server_command():
                server = self.client_server()
            else:
                server = Server(argv, _env(env), cwd)
                self._servers.append(server)
            answer = server.chat("What is the capital of France?")
            return Run(command, substituted, answer, server.log_tail(), cwd, server)
        faster = [w for flag, value in FASTER.get(argv[1], {}).items()
                  if not any(a == flag or a.startswith(flag + "=") for a in argv) for w in (flag, value)]
        return self._run(command, substituted, [sys.executable, "-m", "kvpage.cli", *argv[1:], *faster], env, cwd)

    def _run(self, label: str, substituted: str, argv: list[str], env: dict[str, str], cwd: Path) -> Run:
        p = subprocess.run(argv, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert p.returncode == 0, f"README {label!r} exited with {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return Run(label, substituted, p.stdout, p.stderr, cwd)

    def stop_servers(self) -> None:
        """Stop the servers :meth:`command` started, except the client-facing one."""
        while self._servers:
            self._servers.pop().stop()

    def close(self) -> None:
        """Stop every server."""
        self.stop_servers()
        if self._client_server is not None:
            self._client_server.stop()


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    """One :class:`Runner` per module (its client-facing server shared by the snippets that talk to it)."""
    r = Runner(tmp_path_factory.mktemp("readme"))
    try:
        yield r
    finally:
        r.close()


# -- what each run must show ---------------------------------------------------------------------------
#
# Every run must exit 0, print something and raise no deprecation warning. The checks below add what
# the snippet promises; each is keyed by a regex over the command (or the Python block) it checks, and
# a key that matches no snippet fails the classification test (a check never goes stale silently).
# Greedy text of a lossy format is never compared exactly: substrings the answer must contain, numbers
# the README states, or the structure of what was written.

CHECKS: list[tuple[str, Callable[[Run], None]]] = []


def _check(pattern: str) -> Callable[[Callable[[Run], None]], Callable[[Run], None]]:
    def register(fn: Callable[[Run], None]) -> Callable[[Run], None]:
        CHECKS.append((pattern, fn))
        return fn
    return register


def _answer(run: Run) -> str:
    """``kvpage generate``'s answer: its stdout before the first ``[kvpage]`` line."""
    return run.stdout.split("\n[kvpage]")[0].strip()


def _kv_line(run: Run) -> str:
    m = re.search(r"^\[kvpage\] KV cache: .*$", run.stdout, flags=re.M)
    assert m, f"no KV cache line in:\n{run.stdout}"
    return m.group(0)


@_check(r'kvpage generate "What is the capital of France\?"')
def _capital_cli(run: Run) -> None:
    assert "Paris" in _answer(run), run.stdout
    assert _kv_line(run).startswith("[kvpage] KV cache: int8 (8.25 bits/value), 11,880 bytes/token"), run.stdout
    # the README's sample start-up line is this command's, up to the thread count and its reason
    sample = next(s.code for s in readme_snippets() if s.lang == "text" and s.code.startswith("[kvpage] engine:"))
    real = re.search(r"\[kvpage\] engine: [^\n\r]*", run.stderr)
    assert real, run.stderr[-2000:]
    assert real.group(0).partition("); ")[2] == sample.strip().partition("); ")[2], (real.group(0), sample)


@_check(r'kvpage generate "Once upon a time" --no-chat')
def _story_cli(run: Run) -> None:
    assert len(_answer(run).split()) >= 5, run.stdout
    assert _kv_line(run).startswith("[kvpage] KV cache: fp8 (8.25 bits/value)"), run.stdout


@_check(r'kvpage generate "Hi" --model')
def _model_path_cli(run: Run) -> None:
    assert _answer(run), run.stdout


@_check(r"^kvpage formats\b")
def _formats_cli(run: Run) -> None:
    from kvpage.formats import available_formats

    missing = [f for f in available_formats() if not re.search(rf"\b{f}\b", run.stdout)]
    assert not missing, f"`kvpage formats` does not list {missing}:\n{run.stdout}"


@_check(r"^kvpage eval --text")
def _eval_cli(run: Run) -> None:
    out = run.cwd / "kvpage-eval"
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert {"int8", "fp8", "int4", "int2"} <= set(rows), sorted(rows)
    for name, row in rows.items():
        assert math.isfinite(row["ppl"]) and 1 < row["ppl"] < 1000, (name, row["ppl"])
    assert rows["int8"]["bits_per_value"] == rows["fp8"]["bits_per_value"] == 8.25
    # on 64 tokens int4/int2 hold most of the text in their 8-bit first block and 16-bit tail (window),
    # so their effective bits lie between the 8-bit formats' and the float32 baseline's
    baseline = json.loads((out / "results.json").read_text())["results"][0]
    assert all(8.25 < rows[f]["bits_per_value"] < baseline["bits_per_value"] for f in ("int4", "int2")), rows
    assert (out / "ppl_vs_bits.png").stat().st_size > 0 and (out / "kld_vs_bits.png").stat().st_size > 0


@_check(r"^kvpage serve --kv-cache-dtype int8 --port 8000")
def _serve_cli(run: Run) -> None:
    assert "Paris" in run.stdout, run.stdout
    assert "int8 KV cache" in run.stderr, run.stderr


@_check(r"client = OpenAI\(")
def _openai_client(run: Run) -> None:
    first, _, streamed = run.stdout.partition("CompletionUsage(")
    assert "Paris" in first, run.stdout
    assert re.search(r"completion_tokens=[1-9]", streamed), run.stdout
    assert all(str(n) in streamed.partition("\n")[2] for n in range(1, 6)), run.stdout


@_check(r'llm = LLM\(kv_cache_dtype="int8", block_size=16')
def _llm_python(run: Run) -> None:
    assert "Paris" in run.stdout.partition("RequestMetrics")[0], run.stdout
    assert "RequestMetrics(prompt_tokens=5, output_tokens=" in run.stdout, run.stdout
    assert re.search(r"\b11880(\.0)? bytes/token; a cache in the model dtype takes 46080(\.0)?$", run.stdout, flags=re.M), \
        run.stdout


@_check(r"KVPageCache\(model\.config")
def _kvpage_cache_python(run: Run) -> None:
    text, memory = run.stdout.rstrip().rsplit("\n", 1)
    assert text.startswith("The capital of France is") and "Paris" in text, run.stdout
    m = re.fullmatch(r"int4: ([\d,]+) tokens x 1 row\(s\) hold ([\d,]+) bytes = ([\d,]+) of codes and scales "
                     r"\(([\d.]+) bits/value\) \+ ([\d,]+) of fixed side costs .*", memory)
    assert m, run.stdout
    tokens, held, codes, bits, side = (float(g.replace(",", "")) for g in m.groups())
    # a short answer sits mostly in the open block (the model's dtype until it seals): the side parts are apart,
    # and the codes alone cost int4's rate (4-bit codes plus their scales)
    assert tokens > 0 and held == codes + side and codes > 0 and 4 < bits < 5, run.stdout


@_check(r"kvpage generate .*--kv-store redis://")
def _tiers_cli(run: Run) -> None:
    import redis

    line = next((x for x in run.stdout.splitlines() if x.startswith("[kvpage] tiers:")), None)
    assert line, run.stdout
    assert "disk" in line and "redis" in line and "error" not in line and "rejected" not in line, line
    stored = re.search(r"(\d+) blocks loaded, (\d+) stored \(all stores\)", line)
    assert stored and int(stored.group(2)) > 0, line
    assert any((run.cwd / "kvpage-cache").rglob("*")), "the disk store wrote nothing"
    port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", run.substituted).group(1))
    assert redis.Redis(host="127.0.0.1", port=port).dbsize() > 0, "the Redis store holds nothing"


@_check(r"^kvpage calibrate --text")
def _calibrate_cli(run: Run) -> None:
    from safetensors.torch import load_file

    scales = load_file(run.cwd / "scales.safetensors")
    assert scales["layers.0.k_absmax"].shape == (3, 64) and len(scales) == 2 * 30, sorted(scales)[:4]
    assert all(bool((t > 0).all()) for t in scales.values())


@_check(r"kvpage generate .*--kv-cache-dtype int8_static --kv-cache-scales")
def _static_cli(run: Run) -> None:
    assert _answer(run), run.stdout
    assert _kv_line(run).startswith("[kvpage] KV cache: int8_static (8 bits/value)"), run.stdout


@_check(r'speculative_config=\{"method": "ngram"')
def _speculative_python(run: Run) -> None:
    assert "quick brown fox" in run.stdout, run.stdout
    m = re.search(r"num_accepted_tokens=(\d+)", run.stdout)
    assert m and int(m.group(1)) > 0, run.stdout


@_check(r'kvpage generate .*--speculative-config .*"ngram"')
def _speculative_cli(run: Run) -> None:
    m = re.search(r"^\[kvpage\] speculative: (\d+) drafted", run.stdout, flags=re.M)
    assert m, run.stdout


@_check(r'kvpage serve --speculative-config .*"layer_skip"')
def _speculative_serve(run: Run) -> None:
    assert "Paris" in run.stdout, run.stdout  # speculation keeps greedy output the model's own
    m = re.search(r"^kvpage:spec_decode_num_drafts_total(?:\{[^}]*\})? (\S+)$", run.server.metrics(), flags=re.M)
    assert m and float(m.group(1)) > 0, "the layer_skip server drafted nothing"


def _checks_for(unit: str) -> list[Callable[[Run], None]]:
    return [fn for pattern, fn in CHECKS if re.search(pattern, unit, flags=re.M)]


# -- the tests -----------------------------------------------------------------------------------------

def test_every_readme_snippet_is_run_or_skipped_with_a_reason() -> None:
    snippets = readme_snippets()
    assert len(snippets) >= 10, "the fence pattern is broken"
    unknown = [(s.id, s.lang) for s in snippets if s.lang not in PYTHON_LANGS | SHELL_LANGS | TEXT_LANGS]
    assert not unknown, f"README blocks without a known language (python, bash, text, ...): {unknown}"
    for s in snippets:
        if s.lang in SHELL_LANGS and s.skip is None:
            for command in s.commands():
                words = _argv(command)[1]
                assert words and words[0] in RUNNABLE_COMMANDS, (
                    f"README {s.id}: `{command}` is not a command tests/test_readme.py can run "
                    f"({sorted(RUNNABLE_COMMANDS)}); run it there or mark the block `<!-- readme-test: skip: why -->`")
    units = [u for _, u in _run_units()]
    for pattern, _ in CHECKS:
        hits = [u for u in units if re.search(pattern, u, flags=re.M)]
        assert len(hits) == 1, f"check {pattern!r} matches {len(hits)} README snippets or commands, not one"
    servers_needed = [u for u in units if PLACEHOLDER_SERVER in u]
    assert not servers_needed or _client_server_command()


def test_snippet_parser_reads_markers_languages_and_commands() -> None:
    text = "\n".join([
        "intro", "<!-- readme-test: skip: needs a GPU -->", "```bash", "make demo", "```", "",
        "```python", "print(1)", "```", "```", "[kvpage] sample output", "```", "",
        "```console", "$ kvpage generate \\", '    "Hi"   # a comment', "# only a comment", "", "curl -s x", "```",
    ])
    got = readme_snippets(text)
    assert [(s.line, s.lang, s.skip) for s in got] == [(3, "bash", "needs a GPU"), (7, "python", None), (10, "", None),
                                                       (14, "console", None)]
    assert got[1].code == "print(1)"
    assert got[3].commands() == ['kvpage generate      "Hi"   # a comment', "curl -s x"]
    assert _argv(got[3].commands()[0]) == ({}, ["kvpage", "generate", "Hi"])
    assert _argv("KVPAGE_CPU_KERNELS=0 kvpage formats") == ({"KVPAGE_CPU_KERNELS": "0"}, ["kvpage", "formats"])
    with pytest.raises(ValueError, match="right above a fence"):
        readme_snippets("<!-- readme-test: skip: why -->\n\n```bash\nmake\n```")
    with pytest.raises(ValueError, match="skip: <reason>"):
        readme_snippets("<!-- readme-test: skip -->\n```bash\nmake\n```")
    with pytest.raises(ValueError, match="never closed"):
        readme_snippets("```python\nprint(1)\n")


def test_skipped_readme_blocks_name_what_exists() -> None:
    """A skipped block is not run, but the Makefile targets and scripts it names must exist."""
    root = README.parent
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    named = 0
    for s in readme_snippets():
        if s.skip is None or s.lang not in SHELL_LANGS:
            continue
        for command in s.commands():
            words = _argv(command)[1]
            if words[0] == "make":
                for target in words[1:]:
                    assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no Makefile target {target!r}"
                    named += 1
            for word in words:
                if word.endswith((".py", ".sh")):
                    assert (root / word).is_file(), f"README {s.id} names {word}, which does not exist"
                    named += 1
    assert named >= 10


def _params() -> list:
    try:
        snippets = readme_snippets()
    except ValueError:  # a malformed marker: the classification test reports it; the other tests still collect
        return []
    return [pytest.param(s, id=s.id) for s in snippets if _runnable(s)]


@pytest.mark.slow
@pytest.mark.parametrize("snippet", _params())
def test_readme_snippet_runs(snippet: Snippet, runner: Runner, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    units = [snippet.code] if snippet.lang in PYTHON_LANGS else snippet.commands()
    assert units
    for unit in units:
        try:
            run = (runner.python(unit, tmp_path, request) if snippet.lang in PYTHON_LANGS
                   else runner.command(unit, tmp_path, request))
            assert run.stdout.strip(), f"README {snippet.id}: `{unit}` printed nothing"
            assert "Traceback" not in run.stderr, run.stderr[-3000:]
            warned = re.findall(r"^.*(?:FutureWarning|DeprecationWarning).*$", run.stderr, flags=re.M)
            assert not warned, f"README {snippet.id}: `{unit}` is deprecated usage: {warned}"
            for check in _checks_for(unit):
                check(run)
        finally:
            runner.stop_servers()
