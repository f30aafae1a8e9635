"""Classification finetuning of a small model: accuracy, time, and parameters trained.

The task (made here from ../shared/data/tinyshakespeare.txt): which play is a speech
from, *The Taming of the Shrew* or *The Tempest*? Both plays lie in the last 10% of
the file, which `glassgpt train` holds out for validation, so a model pretrained on
the first 90% has never seen a single speech of the task. The speaker's name is
removed from each speech; the classes are balanced; 80% train, 20% validation.

Runs (all through the `glassgpt` command line, one process each, under the same flags):
  1. pretrain a 4-block char-level GPT (0.8M parameters) on the first 90%;
  2. finetune a randomly initialised copy (all weights) -- what pretraining buys;
  3. finetune the pretrained model: last block (the book's choice), all weights, LoRA.
Then trainable-parameter counts for GPT-2 124M as a classifier and as an instruction
model, with and without LoRA. Run it under `flock /tmp/glassgpt-bench.lock`.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import glassgpt
from glassgpt import finetune as ft

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DATA, machine_info  # noqa: E402

TEMPEST = {"PROSPERO", "MIRANDA", "ARIEL", "CALIBAN", "FERDINAND", "ALONSO", "SEBASTIAN", "ANTONIO",
           "GONZALO", "TRINCULO", "STEPHANO", "ADRIAN", "FRANCISCO", "Boatswain", "Master"}
SHREW = {"PETRUCHIO", "KATHARINA", "TRANIO", "BAPTISTA", "GRUMIO", "HORTENSIO", "LUCENTIO", "BIONDELLO",
         "GREMIO", "BIANCA", "VINCENTIO", "Pedant", "Widow", "CURTIS"}


def make_task(out: Path, seed: int = 0) -> tuple[Path, Path, dict]:
    text = (DATA / "tinyshakespeare.txt").read_text()
    held_out = text[int(len(text) * 0.9):]  # glassgpt train's validation split (the last 10%)
    speeches = {"shrew": [], "tempest": []}
    for block in held_out.split("\n\n"):
        m = re.match(r"([A-Za-z ]+):\n(.+)", block, re.S)
        if not m:
            continue
        speaker, speech = m.group(1).strip(), m.group(2).strip()
        play = "tempest" if speaker in TEMPEST else "shrew" if speaker in SHREW else None
        if play and len(speech) >= 20:
            speeches[play].append(speech)
    rng = random.Random(seed)
    n = min(len(v) for v in speeches.values())
    rows = [(s, play) for play, v in speeches.items() for s in rng.sample(v, n)]
    rng.shuffle(rows)
    n_val = len(rows) // 5
    paths = out / "train.csv", out / "val.csv"
    for path, part in zip(paths, (rows[n_val:], rows[:n_val])):
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(part)
    lengths = sorted(len(s) for s, _ in rows)
    return paths[0], paths[1], {"per_class": n, "train": len(rows) - n_val, "val": n_val,
                                "median_chars": lengths[len(lengths) // 2]}


def glassgpt_cli(*args: str) -> float:
    """Run `glassgpt ARGS` in its own process; return its wall time."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "glassgpt", *args, "--no-progress"], check=True)
    return time.perf_counter() - t0


