"""What bfloat16, int8 and int4 weights cost in quality: perplexity on held-out real text, before and after.

With `--model SPEC` (a checkpoint, a run directory, or a hub id already in the cache)
it measures that model. Without, it first trains a small GPT-2-BPE model (the real
50,257-token vocabulary and tied head, emb_dim 256, 4 blocks) for a few minutes on the
first 90% of tinyshakespeare, so the numbers come from a model with real predictions
(random weights would give perplexity ~ vocabulary size either way). Reported, on the
held-out last 10% only (text the model never trained on): perplexity in float32,
bfloat16, int8 and int4 (4-bit groups of 32), and how often each variant's top-1 token
equals float32's. Whole windows run at once, so int8 and int4 take PyTorch's path (the
dequantized weights); "int4, decoded" feeds the same windows one token at a time through
the KV cache, as generation does, so it runs glassgpt's kernel, which also rounds the
activations to int8 per group.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_int8_quality.py
    flock /tmp/glassgpt-bench.lock python benchmarks/bench_int8_quality.py --model openai-community/gpt2
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DATA, machine_info  # noqa: E402

from glassgpt.config import GPTConfig  # noqa: E402
from glassgpt.engine import Engine, KVCache, quantize_int4, quantize_int8  # noqa: E402
from glassgpt.tokenizer import get_tokenizer  # noqa: E402
from glassgpt.formats import load_model, load_tokenizer, random_model  # noqa: E402


def train_small(ids: list[int], steps: int, window: int = 128, seed: int = 0) -> torch.nn.Module:
    cfg = GPTConfig(context_length=window, emb_dim=256, n_heads=4, n_layers=4)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=seed).train()
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (8,), generator=gen)
        x = torch.stack([data[s:s + window] for s in starts])
        y = torch.stack([data[s + 1:s + window + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d}  train loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)")
    return model.eval()


@torch.inference_mode()
def score(model: torch.nn.Module, ids: list[int], window: int) -> tuple[float, torch.Tensor]:
    """Perplexity over non-overlapping windows, and the top-1 id at every scored position."""
    n = (len(ids) - 1) // window * window
    x = torch.tensor(ids[:n]).view(-1, window)
    y = torch.tensor(ids[1:n + 1]).view(-1, window)
    logits = torch.cat([model(rows) for rows in x.split(16)]).float()
    nll = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return math.exp(nll.item()), logits.argmax(-1).flatten()


@torch.inference_mode()
def score_decoding(model: torch.nn.Module, ids: list[int], window: int, batch: int = 8) -> tuple[float, torch.Tensor]:
    """`score`, with each window fed one token at a time through the KV cache (8 windows at once)."""
    n = (len(ids) - 1) // window * window
    x = torch.tensor(ids[:n]).view(-1, window)
    engine = Engine(model)
    logits = []
    for rows in x.split(batch):
        cache = KVCache(model.cfg, rows.shape[0], window, dtype=model.tok_emb.weight.dtype)
        logits.append(torch.cat([engine(rows[:, i:i + 1], cache, last_only=True) for i in range(window)], dim=1))
    logits = torch.cat(logits).float()
    y = torch.tensor(ids[1:n + 1]).view(-1, window)
    return math.exp(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()), logits.argmax(-1).flatten()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint / run dir / cached hub id (default: train a small one here)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--text", default=str(DATA / "tinyshakespeare.txt"))
    p.add_argument("--max-tokens", type=int, default=None, help="use only the last this many tokens of the text")
    args = p.parse_args()
    print(machine_info(torch.device("cpu")))
    text = Path(args.text).read_text(encoding="utf-8")
    if args.model:
        model = load_model(args.model, dtype="float32")
        tok = load_tokenizer(args.model)
    else:
        tok = get_tokenizer("gpt2")
    ids = tok.encode(text)[-args.max_tokens:] if args.max_tokens else tok.encode(text)
    split = int(0.9 * len(ids))
    if not args.model:
        print(f"training a small GPT-2-BPE model on the first 90% of {Path(args.text).name} ({split:,} tokens)")
        model = train_small(ids[:split], args.steps)
    window = min(model.cfg.context_length, 256)

    def variant(kind: str) -> torch.nn.Module:
        clone = random_model(model.cfg, torch.device("cpu"), torch.float32)
        clone.load_state_dict(model.state_dict())
        if kind == "bfloat16":
            return clone.to(torch.bfloat16).eval()
        if kind == "int8":
            return quantize_int8(clone)
        if kind.startswith("int4"):
            return quantize_int4(clone)
        return clone.eval()

    results = {kind: score(variant(kind), ids[split:], window) for kind in ("float32", "bfloat16", "int8", "int4")}
    results["int4, decoded"] = score_decoding(variant("int4"), ids[split:], window)
    base, base_top = results["float32"]
    print(f"\nperplexity on the held-out last 10% of {Path(args.text).name} ({len(ids) - split:,} tokens, "
          f"never trained on), windows of {window} tokens")
    print("| weights | held-out perplexity | change vs float32 | top-1 = float32's |")
    print("|---|---:|---:|---:|")
    for kind, (ppl, top) in results.items():
        agree = (top == base_top).float().mean().item()
        print(f"| {kind} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {agree:.2%} |")

if __name__ == "__main__":
    main()
