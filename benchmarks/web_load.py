"""Load check of the web page's API: many clients at once, every answer right, memory flat.

Starts `glassgpt serve` on loopback (a separate process, so its memory is its own) with a
small random model, then sends rounds of requests from concurrent clients: /api/explain
for a handful of prompts (with attention and the logit lens, as the page asks, and without the
embedding check, which the page asks for by default since its options were declared once, so
that the figures stay comparable with the earlier ones) and /api/append. Every answer is checked against a trace of the same model computed in this
process (same preset seed, same weights): token ids, every stage's shape, the next token
and its probability. The server's resident memory is read from /proc after a warm-up and
after each round; flat means the trace leaves nothing behind per request.

    flock /tmp/glassgpt-bench.lock python benchmarks/web_load.py [--requests 200 --clients 8 --rounds 2]

With --flood, it measures instead what the page feels under a flood of heavy work: FLOOD_CLIENTS
clients send `why` with activation patching at 256 tokens, again and again, for --flood-seconds,
while one client sends a plain /api/explain of a short prompt every half second. It prints the
short requests' latency (median, p95, max; the page must keep answering: each well under 2 s) and
how the heavy requests were answered (200, or 429 with Retry-After once their queue is full).

    flock /tmp/glassgpt-bench.lock python benchmarks/web_load.py --flood [--flood-clients 12 --flood-seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import glassgpt
from glassgpt.explain import TraceOptions
from glassgpt.formats import load_model, load_tokenizer

# Small, but every part of GPT-2 is there: GPT-2's tokenizer and vocabulary, 4 blocks.
SMALL = glassgpt.GPTConfig(vocab_size=50257, context_length=128, emb_dim=128, n_heads=4, n_layers=4)
PROMPTS = ["Every effort moves you", "The quick brown fox jumps over the lazy dog",
           "Where does 50,257 become 768 and back?", "Hello", "I HAD always thought Jack Gisburn rather a cheap genius",
           "In the beginning", "1 2 3 4 5 6 7 8", "GPT-2"]


# The flood's model: as SMALL, with room for the 256-token patching requests.
FLOOD = glassgpt.GPTConfig(vocab_size=50257, context_length=256, emb_dim=128, n_heads=4, n_layers=4)
HEAVY_BODY = {"prompt": " ".join(["Every effort moves you"] * 64), "patch": " ".join(["Every effort moves him"] * 64),
              "versus": " the"}  # 256 tokens each, as the patch must match the prompt token for token
SHORT_BODY = {"prompt": "Every effort moves you", "top_k": 10, "attention": True, "logit_lens": True}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(model_spec: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "glassgpt", "serve", "--model", model_spec, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "glassgpt: serving ... at http://127.0.0.1:PORT/  (Ctrl+C to stop)"
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line}{proc.stderr.read()}")
    url = line.split(" at ", 1)[1].split()[0].rstrip("/")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, url


def expected_answers(model_spec: str) -> dict[tuple, dict]:
    """What each request must return, from a trace of the same model in this process."""
    model, tok = load_model(model_spec), load_tokenizer(model_spec)
    want = {}
    for p in PROMPTS:
        ids = tok.encode(p)
        want[("explain", p)] = glassgpt.trace(model, tok, ids=ids, options=TraceOptions(
            top_k=10, attention=True, logit_lens=True, embedding_check=False)).to_dict()
        want[("append", p)] = glassgpt.trace(model, tok, ids=ids + [13], options=TraceOptions(
            top_k=10, embedding_check=False)).to_dict()
    return want


def request(client: httpx.Client, i: int) -> tuple[tuple, dict, float]:
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = "append" if i % 4 == 3 else "explain"
    body = {"prompt": prompt, "top_k": 10, "attention": True, "logit_lens": True, "embedding_check": False}
    if kind == "append":
        body["token"] = 13
    start = time.perf_counter()
    r = client.post(f"/api/{kind}", json=body, timeout=120)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return (kind, prompt), r.json(), seconds


def check(got: dict, want: dict) -> str | None:
    if [t["id"] for t in got["tokens"]] != [t["id"] for t in want["tokens"]]:
        return "token ids differ"
    if [(s["name"], s["shape"]) for s in got["stages"]] != [(s["name"], s["shape"]) for s in want["stages"]]:
        return "stages or shapes differ"
    g, w = got["next_token"], want["next_token"]
    if g["id"] != w["id"] or abs(g["prob"] - w["prob"]) > 1e-5 * max(w["prob"], 1e-12) + 1e-9:
        return f"next token {g['id']} ({g['prob']}) != {w['id']} ({w['prob']})"
    if "attention" in want and got["attention"]["shape"] != want["attention"]["shape"]:
        return "attention shape differs"
    if "head" in want:  # the head's dot products (absent from traces made before they were added)
        rows = [(r["id"], round(r["logit"], 4)) for r in got["head"]["rows"]]
        if rows != [(r["id"], round(r["logit"], 4)) for r in want["head"]["rows"]]:
            return "the head's dot products differ"
    return None


def run_round(url: str, n_requests: int, n_clients: int, want: dict) -> tuple[int, list[float], float]:
    clients = [httpx.Client(base_url=url) for _ in range(n_clients)]
    local = threading.local()
    ids = iter(range(n_clients))
    lock = threading.Lock()

    def work(i: int):
        if not hasattr(local, "client"):
            with lock:
                local.client = clients[next(ids)]
        return request(local.client, i)

    start = time.perf_counter()
    with ThreadPoolExecutor(n_clients) as pool:
        results = list(pool.map(work, range(n_requests)))
    wall = time.perf_counter() - start
    for c in clients:
        c.close()
    wrong = 0
    for key, got, _ in results:
        problem = check(got, want[key])
        if problem:
            wrong += 1
            print(f"WRONG {key}: {problem}")
    return wrong, [s for _, _, s in results], wall


def flood(url: str, n_clients: int, seconds: float) -> int:
    """The short requests' latency while `n_clients` send heavy requests for `seconds`; 1 if one failed."""
    stop = time.monotonic() + seconds
    heavy: dict[int, int] = {}
    lock = threading.Lock()

    def heavy_client() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            while time.monotonic() < stop:
                r = c.post("/api/why", json=HEAVY_BODY)
                with lock:
                    heavy[r.status_code] = heavy.get(r.status_code, 0) + 1
                if r.status_code == 429:  # as a polite client does
                    time.sleep(min(float(r.headers.get("Retry-After", 1)), max(0.0, stop - time.monotonic())))

    threads = [threading.Thread(target=heavy_client, daemon=True) for _ in range(n_clients)]
    for t in threads:
        t.start()
    latencies, failed = [], 0
    with httpx.Client(base_url=url, timeout=600) as c:
        time.sleep(1.0)  # the flood is in
        while time.monotonic() < stop:
            start = time.perf_counter()
            r = c.post("/api/explain", json=SHORT_BODY)
            latencies.append(time.perf_counter() - start)
            failed += r.status_code != 200
            time.sleep(0.5)
    for t in threads:
        t.join()
    lat = sorted(latencies)
    print(f"flood: {n_clients} clients sending why with patching at 256 tokens for {seconds:.0f} s; heavy answers "
          f"{dict(sorted(heavy.items()))}")
    print(f"short explain during the flood: {len(lat)} requests, {failed} not 200; latency median "
          f"{1e3 * statistics.median(lat):.0f} ms, p95 {1e3 * lat[max(0, int(0.95 * len(lat)) - 1)]:.0f} ms, "
          f"max {1e3 * lat[-1]:.0f} ms")
    return 1 if failed or lat[-1] >= 2.0 else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="requests per round (default 200)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, memory read after each (default 2)")
    p.add_argument("--flood", action="store_true", help="measure a short request's latency under a heavy flood instead")
    p.add_argument("--flood-clients", type=int, default=12, help="heavy clients in the flood (default 12)")
    p.add_argument("--flood-seconds", type=float, default=30.0, help="how long the flood lasts (default 30)")
    args = p.parse_args()

    if args.flood:
        with tempfile.TemporaryDirectory() as tmp:
            spec = os.path.join(tmp, "flood.json")
            Path(spec).write_text(json.dumps(FLOOD.to_dict()))
            proc, url = start_server(spec)
            try:
                print(f"server {url} (pid {proc.pid}); model {FLOOD}")
                with httpx.Client(base_url=url, timeout=600) as c:  # warm up: each request shape once
                    assert c.post("/api/explain", json=SHORT_BODY).status_code == 200
                    assert c.post("/api/why", json=HEAVY_BODY).status_code == 200
                return flood(url, args.flood_clients, args.flood_seconds)
            finally:
                proc.terminate()
                proc.wait(30)

    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "small.json")
        Path(spec).write_text(json.dumps(SMALL.to_dict()))
        want = expected_answers(spec)
        proc, url = start_server(spec)
        try:
            print(f"server {url} (pid {proc.pid}); model {SMALL}")
            with httpx.Client(base_url=url) as c:
                assert c.get("/").status_code == 200
                for i in range(2 * len(PROMPTS)):  # warm-up: every request shape once
                    request(c, i)
            rss = [rss_mib(proc.pid)]
            print(f"RSS after warm-up: {rss[0]:.1f} MiB")
            all_wrong = 0
            for r in range(args.rounds):
                wrong, latencies, wall = run_round(url, args.requests, args.clients, want)
                all_wrong += wrong
                rss.append(rss_mib(proc.pid))
                lat = sorted(latencies)
                print(f"round {r + 1}: {args.requests} requests from {args.clients} clients in {wall:.1f} s "
                      f"({args.requests / wall:.1f} req/s); {args.requests - wrong}/{args.requests} correct; "
                      f"latency median {1e3 * statistics.median(lat):.0f} ms, p95 {1e3 * lat[int(0.95 * len(lat)) - 1]:.0f} ms; "
                      f"RSS {rss[-1]:.1f} MiB ({rss[-1] - rss[0]:+.1f} MiB since warm-up)")
            with httpx.Client(base_url=url) as c:  # the page still loads after the load
                assert c.get("/").status_code == 200
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"summary: {args.rounds * args.requests - all_wrong}/{args.rounds * args.requests} correct; "
          f"server RSS {' -> '.join(f'{x:.1f}' for x in rss)} MiB")
    return 1 if all_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
