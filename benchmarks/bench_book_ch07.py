"""Chapter 7, side by side: the book's own code, `glassgpt finetune instruct --recipe book` (exact), and
the same run on glassgpt's fast path, in one run, on the same thread count.

    book      the notebook's cells, run from llms_from_scratch 1.0.x: instruction-data.json split 85/10/5,
              InstructionDataset, custom_collate_fn (allowed_max_length 1024), torch.manual_seed(123),
              loaders of batch 8, GPTModel with the weights below, torch.manual_seed(123); AdamW(lr 5e-5,
              weight decay 0.1); train_model_simple(2 epochs, eval_freq 5, eval_iter 5,
              format_input(val_data[0])); then each test record answered by generate(max_new_tokens 256,
              eos_id 50256) into instruction-data-with-response.json
    exact     glassgpt finetune instruct --recipe book --model model.pth --data instruction-data.json
    fast      the same, --dtype bfloat16: a bf16 copy of the master weights, the KV cache for generation

The data is shared/data/book/instruction-data.json (1,100 records), the model the book's layout (GPT-2
124M's shape with qkv biases, drop_rate 0.0; the book finetunes the 355M medium), random weights drawn by
`torch.manual_seed(123); GPTModel(cfg)` and saved as model.pth for every side.

Prints the lines side by side, whether the exact run's lines, weights and responses equal the book's,
the fast run's final losses against the book's (chapter 5's tolerance), how many of its responses
equal the book's, and the wall-time ratio fast / book (goal <= 0.25, issue 36). Run it under the lock:

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_book_ch07.py [--threads 1] [--small]

`--small` runs a 2-block, 64-wide model on the first 60 records for 1 epoch, to try the script in a minute.
`--responses N` answers only the first N of the 110 test records on every side (the notebook shows 3 before
it answers all): the book's generate runs the whole sequence again for each new token, so at 124M on 2
cores its 110 x 256 tokens alone would take hours.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

from bench_book_ch05 import DATA, final_losses, run_sides, side_by_side, timed, tiktoken_env, weights_equal

INSTRUCTIONS = DATA.parent / "book" / "instruction-data.json"
BASE_CFG = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
            "drop_rate": 0.0, "qkv_bias": True}
SMALL = {"emb_dim": 64, "n_heads": 4, "n_layers": 2}
TOLERANCE = 0.05  # chapter 5's, on the losses
RESPONSES = "instruction-data-with-response.json"


def write_inputs(root: Path, small: bool) -> None:
    import torch
    from llms_from_scratch.ch04 import GPTModel
    data = json.loads(INSTRUCTIONS.read_text(encoding="utf-8"))
    (root / "instruction-data.json").write_text(json.dumps(data[:60] if small else data, indent=4))
    torch.manual_seed(123)
    torch.save(GPTModel({**BASE_CFG, **(SMALL if small else {})}).state_dict(), root / "model.pth")
    (root / "model.json").write_text('{"n_heads": %d}' % (SMALL if small else BASE_CFG)["n_heads"])


def book_side(root: Path, epochs: int, small: bool, threads: int, responses: int | None) -> None:
    """The notebook's chapter-7 cells, with llms_from_scratch's functions (run in a process of its own)."""
    import tiktoken
    import torch
    from llms_from_scratch.ch04 import GPTModel
    from llms_from_scratch.ch05 import generate, text_to_token_ids, token_ids_to_text, train_model_simple
    from llms_from_scratch.ch07 import InstructionDataset, custom_collate_fn, format_input

    torch.set_num_threads(threads)
    cfg = {**BASE_CFG, **(SMALL if small else {})}
    data = json.loads((root / "instruction-data.json").read_text())
    train_portion, test_portion = int(len(data) * 0.85), int(len(data) * 0.1)
    train_data, test_data = data[:train_portion], data[train_portion:train_portion + test_portion]
    val_data = data[train_portion + test_portion:]
    tokenizer = tiktoken.get_encoding("gpt2")
    collate = functools.partial(custom_collate_fn, device="cpu", allowed_max_length=1024)
    torch.manual_seed(123)
    loader = lambda part, train: torch.utils.data.DataLoader(InstructionDataset(part, tokenizer), batch_size=8,
                                                             collate_fn=collate, shuffle=train, drop_last=train,
                                                             num_workers=0)
    train_loader, val_loader = loader(train_data, True), loader(val_data, False)
    model = GPTModel(cfg)
    model.load_state_dict(torch.load(root / "model.pth", weights_only=True))
    model.eval()
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.00005, weight_decay=0.1)
    train_model_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=epochs, eval_freq=5,
                       eval_iter=5, start_context=format_input(val_data[0]), tokenizer=tokenizer)
    test_data = test_data[:responses]
    for entry in test_data:
        input_text = format_input(entry)
        token_ids = generate(model=model, idx=text_to_token_ids(input_text, tokenizer), max_new_tokens=256,
                             context_size=cfg["context_length"], eos_id=50256)
        entry["model_response"] = token_ids_to_text(token_ids, tokenizer)[len(input_text):].replace(
            "### Response:", "").strip()
    with open(root / RESPONSES, "w") as file:
        json.dump(test_data, file, indent=4)
    torch.save(model.state_dict(), root / "book-model.pth")


def glassgpt_command(root: Path, run_dir: Path, epochs: int, threads: int, fast: bool,
                     responses: int | None) -> list[str]:
    return [sys.executable, "-m", "glassgpt", "finetune", "instruct", "--recipe", "book", "--model",
            str(root / "model.pth"), "--data", str(root / "instruction-data.json"), "--epochs", str(epochs),
            "--out", str(run_dir), "--threads", str(threads), "--no-progress",
            *(["--dtype", "bfloat16"] if fast else []), *(["--responses", str(responses)] if responses else [])]


def lines_of(output: list[str]) -> list[str]:
    return [line for line in output if line.startswith(("Ep ", "Below is an instruction"))]


def same_responses(book: Path, ours: Path) -> str:
    a, b = json.loads(book.read_text()), json.loads(ours.read_text())
    same = sum(x["model_response"] == y["model_response"] for x, y in zip(a, b))
    return f"{same} of {len(a)} responses equal the book's" + (" (the file, byte for byte)"
                                                               if book.read_bytes() == ours.read_bytes() else "")


def report(results: dict, threads: int) -> None:
    side_by_side(results, "lines")
    print(f"threads: {threads} on every side")
    for s in results:
        print(f"{s:>5}: {results[s]['seconds']:7.1f} s wall, final " + ", ".join(
            f"{k} {v:.3f}" for k, v in final_losses(results[s]["lines"]).items()) + results[s].get("note", ""))
    if "exact" in results:
        same = results["exact"]["lines"] == results["book"]["lines"]
        print(f"exact: {'every line equals the book' if same else 'DIFFERS from the book'}; weights "
              f"{results['exact']['weights']}")
    if "fast" in results:
        book, fast = final_losses(results["book"]["lines"]), final_losses(results["fast"]["lines"])
        close = all(abs(fast[k] - book[k]) <= TOLERANCE for k in book)
        ratio = results["fast"]["seconds"] / results["book"]["seconds"]
        print(f"fast / book wall time: {ratio:.2f} (goal <= 0.25, issue 36); final losses within {TOLERANCE}: "
              f"{'yes' if close else 'NO'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="default 2, the book's (--small: 1)")
    p.add_argument("--small", action="store_true", help="a 2-block, 64-wide model on 60 records: try the script")
    p.add_argument("--skip-exact", action="store_true", help="only the book and the fast run")
    p.add_argument("--responses", type=int, default=None, help="answer only the first N test records (default all)")
    p.add_argument("--side", choices=["book"], help=argparse.SUPPRESS)  # (the book's own process)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    epochs = args.epochs or (1 if args.small else 2)
    if args.side == "book":
        return book_side(args.root, epochs, args.small, args.threads, args.responses)
    with tempfile.TemporaryDirectory(prefix="bench-ch07-") as tmp:
        root = Path(tmp)
        (root / "tiktoken").mkdir()
        env = tiktoken_env(root / "tiktoken")
        write_inputs(root, args.small)
        flags = ["--threads", str(args.threads), "--epochs", str(epochs), *(["--small"] if args.small else []),
                 *(["--responses", str(args.responses)] if args.responses else [])]
        seconds, lines = timed([sys.executable, __file__, "--side", "book", "--root", str(root), *flags], env)
        results = {"book": {"seconds": seconds, "lines": lines_of(lines)}}
        run_sides(results, lambda side, fast: (glassgpt_command(root, root / side, epochs, args.threads, fast,
                                                                 args.responses),
                                                root / side),
                  lambda run: {"weights": weights_equal(root / "book-model.pth", run),
                               "note": "; " + same_responses(root / RESPONSES, run / RESPONSES)},
                  args.skip_exact, env, lines_of)
        report(results, args.threads)


if __name__ == "__main__":
    main()
