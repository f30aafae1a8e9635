"""Training step speed: tokens/s and MFU, glassgpt vs transformers, same weights and batch.

One step = forward, cross-entropy over every position, backward, AdamW step, zero_grad
(batch 4 x 256, dropout 0, lr 3e-4, weight decay 0.1, no gradient clipping, no
`.item()` inside the step). glassgpt's rows use what `glassgpt train` uses:
`train.make_optimizer` (fused AdamW) and `train.autocast` (bf16 autocast, float32
master weights). Hugging Face's rows use `torch.optim.AdamW` with its defaults
(foreach) and the same autocast for its bf16 row.

MFU = achieved FLOP/s / measured matmul peak (an n x n matmul on the same device, in
the row's compute dtype, printed alongside). FLOPs per token = 6 N + 12 L t d
(N: parameters in matmuls, the tied head counted once, embeddings' lookups not; the
second term is attention's q @ k.T and attn @ v, forward and backward, PaLM's formula).

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_train_step.py [--compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (common_args, glass_model, hf_model, matmul_peak, print_table, setup,  # noqa: E402
                     time_rows)

from glassgpt.config import PRESETS, GPTConfig  # noqa: E402
from glassgpt.memory import parameter_counts  # noqa: E402
from glassgpt.engine.loss import cross_entropy  # noqa: E402
from glassgpt.train import TrainConfig, autocast, make_optimizer  # noqa: E402


def flops_per_token(cfg: GPTConfig, t: int) -> float:
    n_matmul = parameter_counts(cfg)["linear"] + (cfg.out_dim * cfg.emb_dim if cfg.tie_embeddings else 0)
    return 6 * n_matmul + 12 * cfg.n_layers * t * cfg.emb_dim


def ours_step(model, opt, x, y, amp: torch.dtype):
    device = x.device

    def step():
        with autocast(device, amp):
            logits = model(x)
        loss = cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def hf_step(model, opt, x, y, amp: torch.dtype):
    device = x.device

    def step():
        with autocast(device, amp):
            logits = model(x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    device = setup(args)
    cfg = PRESETS[args.model]
    b, t = args.batch, args.seq_len
    peaks = {dt: matmul_peak(dt, device) for dt in (torch.float32, torch.bfloat16)}
    print(f"measured matmul peak: float32 {peaks[torch.float32] / 1e9:,.0f} GFLOP/s, "
          f"bfloat16 {peaks[torch.bfloat16] / 1e9:,.0f} GFLOP/s")
    fpt = flops_per_token(cfg, t)
    print(f"{args.model}: batch {b} x {t}, AdamW, dropout 0; {fpt / 1e9:.3f} GFLOP per token; "
          f"median of {args.repeats} steps after 2 warm-up steps; device {device}")

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
    tcfg = TrainConfig(out="unused", lr=3e-4, weight_decay=0.1)
    fns, amps = {}, {}
    rows_spec = [("glassgpt float32", torch.float32, False), ("glassgpt bfloat16 autocast", torch.bfloat16, False)]
    if args.compile:
        rows_spec.append(("glassgpt bfloat16 autocast + compile", torch.bfloat16, True))
    for name, amp, compiled in rows_spec:
        model = glass_model(cfg, device, torch.float32).train()
        opt = make_optimizer(model, tcfg, device)
        fns[name] = ours_step(torch.compile(model) if compiled else model, opt, x, y, amp)
        amps[name] = amp
    if not args.no_hf:
        base = glass_model(cfg, device, torch.float32)
        for name, amp in (("HF float32", torch.float32), ("HF bfloat16 autocast", torch.bfloat16)):
            model = hf_model(base, torch.float32).train()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
            fns[name] = hf_step(model, opt, x, y, amp)
            amps[name] = amp
        del base
    seconds = time_rows(fns, device, args.repeats, warmup=2)
    rows = [(name, b * t / s) for name, s in seconds.items()]
    print_table(f"training step, batch {b} x {t}", "tokens/s", rows, "HF float32" if not args.no_hf else None)
    print("\nMFU (achieved FLOP/s / measured matmul peak of the row's compute dtype; and vs the bf16 peak)")
    for name, tps in rows:
        achieved = tps * fpt
        print(f"  {name:<40} {achieved / 1e9:8,.1f} GFLOP/s   MFU {achieved / peaks[amps[name]]:6.1%}"
              f"   vs bf16 peak {achieved / peaks[torch.bfloat16]:6.1%}")


if __name__ == "__main__":
    main()
