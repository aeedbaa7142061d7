"""The ``kvpage`` command line: ``kvpage generate``, ``serve``, ``eval``, ``calibrate``, ``formats`` and ``build-kernels``.

One module per sub-command, each with its ``add_*_parser`` and ``run_*`` (``kvpage eval``'s are
:mod:`kvpage.eval.command`'s); :mod:`kvpage.cli.engine_flags` holds the flags ``generate`` and ``serve`` share.
The top layer: it may import any other, and none imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvpage.cli.calibrate import add_calibrate_parser
from kvpage.cli.formats import add_formats_parser
from kvpage.cli.generate import add_generate_parser
from kvpage.cli.kernels import add_build_kernels_parser
from kvpage.cli.serve import add_serve_parser
from kvpage.errors import KVPageError

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a hint, not the whole usage block.

    ``kvpage generate --max-num-seqs 0`` prints ``kvpage generate: error: argument --max-num-seqs: ...``
    and ``run 'kvpage generate --help' for the options`` on stderr, then exits with status 2
    (argparse's). Sub-command parsers are of this class too (``add_subparsers`` uses the parent's).
    """

    #: The sub-commands' parsers by name (set by :func:`build_parser`), for :meth:`parse_command_line`.
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` and a ``--help`` hint on stderr; exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\nrun '{self.prog} --help' for the options\n")

    def parse_command_line(self, argv: Sequence[str] | None) -> argparse.Namespace:
        """``parse_args(argv)``, except that flags no parser knows are reported by the sub-command's parser
        (``kvpage generate: error: unrecognized arguments: --kv-cache-dtpye`` and its ``kvpage generate --help``
        hint): argparse leaves them to the top-level parser, whose hint lists only the sub-commands. Exits with
        status 2 on a bad command line, as ``parse_args`` does."""
        ns, extra = self.parse_known_args(argv)
        if extra:
            parser = getattr(self, "commands", {}).get(getattr(ns, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> _Parser:
    """The ``kvpage`` argument parser (sub-commands ``generate``, ``serve``, ``eval``, ``calibrate``, ``formats``,
    ``build-kernels``).

    A bad flag exits with status 2 after one error line and a ``--help`` hint (:class:`_Parser`).
    """
    parser = _Parser(prog="kvpage", description="Paged, quantized KV cache and a small LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    from kvpage.eval.command import add_eval_parser  # here, not at the top: importing kvpage.eval imports torch

    add_eval_parser(sub)
    add_calibrate_parser(sub)
    add_formats_parser(sub)
    add_build_kernels_parser(sub)
    parser.commands = dict(sub.choices)  # which parser reports a flag none knows (_Parser.parse_command_line)
    return parser


#: Exit status after Ctrl-C (SIGINT): 128 + 2, as shells report a process that SIGINT ended.
EXIT_INTERRUPTED = 130
#: Exit status when the reader of stdout went away (``kvpage formats | head -3``): 128 + 13 (SIGPIPE), as shells
#: report a process that SIGPIPE ended, which is how ``ls``, ``cat`` and other C tools end there.
EXIT_BROKEN_PIPE = 141


def _silence_stdout() -> None:
    """Point stdout at ``/dev/null``, so the interpreter's last flush of the closed pipe raises nothing
    (Python's documented recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by something without a file descriptor
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpage`` console script; returns the exit status.

    2 on a kvpage error (one ``kvpage: error: ...`` line on stderr); :data:`EXIT_INTERRUPTED` (130) on
    Ctrl-C, after one ``kvpage: interrupted`` line on stderr instead of a traceback; :data:`EXIT_BROKEN_PIPE`
    (141), quietly, when stdout's reader closed it (``kvpage formats | head -3``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        args = build_parser().parse_command_line(argv)
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught below, not in the interpreter's exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (KVPageError, FileNotFoundError, ValueError) as e:
        print(f"kvpage: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpage: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
