"""The engine's argparse value types, help texts and path checks, shared by every front end that takes engine flags.

:mod:`kvpage.cli` and :mod:`kvpage.eval.command` both import them from here, below both (as vLLM keeps
its engine arguments with the engine). A leaf: it imports nothing of kvpage at import time (the
``--threads`` help reads :mod:`kvpage.engine.threads` when called).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _int(text: str, what: str) -> int:
    """``text`` as an int, else an ``ArgumentTypeError`` saying it must be ``what`` (argparse prints it as is)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def model_dtype(text: str) -> str:
    """argparse type: a compute dtype name :func:`kvpage.engine.config.resolve_dtype` takes (``auto``, ``float32``,
    ``bfloat16``, ``float16`` or an alias such as ``bf16``); returned as given."""
    from kvpage.engine.config import resolve_dtype

    try:
        resolve_dtype(text)
    except ValueError as e:  # "dtype must be one of ...": argparse prefixes "argument --dtype: "
        raise argparse.ArgumentTypeError(str(e).removeprefix("dtype ")) from None
    return text


def seed(text: str) -> int:
    """argparse type: a sampling seed, an integer in ``[-2**63, 2**64 - 1]`` (what
    :class:`~kvpage.engine.sampling.SamplingParams` takes)."""
    from kvpage.engine.sampling import SEED_MAX, SEED_MIN

    value = _int(text, "an integer")
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64 - 1], got {value}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    value = _int(text, "a TCP port (0-65535)")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value}")
    return value


def _json_object(text: str, example: str | None) -> dict[str, Any]:
    """``text`` parsed as a JSON object; the ``ArgumentTypeError`` shows ``example`` (a usage, flag included)."""
    eg = f", e.g. {example}" if example else ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object{eg}; {text!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}){eg}; got a JSON {type(value).__name__}: "
                                         f"{text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object as a dict (a flag with its own example takes :func:`json_object_arg`).

    Only the syntax is checked here; the keys are checked by the engine setting the dict goes to.
    argparse prefixes the error with the flag (``argument --kv-transfer-config: ...``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON but not an object.
    """
    return _json_object(text, None)


def json_object_arg(flag: str, example: str) -> Callable[[str], dict[str, Any]]:
    """argparse type of ``flag``: a JSON object as a dict, whose error shows ``flag`` with ``example``.

    E.g. ``json_object_arg("--kv-events-config", '{"enable_kv_cache_events": true}')``: a bad value is reported as
    ``argument --kv-events-config: must be a JSON object, e.g. --kv-events-config '{"enable_kv_cache_events":
    true}'; ...``, never with another flag's example. Errors as :func:`json_object`.
    """
    usage = f"{flag} '{example}'"

    def parse(text: str) -> dict[str, Any]:
        return _json_object(text, usage)

    parse.__name__ = f"json_object({flag})"
    return parse


def _probe_writable_dir(folder: Path, flag: str, shown: Path) -> None:
    """Create ``folder`` (and missing parents) and a temporary file in it, then remove what was created.

    The only reliable answer to "can this command write there" (``os.access`` says yes to root on ``/proc``).

    Raises:
        ValueError: it cannot be created or written (names ``flag``, ``shown`` and the OS's reason).
    """
    missing = [a for a in (folder, *folder.parents) if not a.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvpage-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {shown}: cannot write there ({e.strerror or e})") from None
    finally:
        for m in missing:  # deepest first: leave the file system as it was (the run creates them again)
            try:
                m.rmdir()
            except OSError:
                pass


def check_output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a ``Path`` after checking that a command can write its files into it: an existing directory,
    or one it can create. Run before any long work, so a bad ``--out`` fails at once, not after the run.

    Side effects: none that last (it creates the folder and a temporary file in it, then removes both).

    Raises:
        ValueError: ``path`` is an existing file (or other non-directory), lies under one, or cannot be created
            or written (the message names ``flag``).
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p}: exists and is not a directory (give a folder for the output files)")
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {p}: {blocker} is not a directory")
    _probe_writable_dir(p, flag, p)
    return p


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` (``~`` expanded) after checking that a command can write the file: not a directory, and its
    folder exists or can be created and is writable. An existing file is fine (it is replaced).

    Side effects: none that last (as :func:`check_output_dir`, on the file's folder).

    Raises:
        ValueError: ``path`` is a directory, or its folder cannot be created or written (names ``flag``).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {p}: is a directory (give a file name, e.g. {p / 'scales.safetensors'})")
    if p.exists() and not p.is_file():
        raise ValueError(f"{flag} {p}: exists and is not a regular file")
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {p}: {blocker} is not a directory")
    _probe_writable_dir(p.parent, flag, p)
    return p


def read_text_file(path: str | os.PathLike[str], flag: str) -> str:
    """The UTF-8 text of the file ``path`` names (the value of ``flag``).

    Raises:
        FileNotFoundError: no such file (names ``flag``).
        ValueError: a directory or another non-file, unreadable, or not UTF-8 text (names ``flag``, and the byte
            offset of the first bad byte).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p}: no such file")
    if p.is_dir():
        raise ValueError(f"{flag} {p}: is a directory, not a text file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {p}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset "
                         f"{e.start}); give a UTF-8 text file") from None
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot be read ({e.strerror or e})") from None


#: ``--dtype`` help, the same for every sub-command.
DTYPE_HELP = "model compute dtype: auto (float32), float32, bfloat16, float16"
#: ``--weights-dtype`` help, the same for every sub-command.
WEIGHTS_DTYPE_HELP = ("how a GGUF's weights are held: auto (Q4_0/Q4_1/Q8_0 projections and LM head run as shipped "
                      "when --dtype is bfloat16, else dequantized), as_shipped (run as shipped with any --dtype), "
                      "dequantized (every tensor in --dtype)")


def threads_help() -> str:
    """``--threads`` help: the thread rule of :mod:`kvpage.engine.threads`."""
    from kvpage.engine.threads import RULE_HELP

    return f"torch CPU threads ({RULE_HELP}); the engine's start-up line prints the count"
