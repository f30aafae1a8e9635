"""Chapter 6, side by side: the book's own code, `glassgpt finetune classify --recipe book` (exact), and
the same run on glassgpt's fast path, in one run, on the same thread count.

    book      the notebook's cells, run from llms_from_scratch 1.0.x: SpamDataset (padded to the longest
              training text with 50256), torch.manual_seed(123), loaders of batch 8, GPTModel(BASE_CONFIG)
              with the weights below, every weight frozen, torch.manual_seed(123); out_head = nn.Linear(768, 2),
              the last block and final_norm trainable, torch.manual_seed(123); AdamW(lr 5e-5, weight decay
              0.1); train_classifier_simple(5 epochs, eval_freq 50, eval_iter 5); the three accuracies
    exact     glassgpt finetune classify --recipe book --model model.pth --data train.csv --val validation.csv
              --test test.csv (the recipe's defaults are the notebook's)
    fast      the same, --dtype bfloat16: a bf16 copy of the float32 master weights on the engine's kernels

The data: no SMS corpus ships with glassgpt, so the benchmark writes the book's CSVs (Label, Text) from
the shared texts as stand-in messages: lines of tinyshakespeare are "spam" (1), sentences of the-verdict
"not spam" (0), 747 of each as the book balances them, split 70/10/20 as its random_split does. The model
is the book's layout (GPT_CONFIG_124M with qkv biases, BASE_CONFIG's drop_rate 0.0), random weights drawn
by `torch.manual_seed(123); GPTModel(cfg)` and saved as model.pth for every side.

Prints the lines side by side, whether the exact run's lines and weights equal the book's, the fast
run's final accuracies and losses against the book's (chapter 5's tolerance), and the wall-time ratio
fast / book (goal <= 0.25, issue 36). Run it under the lock:

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_book_ch06.py [--threads 1] [--small]

`--small` runs a 2-block, 64-wide model on 120 texts for 2 epochs instead, to try the script in a minute.
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import sys
import tempfile
from pathlib import Path

from bench_book_ch05 import DATA, final_losses, run_sides, side_by_side, timed, tiktoken_env, weights_equal

BASE_CFG = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
            "drop_rate": 0.0, "qkv_bias": True}
SMALL = {"emb_dim": 64, "n_heads": 4, "n_layers": 2}
TOLERANCE = {"loss": 0.05, "accuracy": 0.02}  # chapter 5's tolerance on the losses; two points of accuracy
LINES = ("Ep ", "Training accuracy", "Validation accuracy", "Test accuracy")


def write_csvs(root: Path, n_per_class: int) -> dict[str, Path]:
    """train.csv / validation.csv / test.csv in the book's layout, from the shared texts (see the docstring)."""
    verdict = [s.strip() for s in re.split(r"(?<=[.!?])\s+", DATA.read_text(encoding="utf-8")) if 3 < len(s) < 300]
    shakespeare = [line.strip() for line in (DATA.parent / "tinyshakespeare.txt").read_text(encoding="utf-8").splitlines()
                   if len(line.strip()) > 20]
    rng = random.Random(123)
    rows = [(0, t) for t in rng.sample(verdict, min(n_per_class, len(verdict)))]
    rows += [(1, t) for t in rng.sample(shakespeare, len(rows))]
    rng.shuffle(rows)
    n_train, n_val = int(len(rows) * 0.7), int(len(rows) * 0.1)
    parts = {"train": rows[:n_train], "validation": rows[n_train:n_train + n_val], "test": rows[n_train + n_val:]}
    paths = {}
    for name, part in parts.items():
        paths[name] = root / f"{name}.csv"
        with open(paths[name], "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["Label", "Text"])
            out.writerows(part)
    return paths


def write_model(path: Path, small: bool) -> None:
    import torch
    from llms_from_scratch.ch04 import GPTModel
    torch.manual_seed(123)
    torch.save(GPTModel({**BASE_CFG, **(SMALL if small else {})}).state_dict(), path)
    path.with_suffix(".json").write_text('{"n_heads": %d}' % (SMALL if small else BASE_CFG)["n_heads"])


def book_side(root: Path, epochs: int, small: bool, threads: int) -> None:
    """The notebook's chapter-6 cells, with llms_from_scratch's functions (run in a process of its own)."""
    import tiktoken
    import torch
    from llms_from_scratch.ch04 import GPTModel
    from llms_from_scratch.ch06 import SpamDataset, calc_accuracy_loader, train_classifier_simple

    torch.set_num_threads(threads)
    cfg = {**BASE_CFG, **(SMALL if small else {})}
    tokenizer = tiktoken.get_encoding("gpt2")
    train_ds = SpamDataset(root / "train.csv", tokenizer, max_length=None)
    val_ds = SpamDataset(root / "validation.csv", tokenizer, max_length=train_ds.max_length)
    test_ds = SpamDataset(root / "test.csv", tokenizer, max_length=train_ds.max_length)
    torch.manual_seed(123)
    loader = lambda ds, train: torch.utils.data.DataLoader(ds, batch_size=8, shuffle=train, num_workers=0,
                                                            drop_last=train)
    train_loader, val_loader, test_loader = loader(train_ds, True), loader(val_ds, False), loader(test_ds, False)
    model = GPTModel(cfg)
    model.load_state_dict(torch.load(root / "model.pth", weights_only=True))
    model.eval()
    for p in model.parameters():
        p.requires_grad = False
    torch.manual_seed(123)
    model.out_head = torch.nn.Linear(cfg["emb_dim"], 2)
    for p in [*model.trf_blocks[-1].parameters(), *model.final_norm.parameters()]:
        p.requires_grad = True
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.1)
    train_classifier_simple(model, train_loader, val_loader, optimizer, torch.device("cpu"), num_epochs=epochs,
                            eval_freq=5 if small else 50, eval_iter=5)
    for name, data_loader in (("Training", train_loader), ("Validation", val_loader), ("Test", test_loader)):
        print(f"{name} accuracy: {calc_accuracy_loader(data_loader, model, 'cpu') * 100:.2f}%")
    torch.save(model.state_dict(), root / "book-model.pth")


