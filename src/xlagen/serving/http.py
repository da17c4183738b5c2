"""The HTTP layer under the server's app: the listening socket, uvicorn's protocol with the limits it lacks,
and a server whose shutdown tells the app to drain.

uvicorn bounds neither the time a client may take to send its request headers nor the number of open
connections: a client that opens connections and sends nothing (or half a header) holds a socket each
until the process runs out of file descriptors. `HttpLimits` adds both: a request's headers must arrive
within `header_timeout` seconds of the connection (or of the previous response on a kept-alive one), and
connections beyond `max_connections` are closed as they arrive. The request body's own timeout is the app's
(`xlagen.serving.guard`), which answers it with an error.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import socket
import struct
import time
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Connection limits of the HTTP server.

    Attributes:
        header_timeout: Seconds a client has to send a request's headers, from the connection's start or
            the end of its previous response; then the connection is closed.
        max_connections: Open connections at most; one more is closed at once (logged at most every 10 s).
        keep_alive: Seconds an idle kept-alive connection stays open.
        graceful_timeout: Seconds the drain on SIGTERM waits for requests in flight (None: as long as they take).
    """

    header_timeout: float = 10.0
    max_connections: int = 512
    keep_alive: int = 5
    graceful_timeout: float | None = None

    def __post_init__(self):
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0, got {self.header_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: a free one), made before the model loads so that a port
    in use is reported at once.

    Raises:
        OSError: If the address is in use or cannot be bound, with the address in the message.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host in ("", "::") else 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        reason = "the address is in use (another server listens there)" if error.errno in (98, 48) else error.strerror
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def raise_file_limit(needed: int) -> None:
    """Raises this process's soft limit of open files towards `needed` (at most the hard limit), so that
    `max_connections` sockets and the model's files fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class _LimitedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers and a cap on open connections."""

    limits: HttpLimits = HttpLimits()
    _last_refusal_log = 0.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            now = time.monotonic()
            if now - _LimitedProtocol._last_refusal_log > 10:
                _LimitedProtocol._last_refusal_log = now
                logger.warning("%d connections are open (max_connections=%d): closing new ones",
                               len(self.connections), self.limits.max_connections)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a reset: the client learns at once, and no TIME_WAIT is left here
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        waiting_for = self.cycle

        def expire() -> None:  # no new request (no new cycle) since the deadline was armed
            if self.cycle is waiting_for and not self.transport.is_closing():
                self.transport.close()

        self._header_deadline = self.loop.call_later(self.limits.header_timeout, expire)

    def _cancel_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers arrived
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._cancel_header_deadline()
            self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)


class RedactQueries(logging.Filter):
    """Drops query strings from uvicorn's access log lines: a client may put a key or a token there."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with its query, HTTP version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[redacted]", *args[3:])
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn's server that calls `on_shutdown` when its graceful shutdown starts (SIGTERM, Ctrl-C), so that
    the app can end requests whose client is still sending the body instead of waiting for them."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets)


def server_for(app, limits: HttpLimits, *, log_level: str = "warning", access_log: bool = False) -> DrainingServer:
    """A uvicorn server of `app` with `limits` (run it with `.run(sockets=[bind(...)])`); the app's shutdown hook
    is `app.state.server.begin_drain` when the app is xlagen's."""
    protocol = type("LimitedProtocol", (_LimitedProtocol,), {"limits": limits})
    config = uvicorn.Config(app, http=protocol, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=limits.keep_alive, timeout_graceful_shutdown=limits.graceful_timeout,
                            lifespan="on")
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQueries) for f in access.filters):
        access.addFilter(RedactQueries())
    state = getattr(getattr(app, "state", None), "server", None)
    return DrainingServer(config, getattr(state, "begin_drain", None))
