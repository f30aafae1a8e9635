"""The web page's server: one static page and thin routes over `ExplainService` (service.py).

    app = create_app(model, tokenizer, glassgpt.formats.open("gpt2").about())

    GET  /                  the page (static/index.html; its script and style under /static/)
    GET  /api/model         the loaded model: name, config, layout, parameters, limits, random or not
    POST /api/explain       {"prompt": "Every effort moves you", "top_k": 10} -> the trace JSON
                            ({"ids": [...]} instead of "prompt" traces token ids as they are)
    POST /api/append        {"ids": [...], "token": 2300} -> the trace of ids + [token]
    POST /api/diagram.svg   same body as /api/explain -> the trace drawn as SVG
    POST /api/why           same body + "target": id -> which parts and prompt tokens made that token
    GET  /api/snapshots     served on a run directory: its evaluations, each with its snapshot
    POST /api/windows       {"prompt": "...", "max_length": 4, "stride": 2} -> the text's sliding windows
    GET  /gallery           the architecture gallery (explain/gallery.py): ?models=gpt2,gemma3&dtype=&tokens=
    GET  /api/gallery       the same cards as JSON

The rules (which prompts, which limits, what a trace holds) are the service's; this module
adds what only HTTP needs. Errors are JSON `{"error": "..."}`: 400 for a prompt the model
cannot take (empty, a temperature so small that the probabilities overflow), for a body that
is not JSON and for a Host header this server does not answer; 413 for a body over the size
limit, 422 for a field out of range, 429 (with Retry-After) when the server's queue for that kind of
work is full. A prompt over the limit is cut, and `notes` says so.

A trace request sent with `Accept: application/x-ndjson` is answered with one JSON line
per step as the trace goes (`{"progress": {"step": "trf_blocks.3", "done": 4, "total": 25}}`)
and a last line holding `{"trace": ...}` or `{"error": "...", "status": 400}`: the page
shows long traces' progress this way.

The model is shared by all requests and only read, under `torch.inference_mode()`. Each
trace records into its own recorder (explain/record.py), so traces run side by side in worker
threads, in two lanes (guards.Lane), each with its slots and a bounded queue: plain traces
(MAX_CONCURRENT_TRACES at once) and heavy work (HEAVY_SLOTS at once: activation patching, why or a
trace of a long prompt; service.is_heavy), so that a flood of heavy requests never delays a plain
trace of a short prompt. A request past its lane's queue is answered 429 at once. While one runs, the server watches its client: when the
client goes away (the page cancels a request whenever a slider moves), the trace stops at
its next module, and a request still waiting for a thread is dropped, so nobody waits behind
abandoned work. The page and its assets are answered from memory, never behind a trace.

Only requests whose Host header names this server are answered (loopback names by default,
see `allowed_hosts`), so a web page on another site cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import html
import json
import logging
import threading
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.gzip import GZipMiddleware

from ..errors import GlassError, TraceCancelled
from ..explain import About, Progress
from ..explain.gallery import SHAPES, Gallery, gallery
from ..explain.views import draw
from ..formats import Source
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .guards import LOOPBACK_HOSTS, BodyLimit, Busy, HostCheck, Lane
from .guards import error_response as _error
from .service import MAX_BODY_BYTES, AppendRequest, ExplainRequest, ExplainService, WhyRequest, WindowsRequest

# Each trace already uses every core for its matmuls; more at once would only share them out.
MAX_CONCURRENT_TRACES = 4
MAX_WAITING_TRACES = 64
# Heavy work (service.is_heavy: patching, long prompts) has a lane of its own, so a flood of it leaves
# the plain traces' slots free; past its queue the answer is 429 with Retry-After.
HEAVY_SLOTS = 2
HEAVY_WAITING = 8
DISCONNECT_POLL_S = 0.1  # how often a running trace checks that its client is still there
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


def create_app(model: GPTModel, tokenizer: Tokenizer, about: About | Source | None = None, *,
               max_prompt_tokens: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               allowed_hosts: Sequence[str] = LOOPBACK_HOSTS, run_dir: str | Path | None = None,
               heavy_slots: int = HEAVY_SLOTS, heavy_waiting: int = HEAVY_WAITING) -> FastAPI:
    """The FastAPI app serving the page for `model` (read-only, shared by every request).

    about: what the weights cannot say (its name, shown by its file's name only; a random model's
    initialisation; a classifier's labels and reading; what its finetuning trained; the notes on values
    its file does not hold): a Source's `about()`, or the Source itself (default: About()).
    max_prompt_tokens: most tokens of a prompt traced (default and upper bound: context_length).
    max_body_bytes: larger request bodies are refused with 413 before they are parsed.
    allowed_hosts: the names (with any port) that the Host header may hold; "*" allows any.
    run_dir: the training run the model came from: the page gets a slider over its evaluations.
    heavy_slots, heavy_waiting: how many heavy requests (patching, long prompts) run at once and how
    many more wait; past that they are answered 429 with Retry-After, and plain traces never wait for them.
    """
    about = about.about() if isinstance(about, Source) else about
    service = ExplainService(model, tokenizer, about, max_prompt_tokens, max_body_bytes, run_dir)
    app = FastAPI(title="glassgpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GZipMiddleware, minimum_size=2048)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(HostCheck, allowed=allowed_hosts)  # added last: it runs first
    _add_error_handlers(app)
    _add_page(app)
    light = Lane("trace", MAX_CONCURRENT_TRACES, MAX_WAITING_TRACES, typical_s=0.2)
    heavy = Lane("heavy (patching or long prompt)", heavy_slots, heavy_waiting, typical_s=5.0)

    async def traced(request: Request, method: Callable, req: ExplainRequest, asks_why: bool = False,
                     stream: bool = True) -> Any:
        """`method(req, cancel, progress)` in a worker thread, in its lane: JSON, or NDJSON progress lines
        when asked for (and `stream`)."""
        lane = heavy if service.is_heavy(req, asks_why) else light
        release = lane.admit()
        work = partial(method, req)
        if stream and NDJSON in request.headers.get("accept", ""):
            return ProgressStream(request, work, lane.limiter, release)
        try:
            return await run_watched(request, work, lane.limiter)
        finally:
            release()

    @app.get("/api/model")
    async def model_info() -> dict[str, Any]:
        return service.info()

    @app.post("/api/explain")
    async def explain(req: ExplainRequest, request: Request) -> Any:
        return await traced(request, service.explain, req)

    @app.post("/api/append")
    async def append(req: AppendRequest, request: Request) -> Any:
        return await traced(request, service.append, req)

    @app.post("/api/why")
    async def why(req: WhyRequest, request: Request) -> Any:
        return await traced(request, service.why, req, asks_why=True, stream=False)

    @app.post("/api/diagram.svg")
    async def diagram(req: ExplainRequest, request: Request) -> Response:
        svg = await traced(request, service.diagram, req, stream=False)
        return Response(svg, media_type="image/svg+xml")

    @app.get("/api/snapshots")
    async def snapshots() -> dict[str, Any]:
        return await anyio.to_thread.run_sync(service.snapshots)

    @app.post("/api/windows")
    async def windows(req: WindowsRequest) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(service.windows, req)

    return app


def _gallery(models: str, dtype: str, tokens: int) -> Gallery:
    return gallery([m for m in models.split(",") if m] or list(SHAPES), dtype, tokens)


def _add_gallery(app: FastAPI) -> None:
    """The architecture gallery: the same for every model served (its cards are the book's models' real shapes)."""

    @app.get("/api/gallery")
    async def gallery_json(models: str = "", dtype: str = "bfloat16", tokens: int = 8192) -> dict[str, Any]:
        return (await anyio.to_thread.run_sync(_gallery, models, dtype, tokens)).to_dict()

    @app.get("/gallery", response_class=HTMLResponse)
    async def gallery_page(models: str = "", dtype: str = "bfloat16", tokens: int = 8192) -> Response:
        g = await anyio.to_thread.run_sync(_gallery, models, dtype, tokens)
        page = ('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>glassgpt · the architecture '
                'gallery</title><link rel="stylesheet" href="/static/style.css"></head><body><main>'
                f"{draw.to_svg(g.picture())}<pre>{html.escape(g.to_text())}</pre></main></body></html>")
        return Response(page, media_type=STATIC_TYPES[".html"], headers=SECURITY_HEADERS)


def _add_page(app: FastAPI) -> None:
    static = _read_static()
    _add_gallery(app)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> Response:
        return Response(static["index.html"], media_type=STATIC_TYPES[".html"], headers=SECURITY_HEADERS)

    @app.get("/static/{name}")
    async def asset(name: str) -> Response:
        if name not in static:
            raise HTTPException(404, f"no asset {name!r}: the page uses {', '.join(sorted(static))}")
        return Response(static[name], media_type=STATIC_TYPES[name[name.rfind("."):]], headers=SECURITY_HEADERS)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(GlassError)
    async def glass_error(request: Request, exc: GlassError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Busy)
    async def busy(request: Request, exc: Busy) -> JSONResponse:
        response = _error(429, str(exc))
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(TraceCancelled)
    async def client_gone(request: Request, exc: TraceCancelled) -> Response:
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # Still logged with its traceback by the server; the page gets a line it can show.
        return _error(500, _bug_message(exc))


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

    def __init__(self, request: Request, work: Work, limiter: anyio.CapacityLimiter,
                 release: Callable[[], None] = lambda: None) -> None:
        # Not Response.__init__: it would declare a Content-Length for the empty body.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", f"{NDJSON}; charset=utf-8".encode())] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in SECURITY_HEADERS.items()]
        self.request, self.work, self.limiter, self.release = request, work, limiter, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._stream(send)
        finally:
            self.release()  # its place in the lane

    async def _stream(self, send) -> None:
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


def _bug_message(exc: Exception) -> str:
    return f"the server failed ({type(exc).__name__}: {exc}): this is a bug in glassgpt, please report it"


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


