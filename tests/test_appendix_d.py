"""training/appendix_d.py against the book's appendix D code (llms_from_scratch.appendix_d), side by side.

Chapter 5's small GPT_CONFIG 64 wide (2 blocks, context 32, dropout 0.1; at 64 the gradient's norm
is above 1, so clipping acts) on the first 4,000 characters of the-verdict, with the notebook's
section D.4 settings (AdamW at peak 0.001, a warm-up over 20% of the steps from 1e-5, a cosine to
1e-5, eval_freq 5 on 1 batch) for 2 epochs of 14 steps: the lines `train_model` prints, the four
lists it returns and the weights it ends with, bit for bit, with clipping from the end of the
warm-up and (slow) as the printed book clipped it; then the same under `glassgpt train --recipe
book-appendix-d`, and the flags it refuses.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math

import pytest
import tiktoken
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.training.book.appendix_d import in_book_order, run_appendix_d, train_model

from glassgpt.training import read_metrics
from helpers import CH05_FLAGS as FLAGS, CH05_SMALL as SMALL, CH05_TEXT as TEXT, book_loaders, one_line_error

from llms_from_scratch import appendix_d  # noqa: E402
from llms_from_scratch.ch04 import GPTModel as BookGPTModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")
EPOCHS = 2
VERDICT = TEXT[0][:4000]
CONFIG = {**SMALL, "emb_dim": 64}


@functools.lru_cache(maxsize=None)
def book_run(orig_book_version: bool) -> tuple[list[str], tuple, dict]:
    """Section D.4 as the notebook runs it: loaders, seed, model, AdamW, train_model (printing)."""
    torch.set_num_threads(1)
    train_loader, val_loader = book_loaders(VERDICT)
    torch.manual_seed(123)
    model = BookGPTModel(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001, weight_decay=0.1)
    warmup_steps = int(0.2 * len(train_loader) * EPOCHS)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = appendix_d.train_model(
            model, train_loader, val_loader, optimizer, "cpu", n_epochs=EPOCHS, eval_freq=5, eval_iter=1,
            start_context="Every effort moves you", tokenizer=tiktoken.get_encoding("gpt2"),
            warmup_steps=warmup_steps, initial_lr=1e-5, min_lr=1e-5, orig_book_version=orig_book_version)
    return printed.getvalue().splitlines(), results, model.state_dict()


@pytest.mark.parametrize("orig_book_version", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_train_model_prints_the_books_lines_returns_its_lists_and_ends_with_its_weights(orig_book_version,
                                                                                     monkeypatch):
    book_lines, book_results, book_state = book_run(orig_book_version)
    lines, norms = [], []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(float(clip(*a, **k))))
    model, results = run_appendix_d(GPTConfig(**CONFIG, tie_embeddings=False), VERDICT, glassgpt.get_tokenizer("gpt2"),
                                    context_length=32, n_epochs=EPOCHS, orig_book_version=orig_book_version,
                                    log=lines.append)
    steps = len(results[3])  # one learning rate per step
    assert steps == len(book_results[3]) >= 10 and len(norms) == steps - int(0.2 * steps) - orig_book_version and max(norms) > 1.0
    assert book_lines[0].startswith("Ep 1 (Iter 000000): Train loss ") and len(book_lines) == -(-steps // 5) + EPOCHS  # every 5th step, then a sample per epoch
    assert lines == book_lines  # every evaluation line and both samples, character for character
    assert results == book_results  # train and val losses, tokens seen, the learning rate of every step
    different = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, book_state[name])]
    assert different == []


def test_parameters_in_the_books_order_are_the_book_models_order():
    """clip_grad_norm_ sums the per-tensor norms in parameter order: the book's, for its total norm."""
    torch.manual_seed(0)
    ours = glassgpt.load_model(config=GPTConfig(**SMALL, tie_embeddings=False))
    names = {id(p): name for name, p in ours.named_parameters()}
    assert [names[id(p)] for p in in_book_order(ours)] == [name for name, _ in BookGPTModel(SMALL).named_parameters()]
    assert [names[id(p)] for p in ours.parameters()] != [names[id(p)] for p in in_book_order(ours)]


