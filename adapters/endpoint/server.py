"""`EndpointServer`: an ASGI app served by uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from masenvs.listeners import head_timeout_protocol


class EndpointServer:
    """Runs an ASGI app with uvicorn in a background thread (loopback, free port by default)."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.log_level = log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> str:
        """Start serving and return the root URL, e.g. `http://127.0.0.1:41234`."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only for sockets
        # whose proto says TCP; without it each JSON response waits ~40 ms for a delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            http=head_timeout_protocol(),  # a connection that sends no request is closed
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="masenvs-endpoint",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self.url

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The plain OpenAI base URL (`.../v1`)."""
        return f"{self.url}/v1"

    def rollout_url(self, rollout_id: str) -> str:
        """The OpenAI base URL whose calls are recorded under `rollout_id`."""
        return f"{self.url}/r/{rollout_id}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> EndpointServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
