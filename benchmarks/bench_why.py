"""What `why` costs next to a plain trace, in the same process, on GPT-2 124M (random weights: the cost
does not depend on the values) and one 16-token prompt.

    plain trace     glassgpt.trace with TraceOptions(embedding_check=False): the flow, as `explain` records it
    record          why's one recording of the clean run (the taps it keeps, one forward pass)
    attribution     record + the exact parts and the per-source split (the direct answer): the issue's <= 3x
    + causal        + the prompt run again with each token removed: only the tokens after the removed one, on the
                    clean run's keys and values before it, packed in one pass (120 tokens, not 16 x 15 = 240)
                    on the fused twin (engine/fused.py)
    why             glassgpt.why(...) as the CLI calls it (attribution, causal, the runner-up's contrast)
    + patch         glassgpt.why(..., patch=...): the corrupted run recorded once, then the residual grid
                    (13 rows x 16 positions) and the per-head grid, each run starting from the corrupted
                    run's recorded input of the patched block; the clean run's activations are reused

Median of --repeats runs after one warm-up each. Run it under the exclusive lock:

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_why.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import glassgpt
from glassgpt.explain import TraceOptions
from glassgpt.explain.why import attribute, record_run, remove_each

PROMPT = "Every effort moves you, and every step forward is a step closer to the end"
CORRUPTED = "Every effort moves me, and every step forward is a step closer to the end"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0), glassgpt.get_tokenizer("gpt2")
    ids = tok.encode(PROMPT)
    assert len(ids) == 16 and len(tok.encode(CORRUPTED)) == 16, (len(ids), len(tok.encode(CORRUPTED)))
    opt = TraceOptions(embedding_check=False)

    def attribution():
        with torch.inference_mode():
            seen, logits = record_run(model, ids, None)
            return attribute(model, seen, ids, int(logits[0, -1].argmax()), None), seen, logits

    def with_causal():
        result, seen, logits = attribution()
        with torch.inference_mode():
            return remove_each(model, seen, ids, logits[0, -1].float(), int(logits[0, -1].argmax()))

    rows = [("plain trace", lambda: glassgpt.trace(model, tok, ids=ids, options=opt)),
            ("record", lambda: torch.inference_mode()(record_run)(model, ids, None)),
            ("attribution", attribution), ("+ causal", with_causal),
            ("why", lambda: glassgpt.why(model, tok, PROMPT)),
            ("+ patch", lambda: glassgpt.why(model, tok, PROMPT, patch=CORRUPTED))]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    print(f"GPT-2 124M (random), 16 tokens, float32, {args.threads} threads, median of {args.repeats}; {cpu}; "
          f"torch {torch.__version__}")
    print("| step | time | x plain trace |\n|---|---|---|")
    base = None
    for name, fn in rows:
        t = timed(fn, args.repeats)
        base = base or t
        print(f"| {name} | {1000 * t:.1f} ms | {t / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
