"""GELU's tanh form in a 1 x 512 prefill of gpt2: torch's F.gelu against glassgpt's kernel (FusedGELU.kernel),
paired in one process, run by run: this host's speed moves too much between processes to see a few percent.

    flock /tmp/glassgpt-bench.lock python benchmarks/ab_gelu.py [--pairs 12]

Prints, per precision, each side's median prefill, the median of the paired ratios and the largest difference of
the two sides' last-position logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import glass_model  # noqa: E402
from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import Engine, KVCache  # noqa: E402
from glassgpt.engine.fused import FusedGELU  # noqa: E402


@torch.inference_mode()
def pair(dtype: torch.dtype, pairs: int) -> str:
    cfg = PRESETS["gpt2"]
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    engine = Engine(glass_model(cfg, torch.device("cpu"), dtype))
    gelus = [m for m in engine.fast.modules() if isinstance(m, FusedGELU)]
    kernel = gelus[0].kernel
    if kernel is None:
        return f"{dtype}: glassgpt's GELU kernel is not chosen here (autotune: {engine.choices.ms.get('gelu')})"
    cache = KVCache(cfg, 1, 512, dtype=dtype)

    def run(gelu) -> tuple[float, torch.Tensor]:
        for m in gelus:
            m.kernel = gelu
        cache.reset()
        start = time.perf_counter()
        logits = engine(ids, cache, last_only=True)
        return time.perf_counter() - start, logits

    run(None), run(kernel)  # warm-up
    plain, chosen, ratios = [], [], []
    for _ in range(pairs):
        (a, ya), (b, yb) = run(None), run(kernel)
        plain.append(a)
        chosen.append(b)
        ratios.append(a / b)
    diff = (ya.float() - yb.float()).abs().max().item()
    return (f"{dtype}: torch's gelu {statistics.median(plain) * 1e3:.1f} ms, glassgpt's "
            f"{statistics.median(chosen) * 1e3:.1f} ms a prefill; paired median {statistics.median(ratios):.3f}x; "
            f"logits differ by at most {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in (torch.float32, torch.bfloat16):
        print(pair(dtype, args.pairs))


if __name__ == "__main__":
    main()
