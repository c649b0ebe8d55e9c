"""uvicorn's HTTP/1.1 protocol with the connection limits ``redknot serve`` needs under hostile
clients, and the uvicorn config both the CLI and ``BackgroundServer`` run.

``GuardedH11Protocol`` adds to uvicorn's h11 protocol:

* a read timeout: a connection must deliver each whole request (head and body) within
  ``read_timeout`` seconds of the connection opening or of the previous response; otherwise it
  is closed (slowloris clients trickling headers otherwise hold a socket forever, since uvicorn's
  keep-alive timer stops at the first byte);
* a write timeout: a client that takes none of the response for ``write_timeout`` seconds (the
  socket's buffers stay full that long) is cut off; its request is then aborted like any other
  disconnect, so its KV pages come back instead of filling with output nobody reads;
* a connection cap: past ``max_connections`` open connections a new one is closed as soon as it
  is accepted, so idle sockets can never use up the file descriptors (accept() then fails and
  the server stops answering anything, /health included).

``ConcurrencyLimit`` answers requests past ``--limit-concurrency`` in flight with an OpenAI-style
JSON 503 and a Retry-After header (uvicorn's own limit answers plain text, which OpenAI clients
cannot parse); ``/health`` and ``/metrics`` are never refused, so probes see a busy server as up.
It counts requests whose body has fully arrived, not connections: a client trickling a body holds
no slot (the read timeout closes it). With several API keys the slots are shared fairly: a key
may not take the last slot kept for each other key that holds none, so no tenant can hold every
slot and starve the others.
"""

from __future__ import annotations

import hmac
import json
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# File descriptors kept back for the model, the log and other files when sizing the connection cap.
RESERVED_FDS = 128


class GuardedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    max_connections: int = 4096

    def connection_made(self, transport) -> None:
        self._read_deadline = self._write_deadline = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.logger.warning("connection refused: %d connections open (--max-connections)", len(self.connections) - 1)
            transport.abort()
            return
        self._arm_read_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_read_deadline()
        self._disarm_write_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        # the buffers are full: the client must take some of it within write_timeout
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self._disarm_write_deadline()
        super().resume_writing()

    def _disarm_write_deadline(self) -> None:
        if getattr(self, "_write_deadline", None) is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_timed_out(self) -> None:
        self._write_deadline = None
        self.logger.warning("connection closed: the client read nothing for %.0f s (--write-timeout)",
                            self.write_timeout)
        # abort, not close: close would wait for the unread buffer to drain, which is the problem
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.DONE or self.conn.their_state is h11.MUST_CLOSE:
            self._disarm_read_deadline()  # the whole request is in: the app's time is not the client's

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline()  # the next request on this connection has the same budget
            if self.conn.their_state is h11.DONE:  # a pipelined request already arrived
                self._disarm_read_deadline()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as an OpenAI error body (uvicorn's own is
        plain text, which OpenAI clients cannot read)."""
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete and self.conn.their_state is h11.DONE:
            return  # a response is being produced: not the client's delay
        self.transport.close()


class ConcurrencyLimit:
    """ASGI middleware: at most ``limit`` HTTP requests in flight; the next ones get a JSON 503."""

    EXEMPT = ("/health", "/metrics")

    def __init__(self, app, limit: int, max_body_bytes: int = 1 << 20, api_keys=()):
        if limit < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {limit}")
        self.app, self.limit, self.in_flight, self.max_body = app, limit, 0, max_body_bytes
        self.keys = tuple(k.encode("utf-8") for k in api_keys if k)
        self.held = [0] * len(self.keys)  # requests in flight per API key

    def admits(self, tenant: int | None) -> bool:
        """Whether a request of API key ``tenant`` (None: no key matched) may take a slot now: one
        is free, and with several keys, a key that already holds some leaves one free slot for
        each other key holding none."""
        if self.in_flight >= self.limit:
            return False
        if tenant is None or len(self.keys) < 2 or self.held[tenant] == 0:
            return True
        kept = sum(1 for i, n in enumerate(self.held) if n == 0 and i != tenant)
        return self.in_flight + kept < self.limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.EXEMPT:
            return await self.app(scope, receive, send)
        messages = await self._body(receive)
        if messages is None:  # the client left before its body arrived
            return
        tenant = self._tenant(scope)
        if not self.admits(tenant):
            share = "" if tenant is None or len(self.keys) < 2 else " for this API key (slots are kept for the others)"
            body = json.dumps({"error": {"message": f"the server is at its limit of {self.limit} requests in flight"
                                                    f"{share} (--limit-concurrency); retry later",
                                         "type": "server_busy", "param": None, "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        if tenant is not None:
            self.held[tenant] += 1

        async def replay():
            return messages.pop(0) if messages else await receive()
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1
            if tenant is not None:
                self.held[tenant] -= 1

    def _tenant(self, scope) -> int | None:
        """The index of the API key the request carries (compared with every key, in constant time
        per key), None without keys or a match (the app then answers 401)."""
        if not self.keys:
            return None
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        found = None
        for i, key in enumerate(self.keys):
            if scheme.lower() == b"bearer" and hmac.compare_digest(token, key) and found is None:
                found = i
        return found

    async def _body(self, receive) -> list | None:
        """The request's body messages, read before it takes a slot (past ``max_body`` bytes the
        rest is left to the app, whose size guard answers 413); None if the client disconnected."""
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_body:
                return messages


def default_max_connections() -> int:
    """Raise the soft file-descriptor limit to the hard one (as vLLM does) and leave
    ``RESERVED_FDS`` of it for everything but connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 65536)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(16, soft - RESERVED_FDS)


def protocol_class(read_timeout: float = 30.0, max_connections: int | None = None,
                   write_timeout: float = 30.0) -> type[H11Protocol]:
    """A ``GuardedH11Protocol`` with these limits (``max_connections`` None: ``default_max_connections``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout": float(read_timeout), "write_timeout": float(write_timeout),
                 "max_connections": default_max_connections() if max_connections is None else int(max_connections)})


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                   timeout_keep_alive: float = 5, limit_concurrency: int | None = None, read_timeout: float = 30.0,
                   max_connections: int | None = None, write_timeout: float = 30.0, shutdown_timeout: float = 30.0):
    """uvicorn's Config for ``app`` with the guarded protocol and, with ``limit_concurrency``, the
    JSON 503 limit on requests in flight; ``timeout_keep_alive`` is vLLM's default (5 s). On
    shutdown, requests in flight get ``shutdown_timeout`` seconds to finish; then they are
    cancelled (each cancelled stream aborts its engine request) and the server exits."""
    import uvicorn

    if limit_concurrency is not None:
        state = getattr(app, "state", None)
        limits = getattr(state, "limits", None)  # build_app's: buffer no more than it takes
        app = ConcurrencyLimit(app, limit_concurrency, getattr(limits, "max_body_bytes", None) or 1 << 20,
                               api_keys=getattr(state, "api_keys", ()))
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
                          http=protocol_class(read_timeout, max_connections, write_timeout),
                          timeout_graceful_shutdown=shutdown_timeout)
