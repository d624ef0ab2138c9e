"""The endpoints on a socket: uvicorn in a thread of this process (a training run's agent
rounds, tests), or in the foreground (`rollwise serve`). Binding anywhere but the loopback
needs an API key, which every request must then carry.

What a connection may hold is bounded: at most MAX_CONNECTIONS open (one past it is closed
at once), and a request's head (the request line and headers) must arrive within
HEADER_TIMEOUT_S of the connection's opening, or of its first byte on a kept-alive
connection, else the connection is closed: a client that sends half a request, or nothing,
holds no socket for long. The body's time is bounded by the gate (BODY_TIMEOUT_S)."""

from __future__ import annotations

import ipaddress
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollwise.waits import STARTUP_S


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise ValueError(f"serving on {host} exposes the model beyond this machine: set an API "
                         f"key (--api-key), which every request must send "
                         f"as 'Authorization: Bearer KEY', or bind 127.0.0.1")


MAX_CONNECTIONS = 512
HEADER_TIMEOUT_S = 15.0
SHUTDOWN_S = 5.0  # after a stop, requests still answering get this long before they are cut


def bounded_protocol(header_timeout_s: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with a deadline on each request's head and a cap on open
    connections (uvicorn has neither: it holds a half-sent request for ever)."""

    class BoundedH11(H11Protocol):
        head_timer = None
        awaiting_head = True  # no request's head has arrived since the last response

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()  # connection_lost forgets it
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.awaiting_head and self.head_timer is None:
                self._arm()  # a kept-alive connection's next request has begun
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's head came whole
                self.awaiting_head = False
                self._disarm()

        def on_response_complete(self) -> None:
            self.awaiting_head = True  # before a pipelined request's head is handled
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_late(self) -> None:
            self.head_timer = None
            if self.awaiting_head and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11


def _config(app, host: str, port: int, header_timeout_s: float = HEADER_TIMEOUT_S,
            max_connections: int = MAX_CONNECTIONS) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                          access_log=False, timeout_keep_alive=30,
                          http=bounded_protocol(header_timeout_s, max_connections),
                          timeout_graceful_shutdown=SHUTDOWN_S)


class StoppingServer(uvicorn.Server):
    """uvicorn, calling on_exit() at the first SIGINT or SIGTERM, before it stops taking
    connections: the engine's work is aborted then, so the answers still open end at once
    (503) and the process ends in bounded time instead of computing on."""

    def __init__(self, config: uvicorn.Config, on_exit=None):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.on_exit is not None and not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)


class BackgroundServer:
    """uvicorn serving `app` from a thread; `url` once it listens."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        check_bind(host, api_key)
        self.server = uvicorn.Server(_config(app, host, port, header_timeout_s,
                                             max_connections))
        self.thread = threading.Thread(target=self.server.run, name="rollwise-serve-http",
                                       daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > STARTUP_S:
                raise RuntimeError(f"the HTTP server did not start on {host}:{port} (is the "
                                   f"port taken?)")
            time.sleep(0.01)
        bound = self.server.servers[0].sockets[0].getsockname()
        self.host, self.port = host, bound[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def serve_forever(app, host: str, port: int, api_key: str | None, on_exit=None) -> None:
    """Serve until SIGINT or SIGTERM; on_exit() is called at the first."""
    check_bind(host, api_key)
    StoppingServer(_config(app, host, port), on_exit).run()
