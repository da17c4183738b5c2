"""ASGI middleware that decides whether a request may reach the routes at all, before any of them runs.

In order, each refusal in OpenAI's error JSON:

- `Host` must be a name the server answers to (400): a page on another site can make a browser send
  requests to a server on the user's machine, and with DNS rebinding read the answers; those requests carry
  the attacker's host name. Allowed: IP literals of the bound address (any IP literal when bound to all
  interfaces: a rebinding needs a name), `localhost` when bound to loopback or all interfaces, and
  `--allowed-hosts`.
- `Origin`, which browsers send with cross-site requests, must be an allowed origin (403); allowed origins get
  CORS answers (preflights included) from Starlette's `CORSMiddleware`.
- `/v1/*` needs the API key when one is set (401), compared in constant time.
- A POST's `Content-Type` must be the route's (415): `application/json` for the JSON routes, so that a page
  cannot send a "simple" `text/plain` request without a preflight; `multipart/form-data` for uploads.
- The body: larger than `max_body_bytes` is 413 (from `Content-Length`, or while it is read); not received
  within `body_timeout` seconds is 408; still being sent when the server starts draining is 503.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Callable

from xlagen.serving.errors import error_response
from xlagen.serving.protocol import RequestError
from xlagen.serving.settings import ServerSettings

JSON, MULTIPART = "application/json", "multipart/form-data"


class _BodyRefused(Exception):
    def __init__(self, error: RequestError):
        super().__init__(str(error))
        self.error = error


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_name(header: str) -> str:
    """The host of a `Host` header, without its port, brackets or trailing dot, lowercased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def is_loopback(address: str) -> bool:
    """Whether a listening address is reachable from this machine only (`localhost`, 127.0.0.0/8, ::1)."""
    ip = _ip(address)
    return address == "localhost" or (ip is not None and ip.is_loopback)


def host_allowed(name: str, bound: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request whose `Host` is `name` (see `host_name`) is answered by a server bound to `bound`.

    Args:
        name: The request's host.
        bound: The listening address (`0.0.0.0` / `::` / empty: all interfaces).
        allowed: Extra names: exact, `.example.com` (that domain and its subdomains) or `*` (any).
    """
    for pattern in allowed:
        if pattern == "*" or pattern == name or (pattern.startswith(".") and (name == pattern[1:]
                                                                                or name.endswith(pattern))):
            return True
    wildcard = bound in ("", "0.0.0.0", "::")
    bound_ip = _ip(bound)
    loopback = is_loopback(bound)
    ip = _ip(name)
    if ip is not None:
        return wildcard or (loopback and ip.is_loopback) or (bound_ip is not None and ip == bound_ip)
    return (wildcard or loopback) and (name == "localhost" or name.endswith(".localhost"))


def media_type(header: str | None) -> str:
    """The media type of a `Content-Type` header, without parameters, lowercased ('' when absent)."""
    return (header or "").split(";", 1)[0].strip().lower()


class Guard:
    """The checks of the module docstring, around `app`.

    Args:
        app: The ASGI app (xlagen's routes, inside Starlette's CORS middleware when origins are allowed).
        settings: The server's settings.
        post_types: The media type each POST route takes (path -> `JSON` or `MULTIPART`).
        on_response: Called with (path, status) as each response starts (the request metrics).
        draining: An event set when the server starts draining (None: never).
    """

    def __init__(self, app, settings: ServerSettings, post_types: dict[str, str],
                 on_response: Callable[[str, int], None], draining: Callable[[], asyncio.Event | None]):
        self.app, self.settings, self.post_types = app, settings, post_types
        self.on_response, self.draining = on_response, draining

    def _refusal(self, scope, headers: dict[str, str]) -> RequestError | None:
        settings = self.settings
        host = headers.get("host")
        if host is not None and not host_allowed(host_name(host), settings.host, settings.allowed_hosts):
            return RequestError(f"this server does not answer to the host {host_name(host)!r} (a guard against DNS "
                                "rebinding); add it with --allowed-hosts", status=400, code="invalid_host")
        origin = headers.get("origin")
        if origin is not None and "*" not in settings.allowed_origins and origin.rstrip("/") not in \
                settings.allowed_origins:
            return RequestError(f"requests from the web origin {origin!r} are not allowed; allow it with "
                                "--allowed-origins", status=403, error_type="permission_error",
                                code="origin_not_allowed")
        if scope["method"] == "OPTIONS" and origin is not None:
            return None  # a CORS preflight: no key or body (CORSMiddleware answers it)
        path = scope["path"]
        if settings.api_key is not None and path.startswith("/v1"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     settings.api_key.encode()):
                return RequestError("a valid API key is required: Authorization: Bearer KEY", status=401,
                                    error_type="authentication_error", code="invalid_api_key")
        expected = self.post_types.get(path) if scope["method"] == "POST" else None
        given = media_type(headers.get("content-type"))
        if expected is not None and given != expected:
            return RequestError(f"Content-Type must be {expected} on {path}, got {given or 'none'!r}", status=415,
                                code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> RequestError:
        return RequestError(f"the request body exceeds {self.settings.max_body_bytes} bytes", status=413,
                            code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.on_response(scope["path"], message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await _respond(refusal, scope, receive, tracking_send)
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.settings.body_timeout
        received, body_done = 0, False
        drain_event = self.draining()
        drain = None

        async def guarded_receive():
            nonlocal received, body_done, drain
            if body_done:  # afterwards receive() only reports a disconnect: no deadline
                return await receive()
            if drain is None and drain_event is not None:
                drain = asyncio.ensure_future(drain_event.wait())
            message_task = asyncio.ensure_future(receive())
            waiting = {message_task} | ({drain} if drain is not None else set())
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, body_deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if message_task not in done:
                message_task.cancel()
                if drain is not None and drain in done:
                    raise _BodyRefused(RequestError("the server is shutting down", status=503,
                                                    error_type="server_error", code="shutting_down"))
                raise _BodyRefused(RequestError(f"the request body did not arrive within {self.settings.body_timeout} "
                                                "s", status=408, error_type="timeout_error", code="request_timeout"))
            message = message_task.result()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.settings.max_body_bytes:
                    raise _BodyRefused(self._too_large())
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except _BodyRefused as refused:
            if not started:
                await _respond(refused.error, scope, receive, tracking_send, close=True)
        finally:
            if drain is not None:
                drain.cancel()


async def _respond(error: RequestError, scope, receive, send, close: bool = False) -> None:
    headers = {"Connection": "close"} if close else None
    await error_response(error, headers)(scope, receive, send)
