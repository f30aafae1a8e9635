"""`glassgpt finetune instruct --recipe book` against the book's own chapter-7 code (llms_from_scratch.ch07).

A small random model in the book's layout (2 blocks 32 wide, context 96, drop_rate 0.0) and 20 made-up
Alpaca records: the notebook's split, InstructionDataset, custom_collate_fn, seeds, AdamW and
`train_model_simple` (with `format_input(val_data[0])` as its start context) for 2 epochs, side by
side with glassgpt's recipe. The lines (evaluations and samples) are equal character for character,
the weights bit for bit (torch.equal), and instruction-data-with-response.json holds the test
set's responses exactly as the notebook writes them.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path

import pytest
import tiktoken
import torch

import glassgpt
from glassgpt.cli import main

ch07 = pytest.importorskip("llms_from_scratch.ch07", reason="the README's test command installs llms-from-scratch")
from llms_from_scratch.ch04 import GPTModel as BookGPTModel  # noqa: E402
from llms_from_scratch.ch05 import generate, text_to_token_ids, token_ids_to_text, train_model_simple  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")

SMALL = dict(vocab_size=50257, context_length=96, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0, qkv_bias=False)
VERBS = ["Rewrite", "Translate", "Summarize", "Classify", "Name", "Explain"]
EPOCHS, EVAL_FREQ = 2, 3


def records(n: int = 20) -> list[dict[str, str]]:
    return [{"instruction": f"{VERBS[i % len(VERBS)]} the sentence number {i}.",
             "input": "" if i % 3 == 0 else f"The cat sat on mat {i} and looked " + "very " * (i % 4) + "happy.",
             "output": f"Answer {i}: " + "ok " * (1 + i % 7)} for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ch07")
    torch.manual_seed(11)
    torch.save(BookGPTModel(SMALL).state_dict(), root / "model.pth")
    (root / "model.json").write_text(json.dumps({"n_heads": 4}))
    (root / "instruction-data.json").write_text(json.dumps(records(), indent=4))
    return {"root": root, "model": root / "model.pth", "data": root / "instruction-data.json"}


@pytest.fixture(scope="module")
def book_run(files):
    """The notebook, cell by cell: split, datasets, loaders, model, seed, AdamW, training, test responses."""
    torch.set_num_threads(1)
    data = json.loads(files["data"].read_text())
    train_portion, test_portion = int(len(data) * 0.85), int(len(data) * 0.1)
    train_data, test_data = data[:train_portion], data[train_portion:train_portion + test_portion]
    val_data = data[train_portion + test_portion:]
    tokenizer = tiktoken.get_encoding("gpt2")
    collate = functools.partial(ch07.custom_collate_fn, device="cpu", allowed_max_length=1024)
    torch.manual_seed(123)
    loader = lambda part, train: torch.utils.data.DataLoader(ch07.InstructionDataset(part, tokenizer), batch_size=8,
                                                             collate_fn=collate, shuffle=train, drop_last=train,
                                                             num_workers=0)
    train_loader, val_loader = loader(train_data, True), loader(val_data, False)
    model = BookGPTModel(SMALL)
    model.load_state_dict(torch.load(files["model"], weights_only=True))
    model.eval()
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.00005, weight_decay=0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_model_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=EPOCHS, eval_freq=EVAL_FREQ,
                           eval_iter=5, start_context=ch07.format_input(val_data[0]), tokenizer=tokenizer)
    for entry in test_data:
        input_text = ch07.format_input(entry)
        token_ids = generate(model=model, idx=text_to_token_ids(input_text, tokenizer), max_new_tokens=256,
                             context_size=SMALL["context_length"], eos_id=50256)
        generated_text = token_ids_to_text(token_ids, tokenizer)
        entry["model_response"] = generated_text[len(input_text):].replace("### Response:", "").strip()
    written = files["root"] / "book-responses.json"
    with open(written, "w") as file:
        json.dump(test_data, file, indent=4)
    return printed.getvalue().splitlines(), model, written


@pytest.fixture(scope="module")
def glass_run(files, tmp_path_factory):
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("glass") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["finetune", "instruct", "--recipe", "book", "--model", str(files["model"]), "--data",
                     str(files["data"]), "--out", str(run), "--threads", "1", "--no-progress",
                     "--eval-every", str(EVAL_FREQ)]) == 0
    return printed.getvalue().splitlines(), run


def test_the_lines_are_train_model_simples_character_for_character(book_run, glass_run):
    book_lines = book_run[0]
    start = "Below is an instruction"
    assert book_lines[0].startswith("Ep 1 (Step 000000): Train loss ") and sum(l.startswith(start) for l in book_lines) == 2
    assert [line for line in glass_run[0] if line.startswith(("Ep ", start))] == book_lines


def test_the_weights_after_two_epochs_equal_the_books_bit_for_bit(book_run, glass_run):
    book_state = book_run[1].state_dict()
    ours = glassgpt.load_model(glass_run[1] / "latest").state_dict()
    different = [name for name, tensor in ours.items() if not torch.equal(tensor, book_state[name])]
    assert sorted(ours) and different == []


def test_the_test_sets_responses_are_written_as_the_book_writes_them(book_run, glass_run):
    ours = (glass_run[1] / "instruction-data-with-response.json").read_text()
    assert json.loads(ours)[0]["model_response"] is not None and ours == book_run[2].read_text()


def test_chat_recipe_book_answers_as_the_notebook(book_run, glass_run, files, capsys):
    entry = json.loads(book_run[2].read_text())[0]
    assert main(["chat", entry["instruction"], "--input", entry["input"], "--model", str(glass_run[1] / "latest"),
                 "--recipe", "book"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == entry["model_response"]


def test_a_record_missing_its_output_is_named_and_no_run_is_left(files, tmp_path, capsys):
    data = records()
    del data[7]["output"]
    bad = tmp_path / "instruction-data.json"
    bad.write_text(json.dumps(data))
    run = tmp_path / "run"
    assert main(["finetune", "instruct", "--recipe", "book", "--model", str(files["model"]), "--data", str(bad),
                 "--out", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "instruction-data.json record 8 of 20 has no 'output'" in errors[0] and not run.exists()


def test_a_flag_the_recipe_fixes_is_refused_by_name(files, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["finetune", "instruct", "--recipe", "book", "--model", str(files["model"]), "--data",
                 str(files["data"]), "--out", str(run), "--val-fraction", "0.2"]) == 2
    assert "--recipe book does not take --val-fraction" in capsys.readouterr().err and not run.exists()


def test_responses_n_answers_the_first_n_test_records_as_the_book_does(book_run, files, tmp_path):
    run = tmp_path / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["finetune", "instruct", "--recipe", "book", "--model", str(files["model"]), "--data",
                     str(files["data"]), "--out", str(run), "--threads", "1", "--no-progress",
                     "--eval-every", str(EVAL_FREQ), "--responses", "1"]) == 0
    first = json.loads(book_run[2].read_text())[:1]
    assert (run / "instruction-data-with-response.json").read_text() == json.dumps(first, indent=4)


def test_the_responses_report_progress_and_never_write_through_a_link(book_run, glass_run, tmp_path):
    from glassgpt.errors import TrainError
    from glassgpt.training.book import ch07 as book_ch07
    model, tok = glassgpt.load_model(glass_run[1] / "latest"), glassgpt.get_tokenizer("gpt2")
    test = json.loads(book_run[2].read_text())
    steps = []
    path = book_ch07.write_responses(model, tok, test, tmp_path / "answers.json",
                                     progress=lambda step, done, total: steps.append((done, total)))
    assert steps == [(k, len(test)) for k in range(1, len(test) + 1)]
    assert path.read_text() == book_run[2].read_text()
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    link = tmp_path / "run-responses.json"
    link.symlink_to(outside)
    with pytest.raises(TrainError, match="is a symbolic link"):
        book_ch07.write_responses(model, tok, test, link)
    assert outside.read_text() == "keep" and link.is_symlink()


def test_the_responses_run_in_eval_mode_and_the_model_keeps_its_mode(book_run, glass_run, tmp_path, monkeypatch):
    """A model left in training mode (as fit leaves it) answers in eval mode: no dropout, and the engine
    (which tunes and runs glassgpt's kernels for eval-mode models only) decodes with the KV cache."""
    from glassgpt.training.book import ch07 as book_ch07
    model, tok = glassgpt.load_model(glass_run[1] / "latest"), glassgpt.get_tokenizer("gpt2")
    test = json.loads(book_run[2].read_text())
    modes = []
    real = book_ch07.generate
    monkeypatch.setattr(book_ch07, "generate", lambda m, *a, **k: (modes.append(m.training), real(m, *a, **k))[1])
    model.train()
    path = book_ch07.write_responses(model, tok, test, tmp_path / "answers.json", exact=False)
    assert modes == [False] * len(test) and model.training
    assert path.read_text() == book_run[2].read_text()
