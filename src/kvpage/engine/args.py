"""The engine's argparse value types and help texts, shared by every front end that takes engine flags.

:mod:`kvpage.cli` and :mod:`kvpage.eval.command` both import them from here, below both (as vLLM keeps
its engine arguments with the engine). A leaf: it imports nothing of kvpage at import time (the
``--threads`` help reads :mod:`kvpage.engine.threads` when called).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
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
