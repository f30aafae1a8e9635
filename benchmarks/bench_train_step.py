"""Training step speed: tokens/s and MFU, glassgpt vs transformers, same weights and batch.

One step = forward, cross-entropy over every position, backward, AdamW step, zero_grad
(batch 4 x 256, dropout 0, lr 3e-4, weight decay 0.1 on matrices, no gradient clipping,
no `.item()` inside the step). Two views (harness.print_views):

- like for like: the same optimizer (`training.compute.make_optimizer`: fused AdamW, decay on matrices
  only) and the same loss (`F.cross_entropy` on float32 logits) on both sides, float32 or
  bfloat16 autocast, eager or compiled: only the models differ (glassgpt's with the fused
  kernels, `engine.fused(model, in_place=True)`, as `glassgpt train` runs it: model.py alone
  computes the book's formulas op by op).
- best against best: glassgpt as `glassgpt train --dtype bfloat16` runs it (the engine:
  bf16 weights with a float32 master copy, engine/mixed.py, and the chunked loss,
  engine/loss.py), against transformers' fastest row.

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
from harness import Row, common_args, glass_model, hf_model, matmul_peak, print_views, setup, time_rows  # noqa: E402

from glassgpt.config import PRESETS, GPTConfig  # noqa: E402
from glassgpt.engine import LowPrecisionCopy, cross_entropy, fused  # noqa: E402
from glassgpt.memory import parameter_counts  # noqa: E402
from glassgpt.training import TrainConfig  # noqa: E402
from glassgpt.training.loop.compute import autocast, make_optimizer  # noqa: E402


def flops_per_token(cfg: GPTConfig, t: int) -> float:
    n_matmul = parameter_counts(cfg)["linear"] + (cfg.out_dim * cfg.emb_dim if cfg.tie_embeddings else 0)
    return 6 * n_matmul + 12 * cfg.n_layers * t * cfg.emb_dim


def plain_step(forward, opt, x, y, amp: torch.dtype):
    """Autocast forward, F.cross_entropy on float32 logits, backward, optimizer step."""
    device = x.device

    def step():
        with autocast(device, amp):
            logits = forward(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def engine_step(copy: LowPrecisionCopy, forward, opt, x, y):
    """glassgpt train's bfloat16 step: bf16 forward/backward, float32 master update, chunked loss."""
    def step():
        loss = cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        copy.grads_to_master()
        opt.step()
        opt.zero_grad(set_to_none=True)
        copy.refresh()
    return step


def main() -> None:
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    device = setup(args)
    cfg = PRESETS[args.model]
    b, t = args.batch, args.seq_len
    peaks = {"float32": matmul_peak(torch.float32, device), "bfloat16": matmul_peak(torch.bfloat16, device)}
    print(f"measured matmul peak: float32 {peaks['float32'] / 1e9:,.0f} GFLOP/s, "
          f"bfloat16 {peaks['bfloat16'] / 1e9:,.0f} GFLOP/s")
    fpt = flops_per_token(cfg, t)
    print(f"{args.model}: batch {b} x {t}, AdamW, dropout 0; {fpt / 1e9:.3f} GFLOP per token; "
          f"median of {args.repeats} steps after 2 warm-up steps; device {device}")

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
    tcfg = TrainConfig(out="unused", lr=3e-4, weight_decay=0.1)
    base = glass_model(cfg, device, torch.float32)
    compiles = (False, True) if args.compile else (False,)
    fns, meta = {}, {}

    def add(name, fn, precision, compiled, reference):
        fns[name], meta[name] = fn, (precision, compiled, reference)

    for compiled in compiles:
        suffix = " + compile" if compiled else ""
        for precision, amp in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            if compiled and precision == "float32":
                continue
            # as glassgpt train runs it: the glass model with the fused kernels (training/loop.py)
            model = fused(glass_model(cfg, device, torch.float32).train(), in_place=True)
            add(f"glassgpt {precision}{' autocast' if amp != torch.float32 else ''}{suffix}",
                plain_step(torch.compile(model) if compiled else model, make_optimizer(model, tcfg, device), x, y, amp),
                precision, compiled, False)
            if not args.no_hf:
                hf = hf_model(base, torch.float32).train()
                forward = lambda ids, hf=hf: hf(ids, use_cache=False).logits  # noqa: E731
                add(f"HF {precision}{' autocast' if amp != torch.float32 else ''}{suffix}",
                    plain_step(torch.compile(forward) if compiled else forward, make_optimizer(hf, tcfg, device),
                               x, y, amp), precision, compiled, True)
        master = fused(glass_model(cfg, device, torch.float32).train(), in_place=True)
        copy = LowPrecisionCopy(master, torch.bfloat16)
        add(f"glassgpt bfloat16 engine (bf16 copy + fp32 master, chunked loss){suffix}",
            engine_step(copy, torch.compile(copy.module) if compiled else copy.module,
                        make_optimizer(master, tcfg, device), x, y), "bfloat16", compiled, False)
        if device.type == "cuda" and compiled:  # what the padded head (engine/linear.py) gives: the same row without it
            master = fused(glass_model(cfg, device, torch.float32).train(), in_place=True)
            copy = LowPrecisionCopy(master, torch.bfloat16)
            copy.module.out_head.pad_to = None
            add(f"glassgpt bfloat16 engine{suffix}, head not padded",
                engine_step(copy, torch.compile(copy.module), make_optimizer(master, tcfg, device), x, y),
                "bfloat16", compiled, False)
    del base
    seconds = time_rows(fns, device, args.repeats, warmup=2)
    rows = [Row(name, b * t / s, *meta[name],
                note=f"MFU {b * t / s * fpt / peaks[meta[name][0]]:.1%}") for name, s in seconds.items()]
    print_views(f"training step, batch {b} x {t} (MFU: achieved FLOP/s / the row's dtype matmul peak)",
                "tokens/s", rows)


if __name__ == "__main__":
    main()
