"""What the HTTP layer refuses before a route sees a request: a head over the size limit, ambiguous framing, a
Host that is not served here.

uvicorn runs h11 here (pinned, so that the behaviour does not change with what else is installed), with:

- `HeadLimit`: a request head (request line and headers) longer than `--max-header-bytes` gets a 431 and the
  connection is closed, whether the head arrived whole or is still arriving (h11 alone takes any head that
  arrives in one read and resets the connection on a longer one). The refusal is written, the write side
  shut and what the client still sends read and dropped for a moment before the socket closes, so that the
  client reads the answer rather than a reset.
- `FramingCheck`: a request with both `Content-Length` and `Transfer-Encoding` gets a 400 and the connection
  is closed (RFC 9112 section 6.1): where a proxy in front reads the body by one header and this server by
  the other, the bytes after the body would otherwise be served as a second request (request smuggling).
- `HostCheck`: a request whose Host names no allowed host gets a 400 (DNS rebinding). A request without a
  Host (HTTP/1.0; h11 refuses an HTTP/1.1 one) is served: a browser always sends one. `allowed_hosts`: the
  names it accepts, from the bound address unless configured.

`listen` binds the server's socket, with TCP_NODELAY on its connections.
"""

from __future__ import annotations

import socket
from http import HTTPStatus

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.protocol import ApiError

DEFAULT_MAX_HEADER_BYTES = 32 << 10  # nginx's default large header buffers hold 32 KiB
DRAIN_SECONDS = 1.0  # how long a refused connection's further bytes are read and dropped before it closes
CLOSE = {"Connection": "close"}
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
ANY_ADDRESS = ("0.0.0.0", "::", "")


def allowed_hosts(host: str, configured: frozenset[str] | None = None) -> frozenset[str] | None:
    """The Host header names the server accepts (None: any): `configured` ("*" in it: any), else those of the
    bound address: the loopback names for a loopback address, that address (and the loopback names) for
    another one, any for all interfaces (0.0.0.0, ::), whose names the server cannot know."""
    if configured is not None:
        return None if "*" in configured else frozenset(h.lower() for h in configured)
    if host in ANY_ADDRESS:
        return None
    return LOOPBACK | {host.lower().strip("[]")}


def listen(host: str, port: int) -> socket.socket:
    """The listening socket; ValueError (one line) where the address cannot be bound."""
    try:
        sock = socket.create_server((host, port), backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # Accepted connections inherit TCP_NODELAY. asyncio sets it only on sockets whose proto is
    # IPPROTO_TCP, which create_server's are not: without it, Nagle's algorithm meets the client's
    # delayed ACKs and a kept-alive connection gets its SSE tokens in ~40 ms bursts.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def closing_response(e: ApiError) -> JSONResponse:
    """The error as JSON, in a response after which the server closes the connection."""
    return JSONResponse(e.body(), status_code=e.status, headers={**(e.headers or {}), **CLOSE})


class HeadLimit(H11Protocol):
    """h11's protocol with a limit on the request head: the config's `h11_max_incomplete_event_size`."""

    draining = False

    def data_received(self, data: bytes) -> None:
        if not self.draining:  # a refused connection's bytes are read and dropped until it closes
            super().data_received(data)

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE:  # the buffer starts with the next request's head
            limit = self.config.h11_max_incomplete_event_size
            buffered, _ = self.conn.trailing_data
            end = buffered.find(b"\r\n\r\n")
            if end > limit or (end < 0 and len(buffered) > limit):
                self.refuse(
                    ApiError(
                        431,
                        f"the request head is over this server's limit of {limit} bytes (--max-header-bytes)",
                        code="request_header_fields_too_large",
                    )
                )
                return
        super().handle_events()

    def refuse(self, e: ApiError) -> None:
        """Answer with `e` and close: the write side shut now, the socket after `DRAIN_SECONDS`."""
        body = closing_response(e)
        head = f"HTTP/1.1 {e.status} {HTTPStatus(e.status).phrase}\r\n".encode()
        head += b"".join(name + b": " + value + b"\r\n" for name, value in body.raw_headers)
        self.transport.write(head + b"\r\n" + body.body)
        self.draining = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(DRAIN_SECONDS, self.transport.close)


class FramingCheck:
    """ASGI middleware: a 400 that closes the connection for a request with both Content-Length and
    Transfer-Encoding (uvicorn closes a connection after a response that says `Connection: close`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name for name, _ in scope.get("headers") or ()}
            if {b"content-length", b"transfer-encoding"} <= names:
                error = ApiError(
                    400,
                    "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112 section 6.1)",
                    code="ambiguous_framing",
                )
                await closing_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1", "localhost:80" -> "localhost")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """ASGI middleware: a JSON 400 for a request whose Host header names no allowed host (a page on another
    site that resolves its own name to this address, DNS rebinding, cannot reach a local server); a request
    without a Host header passes (no browser sends one)."""

    def __init__(self, app, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.allowed is not None:
            headers = dict(scope.get("headers") or [])
            if b"host" in headers:
                name = host_name(headers[b"host"].decode("latin-1"))
                if name not in self.allowed:
                    error = ApiError(400, f"Host '{name}' is not served here (--allowed-hosts)", code="invalid_host")
                    await JSONResponse(error.body(), status_code=400)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
