"""``kvpage serve``: the model behind an OpenAI-compatible HTTP API (see :mod:`kvpage.server`), run by uvicorn."""
from __future__ import annotations

import argparse
from typing import Any

from kvpage.cli.engine_flags import add_engine_args, build_llm
from kvpage.engine.args import port


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser."""
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem or folder name)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per forward pass (default 2048)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps (default on)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    s.set_defaults(func=run_serve)
    return s


def run_serve(args: argparse.Namespace) -> int:
    """``kvpage serve``: bind the port, build the engine from the flags and serve it until interrupted.

    The socket is bound before the model loads (:func:`~kvpage.server.listen.bind_socket`), so a busy
    ``--host:--port`` is one error line (status 2) and no load; the URL printed is the bound one
    (``--port 0`` shows the port the system picked). uvicorn then serves on that socket.
    """
    import uvicorn

    from kvpage.server.app import build_app
    from kvpage.server.listen import bind_socket, bound_url

    sock = bind_socket(args.host, args.port)
    try:
        llm = build_llm(
            args,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        app = build_app(llm, args.served_model_name, close_llm=True)  # shutdown flushes events, closes stores
        print(f"[kvpage] serving {app.state.served_model_name!r} ({llm.spec.format_label} KV cache, "
              f"{llm.num_blocks} blocks x {llm.spec.block_size} tokens) on {bound_url(sock)}/v1", flush=True)
        config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level=args.log_level)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
