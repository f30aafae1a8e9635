"""The web page's server: one static page and a small JSON API over `explain.trace`.

    app = create_app(model, tokenizer, model_name="gpt2", random_weights=True)

    GET  /                  the page (static/index.html; its script and style under /static/)
    GET  /api/model         the loaded model: name, config, parameters, limits, random or not
    POST /api/explain       {"prompt": "Every effort moves you", "top_k": 10} -> the trace JSON
                            ({"ids": [...]} instead of "prompt" traces token ids as they are)
    POST /api/append        {"ids": [...], "token": 2300} -> the trace of ids + [token]
    POST /api/diagram.svg   same body as /api/explain -> the trace drawn as SVG

Errors are JSON `{"error": "..."}`: 400 for a prompt the model cannot take (empty, over
the token limit, a temperature so small that the probabilities overflow), for a body that
is not JSON and for a Host header this server does not answer; 413 for a body over the
size limit, 422 for a field out of range.

A trace request sent with `Accept: application/x-ndjson` is answered with one JSON line
per step as the trace goes (`{"progress": {"step": "trf_blocks.3", "done": 4, "total": 25}}`)
and a last line holding `{"trace": ...}` or `{"error": "...", "status": 400}`: the page
shows long traces' progress this way.

The model is shared by all requests and only read, under `torch.inference_mode()`. Each
trace records into its own recorder (see explain.py), so up to MAX_CONCURRENT_TRACES run
side by side in worker threads. While one runs, the server watches its client: when the
client goes away (the page cancels a request whenever a slider moves), the trace stops at
its next module, and a request still waiting for a thread is dropped, so nobody waits behind
abandoned work. The page and its assets are answered from memory, never behind a trace.

Only requests whose Host header names this server are answered (loopback names by default,
see `allowed_hosts`), so a web page on another site cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import partial
from importlib import resources
from typing import Any, Awaitable, Callable, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.middleware.gzip import GZipMiddleware

from ..errors import GlassError
from ..errors import TraceCancelled
from ..explain import Progress, trace
from ..explain.diagram import to_svg
from ..model import GPTModel
from ..tokenizer import Tokenizer, check_fits

MAX_BODY_BYTES = 256 * 1024  # a full 1,024-token prompt is a few KiB of JSON
MAX_TOP_K = 100
# Attention weights are n_layers x n_heads x t x t numbers; past this many the page
# would receive tens of MB per step, so the trace leaves them out and says why.
MAX_ATTENTION_WEIGHTS = 1_000_000
# Each trace already uses every core for its matmuls; more at once would only share them out.
MAX_CONCURRENT_TRACES = 4
DISCONNECT_POLL_S = 0.1  # how often a running trace checks that its client is still there
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
NDJSON = "application/x-ndjson"
CLIENT_GONE = 499  # nginx's code for "the client closed the request"; nobody reads the answer
log = logging.getLogger("glassgpt.web")
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
# Everything the page needs comes from this server; the policy makes a stray CDN link fail loudly.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class ExplainRequest(BaseModel):
    """What the page asks for. Give `prompt` (text) or `ids` (token ids), not both."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    ids: list[int] | None = None
    top_k: int = Field(10, ge=1, le=MAX_TOP_K)
    temperature: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    block: int = Field(0, ge=0)
    attention: bool = True
    logit_lens: bool = True
    embedding_check: bool = False


class AppendRequest(ExplainRequest):
    token: int = Field(ge=0)


