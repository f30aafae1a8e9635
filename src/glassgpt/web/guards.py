"""What guards the server: a body-size limit and the Host names it answers (ASGI middleware), and
bounded queues for the work it does (`Lane`), past which it answers 429 with Retry-After."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import anyio

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413, before the app parses them.

    A declared Content-Length is checked up front; a chunked body is counted as it arrives.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is over {self.max_bytes:,} bytes: send a shorter prompt"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await error_response(413, message)(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while reading the body on to its handler.
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, counted_receive, send)


class HostCheck:
    """Answer only requests whose Host header is one of `allowed` (any port).

    A page on another site can make a browser send requests to 127.0.0.1 under its own name
    (DNS rebinding); checking the name keeps such requests from reading this server.
    """

    def __init__(self, app, allowed: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = {host_name(h) for h in allowed if h != "*"}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.any:
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.allowed:
            names = ", ".join(sorted(self.allowed))
            what = f"Host {host!r}" if host else "a request without a Host header"
            return await error_response(400, f"this server does not answer {what}: it answers {names}; to reach it "
                                             "under another name, start it with --allowed-hosts NAME")(scope, receive, send)
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """The name in a Host header or --allowed-hosts entry, without its port: 'LocalHost:8000' -> 'localhost',
    '[::1]:8000' and '::1' -> '[::1]'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    if host.count(":") > 1:  # a bare IPv6 address
        return f"[{host}]"
    return host.partition(":")[0].rstrip(".")


class Busy(Exception):
    """A lane's queue is full: answered 429, with Retry-After: `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Lane:
    """One kind of work's own queue: `slots` requests run at once (worker threads), up to `waiting`
    more wait for a slot, and one past that is refused at once (Busy -> 429) with a Retry-After from
    how long this lane's requests have taken. Used from the event loop only, so the counts need no lock."""

    def __init__(self, name: str, slots: int, waiting: int, typical_s: float = 1.0) -> None:
        if slots < 1 or waiting < 0:
            raise ValueError(f"a lane needs a slot or more and no negative wait, got {slots} and {waiting}")
        self.name, self.slots, self.waiting = name, slots, waiting
        self.limiter = anyio.CapacityLimiter(slots)
        self.inside = 0             # running and waiting
        self.typical_s = typical_s  # a moving average of how long a request here takes

    def admit(self) -> Callable[[], None]:
        """A place in this lane (running or waiting), or Busy when there is none; call what it returns
        (once is enough) when the request is done."""
        if self.inside >= self.slots + self.waiting:
            retry = max(1, math.ceil(self.typical_s * self.inside / self.slots))
            raise Busy(f"the server is busy with {self.inside} {self.name} requests (it runs {self.slots} at once "
                       f"and queues {self.waiting}): try again in {retry} s", retry)
        self.inside += 1
        start = time.monotonic()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.inside -= 1
                self.typical_s = 0.8 * self.typical_s + 0.2 * (time.monotonic() - start)
        return release
