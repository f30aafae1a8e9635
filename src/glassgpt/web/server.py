"""Serving the app with uvicorn, with deadlines for slow clients.

uvicorn closes a keep-alive connection that stays idle (`timeout_keep_alive`), but waits
for ever on a request that stops half-way, head or body: a few such connections would
hold the server's sockets. `RequestDeadlineProtocol` gives every request a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT_S = 10.0  # the whole request, head and body; a prompt is a few KiB
KEEP_ALIVE_S = 5.0


class RequestDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline: a request must arrive whole (head and body)
    within `request_timeout_s` of its first byte, or of the connection opening; else the
    connection is closed. The time the app takes to answer does not count."""

    request_timeout_s = REQUEST_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_client():
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_client(self) -> bool:
        """True while a request has begun to arrive but is not whole yet."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def _arm(self) -> None:
        if self._deadline is None:  # a deadline, not an idle timer: trickling bytes do not extend it
            self._deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closed a connection whose request did not arrive within %gs", self.request_timeout_s)
            self.transport.close()


def make_server(app, request_timeout_s: float = REQUEST_TIMEOUT_S, keep_alive_s: float = KEEP_ALIVE_S,
                log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for `app` (run it with `.run(sockets=[sock])`) that closes stalled connections."""
    protocol = type("RequestDeadlineProtocol", (RequestDeadlineProtocol,), {"request_timeout_s": request_timeout_s})
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive_s, log_level=log_level)
    return uvicorn.Server(config)


@contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, **kwargs) -> Iterator[str]:
    """Serve `app` from a background thread while the `with` block runs; yields its base URL.

    For notebooks and tests: `with serving(create_app(model, tok)) as url: ...`. kwargs go to make_server.
    """
    sock = socket.create_server((host, port))
    server = make_server(app, **kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
