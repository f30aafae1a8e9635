"""`glassgpt train --recipe book` against the book's own chapter-5 code (llms_from_scratch), side by side.

A small GPT_CONFIG (2 blocks 32 wide, context 32, the book's dropout 0.1 and no qkv biases) on the
first 6,000 characters of the-verdict, 2 epochs of 20 steps: the lines that `train_model_simple`
prints (its evaluations and its samples) and the weights it ends with, bit for bit; the losses of
`calc_loss_loader` over each loader (`glassgpt eval --recipe book`); an exact resume in the middle
of an epoch; and what a reader who brings the book's model.pth runs into. The full chapter-5 run
(GPT_CONFIG_124M, 10 epochs) is benchmarks/bench_book_ch05.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.model import GPTModel
from glassgpt.training import TrainConfig, fit, read_metrics
from glassgpt.training.book.ch05 import BookTask, split_text, windows

from helpers import CH05_FLAGS as FLAGS, CH05_SMALL as SMALL, CH05_TEXT as TEXT, book_loaders, one_line_error

ch02 = pytest.importorskip("llms_from_scratch.ch02", reason="the README's test command installs llms-from-scratch")
from llms_from_scratch.ch04 import GPTModel as BookGPTModel, generate_text_simple  # noqa: E402
from llms_from_scratch.ch05 import calc_loss_loader, train_model_simple  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verdict") / "verdict-6000.txt"
    path.write_text(TEXT[0], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def book_run(text):
    """The book's code, as the notebook runs it: seed, model, AdamW, train_model_simple (printing)."""
    torch.set_num_threads(1)
    train_loader, val_loader = book_loaders(text.read_text(encoding="utf-8"))
    torch.manual_seed(123)
    model = BookGPTModel(SMALL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_model_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=2, eval_freq=5,
                           eval_iter=5, start_context="Every effort moves you", tokenizer=ch02.tiktoken.get_encoding("gpt2"))
    return printed.getvalue().splitlines(), model.state_dict()


@pytest.fixture(scope="module")
def glass_run(text, tmp_path_factory):
    """`glassgpt train --recipe book` with the same settings (the recipe's defaults are the notebook's)."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("book") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--recipe", "book", "--data", str(text), "--out", str(run), "--epochs", "2", *FLAGS]) == 0
    return printed.getvalue().splitlines(), run


def test_the_evaluation_lines_and_samples_are_the_books(book_run, glass_run):
    book_lines, _ = book_run
    ours = [line for line in glass_run[0] if line.startswith(("Ep ", "Every effort moves you"))]
    assert book_lines[0].startswith("Ep 1 (Step 000000): Train loss ") and len(book_lines) >= 4
    assert ours == book_lines  # every evaluation line and both samples, character for character


def test_the_weights_after_two_epochs_equal_the_books_bit_for_bit(book_run, glass_run):
    book_state = book_run[1]
    ours = glassgpt.load_model(glass_run[1] / "latest").state_dict()
    assert verify_step(glass_run[1]) == 2 * len(book_loaders(TEXT[0])[0])  # two epochs
    different = [name for name, tensor in ours.items() if not torch.equal(tensor, book_state[name])]
    assert different == []


def verify_step(run: Path) -> int:
    return json.loads((run / "latest" / "train_state.json").read_text())["step"]


def test_the_run_records_the_books_evaluations_and_a_snapshot_at_each(glass_run):
    evals = [r for r in read_metrics(glass_run[1]) if "val_loss" in r]
    steps = verify_step(glass_run[1])
    assert [r["step"] for r in evals] == list(range(1, steps + 1, 5))  # global_step 0, 5, 10, ... as the book's
    assert all(r["snapshot"]["prompt"] == "Every effort moves you" and len(r["snapshot"]["lens"]) == 2 for r in evals)


def test_calc_loss_loader_over_each_loader_is_eval_recipe_book(text, tmp_path, capsys):
    """The notebook's "Training loss" / "Validation loss" of the untrained model (section 5.1.3)."""
    train_loader, val_loader = book_loaders(text.read_text(encoding="utf-8"))
    torch.manual_seed(123)
    model = BookGPTModel(SMALL).eval()  # "model.eval();  # Disable dropout during inference"
    torch.manual_seed(123)  # "For reproducibility due to the shuffling in the data loader"
    with torch.no_grad():
        expected = {"train": calc_loss_loader(train_loader, model, "cpu"), "val": calc_loss_loader(val_loader, model, "cpu")}
    pth = tmp_path / "model.pth"
    torch.save(model.state_dict(), pth)
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": 4}))  # the head count, which no shape shows
    for split in ("train", "val"):
        assert main(["eval", "--recipe", "book", "--model", str(pth), "--data", str(text), "--split", split,
                     "--context-length", "32", "--threads", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["loss"] == expected[split]  # the same sums, in the same order
    assert main(["eval", "--model", str(pth), "--data", str(text), "--context-length", "32", "--batch-size", "2",
                 "--eval-batches", "2", "--cache-dir", str(tmp_path / "c"), "--threads", "1"]) == 0
    assert "--recipe book scores those" in capsys.readouterr().err  # plain eval says why its number differs


def small_book_task(text: str, **kw) -> BookTask:
    tok = glassgpt.get_tokenizer("gpt2")
    train, val = split_text(text, 0.1)
    return BookTask(windows(tok, train, 32, 32, "training"), windows(tok, val, 32, 32, "validation"), 2, 5, tok, **kw)


class InterruptAt:
    """A task that sends this process SIGINT while building the batch of step `step`."""

    def __init__(self, task, step):
        self.task, self.step = task, step

    def train_batch(self, step, micro, rank, world):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGINT)
        return self.task.train_batch(step, micro, rank, world)

    def __getattr__(self, name):
        return getattr(self.task, name)


def test_a_book_run_stopped_in_the_middle_of_an_epoch_resumes_exactly(text, tmp_path):
    """The checkpoint holds torch's RNG state and the epoch's order, so the resumed run draws
    the same dropout masks and batches as the run that never stopped."""
    content = text.read_text(encoding="utf-8")
    steps = 2 * small_book_task(content, sample_tokens=8).steps_per_epoch  # two epochs
    cfg = lambda out: TrainConfig(out=str(tmp_path / out), recipe="book", max_steps=steps, lr=4e-4, batch_size=2,  # noqa: E731
                                  eval_every=5, eval_batches=5, warmup_steps=0, grad_clip=0.0, beta2=0.999,
                                  sample_tokens=8, plot=False)

    def start(seed=123):
        torch.manual_seed(seed)
        return GPTModel(GPTConfig(**SMALL, tie_embeddings=False)), small_book_task(content, sample_tokens=8)

    model, task = start()
    fit(model, task, cfg("straight"), task.tokenizer)
    model, task = start()
    stop = task.steps_per_epoch + task.steps_per_epoch // 2  # in the middle of the second epoch
    first = fit(model, InterruptAt(task, step=stop), cfg("stopped"), task.tokenizer)
    assert first["interrupted"] and first["step"] == stop + 1
    model, task = start(seed=7)  # other weights and another RNG state: all must come from the checkpoint
    fit(model, task, cfg("stopped"), task.tokenizer, resume=True)
    assert _but_time(tmp_path / "stopped") == _but_time(tmp_path / "straight")  # every record, step for step
    straight = glassgpt.load_model(tmp_path / "straight" / "latest").state_dict()
    resumed = glassgpt.load_model(tmp_path / "stopped" / "latest").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _but_time(run) -> list[dict]:
    """A run's metrics without the clock's fields: losses, evaluations, samples and snapshots."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in read_metrics(run)]


def test_the_untrained_book_preset_says_hello_as_the_book_does():
    """The book's chapter 4 ids (its own tests assert them) from the gpt2-book preset at seed 123."""
    ids = [15496, 11, 314, 716]  # "Hello, I am"
    model = glassgpt.load_model("gpt2-book", seed=123)
    out = glassgpt.generate(model, ids, 10)[0].tolist()
    assert out == ids + [27018, 24086, 47843, 30961, 42348, 7267, 49706, 43231, 47062, 34657]
    torch.manual_seed(123)
    book = BookGPTModel({**SMALL, "emb_dim": 768, "n_heads": 12, "n_layers": 12, "context_length": 1024}).eval()
    assert generate_text_simple(book, torch.tensor([ids]), 10, 1024)[0].tolist() == out


# --- bad input --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--warmup-steps", "100"], "--recipe book sets --warmup-steps itself (0, as chapter 5 trains"),
    (["--grad-clip", "1"], "--recipe book sets --grad-clip itself"),
    (["--epochs", "2", "--max-steps", "5"], "give --epochs or --max-steps, not both"),
])
def test_flags_the_recipe_overrides_are_refused_by_name(text, tmp_path, capsys, flags, message):
    assert main(["train", "--recipe", "book", "--data", str(text), "--out", str(tmp_path / "r"), *FLAGS, *flags]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "r" / "train_config.json").exists()


