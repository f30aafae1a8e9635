"""A model is opened once (`formats.open` -> Source), and nothing is guessed silently.

A state dict of the book's GPTModel with 4 heads of 16 (emb_dim 64) is what GPT-2's rule (64 per head)
gets wrong: every command that reads it says, in one note, the head count it assumed; with `--n-heads 4`
it says nothing and gives the book's own numbers. A run directory opens as best/, a `--recipe book`
run as its final model (latest/), and the first line a command prints says which.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt import formats
from glassgpt.cli import main
from glassgpt.errors import ConfigError

from conftest import shared_data

ch04 = pytest.importorskip("llms_from_scratch.ch04", reason="the README's test command installs llms-from-scratch")
from llms_from_scratch import ch02, ch05, ch06  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")

BOOK4 = dict(vocab_size=50257, context_length=32, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0, qkv_bias=False)
RULE = ("note: n_heads 1 by GPT-2's rule, 64 per head (a state dict's shapes cannot tell the head count; pass "
        "--n-heads if the model was built with another)")
PROMPT = "Every effort moves you"


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rule_notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: n_heads")]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """The book's GPTModel with 4 heads, saved as a bare state dict (nothing beside it), and a classifier of it."""
    root = tmp_path_factory.mktemp("book4")
    torch.manual_seed(4)
    model = ch04.GPTModel(BOOK4).eval()
    torch.save(model.state_dict(), root / "model.pth")
    torch.manual_seed(5)
    classifier = ch04.GPTModel(BOOK4)
    classifier.out_head = torch.nn.Linear(BOOK4["emb_dim"], 2)
    classifier.eval()
    (root / "clf").mkdir()
    torch.save(classifier.state_dict(), root / "clf" / "classifier.pth")
    return {"root": root, "pth": root / "model.pth", "model": model, "clf_pth": root / "clf" / "classifier.pth",
            "clf": classifier}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "verdict.txt"
    path.write_text(shared_data("the-verdict.txt").read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return path


# --- opened once ----------------------------------------------------------------------------------

def test_explain_on_a_pth_resolves_its_spec_once(book, monkeypatch, capsys):
    from glassgpt.formats import book as book_format, source
    counts = {"kind": 0, "is_state_dict_file": 0, "read_state_dict": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(source, "resolve_kind", counted("kind", source.resolve_kind))
    monkeypatch.setattr(book_format, "is_state_dict_file", counted("is_state_dict_file", book_format.is_state_dict_file))
    monkeypatch.setattr(book_format, "read_state_dict", counted("read_state_dict", book_format.read_state_dict))
    code, out, err = run(["explain", PROMPT, "--model", book["pth"], "--n-heads", 4, "--threads", 1,
                          "--color", "never"], capsys)
    assert code == 0 and "glassgpt explain" in out
    assert counts == {"kind": 1, "is_state_dict_file": 1, "read_state_dict": 1}


def test_a_source_knows_its_kind_config_and_what_it_assumed(book):
    source = formats.open(book["pth"])
    assert source.kind == "state_dict" and source.path == book["pth"] and source.checkpoint is None
    assert source.config.n_heads == 1 and source.assumed("n_heads") and source.assumed("drop_rate")
    heads = source.notes()[0]
    assert (heads.field, heads.value, heads.assumed) == ("n_heads", 1, True) and "GPT-2's rule" in heads.reason
    told = formats.open(book["pth"], n_heads=4, drop_rate=0.1)
    assert told.config.n_heads == 4 and told.config.drop_rate == 0.1
    assert not any(n.assumed for n in told.notes())
    assert told.about().notes == tuple(str(n) for n in told.notes())
    model = told.load("cpu", "float32")
    assert model.cfg == told.config and formats.open(told) is told
    assert formats.open("gpt2").notes() == [] and formats.open("gpt2").init == "gpt2"


def test_int8_is_loaded_in_bfloat16_and_quantized_by_the_source(book):
    from glassgpt.engine import autotune
    model = formats.open(book["pth"], n_heads=4).load("cpu", "int8")
    assert autotune.precision_of(model) == "int8"


# --- no silent guesses: the same note in every command, none with --n-heads -----------------------

def book_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ch04.generate_text_simple(model, torch.tensor([ids]), n, BOOK4["context_length"])
    return out[0, len(ids):].tolist()


def test_generate_says_the_head_count_it_assumed_and_with_the_flag_gives_the_books_tokens(book, capsys):
    code, out, err = run(["generate", PROMPT, "--model", book["pth"], "--max-new-tokens", 6, "--json",
                          "--threads", 1], capsys)
    assert code == 0 and rule_notes(err) == [RULE]
    code, out, err = run(["generate", PROMPT, "--model", book["pth"], "--n-heads", 4, "--max-new-tokens", 6, "--json",
                          "--threads", 1], capsys)
    answer = json.loads(out)
    assert code == 0 and "note:" not in err
    assert answer["new_ids"] == book_greedy(book["model"], answer["prompt_ids"], 6)


def test_explain_says_it_and_with_the_flag_gives_the_books_probability(book, capsys):
    code, out, err = run(["explain", PROMPT, "--model", book["pth"], "--format", "json", "--threads", 1], capsys)
    assert code == 0 and rule_notes(err) == [RULE] and RULE.removeprefix("note: ") in json.loads(out)["model"]["notes"]
    code, out, err = run(["explain", PROMPT, "--model", book["pth"], "--n-heads", 4, "--format", "json",
                          "--threads", 1], capsys)
    assert code == 0 and "note: n_heads" not in err
    trace = json.loads(out)
    with torch.no_grad():
        probs = book["model"](torch.tensor([[t["id"] for t in trace["tokens"]]]))[0, -1].softmax(-1)
    assert trace["next_token"]["id"] == int(probs.argmax())
    assert trace["next_token"]["prob"] == pytest.approx(float(probs.max()), abs=1e-6)


def test_eval_says_it_and_with_the_flag_gives_calc_loss_loaders_loss(book, text, capsys):
    raw = text.read_text(encoding="utf-8")
    split = int(0.9 * len(raw))
    loader = ch02.create_dataloader_v1(raw[split:], batch_size=2, max_length=32, stride=32, drop_last=False,
                                       shuffle=False, num_workers=0)
    torch.manual_seed(123)
    with torch.no_grad():
        expected = ch05.calc_loss_loader(loader, book["model"], "cpu")
    base = ["eval", "--recipe", "book", "--model", book["pth"], "--data", text, "--context-length", 32, "--threads", 1,
            "--json"]
    code, out, err = run(base, capsys)
    assert code == 0 and rule_notes(err) == [RULE] and json.loads(out)["loss"] != expected
    code, out, err = run(base + ["--n-heads", 4], capsys)
    assert code == 0 and "note:" not in err and json.loads(out)["loss"] == expected


def test_classify_says_it_and_with_the_flag_gives_classify_reviews_answer(book, capsys):
    text = "You won a free cruise! Call now"
    tokenizer = glassgpt.get_tokenizer("gpt2")
    expected = ch06.classify_review(text, book["clf"], tokenizer, "cpu", max_length=16)
    with torch.no_grad():
        ids = tokenizer.encode(text)
        probs = book["clf"](torch.tensor([ids + [50256] * (16 - len(ids))]))[0, -1].softmax(-1)
    base = ["classify", text, "--model", book["clf_pth"], "--recipe", "book", "--max-length", 16, "--json",
            "--threads", 1]
    code, out, err = run(base, capsys)
    assert code == 0 and rule_notes(err) == [RULE]
    code, out, err = run(base + ["--n-heads", 4], capsys)
    assert code == 0 and rule_notes(err) == []
    assert json.loads(out) == {"label": expected, "prob": pytest.approx(float(probs.max()), abs=1e-6)}


def test_train_says_it_and_trains_the_model_with_the_flags_heads(book, text, tmp_path, capsys):
    base = ["train", "--init", book["pth"], "--data", text, "--max-steps", 1, "--eval-every", 1, "--batch-size", 2,
            "--eval-batches", 1, "--context-length", 16, "--threads", 1, "--no-progress", "--sample-tokens", 0]
    code, out, err = run(base + ["--out", tmp_path / "guessed"], capsys)
    assert code == 0 and rule_notes(err) == [RULE]
    code, out, err = run(base + ["--out", tmp_path / "told", "--n-heads", 4], capsys)
    assert code == 0 and rule_notes(err) == []
    assert formats.open(tmp_path / "told").config.n_heads == 4
    assert formats.open(tmp_path / "guessed").config.n_heads == 1


def test_export_says_it_and_writes_the_heads_it_was_told(book, tmp_path, capsys):
    code, out, err = run(["export", book["pth"], "--format", "pth", "--out", tmp_path / "a.pth"], capsys)
    assert code == 0 and rule_notes(err) == [RULE]
    code, out, err = run(["export", book["pth"], "--format", "pth", "--out", tmp_path / "b.pth", "--n-heads", 4,
                          "--drop-rate", "0.1"], capsys)
    assert code == 0 and "note:" not in err
    assert json.loads((tmp_path / "b.json").read_text()) == dict(BOOK4, drop_rate=0.1)


def test_diff_says_it_of_each_model_and_takes_the_flag_for_both(book, capsys):
    base = ["diff", book["pth"], book["pth"], "--threads", 1, "--format", "json"]
    code, out, err = run(base, capsys)
    assert code == 0 and rule_notes(err) == [RULE, RULE]  # A and B: each opened once, each says it
    code, out, err = run(base + ["--n-heads", 4], capsys)
    assert code == 0 and rule_notes(err) == [] and json.loads(out)["next_token"]["kl_ab"] == 0


# --- bad input: one line naming both values -------------------------------------------------------

def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", [["generate", "hi"], ["explain", "hi"], ["info"]])
def test_n_heads_that_does_not_divide_the_width_is_one_line_naming_both(book, command, capsys):
    code, _, err = run([*command, "--model", book["pth"], "--n-heads", 3], capsys)
    assert code == 2 and "--n-heads 3" in one_line(err) and "emb_dim 64" in err


def test_n_heads_that_disagrees_with_the_json_beside_the_file_is_one_line_naming_both(book, tmp_path, capsys):
    pth = tmp_path / "model.pth"
    shutil.copy(book["pth"], pth)
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": 2}))
    code, _, err = run(["generate", "hi", "--model", pth, "--n-heads", 4], capsys)
    line = one_line(err)
    assert code == 2 and "--n-heads 4" in line and "n_heads 2" in line and "model.json" in line
    with pytest.raises(ConfigError, match="n_heads 2"):
        formats.open(pth, n_heads=4).config


def test_n_heads_for_a_file_that_records_its_own_is_one_line(capsys):
    code, _, err = run(["info", "--model", "gpt2", "--n-heads", 4], capsys)
    assert code == 2 and "--n-heads" in one_line(err)


# --- run directories: which checkpoint, said first ------------------------------------------------

@pytest.fixture(scope="module")
def book_run(text, tmp_path_factory):
    """A tiny `train --recipe book` run: latest/ at its last step, best/ at an earlier one."""
    out = tmp_path_factory.mktemp("runs") / "book"
    assert main(["train", "--recipe", "book", "--data", str(text), "--out", str(out), "--epochs", "3",
                 "--model", "gpt2-book", "--n-layers", "1", "--emb-dim", "32", "--n-heads", "2",
                 "--context-length", "16", "--threads", "1", "--no-progress", "--lr", "0.01"]) == 0
    return out


@pytest.fixture(scope="module")
def glass_run(text, tmp_path_factory):
    """A tiny run of glassgpt's recipe, saved at every step: best/ and latest/."""
    out = tmp_path_factory.mktemp("runs") / "glass"
    assert main(["train", "--data", str(text), "--out", str(out), "--model", "gpt2", "--n-layers", "1",
                 "--emb-dim", "32", "--n-heads", "2", "--context-length", "16", "--max-steps", "6", "--eval-every",
                 "2", "--eval-batches", "1", "--batch-size", "2", "--save-every", "1", "--sample-tokens", "0",
                 "--threads", "1", "--no-progress", "--lr", "0.03"]) == 0
    return out


def step_of(ckpt: Path) -> int:
    return json.loads((ckpt / "train_state.json").read_text())["step"]


def test_a_book_run_exports_its_final_model_and_says_so_first(book_run, tmp_path, capsys):
    final = step_of(book_run / "latest")
    assert (book_run / "best").is_dir() and step_of(book_run / "best") < final  # the two differ
    code, _, err = run(["export", book_run, "--format", "pth", "--out", tmp_path / "run.pth"], capsys)
    first = err.splitlines()[0]
    assert code == 0 and first.startswith(f"note: {book_run} opens as latest/, the final step {final}, validation loss ")
    assert "--recipe book" in first
    code, _, _ = run(["export", book_run / "latest", "--format", "pth", "--out", tmp_path / "latest.pth"], capsys)
    whole = torch.load(tmp_path / "run.pth", weights_only=True)
    latest = torch.load(tmp_path / "latest.pth", weights_only=True)
    assert code == 0 and whole.keys() == latest.keys() and all(torch.equal(whole[k], latest[k]) for k in whole)
    meta = json.loads((book_run / "latest" / "meta.json").read_text())["train"]
    assert f"validation loss {meta['val_loss']:.4f}" in first


def test_a_glassgpt_run_opens_as_best_and_says_so_first(glass_run, capsys):
    best = step_of(glass_run / "best")
    source = formats.open(glass_run)
    assert source.checkpoint.name == "best" and source.dir == glass_run / "best"
    code, _, err = run(["generate", "hi", "--model", glass_run, "--max-new-tokens", 1, "--threads", 1], capsys)
    assert code == 0 and err.splitlines()[0].startswith(f"note: {glass_run} opens as best/, step {best}, validation loss ")


@pytest.mark.parametrize("left", ["latest", "best"])
def test_a_run_with_one_checkpoint_opens_it_and_says_which(book_run, tmp_path, left, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(book_run, run_dir)
    shutil.rmtree(run_dir / ("best" if left == "latest" else "latest"))
    code, _, err = run(["generate", "hi", "--model", run_dir, "--max-new-tokens", 1, "--threads", 1], capsys)
    first = err.splitlines()[0]
    assert code == 0 and first.startswith(f"note: {run_dir} opens as {left}/, ")
    assert f"step {step_of(run_dir / left)}" in first
    if left == "best":
        assert first.endswith("(it has no latest/)")
    assert formats.open(run_dir).dir == run_dir / left