def test_a_warm_up_of_zero_steps_and_an_unknown_setting_are_refused_in_one_line():
    model = BookGPTModel(SMALL)
    with pytest.raises(ConfigError, match="divides by warmup_steps, got 0: give 1 or more"):
        train_model(model, None, torch.optim.AdamW(model.parameters()), 1, 5, warmup_steps=0)
    with pytest.raises(ConfigError, match="appendix D has no setting 'lr'"):
        run_appendix_d(GPTConfig(**SMALL), VERDICT, glassgpt.get_tokenizer("gpt2"), context_length=32, lr=0.1)


# --- glassgpt train --recipe book-appendix-d ------------------------------------------------------------

CLI_FLAGS = [*FLAGS, "--emb-dim", "64"]  # (the last --emb-dim wins: CONFIG's)


@pytest.fixture
def verdict(tmp_path) -> str:
    path = tmp_path / "verdict-4000.txt"
    path.write_text(VERDICT, encoding="utf-8")
    return str(path)


def test_train_recipe_book_appendix_d_prints_train_models_lines_and_ends_with_its_weights(verdict, tmp_path):
    """The recipe's defaults are section D.4's (peak 0.001, 20% warm-up from 1e-5, cosine to 1e-5,
    eval_freq 5 on 1 batch, seed 123), so two epochs need only --epochs 2."""
    book_lines, book_results, book_state = book_run(False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--recipe", "book-appendix-d", "--data", verdict, "--out", str(tmp_path / "run"),
                     "--epochs", str(EPOCHS), *CLI_FLAGS]) == 0
    ours = [line for line in printed.getvalue().splitlines() if line.startswith(("Ep ", "Every effort moves you"))]
    assert ours == book_lines  # every evaluation line and both samples, character for character
    model = glassgpt.load_model(tmp_path / "run" / "latest")
    different = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, book_state[name])]
    assert different == []
    evals = read_metrics(tmp_path / "run")
    assert [r["val_loss"] for r in evals] == book_results[1] and [r["tokens"] for r in evals] == book_results[2]
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    warmup = int(0.2 * len(book_results[3]))  # section D.4: 20% of the steps
    assert (saved["warmup_steps"], saved["lr"], saved["min_lr"], saved["grad_clip"]) == (warmup, 0.001, 1e-5, 1.0)
    files = lambda: {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir() if p.name != ".lock"}  # noqa: E731
    before = files()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # train_model has no place to resume: refused by name, the run as it was
        assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "--recipe book-appendix-d does not take --resume" in err.getvalue()
    assert files() == before


def test_the_recipe_reports_every_step_to_the_progress_display(verdict, tmp_path):
    """train_model prints only its evaluation lines; the run's progress (a bar on a terminal, a plain line
    every tenth of the run elsewhere) follows each of its optimizer steps, up to the last."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["train", "--recipe", "book-appendix-d", "--data", verdict, "--out", str(tmp_path / "run"),
                     "--epochs", "1", *[f for f in CLI_FLAGS if f != "--no-progress"]]) == 0
    steps = json.loads((tmp_path / "run" / "train_config.json").read_text())["max_steps"]
    progress = [line for line in err.getvalue().splitlines() if line.startswith("train: step ")]
    assert steps > 1 and progress and progress[-1].startswith(f"train: step {steps:,}/{steps:,} ")


@pytest.mark.parametrize("flags, message", [
    (["--grad-clip", "0.5"], "--recipe book-appendix-d sets --grad-clip itself (1.0, as appendix D trains"),
    (["--grad-accum", "2"], "--recipe book-appendix-d sets --grad-accum itself (1, as appendix D trains"),
    (["--max-steps", "3"], "--recipe book-appendix-d does not take --max-steps"),
    (["--save-every", "3"], "--recipe book-appendix-d does not take --save-every"),
    (["--epochs", "1.5"], "train_model runs whole epochs of {epoch} steps, and {steps} steps are not"),
])
def test_flags_appendix_d_fixes_or_has_no_place_for_are_refused_by_name(verdict, tmp_path, capsys, flags, message):
    epoch = len(book_run(False)[1][3]) // EPOCHS  # steps in one epoch of the text (shared or its stand-in)
    message = message.format(epoch=epoch, steps=math.ceil(1.5 * epoch))
    run = tmp_path / "r"
    assert main(["train", "--recipe", "book-appendix-d", "--data", verdict, "--out", str(run), *CLI_FLAGS,
                 *flags]) == 2
    assert message in one_line_error(capsys)
    assert not run.exists() or sorted(p.name for p in run.iterdir()) == []  # left as it was found, lock included