def create_app(model: GPTModel, tokenizer: Tokenizer, model_name: str = "custom", random_weights: bool = False,
               labels: list[str] | None = None, max_prompt_tokens: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS) -> FastAPI:
    """The FastAPI app serving the page for `model` (read-only, shared by every request).

    max_prompt_tokens: longest prompt accepted (default and upper bound: context_length).
    max_body_bytes: larger request bodies are refused with 413 before they are parsed.
    allowed_hosts: the names (with any port) that the Host header may hold; "*" allows any.
    """
    cfg = model.cfg
    limit = cfg.context_length if max_prompt_tokens is None else max_prompt_tokens
    if not 1 <= limit <= cfg.context_length:
        raise GlassError(f"max_prompt_tokens must be in 1..{cfg.context_length:,} (the context_length), got {limit:,}")
    check_fits(tokenizer, cfg.vocab_size, "they do not belong together")
    is_classifier = cfg.num_classes is not None
    static = _read_static()
    limiter = anyio.CapacityLimiter(MAX_CONCURRENT_TRACES)

    app = FastAPI(title="glassgpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GZipMiddleware, minimum_size=2048)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(HostCheck, allowed=allowed_hosts)  # added last: it runs first

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(GlassError)
    async def glass_error(request: Request, exc: GlassError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(TraceCancelled)
    async def client_gone(request: Request, exc: TraceCancelled) -> Response:
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # Still logged with its traceback by the server; the page gets a line it can show.
        return _error(500, _bug_message(exc))

    @app.get("/", response_class=HTMLResponse)
    async def page() -> Response:
        return Response(static["index.html"], media_type=STATIC_TYPES[".html"], headers=SECURITY_HEADERS)

    @app.get("/static/{name}")
    async def asset(name: str) -> Response:
        if name not in static:
            raise HTTPException(404, f"no asset {name!r}: the page uses {', '.join(sorted(static))}")
        suffix = name[name.rfind("."):]
        return Response(static[name], media_type=STATIC_TYPES[suffix], headers=SECURITY_HEADERS)

    info = {
        "name": model_name, "random_weights": random_weights, "config": cfg.to_dict(),
        "tokenizer": tokenizer.name, "n_vocab": tokenizer.n_vocab, "labels": labels,
        "kind": "classifier" if is_classifier else "language model",
        "params": {"total": model.num_parameters(), "total_untied": model.num_parameters(count_tied_twice=True),
                   "tied": model.tied},
        "dtype": str(model.tok_emb.weight.dtype).removeprefix("torch."),
        "device": str(model.tok_emb.weight.device),
        "limits": {"max_prompt_tokens": limit, "max_top_k": MAX_TOP_K, "max_body_bytes": max_body_bytes,
                   "max_attention_weights": MAX_ATTENTION_WEIGHTS},
    }

    @app.get("/api/model")
    async def model_info() -> dict[str, Any]:
        return info

    def checked_ids(req: ExplainRequest, ids: list[int] | None) -> list[int]:
        if ids is None:
            ids = tokenizer.encode(req.prompt) if req.prompt else []
        if not ids:
            raise GlassError("the prompt is empty: type some text, e.g. \"Every effort moves you\"")
        if len(ids) > limit:
            raise GlassError(f"the prompt is {len(ids):,} tokens but this server takes at most {limit:,}"
                             f"{' (the context_length)' if limit == cfg.context_length else ''}: shorten it")
        if req.block >= cfg.n_layers:
            raise GlassError(f"block {req.block} does not exist: choose 0..{cfg.n_layers - 1}")
        return ids

    def run_trace(req: ExplainRequest, ids: list[int] | None, append: int | None,
                  cancel: threading.Event, progress: Progress) -> dict[str, Any]:
        ids = checked_ids(req, ids)
        if append is not None:
            if len(ids) >= limit:
                raise GlassError(f"the prompt already has {len(ids):,} tokens, the most this server takes: "
                                 "start a shorter one")
            ids = ids + [append]
        n_weights = cfg.n_layers * cfg.n_heads * len(ids) ** 2
        with_attention = req.attention and n_weights <= MAX_ATTENTION_WEIGHTS
        tr = trace(model, tokenizer, ids=ids, top_k=req.top_k, temperature=req.temperature, block=req.block,
                   logit_lens=req.logit_lens, attention=with_attention, embedding_check=req.embedding_check,
                   model_name=model_name, random_weights=random_weights, labels=labels, timing=False,
                   cancel=cancel, progress=progress)
        out = tr.to_dict()
        if with_attention:
            out["attention"]["layers"] = _rounded(out["attention"]["layers"])
        elif req.attention:
            most = int((MAX_ATTENTION_WEIGHTS / (cfg.n_layers * cfg.n_heads)) ** 0.5)
            out["attention"] = {"omitted": f"{len(ids):,} tokens give {n_weights:,} attention weights "
                                           f"({cfg.n_layers} layers x {cfg.n_heads} heads x {len(ids)} x {len(ids)}); "
                                           f"the page shows them for prompts of up to {most} tokens"}
        return out

    async def traced(request: Request, req: ExplainRequest, ids: list[int] | None,
                     append: int | None = None) -> Any:
        """The trace as JSON, or as NDJSON progress lines and then the trace when the client asks for them."""
        work = partial(run_trace, req, ids, append)
        if NDJSON in request.headers.get("accept", ""):
            return ProgressStream(request, work, limiter)
        return await run_watched(request, work, limiter)

    def prompt_ids(req: ExplainRequest) -> list[int] | None:
        if req.prompt is not None and req.ids is not None:
            raise GlassError("give \"prompt\" (text) or \"ids\" (token ids), not both")
        if req.ids is not None and len(req.ids) > limit:
            raise GlassError(f"the prompt is {len(req.ids):,} tokens but this server takes at most {limit:,}: shorten it")
        return req.ids

    @app.post("/api/explain")
    async def explain(req: ExplainRequest, request: Request) -> Any:
        return await traced(request, req, prompt_ids(req))

    @app.post("/api/append")
    async def append(req: AppendRequest, request: Request) -> Any:
        if is_classifier:
            raise GlassError("this model is a classifier: its output is a class, not a token to append")
        return await traced(request, req, prompt_ids(req), append=req.token)

    @app.post("/api/diagram.svg")
    async def diagram(req: ExplainRequest, request: Request) -> Response:
        ids = prompt_ids(req)

        def draw(cancel: threading.Event, progress: Progress) -> str:
            tr = trace(model, tokenizer, ids=checked_ids(req, ids), top_k=req.top_k, temperature=req.temperature,
                       block=req.block, embedding_check=True, timing=False, model_name=model_name,
                       random_weights=random_weights, labels=labels, cancel=cancel, progress=progress)
            return to_svg(tr)

        svg = await run_watched(request, draw, limiter)
        return Response(svg, media_type="image/svg+xml")

    return app


Work = Callable[[threading.Event, Progress], Any]


async def run_watched(request: Request, work: Work, limiter: anyio.CapacityLimiter,
                      on_progress: Callable[[dict], Awaitable[None]] | None = None) -> Any:
    """Run `work(cancel, progress)` in a worker thread while watching `request`'s client.

    If the client disconnects, `cancel` is set (the trace stops at its next module), a
    wait for a free thread is abandoned, and TraceCancelled is raised. `on_progress`
    gets the latest progress report every DISCONNECT_POLL_S while the work runs.
    """
    cancel = threading.Event()
    latest: list[dict | None] = [None]  # written by the worker thread, read here

    def progress(step: str, done: int, total: int) -> None:
        latest[0] = {"step": step, "done": done, "total": total}

    finished = anyio.Event()
    outcome: dict[str, Any] = {}

    async def run() -> None:
        try:
            outcome["value"] = await anyio.to_thread.run_sync(partial(work, cancel, progress), limiter=limiter)
        except Exception as e:  # raised again below, in the request's task
            outcome["error"] = e
        finally:
            finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        shown = None
        while not finished.is_set():
            with anyio.move_on_after(DISCONNECT_POLL_S):
                await finished.wait()
            if not finished.is_set() and await request.is_disconnected():
                cancel.set()  # a running trace raises TraceCancelled at its next module
                tasks.cancel_scope.cancel()  # a request still waiting for a thread stops waiting
                break
            if on_progress is not None and latest[0] is not shown:
                shown = latest[0]
                await on_progress(shown)
    if cancel.is_set():
        raise TraceCancelled("the client went away")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class ProgressStream(Response):
    """An NDJSON answer: a line per progress report, then `{"trace": ...}` or `{"error": ..., "status": n}`."""

    def __init__(self, request: Request, work: Work, limiter: anyio.CapacityLimiter) -> None:
        # Not Response.__init__: it would declare a Content-Length for the empty body.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", f"{NDJSON}; charset=utf-8".encode())] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in SECURITY_HEADERS.items()]
        self.request, self.work, self.limiter = request, work, limiter

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def line(obj: dict, more: bool = True) -> None:
            body = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
            await send({"type": "http.response.body", "body": body, "more_body": more})

        try:
            last = {"trace": await run_watched(self.request, self.work, self.limiter,
                                               on_progress=lambda p: line({"progress": p}))}
        except TraceCancelled:
            return  # the client is gone: nothing to finish
        except GlassError as e:
            last = {"error": str(e), "status": 400}
        except Exception as e:
            log.exception("a streamed trace failed")
            last = {"error": _bug_message(e), "status": 500}
        await line(last, more=False)


def _read_static() -> dict[str, bytes]:
    folder = resources.files("glassgpt.web") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir()
            if f.is_file() and f.name[f.name.rfind("."):] in STATIC_TYPES}


def _rounded(layers: list) -> list:
    """Attention weights to 4 decimals: a heatmap cannot show more, and the JSON is a third the size."""
    return [[[[round(w, 4) for w in row] for row in head] for head in layer] for layer in layers]


def _bug_message(exc: Exception) -> str:
    return f"the server failed ({type(exc).__name__}: {exc}): this is a bug in glassgpt, please report it"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """One readable line per bad field; a body that is not JSON (or not an object) is a 400."""
    errors = exc.errors()
    for e in errors:
        if e["type"] == "json_invalid":
            return _error(400, f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')}): "
                               "send an object such as {\"prompt\": \"Every effort moves you\"}")
        if tuple(e["loc"]) == ("body",):
            return _error(400, "the request body must be a JSON object such as {\"prompt\": \"Every effort moves you\"}, "
                               "sent with Content-Type: application/json")
    parts = []
    for e in errors:
        field = ".".join(str(x) for x in e["loc"] if x != "body")
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown field {field!r}: the fields are {', '.join(ExplainRequest.model_fields)} "
                         "(and token, for /api/append)")
        else:
            got = json.dumps(e["input"])[:80] if "input" in e and e["type"] != "missing" else None
            parts.append(f"{field}: {e['msg']}" + (f", got {got}" if got is not None else ""))
    return _error(422, "; ".join(parts))


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, before the app parses them.

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
            return await _error(413, message)(scope, receive, send)
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
    """ASGI middleware: answer only requests whose Host header is one of `allowed` (any port).

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
            return await _error(400, f"this server does not answer {what}: it answers {names}; to reach it under "
                                     "another name, start it with --allowed-hosts NAME")(scope, receive, send)
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
