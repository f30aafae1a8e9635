"""ASGI middleware that guards the server: a body-size limit, and the Host names it answers."""

from __future__ import annotations

from typing import Sequence

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
