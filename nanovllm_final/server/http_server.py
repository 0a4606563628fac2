"""uvicorn, set up for a server facing clients it does not trust: a connection must send a
request's headers within `header_timeout_s` of opening (or of its previous response), an
idle keep-alive connection is closed after `keep_alive_s`, the kernel buffers at most
SEND_BUFFER_BYTES of a connection's unsent output (so that a client that stops reading
blocks its stream soon, and is cut off, engine_client.py), and shutdown (SIGINT/SIGTERM)
first refuses new work, then, after the grace period, aborts what the engine still runs,
so that every open stream ends with a last chunk."""

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import Server, create_app

SEND_BUFFER_BYTES = 256 << 10  # per connection; the kernel doubles it (and would autotune it up to MBs)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, which closes a connection whose next request's headers have not
    all arrived in time (a slowloris client), whatever trickle of bytes it sends."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP (cli.py's has proto 0):
            # without it, a response's body waits behind its headers for the client's delayed ACK (~40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        cycle = self.cycle
        self.loop.call_later(self.header_timeout_s, self._check, cycle)

    def _check(self, cycle) -> None:
        # no new request since the timer was armed: its headers did not come in time
        if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.app_server = server

    async def shutdown(self, sockets=None):
        client = self.app_server.client
        client.accepting = False
        asyncio.get_running_loop().call_later(self.app_server.shutdown_grace_s, client.abort_all)
        await super().shutdown(sockets)


def run(server: Server, sock: socket.socket, log_level: str = "info", header_timeout_s: float = 10.0,
        keep_alive_s: float = 5.0, max_connections: int | None = None) -> None:
    """Serve on the bound socket until SIGINT/SIGTERM; returns once every connection is closed.
    Past `max_connections` open connections, a request gets 503 at once."""
    protocol = type("Protocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(create_app(server), log_level=log_level, lifespan="off", http=protocol,
                            timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=server.shutdown_grace_s + 5,
                            limit_concurrency=max_connections)
    GracefulServer(config, server).run(sockets=[sock])