def glassgpt_command(root: Path, run_dir: Path, epochs: int, threads: int, fast: bool, small: bool) -> list[str]:
    return [sys.executable, "-m", "glassgpt", "finetune", "classify", "--recipe", "book", "--model",
            str(root / "model.pth"), "--data", str(root / "train.csv"), "--val", str(root / "validation.csv"),
            "--test", str(root / "test.csv"), "--epochs", str(epochs), "--out", str(run_dir), "--threads",
            str(threads), "--no-progress", *(["--eval-every", "5"] if small else []),
            *(["--dtype", "bfloat16"] if fast else [])]


def final(lines: list[str]) -> dict[str, float]:
    """The last losses and the three accuracies (fractions)."""
    out = {f"{k} loss": v for k, v in final_losses(lines).items()}
    for line in lines[-3:]:
        name, value = line.split(" accuracy: ")
        out[f"{name.lower()} accuracy"] = float(value.rstrip("%")) / 100
    return out


def report(results: dict, threads: int) -> None:
    side_by_side(results, "lines")
    print(f"threads: {threads} on every side")
    for s in results:
        print(f"{s:>5}: {results[s]['seconds']:7.1f} s wall, " + ", ".join(f"{k} {v:.3f}" for k, v in final(
            results[s]["lines"]).items()))
    if "exact" in results:
        same = results["exact"]["lines"] == results["book"]["lines"]
        print(f"exact: {'every line equals the book' if same else 'DIFFERS from the book'}; weights "
              f"{results['exact']['weights']}")
    if "fast" in results:
        book, fast = final(results["book"]["lines"]), final(results["fast"]["lines"])
        close = all(abs(fast[k] - book[k]) <= TOLERANCE["accuracy" if "accuracy" in k else "loss"] for k in book)
        ratio = results["fast"]["seconds"] / results["book"]["seconds"]
        print(f"fast / book wall time: {ratio:.2f} (goal <= 0.25, issue 36); accuracies and losses within the tolerance "
              f"{TOLERANCE}: {'yes' if close else 'NO'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="default 5, the book's (--small: 2)")
    p.add_argument("--small", action="store_true", help="a 2-block, 64-wide model on 120 texts: try the script")
    p.add_argument("--skip-exact", action="store_true", help="only the book and the fast run")
    p.add_argument("--side", choices=["book"], help=argparse.SUPPRESS)  # (the book's own process)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    epochs = args.epochs or (2 if args.small else 5)
    if args.side == "book":
        return book_side(args.root, epochs, args.small, args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-ch06-") as tmp:
        root = Path(tmp)
        (root / "tiktoken").mkdir()
        env = tiktoken_env(root / "tiktoken")
        write_csvs(root, 60 if args.small else 747)
        write_model(root / "model.pth", args.small)
        flags = ["--threads", str(args.threads), "--epochs", str(epochs), *(["--small"] if args.small else [])]
        seconds, lines = timed([sys.executable, __file__, "--side", "book", "--root", str(root), *flags], env)
        results = {"book": {"seconds": seconds, "lines": [x for x in lines if x.startswith(LINES)]}}
        run_sides(results, lambda side, fast: (glassgpt_command(root, root / side, epochs, args.threads, fast,
                                                                args.small), root / side),
                  lambda run: {"weights": weights_equal(root / "book-model.pth", run)}, args.skip_exact, env,
                  lambda lines: [x for x in lines if x.startswith(LINES)])
        report(results, args.threads)


if __name__ == "__main__":
    main()