def test_a_text_too_short_for_one_window_says_how_many_tokens_it_has(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Every effort moves you. " * 12)
    val_tokens = len(glassgpt.get_tokenizer("gpt2").encode(split_text(short.read_text(), 0.1)[1]))
    assert main(["train", "--recipe", "book", "--data", str(short), "--out", str(tmp_path / "r"), *FLAGS]) == 2
    line = one_line_error(capsys)
    assert f"the validation text is {val_tokens} tokens, but one window needs context_length + 1 = 33" in line


def test_init_from_a_state_dict_says_it_cannot_record_dropout(text, tmp_path, capsys):
    torch.manual_seed(0)
    pth = tmp_path / "model.pth"
    torch.save(BookGPTModel(SMALL).state_dict(), pth)
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": 4}))
    assert main(["train", "--data", str(text), "--out", str(tmp_path / "r"), "--init", str(pth), "--max-steps", "1",
                 "--context-length", "32", "--batch-size", "2", "--eval-batches", "1", "--no-progress", "--no-plot",
                 "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "is a state dict, which cannot record dropout: training assumes drop_rate 0.1" in err
    assert glassgpt.load_model(tmp_path / "r").cfg.drop_rate == 0.1


def test_a_recipe_that_brings_its_own_loop_runs_it_under_the_command_line(book_run, text, tmp_path):
    """The registry's seam for appendix D: a recipe registered with `loop` is a --recipe of train, and
    fit runs its loop (here chapter 5's own, counted) with the run's machinery around it."""
    import dataclasses as dc
    from glassgpt.training import recipes
    from glassgpt.training.loop import loop as training_loop
    calls = []

    def counted(run):
        calls.append(run.cfg.max_steps)
        training_loop.train(run)

    own = dc.replace(recipes.recipe("train", "book"), name="book-own-loop", loop=counted)
    recipes.register(own)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["train", "--recipe", own.name, "--data", str(text), "--out", str(tmp_path / "run"),
                         "--epochs", "2", *FLAGS]) == 0
    finally:
        del recipes.REGISTRY[("train", own.name)]
    assert calls == [verify_step(tmp_path / "run")]
    assert [line for line in printed.getvalue().splitlines() if line.startswith("Ep ")] == \
        [line for line in book_run[0] if line.startswith("Ep ")]
