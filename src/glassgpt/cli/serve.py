"""`glassgpt serve`: the web page for one model, on this machine (loopback) unless told otherwise."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from ..errors import GlassError
from ..weights import is_random_init, load_meta
from .common import add_model_args, load, nonneg_int, positive_int

WEB_EXTRA = "the web page needs FastAPI and uvicorn: pip install 'glassgpt[web]'"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="a web page to explore the model: tokens, shapes, attention, next tokens",
                       description="Serve a page that traces a prompt through the model (every shape from "
                                   "vocab_size to emb_dim and back), shows the next-token probabilities, "
                                   "attention heatmaps and the logit lens, and steps through generation.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=nonneg_int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longest prompt the page accepts (default: the model's context_length)")
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..web import create_app
    except ImportError as e:
        raise GlassError(f"{WEB_EXTRA} ({e})") from None
    model, tok = load(args)
    app = create_app(model, tok, model_name=args.model, random_weights=is_random_init(args.model),
                     labels=load_meta(args.model).get("labels"), max_prompt_tokens=args.max_prompt_tokens)
    # Bind the socket ourselves so that --port 0 can print the port it got.
    sock = _bind(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"glassgpt: serving {args.model} at http://{host}:{port}/  (Ctrl+C to stop)", flush=True)
    if not _is_loopback(args.host):
        print(f"warning: listening on {args.host}: anyone who can reach this machine can use the page",
              file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    return 0


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
