"""The listening socket of ``kvpage serve``: bound before the model loads, then handed to uvicorn.

Binding first makes a busy or forbidden address one clear error in a fraction of a second, instead of
a model load, uvicorn's "Application startup complete" and then ``Errno 98``; and the bound socket
knows the port ``--port 0`` picked. Imports only the standard library and :mod:`kvpage.errors`.
"""
from __future__ import annotations

import errno
import socket

from kvpage.errors import KVPageError


class AddressUnavailableError(KVPageError, OSError):
    """``host:port`` cannot be bound (in use, not an address of this machine, or a privileged port)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening (uvicorn listens on it once the app starts).

    The same socket uvicorn's own ``Config.bind_socket`` makes: IPv6 when ``host`` contains ``:``,
    ``SO_REUSEADDR`` set (a port in ``TIME_WAIT`` can be reused; one another socket listens on cannot),
    inheritable. Side effect: the port is taken until the socket is closed.

    Args:
        host: the interface, e.g. ``127.0.0.1``, ``0.0.0.0``, ``::1``.
        port: 0-65535; 0 lets the system pick a free port (read it with :func:`bound_url`).

    Raises:
        AddressUnavailableError: the bind failed; the message names ``host:port`` and the reason.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: " (another server listens there: stop it, or pick another --port; "
                                  "--port 0 takes a free one)",
                errno.EACCES: " (ports below 1024 need privileges: pick a higher --port)",
                errno.EADDRNOTAVAIL: " (not an address of this machine: check --host)"}.get(e.errno or 0, "")
        err = AddressUnavailableError(f"cannot listen on {_hostport(host, port)}: {e.strerror or e}{hint}")
        err.errno = e.errno
        raise err from None
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket, with the port it really holds (``--port 0``'s pick)."""
    host, port = sock.getsockname()[:2]
    return f"http://{_hostport(host, port)}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