def run_finetune(name: str, model: Path, train: Path, val: Path, out: Path, common: list[str],
                 extra: list[str]) -> dict:
    run = out / name
    wall = glassgpt_cli("finetune", "classify", "--model", str(model), "--data", str(train), "--val", str(val),
                        "--out", str(run), *common, *extra)
    report = json.loads((run / "confusion.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    best = glassgpt.load_model(run, device="cpu")
    meta = glassgpt.load_meta(run)
    return {"name": name, "accuracy": report["accuracy"], "matrix": report["matrix"],
            "train_s": metrics[-1]["elapsed_s"], "wall_s": wall, "steps": metrics[-1]["step"],
            "best_step": meta["train"]["step"], "trainable": _trainable(best, meta["finetune"])}


def _trainable(model: glassgpt.GPTModel, settings: dict) -> int:
    if settings["lora_rank"]:
        ft.apply_lora(model, settings["lora_rank"], settings["lora_alpha"])
    else:
        ft.freeze(model, settings["trainable"])
    return ft.count_parameters(model, trainable_only=True)


def gpt2_counts() -> list[tuple[str, int, int]]:
    """(setting, trainable, total) for GPT-2 124M (random weights: counts do not depend on them)."""
    rows = []
    base = glassgpt.load_model("gpt2", device="cpu")
    lm_total = ft.count_parameters(base)
    rows.append(("instruct, all weights (tied head counted once)", lm_total, lm_total))
    for r in (8, 16):
        lm = ft.apply_lora(glassgpt.load_model("gpt2", device="cpu"), r, r)
        rows.append((f"instruct, LoRA r={r}", ft.count_parameters(lm, True), lm_total))
    clf_total = ft.count_parameters(ft.to_classifier(base, 2))
    for trainable in ("all", "last-2-blocks", "last-block", "head"):
        clf = ft.to_classifier(base, 2)
        ft.freeze(clf, trainable)
        rows.append((f"classify (2 classes), --trainable {trainable}", ft.count_parameters(clf, True), clf_total))
    for r in (8, 16):
        clf = ft.apply_lora(ft.to_classifier(glassgpt.load_model("gpt2", device="cpu"), 2), r, r)
        rows.append((f"classify (2 classes), LoRA r={r} (+ head)", ft.count_parameters(clf, True), clf_total))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/glassgpt-finetune-bench"))
    p.add_argument("--pretrain-steps", type=int, default=1200)
    p.add_argument("--epochs", default="5")
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--lora-rank", default="8")
    args = p.parse_args()
    if not (DATA / "tinyshakespeare.txt").is_file():
        sys.exit(f"{DATA / 'tinyshakespeare.txt'} is not present")
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine_info(torch.device("cpu")))
    train, val, info = make_task(args.out)
    print(f"task: {info}")

    pretrained = args.out / "pretrained"
    if not (pretrained / "latest").is_dir():
        pre_s = glassgpt_cli("train", "--data", str(DATA / "tinyshakespeare.txt"), "--tokenizer", "char",
                             "--n-layers", "4", "--n-heads", "4", "--emb-dim", "128", "--context-length", "128",
                             "--batch-size", "32", "--max-steps", str(args.pretrain_steps), "--lr", "2e-3",
                             "--warmup-steps", "50", "--eval-every", str(args.pretrain_steps // 4),
                             "--out", str(pretrained), "--seed", "0")
        print(f"pretraining: {pre_s:.0f} s")
    pre_meta = glassgpt.load_meta(pretrained)
    random_init = args.out / "random-init"
    model = glassgpt.load_model(pretrained, device="cpu")
    fresh = glassgpt.load_model("gpt2", device="cpu", config=model.cfg, seed=1)
    glassgpt.save_model(fresh, random_init, glassgpt.load_tokenizer(pretrained))

    common = ["--epochs", args.epochs, "--batch-size", "16", "--lr", args.lr, "--max-length", "128",
              "--seed", "0", "--eval-every", "30"]
    runs = [
        run_finetune("random-all", random_init, train, val, args.out, common, ["--trainable", "all"]),
        run_finetune("pretrained-last-block", pretrained, train, val, args.out, common, ["--trainable", "last-block"]),
        run_finetune("pretrained-all", pretrained, train, val, args.out, common, ["--trainable", "all"]),
        run_finetune(f"pretrained-lora-r{args.lora_rank}", pretrained, train, val, args.out, common,
                     ["--lora-rank", args.lora_rank, "--lora-alpha", str(2 * int(args.lora_rank))]),
    ]
    total = ft.count_parameters(ft.to_classifier(model, 2))
    print(f"\npretrained model: val loss {pre_meta['train']['val_loss']:.3f} after {pre_meta['train']['step']} steps\n")
    print("| model, what trains | trainable params | val accuracy | training time (s) | steps (best at) |")
    print("|---|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['name']} | {r['trainable']:,} of {total:,} | {r['accuracy']:.1%} | "
              f"{r['train_s']:.1f} (wall {r['wall_s']:.0f}) | {r['steps']} ({r['best_step']}) |")
    print("\n| GPT-2 124M | trainable | of total | share |")
    print("|---|---:|---:|---:|")
    for name, n, tot in gpt2_counts():
        print(f"| {name} | {n:,} | {tot:,} | {n / tot:.2%} |")
    (args.out / "results.json").write_text(json.dumps({"task": info, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
