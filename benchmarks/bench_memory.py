"""Peak memory: generation, a training step, and loading a checkpoint, next to memory_needs().

Every measurement runs in a fresh subprocess, so that one row's allocations cannot
hide another's. On a CPU it reads the process's resident memory from /proc (peak
resident set, VmHWM, reset before the timed part; and the peak of anonymous memory,
RssAnon, sampled every 2 ms, which leaves out file pages that the kernel can drop,
such as a memory-mapped safetensors file); on CUDA, torch.cuda.max_memory_allocated.
All numbers are MiB above the process's memory right after its imports.

Loading: a random checkpoint of the `--load-model` shape (default gpt2-xl, 6.2 GB in
float32) is saved once under --workdir and loaded with `glassgpt.load_model`, in
float32 and in bfloat16. The load does not hold two copies of the weights when its
anonymous peak stays near one copy in the chosen dtype.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_memory.py                 # all three parts
    flock /tmp/glassgpt-bench.lock python benchmarks/bench_memory.py --parts load --load-model gpt2-xl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_info  # noqa: E402

MiB = 2 ** 20


# --- measuring, inside the child process ------------------------------------------------------

def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Peak resident and peak anonymous memory of this process while the block runs."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "Peak":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return self
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self.anon_peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.anon_peak = max(self.anon_peak, _status("RssAnon"))

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = self.anon_peak = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status("RssAnon"))
        self.peak = _status("VmHWM")


def current(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(), torch.cuda.memory_allocated()
    return _status("VmRSS"), _status("RssAnon")


def child(spec: dict) -> dict:
    import torch.nn.functional as F

    from glassgpt.config import PRESETS
    from glassgpt.generate import generate
    from glassgpt.engine import quantize_int8
    from glassgpt.training import TrainConfig
    from glassgpt.training.loop.compute import autocast, make_optimizer
    from glassgpt.formats import load_model, random_model

    device = torch.device(spec["device"])
    base_rss, base_anon = current(device)
    out = {}
    if spec["kind"] == "load":
        with Peak(device) as p:
            model = load_model(spec["path"], device=device, dtype=spec["dtype"])
        rss, anon = current(device)
        out.update(resident=anon - base_anon, peak=p.peak - base_rss, anon_peak=p.anon_peak - base_anon,
                   weights=sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.parameters()}.values()))
        with torch.inference_mode():
            model(torch.zeros(1, 1, dtype=torch.long, device=device))  # touches every weight once
        rss, anon = current(device)
        out.update(used_rss=rss - base_rss, used_file=_status("RssFile") if device.type == "cpu" else 0)
        return out

    cfg = PRESETS[spec["model"]]
    # int8 starts from bfloat16 weights, as `glassgpt generate --dtype int8` does
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16}[spec["dtype"]]
    if spec["impl"] == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        from glassgpt.formats.hf import config_to_hf
        hf_cfg = GPT2Config(**{k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "torch_dtype")})
        model = GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa")
        model = model.to(device=device, dtype=dtype if spec["kind"] == "generate" else torch.float32)
    else:
        model = random_model(cfg, device, dtype if spec["kind"] == "generate" else torch.float32)
        if spec["dtype"] == "int8":
            model = quantize_int8(model)
    gen = torch.Generator().manual_seed(0)
    if spec["kind"] == "generate":
        model.eval()
        ids = torch.randint(0, cfg.vocab_size, (spec["batch"], 16), generator=gen).to(device)
        n = 64

        def run():
            with torch.inference_mode():
                if spec["impl"] == "hf":
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                else:
                    generate(model, ids, n)
    else:
        model.train()
        b, t = spec["batch"], spec["seq_len"]
        x = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
        y = torch.randint(0, cfg.vocab_size, (b, t), generator=gen).to(device)
        if spec["impl"] == "hf":
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        else:
            opt = make_optimizer(model, TrainConfig(out="unused"), device)
        amp = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32

        def run():
            with autocast(device, amp):
                logits = model(x).logits if spec["impl"] == "hf" else model(x)
            F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rss, anon = current(device)
    with Peak(device) as p:
        run()
        run()
    out.update(resident=anon - base_anon, peak=p.peak - base_rss, anon_peak=p.anon_peak - base_anon)
    return out


# --- the parent: one subprocess per row, and the table -----------------------------------------

def measure(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(model: str, dtype: str, kind: str, batch: int, seq_len: int) -> float:
    from glassgpt.config import PRESETS
    from glassgpt.memory import memory_needs
    needs = memory_needs(PRESETS[model], dtype if kind != "train" else "float32", batch, seq_len)
    if kind == "train" and dtype == "bfloat16":
        # autocast: float32 weights, bf16 activations, and a bf16 copy of each weight kept for the step
        bf16 = memory_needs(PRESETS[model], "bfloat16", batch, seq_len)
        needs["training"] = (needs["weights"] + needs["gradients"] + needs["adamw_state"]
                             + bf16["activations"] + bf16["weights"])
    return needs["training" if kind == "train" else "inference"] / MiB


def print_rows(title: str, rows: list[tuple[str, dict, float]]) -> None:
    print(f"\n{title}")
    print("| configuration | after setup (MiB) | peak resident (MiB) | peak anonymous (MiB) | memory_needs estimate (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, r, est in rows:
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | |")
            continue
        print(f"| {name} | {r['resident'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} | {r['anon_peak'] / MiB:,.0f} | {est:,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--device", default="auto")
    p.add_argument("--parts", nargs="+", default=["generate", "train", "load"], choices=["generate", "train", "load"])
    p.add_argument("--load-model", default="gpt2-xl", help="shape of the random checkpoint that --parts load saves and loads")
    p.add_argument("--workdir", default="/tmp/glassgpt-bench-memory", help="where the load checkpoint is saved (kept)")
    p.add_argument("--no-hf", action="store_true")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    print(machine_info(torch.device(device)))
    print("MiB above the process's memory after imports; 'after setup' = model (and optimizer) built")

    if "generate" in args.parts:
        rows = []
        for impl, dtype in [("glassgpt", "float32"), ("glassgpt", "bfloat16"), ("glassgpt", "int8"),
                            ("hf", "float32"), ("hf", "bfloat16")]:
            if impl == "hf" and args.no_hf:
                continue
            spec = dict(kind="generate", impl=impl, dtype=dtype, model=args.model, device=device, batch=1)
            rows.append((f"{'HF' if impl == 'hf' else 'glassgpt'} {dtype}", measure(spec),
                         estimate(args.model, dtype, "generate", 1, 80)))
        print_rows(f"generation, {args.model}, batch 1, 16 + 64 tokens", rows)
    if "train" in args.parts:
        rows = []
        for impl, dtype in [("glassgpt", "float32"), ("glassgpt", "bfloat16"), ("hf", "float32"), ("hf", "bfloat16")]:
            if impl == "hf" and args.no_hf:
                continue
            spec = dict(kind="train", impl=impl, dtype=dtype, model=args.model, device=device, batch=4, seq_len=256)
            label = f"{'HF' if impl == 'hf' else 'glassgpt'} {dtype}{' autocast' if dtype == 'bfloat16' else ''}"
            rows.append((label, measure(spec), estimate(args.model, dtype, "train", 4, 256)))
        print_rows(f"training step, {args.model}, batch 4 x 256, AdamW", rows)
    if "load" in args.parts:
        path = Path(args.workdir) / args.load_model
        if not (path / "model.safetensors").is_file():
            from glassgpt.formats import random_model, save_model
            from glassgpt.config import PRESETS
            start = time.perf_counter()
            save_model(random_model(PRESETS[args.load_model], torch.device("cpu"), torch.float32), path)
            print(f"(saved a random {args.load_model} checkpoint to {path} in {time.perf_counter() - start:.0f} s)")
        size = (path / "model.safetensors").stat().st_size
        print(f"\nloading {path} (model.safetensors: {size / MiB:,.0f} MiB, float32)")
        print("| configuration | weights in this dtype (MiB) | peak anonymous during load (MiB) | "
              "peak resident during load (MiB) | resident after one forward (MiB) | of which file pages (MiB) |")
        print("|---|---:|---:|---:|---:|---:|")
        for dtype in ("float32", "bfloat16"):
            r = measure(dict(kind="load", path=str(path), dtype=dtype, device=device))
            if "error" in r:
                print(f"| load_model dtype={dtype} | error: {r['error']} | | | | |")
                continue
            print(f"| load_model({args.load_model}, dtype={dtype}) | {r['weights'] / MiB:,.0f} | "
                  f"{r['anon_peak'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} | {r['used_rss'] / MiB:,.0f} | "
                  f"{r['used_file'] / MiB:,.0f} |")


if __name__ == "__main__":
    main()
