"""`glassgpt finetune classify --recipe book` against the book's own chapter-6 code (llms_from_scratch.ch06).

A small random model in the book's layout (2 blocks 64 wide with 4 heads, context 64, BASE_CONFIG's drop_rate 0.0,
saved as a bare state dict, so the head count comes from `--n-heads 4`)
and made-up CSVs in the book's layout (Label, Text): the notebook's seeds, head, freezing, AdamW and
`train_classifier_simple` for 2 epochs, side by side with glassgpt's recipe. The lines it prints
(evaluations, the accuracies after each epoch and the three at the end) are equal character for
character and the weights bit for bit (torch.equal); `classify --recipe book` gives `classify_review`'s
label on the book's own review_classifier.pth.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest
import tiktoken
import torch

import glassgpt
from glassgpt.cli import main

ch06 = pytest.importorskip("llms_from_scratch.ch06", reason="the README's test command installs llms-from-scratch")
from llms_from_scratch.ch04 import GPTModel as BookGPTModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")

# 4 heads of 16: GPT-2's rule (64 per head) would say 1, so the run is told with --n-heads 4 (no JSON beside it).
SMALL = dict(vocab_size=50257, context_length=64, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0, qkv_bias=False)
HAM = ["are we still on for lunch?", "see you at 6 then", "ok, call me when you get home tonight",
       "can you pick up some milk on the way back", "I'll be late, the bus broke down again", "thanks for yesterday!",
       "what time is the game", "happy birthday, have a lovely day"]
SPAM = ["You won a free cruise! Call now", "URGENT: your account is locked, reply with your PIN to unlock it",
        "Claim your 1000 prize today, text WIN to 80085", "Free entry in a weekly draw, txt FREE to 12345",
        "Congratulations! You have been selected for a cash award", "Cheap loans approved in minutes, call 0800 now"]
EPOCHS, EVAL_FREQ = 2, 3


def write_csv(path: Path, n: int, offset: int) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["Label", "Text"])
        for i in range(n):
            spam = (i + offset) % 3 == 0
            pool = SPAM if spam else HAM
            out.writerow([int(spam), pool[(i * 5 + offset) % len(pool)] + (" !" * ((i + offset) % 4))])
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ch06")
    torch.manual_seed(7)
    model = BookGPTModel(SMALL)
    torch.save(model.state_dict(), root / "model.pth")
    return {"root": root, "model": root / "model.pth", "train": write_csv(root / "train.csv", 40, 0),
            "val": write_csv(root / "validation.csv", 12, 1), "test": write_csv(root / "test.csv", 10, 2)}


def notebook_loaders_and_model(files):
    """The notebook's first cells: SpamDataset padded to the longest training text, torch.manual_seed(123),
    the three loaders (batch 8; shuffle and drop_last on train), GPTModel with the pretrained weights, eval."""
    torch.set_num_threads(1)
    tokenizer = tiktoken.get_encoding("gpt2")
    train_ds = ch06.SpamDataset(files["train"], tokenizer, max_length=None)
    val_ds = ch06.SpamDataset(files["val"], tokenizer, max_length=train_ds.max_length)
    test_ds = ch06.SpamDataset(files["test"], tokenizer, max_length=train_ds.max_length)
    torch.manual_seed(123)
    loader = lambda ds, train: torch.utils.data.DataLoader(ds, batch_size=8, shuffle=train, num_workers=0,
                                                            drop_last=train)
    train_loader, val_loader, test_loader = loader(train_ds, True), loader(val_ds, False), loader(test_ds, False)
    model = BookGPTModel(SMALL)
    model.load_state_dict(torch.load(files["model"], weights_only=True))
    model.eval()
    return train_loader, val_loader, test_loader, model


def notebook_training(model, train_loader, val_loader, test_loader) -> list[str]:
    """The notebook's training cells: torch.manual_seed(123), AdamW(5e-5, weight decay 0.1),
    train_classifier_simple, then the three accuracies; the lines they print."""
    torch.manual_seed(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ch06.train_classifier_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=EPOCHS,
                                     eval_freq=EVAL_FREQ, eval_iter=5)
        for name, data_loader in (("Training", train_loader), ("Validation", val_loader), ("Test", test_loader)):
            print(f"{name} accuracy: {ch06.calc_accuracy_loader(data_loader, model, 'cpu') * 100:.2f}%")
    return printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def book_run(files):
    """The notebook, cell by cell: datasets, loaders, model, frozen weights, head, seed, AdamW, training, accuracies."""
    train_loader, val_loader, test_loader, model = notebook_loaders_and_model(files)
    for p in model.parameters():
        p.requires_grad = False
    torch.manual_seed(123)
    model.out_head = torch.nn.Linear(SMALL["emb_dim"], 2)
    for p in [*model.trf_blocks[-1].parameters(), *model.final_norm.parameters()]:
        p.requires_grad = True
    printed = notebook_training(model, train_loader, val_loader, test_loader)
    torch.save(model.state_dict(), files["root"] / "review_classifier.pth")
    (files["root"] / "review_classifier.json").write_text(json.dumps({"n_heads": 4}))
    return printed, model, train_loader.dataset.max_length


def finetune(files, out: Path, *extra: str) -> list[str]:
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        code = main(["finetune", "classify", "--recipe", "book", "--model", str(files["model"]), "--n-heads", "4",
                     "--data", str(files["train"]), "--val", str(files["val"]), "--out", str(out), "--threads", "1",
                     "--no-progress", *extra])
    assert code == 0
    assert "note:" not in said.getvalue()  # told the head count, the book's recipe assumes nothing
    return printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def glass_run(files, tmp_path_factory):
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("glass") / "run"
    lines = finetune(files, run, "--test", str(files["test"]), "--epochs", str(EPOCHS), "--eval-every", str(EVAL_FREQ))
    return lines, run


BOOK_LINES = ("Ep ", "Training accuracy", "Validation accuracy", "Test accuracy")


def test_the_lines_are_train_classifier_simples_character_for_character(book_run, glass_run):
    book_lines = book_run[0]
    assert book_lines[0].startswith("Ep 1 (Step 000000): Train loss ") and len(book_lines) == 4 + EPOCHS + 3
    assert [line for line in glass_run[0] if line.startswith(BOOK_LINES)] == book_lines


def test_without_n_heads_the_run_says_it_took_gpt2s_rule_and_trains_another_model(files, book_run, tmp_path, capsys):
    """The same state dict without --n-heads: one note on stderr (1 head of 64, by GPT-2's rule), before any line."""
    assert main(["finetune", "classify", "--recipe", "book", "--model", str(files["model"]), "--data",
                 str(files["train"]), "--val", str(files["val"]), "--out", str(tmp_path / "run"), "--threads", "1",
                 "--no-progress", "--max-steps", "1", "--eval-every", "1"]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note: n_heads")]
    assert notes == ["note: n_heads 1 by GPT-2's rule, 64 per head (a state dict's shapes cannot tell the head count; "
                     "pass --n-heads if the model was built with another)"]
    assert [line for line in out.splitlines() if line.startswith("Ep ")][0] != book_run[0][0]  # other numbers


def test_the_weights_after_two_epochs_equal_the_books_bit_for_bit(book_run, glass_run):
    book_state = book_run[1].state_dict()
    ours = glassgpt.load_model(glass_run[1] / "latest").state_dict()
    different = [name for name, tensor in ours.items() if not torch.equal(tensor, book_state[name])]
    assert sorted(ours) and different == []


def books_answer(book_run, text: str) -> tuple[str, torch.Tensor]:
    """classify_review's label for `text`, and the book model's class probabilities at its padded length."""
    model, max_length = book_run[1], book_run[2]
    expected = ch06.classify_review(text, model, tiktoken.get_encoding("gpt2"), "cpu", max_length=max_length)
    with torch.no_grad():
        ids = tiktoken.get_encoding("gpt2").encode(text)
        probs = model(torch.tensor([ids + [50256] * (max_length - len(ids))]))[:, -1, :].softmax(-1)[0]
    return expected, probs


@pytest.mark.parametrize("text", ["are we still on for lunch?", "You won a free cruise! Call now"])
def test_classify_recipe_book_gives_classify_reviews_label_on_the_books_pth(book_run, files, text, capsys):
    (expected, probs), max_length = books_answer(book_run, text), book_run[2]
    assert main(["classify", text, "--model", str(files["root"] / "review_classifier.pth"), "--recipe", "book",
                 "--max-length", str(max_length), "--json"]) == 0
    out, err = capsys.readouterr()
    answer = json.loads(out)
    assert answer["label"] == expected and answer["prob"] == pytest.approx(float(probs.max()), abs=1e-6)
    assert "reads the last position, padding included" in err


def test_a_run_of_the_recipe_is_read_at_its_padded_length_with_the_books_names(book_run, glass_run, capsys):
    text = "Claim your 1000 prize today"
    model, max_length = book_run[1], book_run[2]
    expected = ch06.classify_review(text, model, tiktoken.get_encoding("gpt2"), "cpu", max_length=max_length)
    assert main(["classify", text, "--model", str(glass_run[1]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] == expected


@pytest.mark.parametrize("why", [False, True])
def test_explain_recipe_book_reads_the_books_pth_as_classify_review_does(book_run, files, capsys, why):
    """explain (and --why) on the book's own review_classifier.pth: the text padded to --max-length, the last
    position read, the classes named as classify_review names them; its probabilities are the book model's."""
    text = "You won a free cruise! Call now"
    (expected, probs), max_length = books_answer(book_run, text), book_run[2]
    assert main(["explain", text, "--model", str(files["root"] / "review_classifier.pth"), "--recipe", "book",
                 "--max-length", str(max_length), "--format", "json", *(["--why"] if why else [])]) == 0
    out, err = capsys.readouterr()
    trace = json.loads(out)
    assert len(trace["tokens"]) == max_length and trace["tokens"][-1]["id"] == 50256
    assert trace["next_token"]["text"] == expected
    assert trace["next_token"]["prob"] == pytest.approx(float(probs.max()), abs=1e-6)
    assert "padding included" in err and "classify and explain read it so" not in err
    if why:
        assert trace["why"]["target"]["text"] == expected and {trace["why"]["versus"]["text"], expected} == {
            "not spam", "spam"}


def test_serve_recipe_book_hands_the_page_the_books_reading(book_run, files, monkeypatch, capsys):
    import glassgpt.web as web

    class NoServer:  # serves nothing: the test reads what the page was given
        def run(self, sockets):
            sockets[0].close()
    seen = {}
    monkeypatch.setattr(web, "create_app", lambda model, tok, about, **kw: seen.update(about=about))
    monkeypatch.setattr("glassgpt.web.server.make_server", lambda app: NoServer())
    assert main(["serve", "--model", str(files["root"] / "review_classifier.pth"), "--port", "0", "--recipe", "book",
                 "--max-length", str(book_run[2])]) == 0
    assert seen["about"].reading.padded and seen["about"].reading.length == book_run[2]
    assert seen["about"].labels == ["not spam", "spam"]


def test_explain_recipe_book_on_a_language_model_is_refused_in_one_line(files, capsys):
    assert main(["explain", "hi", "--model", str(files["model"]), "--recipe", "book", "--max-length", "8"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is a language model" in errors[0]


def test_labels_beside_a_pth_name_the_classes(files, book_run, capsys):
    (files["root"] / "review_classifier.json").write_text(json.dumps({"n_heads": 4, "labels": ["ham", "spam"]}))
    try:
        assert main(["classify", "see you at 6", "--model", str(files["root"] / "review_classifier.pth"),
                     "--recipe", "book", "--max-length", str(book_run[2]), "--json"]) == 0
    finally:
        (files["root"] / "review_classifier.json").write_text(json.dumps({"n_heads": 4}))
    assert json.loads(capsys.readouterr().out)["label"] in ("ham", "spam")


def test_a_pth_without_the_padded_length_is_refused_in_one_line(files, book_run, capsys):
    assert main(["classify", "hi", "--model", str(files["root"] / "review_classifier.pth"), "--recipe", "book"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pass --max-length N" in errors[0]


@pytest.mark.parametrize("row, why", [(["2", "hello"], "the Label is '2'"), (["1", ""], "the Text is empty")])
def test_a_bad_row_names_its_file_and_line_and_leaves_no_run_behind(files, tmp_path, capsys, row, why):
    bad = tmp_path / "train.csv"
    text = files["train"].read_text(encoding="utf-8").splitlines()
    text.insert(5, ",".join(row))
    bad.write_text("\n".join(text) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    assert main(["finetune", "classify", "--recipe", "book", "--model", str(files["model"]), "--data", str(bad),
                 "--val", str(files["val"]), "--out", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:6: {why}" in err and not run.exists()


@pytest.mark.parametrize("flag", [["--warmup-steps", "5"], ["--grad-clip", "1"], ["--trainable", "all"],
                                  ["--text-column", "Text"]])
def test_a_flag_the_recipe_fixes_is_refused_by_name(files, tmp_path, capsys, flag):
    run = tmp_path / "run"
    assert main(["finetune", "classify", "--recipe", "book", "--model", str(files["model"]), "--data",
                 str(files["train"]), "--val", str(files["val"]), "--out", str(run), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --recipe book ") and flag[0] in err and len(err.splitlines()) == 1
    assert not run.exists()


def test_a_resumed_run_ends_with_the_same_weights(files, glass_run, tmp_path):
    run = tmp_path / "run"
    finetune(files, run, "--test", str(files["test"]), "--max-steps", "4", "--eval-every", str(EVAL_FREQ))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["finetune", "classify", "--resume", str(run), "--max-steps", str(EPOCHS * 5), "--threads", "1",
                     "--no-progress"]) == 0
    whole = glassgpt.load_model(glass_run[1] / "latest").state_dict()
    resumed = glassgpt.load_model(run / "latest").state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [x for x in printed.getvalue().splitlines() if x.startswith(BOOK_LINES)] == \
        [x for x in glass_run[0] if x.startswith(BOOK_LINES)][-7:]  # epoch 1 accuracy on: steps 6, 9, epoch 2, the three


def test_the_recipe_runs_from_python_with_no_command_line(files, book_run, tmp_path):
    """The same recipe as `finetune classify --recipe book`, called as functions: prepare, train_config, fit."""
    from glassgpt.training import fit, recipes
    from glassgpt.training.book.ch06 import accuracy_lines, prepare
    recipe = recipes.recipe("finetune classify", "book")
    cfg = recipe.train_config({"eval_every": EVAL_FREQ}, {"out": str(tmp_path / "run"), "plot": False})
    model = glassgpt.load_model(files["model"], device="cpu", dtype="float32", n_heads=4)
    model, task = prepare(model, glassgpt.load_tokenizer(files["model"]), files["train"], files["val"])
    cfg.max_steps = EPOCHS * task.steps_per_epoch
    lines = []
    fit(model, task, cfg, log=lambda event: lines.append(event))
    assert all(torch.equal(t, book_run[1].state_dict()[k]) for k, t in model.state_dict().items())
    assert sum("train_eval_loss" in e for e in lines) == 4
    assert accuracy_lines(task.final_accuracies(model)) == book_run[0][-3:-1]  # training and validation


def test_explain_of_the_books_pth_says_it_reads_the_last_real_token_and_how_to_read_it_as_the_book(files, book_run,
                                                                                                   capsys):
    assert main(["explain", "hi", "--model", str(files["root"] / "review_classifier.pth"), "--format", "json"]) == 0
    err = capsys.readouterr().err
    assert "reads the last real token (position 0)" in err and "explain read it so with --recipe book --max-length N" in err


def test_explain_names_the_classes_the_json_beside_a_pth_gives(files, book_run):
    (files["root"] / "review_classifier.json").write_text(json.dumps({"n_heads": 4, "labels": ["ham", "spam"]}))
    try:
        assert glassgpt.formats.open(files["root"] / "review_classifier.pth").about().labels == ["ham", "spam"]
    finally:
        (files["root"] / "review_classifier.json").write_text(json.dumps({"n_heads": 4}))


@pytest.mark.parametrize("text", ["are we still on for lunch?", "You won a free cruise! Call now"])
def test_explain_why_and_the_page_read_a_run_of_the_recipe_as_classify_and_classify_review_do(book_run, glass_run,
                                                                                             text, capsys):
    """The run records its padded length: every view reads the last position of the padded text, as trained."""
    from glassgpt.web.service import ExplainRequest, ExplainService
    model, max_length = book_run[1], book_run[2]
    expected = ch06.classify_review(text, model, tiktoken.get_encoding("gpt2"), "cpu", max_length=max_length)
    with torch.no_grad():  # classify_review's own probability, which it does not return
        ids = tiktoken.get_encoding("gpt2").encode(text)
        book_prob = float(model(torch.tensor([ids + [50256] * (max_length - len(ids))]))[:, -1, :].softmax(-1).max())
    assert main(["classify", text, "--model", str(glass_run[1]), "--json"]) == 0
    classified = json.loads(capsys.readouterr().out)
    assert main(["explain", text, "--model", str(glass_run[1]), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    explained = json.loads(out)["next_token"]
    assert main(["explain", text, "--model", str(glass_run[1]), "--why", "--format", "json"]) == 0
    why = json.loads(capsys.readouterr().out)["why"]
    served = ExplainService(glassgpt.load_model(glass_run[1]), glassgpt.load_tokenizer(glass_run[1]),
                            glassgpt.formats.open(glass_run[1]).about()).explain(ExplainRequest(prompt=text, attention=False))
    assert classified["label"] == expected == explained["text"] == why["target"]["text"] == \
        served["next_token"]["text"]
    # float32 on one machine: the same ids through the same forward give the same probability to 1e-6
    for prob in (classified["prob"], explained["prob"], why["candidates"][0]["prob"], served["next_token"]["prob"]):
        assert prob == pytest.approx(book_prob, abs=1e-6)
    assert f"reads the last position, padding included (position {max_length - 1})" in err
    assert any("padding included" in n for n in served["notes"])


def test_the_run_records_what_chapter_6_trained_and_explain_marks_it(glass_run, capsys):
    """The last block, final_norm and the head trained; the rest frozen: in the record, the trace's data,
    its text (one line) and the picture (a legend and a mark per part)."""
    trained = {"tok_emb": "frozen", "pos_emb": "frozen", "trf_blocks.0": "frozen", "trf_blocks.1": "trained",
               "final_norm": "trained", "out_head": "trained"}
    assert glassgpt.load_meta(glass_run[1])["trained"] == trained
    assert main(["explain", "hi", "--model", str(glass_run[1]), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["trained"]["parts"] == trained
    assert main(["explain", "hi", "--model", str(glass_run[1])]) == 0
    line = "trained: trf_blocks.1, final_norm, out_head; frozen: tok_emb, pos_emb, trf_blocks.0"
    assert sum(line in x for x in capsys.readouterr().out.splitlines()) == 1
    from glassgpt.explain import trace
    from glassgpt.explain.views.diagram import layout, to_svg
    tr = trace(glassgpt.load_model(glass_run[1]), glassgpt.load_tokenizer(glass_run[1]), "hi",
               about=glassgpt.formats.open(glass_run[1]).about())
    marks = {item.key for item in layout(tr).keyed("trained:") if item.key != "trained:blocks"}
    assert marks == {f"trained:{part}:{state}" for part, state in trained.items()}
    svg = to_svg(tr)
    assert "its training run, marked beside each part:" in svg and line in svg


# --- appendix E: the same notebook with LoRA ---------------------------------------------------------

RANK, ALPHA = 4, 8


@pytest.fixture(scope="module")
def book_lora_run(files):
    """Appendix E's notebook on chapter 6's data: the head after torch.manual_seed(123), the accuracy cell
    of the untrained classifier (its loaders draw from torch's generator), every weight frozen,
    replace_linear_with_lora on every nn.Linear, torch.manual_seed(123), AdamW, train_classifier_simple."""
    from llms_from_scratch import appendix_e
    train_loader, val_loader, test_loader, model = notebook_loaders_and_model(files)
    torch.manual_seed(123)
    model.out_head = torch.nn.Linear(SMALL["emb_dim"], 2)
    torch.manual_seed(123)
    for data_loader in (train_loader, val_loader, test_loader):
        ch06.calc_accuracy_loader(data_loader, model, "cpu", num_batches=10)
    for p in model.parameters():
        p.requires_grad = False
    appendix_e.replace_linear_with_lora(model, rank=RANK, alpha=ALPHA)
    printed = notebook_training(model, train_loader, val_loader, test_loader)
    return printed, model


def test_appendix_e_under_the_recipe_prints_the_books_lines_and_ends_with_its_adapters(files, book_lora_run,
                                                                                         tmp_path):
    from safetensors.torch import load_file
    run = tmp_path / "run"
    lines = finetune(files, run, "--test", str(files["test"]), "--epochs", str(EPOCHS), "--eval-every",
                     str(EVAL_FREQ), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA))
    book_lines, book_model = book_lora_run
    assert book_lines[0].startswith("Ep 1 (Step 000000): Train loss ") and len(book_lines) == 4 + EPOCHS + 3
    assert [line for line in lines if line.startswith(BOOK_LINES)] == book_lines
    book_state = {k.replace(".lora.A", ".lora_A").replace(".lora.B", ".lora_B"): v
                  for k, v in book_model.state_dict().items() if not k.endswith(".mask")}  # (its causal masks)
    trained = load_file(run / "latest" / "train_model.safetensors")  # the training model: base and adapters
    assert sum(k.endswith("lora_B") for k in trained) == 6 * SMALL["n_layers"] + 1  # every nn.Linear, the head's too
    different = [k for k in book_state if not torch.equal(trained[k], book_state[k])]
    assert sorted(trained) == sorted(book_state) and different == []
    merged = glassgpt.load_model(run / "latest").state_dict()  # the loadable model: the adapters folded in
    head = book_model.out_head
    assert torch.equal(merged["out_head.weight"], head.linear.weight + (head.lora.A @ head.lora.B * ALPHA).T)


def test_a_resumed_appendix_e_run_ends_with_the_same_adapters(files, tmp_path):
    from safetensors.torch import load_file
    lora = ("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--eval-every", str(EVAL_FREQ), "--test",
            str(files["test"]))
    finetune(files, tmp_path / "whole", *lora, "--max-steps", str(EPOCHS * 5))
    finetune(files, tmp_path / "run", *lora, "--max-steps", "4")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["finetune", "classify", "--resume", str(tmp_path / "run"), "--max-steps", str(EPOCHS * 5),
                     "--threads", "1", "--no-progress"]) == 0
    whole, resumed = (load_file(tmp_path / r / "latest" / "train_model.safetensors") for r in ("whole", "run"))
    assert sorted(whole) == sorted(resumed) and all(torch.equal(whole[k], resumed[k]) for k in whole)


# --- the fast path: the frozen blocks' output kept per text (book/ch06.py: BookClassifierTask.logits) -----------

def counted_frozen_rows(monkeypatch) -> list[int]:
    """Wrap ch06.run_frozen: the list receives each call's number of rows."""
    from glassgpt.training.book import ch06 as book_ch06
    rows, real = [], book_ch06.run_frozen
    monkeypatch.setattr(book_ch06, "run_frozen", lambda glass, k, ids: rows.append(ids.shape[0]) or real(glass, k, ids))
    return rows


def distinct_padded_texts(files, book_run) -> int:
    tokenizer = tiktoken.get_encoding("gpt2")
    texts = set()
    for part in ("train", "val", "test"):
        with open(files[part], encoding="utf-8") as f:
            for row in csv.DictReader(f):
                texts.add(tuple(tokenizer.encode(row["Text"])[:book_run[2]]))
    return len(texts)


def test_the_fast_path_reads_each_text_through_the_frozen_blocks_once_and_ends_within_the_books_tolerance(
        files, book_run, tmp_path, monkeypatch):
    """bfloat16, chapter 6's recipe: the 1 frozen block of 2 runs once per distinct text over two epochs, the
    evaluations and the three final accuracies (train, validation, test); the losses end within 0.05 of the
    book's and the accuracies within two points (the benchmark's tolerance, bench_book_ch06.py)."""
    rows = counted_frozen_rows(monkeypatch)
    lines = finetune(files, tmp_path / "fast", "--test", str(files["test"]), "--epochs", str(EPOCHS), "--eval-every",
                     str(EVAL_FREQ), "--dtype", "bfloat16")
    assert sum(rows) == distinct_padded_texts(files, book_run)
    ours, book = [x for x in lines if x.startswith(BOOK_LINES)], book_run[0]
    assert len(ours) == len(book)
    for a, b in zip(ours, book):
        numbers = [(float(x), float(y)) for x, y in zip(a.replace("%", " ").split(), b.replace("%", " ").split())
                   if x.replace(".", "").isdigit() and "." in x]
        assert numbers, (a, b)
        for x, y in numbers:
            assert abs(x - y) <= (2.0 if "accuracy" in a else 0.05), (a, b)


def test_the_exact_run_reads_every_text_through_every_block_every_time(files, tmp_path, monkeypatch):
    rows = counted_frozen_rows(monkeypatch)
    finetune(files, tmp_path / "exact", "--max-steps", "2", "--eval-every", "1")
    assert rows == []


def test_logits_through_the_kept_output_equal_the_whole_forwards_and_are_computed_once(files):
    """float32: from the kept output of the frozen block, the logits equal model(ids)[:, -1] (1e-6 of the
    largest; the same sums, batched otherwise); a text seen before is not run through the frozen blocks again,
    whatever batch it comes in."""
    from glassgpt.training.book import ch06 as book_ch06
    from glassgpt.tokenizer import get_tokenizer
    from glassgpt.training.tasks.examples import freeze
    model = glassgpt.load_model("gpt2", dtype="float32", seed=0, config=glassgpt.GPTConfig(
        vocab_size=50257, context_length=64, emb_dim=64, n_heads=4, n_layers=3, qkv_bias=True, tie_embeddings=False)).eval()
    freeze(model, "last-block")
    assert book_ch06.frozen_blocks(model) == 2
    ids = torch.randint(0, 50257, (8, 20), generator=torch.Generator().manual_seed(0))
    task = book_ch06.BookClassifierTask({"train": (ids, [0] * 8), "val": (ids[:2], [0, 1])}, 8, 5,
                                        get_tokenizer("gpt2"))
    task.reuse_frozen = True
    with torch.no_grad():
        want = book_ch06.last_position_logits(model, ids)
        got = task.logits(model, ids)
        kept = dict(task.frozen_rows)
        again = task.logits(model, ids[[5, 3, 3, 0]])
    assert ((got - want).abs().max() / want.abs().max()) < 1e-6
    assert ((again - want[[5, 3, 3, 0]]).abs().max() / want.abs().max()) < 1e-6
    assert len(kept) == 8 and all(kept[k] is task.frozen_rows[k] for k in kept)  # nothing computed again


@pytest.mark.parametrize("change", ["embeddings train", "every block trains", "dropout in training"])
def test_nothing_is_kept_where_the_first_block_or_the_embeddings_train_or_dropout_draws(change):
    from glassgpt.training.book import ch06 as book_ch06
    from glassgpt.training.tasks.examples import freeze
    cfg = glassgpt.GPTConfig(vocab_size=97, context_length=16, emb_dim=32, n_heads=2, n_layers=2, tie_embeddings=False,
                             drop_rate=0.1 if change == "dropout in training" else 0.0)
    model = glassgpt.load_model("gpt2", dtype="float32", seed=0, config=cfg)
    freeze(model, "last-block")
    if change == "embeddings train":
        model.pos_emb.requires_grad_(True)
    elif change == "every block trains":
        model.trf_blocks[0].requires_grad_(True)
    model.train()
    assert book_ch06.frozen_blocks(model) == 0
    model.eval()
    assert book_ch06.frozen_blocks(model) == (0 if change != "dropout in training" else 1)
