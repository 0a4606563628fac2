"""uvicorn, set up for a server facing clients it does not trust: a connection must send a
request's headers within `header_timeout_s` of opening (or of its previous response), an
idle keep-alive connection is closed after `keep_alive_s`, the kernel buffers at most
SEND_BUFFER_BYTES of a connection's unsent output (so that a client that stops reading
blocks its stream soon, and is cut off, engine_client.py), and shutdown (SIGINT/SIGTERM)
first refuses new work, then, after the grace period, aborts what the engine still runs,
so that every open stream ends with a last chunk."""

import asyncio
import json
import socket
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import Server, create_app
from .protocol import RequestError

SEND_BUFFER_BYTES = (
    256 << 10
)  # per connection; the kernel doubles it (and would autotune it up to MBs)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, which closes a connection whose next request's headers have not
    all arrived in time (a slowloris client), whatever trickle of bytes it sends."""

    header_timeout_s = 10.0
    max_connections: int | None = None
    idle_order: dict = {}  # the server's connections, the longest idle first (run() gives each server its own)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP (cli.py's has proto 0):
            # without it, a response's body waits behind its headers for the client's delayed ACK (~40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self._evict_idle(len(self.connections) - self.max_connections)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.idle_order.pop(self, None)

    def _arm(self) -> None:
        cycle = self.cycle
        self.idle_order.pop(self, None)
        self.idle_order[self] = None  # idle from now: last in the order
        self.loop.call_later(self.header_timeout_s, self._check, cycle)

    def _idle(self) -> bool:
        return (
            self.cycle is None or self.cycle.response_complete
        ) and not self.transport.is_closing()

    def _evict_idle(self, count: int) -> None:
        """Past max_connections: close the `count` connections idle the longest (no request in
        progress), so that a flood of idle connections makes room for the next client."""
        order = (
            self.idle_order
        )  # (a connection that got busy since it was put there is dropped from it)
        while count > 0 and (conn := next(iter(order), self)) is not self:
            del order[conn]
            if conn._idle():
                conn.transport.close()
                count -= 1

    def _check(self, cycle) -> None:
        # no new request since the timer was armed: its headers did not come in time
        if self.cycle is cycle and self._idle():
            self.transport.close()


class ConnectionLimit:
    """ASGI middleware: past max_connections open connections with a request in progress, a
    request gets a 503 with OpenAI's error object at once, except /health (and /metrics), which
    a supervisor must always reach."""

    def __init__(self, app, connections: set, max_connections: int | None):
        self.app, self.connections, self.max_connections = app, connections, max_connections

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or self.max_connections is None
            or len(self.connections) <= self.max_connections
            or scope["path"] in ("/health", "/metrics")
        ):
            return await self.app(scope, receive, send)
        error = RequestError(
            f"the server has more than {self.max_connections} open connections; retry later",
            status=503,
            code="too_many_connections",
        )
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


DEAD_LINGER_S = (
    1.0  # after the engine's death, how long the server still answers (503) before it exits
)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.app_server = server
        server.client.on_dead = self.engine_failed

    def engine_failed(self) -> None:
        """From a thread, once the engine died or hung (its requests are answered): stop serving
        after DEAD_LINGER_S, so that the process exits with code 1 and a supervisor starts a fresh
        one. Until then a request already on its way (its connection open, its headers not yet
        read, which a shutdown would close unanswered) gets its 503 with the cause too."""
        threading.Timer(DEAD_LINGER_S, setattr, (self, "should_exit", True)).start()

    async def shutdown(self, sockets=None):
        client = self.app_server.client
        client.accepting = False
        asyncio.get_running_loop().call_later(self.app_server.shutdown_grace_s, client.abort_all)
        await super().shutdown(sockets)


def run(
    server: Server,
    sock: socket.socket,
    log_level: str = "info",
    header_timeout_s: float = 10.0,
    keep_alive_s: float = 5.0,
    max_connections: int | None = None,
) -> None:
    """Serve on the bound socket until SIGINT/SIGTERM or the engine's failure; returns once every
    connection is closed. Past `max_connections` open connections the idle ones are closed, and
    while all are busy a request gets a JSON 503 at once (/health is always answered)."""
    protocol = type(
        "Protocol",
        (HeaderTimeoutProtocol,),
        {
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
            "idle_order": {},
        },
    )
    config = uvicorn.Config(
        create_app(server),
        log_level=log_level,
        lifespan="off",
        http=protocol,
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=server.shutdown_grace_s + 5,
        backlog=max(2048, (max_connections or 0) + 256),
    )
    uvicorn_server = GracefulServer(config, server)
    config.app = ConnectionLimit(
        config.app, uvicorn_server.server_state.connections, max_connections
    )
    uvicorn_server.run(sockets=[sock])
