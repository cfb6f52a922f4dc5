"""The listening socket of a reference server: bound on 127.0.0.1 before anything else runs."""

from __future__ import annotations

import errno
import socket

from protocols import MidflightError

from .._servers.context import HOST


class PortInUseError(MidflightError, OSError):
    """The port a server was told to bind is taken (or not ours to bind)."""


def bind_listening_socket(port: int) -> socket.socket:
    """A socket bound to ``127.0.0.1:port`` and listening, so no other process can take the port.

    Raises:
        PortInUseError: The port is taken, or binding it is not permitted.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            reason = "already in use" if exc.errno == errno.EADDRINUSE else "not permitted"
            raise PortInUseError(exc.errno, f"port {port} on {HOST} is {reason}") from exc
        raise
    except BaseException:
        sock.close()
        raise
    return sock
