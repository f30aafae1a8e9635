"""`glassgpt serve`: the web page for one model, on this machine (loopback) unless told otherwise.

Served on a training run directory (`--model RUN_DIR`), the page also gets a slider over the
run's evaluations and the snapshot each one recorded.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from pathlib import Path

from ..errors import GlassError
from .common import add_model_args, add_reading_args, load, open_model, positive_int
from .limits import port
from .explain import read_as

WEB_EXTRA = "the web page needs FastAPI and uvicorn: pip install 'glassgpt[web]'"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="a web page to explore the model: tokens, shapes, attention, next tokens",
                       description="Serve a page that traces a prompt through the model (every shape from "
                                   "vocab_size to emb_dim and back), shows the next-token probabilities, "
                                   "attention heatmaps and the logit lens, and steps through generation. Served "
                                   "on a training run directory, it also shows a slider over the run's evaluations.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 1 to 65535 (default: 8000; 0 picks a free one)")
    p.add_argument("--allowed-hosts", metavar="NAMES", type=_names, default=None,
                   help="comma-separated names that requests may address the server by (their Host header), "
                        "besides localhost, 127.0.0.1 and [::1]; '*' allows any (default: none besides those and "
                        "the --host address; any name when --host is 0.0.0.0 or ::). Other names get 400, which "
                        "keeps other web sites from reaching the page through DNS rebinding")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longest prompt the page accepts (default: the model's context_length)")
    add_reading_args(p)
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (checked here, before the slow model load)

        from ..web import create_app
        from ..web.app import LOOPBACK_HOSTS
        from ..web.server import make_server
    except ImportError as e:
        raise GlassError(f"{WEB_EXTRA} ({e})") from None
    source = open_model(args)
    model, tok = load(args, source)
    hosts = allowed_hosts(args.host, args.allowed_hosts, LOOPBACK_HOSTS)
    run_dir = Path(source.name) if source.kind == "checkpoint" and (Path(source.name) / "metrics.jsonl").is_file() \
        else None
    about = read_as(args, source, model)  # what the source says of the model that its weights cannot
    app = create_app(model, tok, about, max_prompt_tokens=args.max_prompt_tokens, allowed_hosts=hosts,
                     run_dir=run_dir)
    # Bind the socket ourselves so that --port 0 can print the port it got.
    sock = _bind(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"glassgpt: serving {args.model} at http://{host}:{port}/  (Ctrl+C to stop)", flush=True)
    if not _is_loopback(args.host):
        print(f"warning: listening on {args.host}: anyone who can reach this machine can use the page"
              + ("" if "*" not in hosts else ", under any name (narrow it with --allowed-hosts)"), file=sys.stderr)
    make_server(app).run(sockets=[sock])
    return 0


def allowed_hosts(host: str, extra: list[str] | None, loopback: tuple[str, ...]) -> list[str]:
    """The Host names to answer: loopback, plus --allowed-hosts, else the --host address, else any
    (a wildcard --host listens on every address, so there is no one name to allow)."""
    if extra:
        return [*loopback, *extra]
    if host in WILDCARD_HOSTS:
        return ["*"]
    return [*loopback, host]


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one host, e.g. example.lan or '*', got {text!r}")
    return names


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise GlassError(f"cannot listen on --host {host!r} ({e.strerror}): give an address such as 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise GlassError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port (0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
