"""The endpoints on a socket: uvicorn in a thread of this process (a training run's agent
rounds, tests), or in the foreground (`rollwise serve`). Binding anywhere but the loopback
needs an API key, which every request must then carry."""

from __future__ import annotations

import ipaddress
import threading
import time

import uvicorn

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


def _config(app, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                          access_log=False, timeout_keep_alive=30)


class BackgroundServer:
    """uvicorn serving `app` from a thread; `url` once it listens."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None):
        check_bind(host, api_key)
        self.server = uvicorn.Server(_config(app, host, port))
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


def serve_forever(app, host: str, port: int, api_key: str | None) -> None:
    check_bind(host, api_key)
    uvicorn.Server(_config(app, host, port)).run()
