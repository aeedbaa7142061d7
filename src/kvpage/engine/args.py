"""The engine's argparse value types and help texts, shared by every front end that takes engine flags.

:mod:`kvpage.cli` and :mod:`kvpage.eval.command` both import them from here, below both (as vLLM keeps
its engine arguments with the engine). A leaf: it imports nothing of kvpage at import time (the
``--threads`` help reads :mod:`kvpage.engine.threads` when called).
"""
from __future__ import annotations

import argparse
import json
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


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (``--speculative-config '{"method": "ngram", ...}'``) as a dict.

    Only the syntax is checked here; the keys are checked by the engine setting the dict goes to.
    argparse prefixes the error with the flag (``argument --speculative-config: ...``).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. "
                                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'; "
                                         f"{text!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got a JSON {type(value).__name__}: "
                                         f"{text!r}")
    return value


#: ``--dtype`` help, the same for every sub-command.
DTYPE_HELP = "model compute dtype: auto (float32), float32, bfloat16, float16"


def threads_help() -> str:
    """``--threads`` help: the thread rule of :mod:`kvpage.engine.threads`."""
    from kvpage.engine.threads import RULE_HELP

    return f"torch CPU threads ({RULE_HELP}); the engine's start-up line prints the count"
