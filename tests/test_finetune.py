"""Finetuning: classifier head, instruction data and its loss mask, training (with LoRA) and the CLI."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.engine import loss
from glassgpt.errors import DataError
from glassgpt.training.tasks import classify, examples, instruct, lora

GPT2_TOK = glassgpt.get_tokenizer("gpt2")


def write_csv(path, rows, header=("text", "label")):
    lines = [",".join(header)] + [",".join(f'"{v}"' for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- classification: data --------------------------------------------------------------

def test_csv_and_jsonl_give_the_same_data(tmp_path):
    rows = [("a fine day", "pos"), ("a bad day", "neg"), ("so good", "pos")]
    a = classify.load_classification_data(write_csv(tmp_path / "d.csv", rows))
    b = classify.load_classification_data(write_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": l} for t, l in rows]))
    assert a == b
    assert a.label_names == ["neg", "pos"] and a.labels == [1, 0, 1]


def test_quoted_csv_fields_keep_their_commas_and_newlines(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('text,label\n"first line,\nsecond line",a\nplain,b\n')
    assert classify.load_classification_data(path).texts == ["first line,\nsecond line", "plain"]


def test_numeric_labels_sort_numerically(tmp_path):
    recs = [{"text": f"t{i}", "label": lab} for i, lab in enumerate([10, 2, 1, 2])]
    data = classify.load_classification_data(write_jsonl(tmp_path / "d.jsonl", recs))
    assert data.label_names == ["1", "2", "10"]


def test_custom_columns_are_read(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("x", "1"), ("y", "0")], header=("sms", "spam"))
    data = classify.load_classification_data(path, text_column="sms", label_column="spam")
    assert data.texts == ["x", "y"] and data.label_names == ["0", "1"]


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("   \n", "is empty"),
    ("text,label\n", "no rows"),
    ("words,label\n\"a\",x\n\"b\",y\n", "column 'text' is missing"),
    ("text,label\n\"a\",x\n\"b\",x\n", "at least two classes"),
    ("text,label\n\"\",x\n\"b\",y\n", r"d.csv:2 has an empty"),
])
def test_bad_classification_files_fail_with_one_clear_error(tmp_path, content, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        classify.load_classification_data(path)


def test_unknown_label_in_validation_data_is_refused(tmp_path):
    path = write_csv(tmp_path / "val.csv", [("a", "pos"), ("b", "maybe")])
    with pytest.raises(DataError, match=r"val.csv:3 has the label 'maybe'.*\['neg', 'pos'\]"):
        classify.load_classification_data(path, label_names=["neg", "pos"])


def test_invalid_jsonl_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"d.jsonl:2 is not valid JSON"):
        classify.load_classification_data(path)


def test_split_validation_is_seeded_and_disjoint():
    data = classify.ClassificationData([f"t{i}" for i in range(20)], [i % 2 for i in range(20)], ["a", "b"])
    train, val = classify.split_validation(data, 0.25, seed=3)
    again, _ = classify.split_validation(data, 0.25, seed=3)
    assert len(val.texts) == 5 and len(train.texts) == 15
    assert set(train.texts).isdisjoint(val.texts) and train == again


def test_max_length_truncates_texts_to_their_first_tokens():
    ids = classify.encode_texts(GPT2_TOK, ["one two three four five"], max_length=3)
    assert ids == [GPT2_TOK.encode("one two three four five")[:3]]


# --- classification: model ---------------------------------------------------------------

def test_to_classifier_keeps_the_body_and_adds_a_new_untied_head(tiny_model):
    clf = classify.to_classifier(tiny_model, 3)
    assert clf.cfg.num_classes == 3 and not clf.cfg.tie_embeddings and not clf.tied
    assert tuple(clf.out_head.weight.shape) == (3, tiny_model.cfg.emb_dim) and clf.out_head.bias is not None
    base = tiny_model.state_dict()
    for name, value in clf.state_dict().items():
        if not name.startswith("out_head."):
            assert torch.equal(value, base[name]), name


def test_classifier_checkpoint_reloads_with_load_model_and_keeps_labels(tiny_model, tmp_path):
    clf = classify.to_classifier(tiny_model, 2)
    glassgpt.save_model(clf, tmp_path / "ckpt", meta={"labels": ["neg", "pos"]})
    back = glassgpt.load_model(tmp_path / "ckpt", device="cpu")
    ids = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(back(ids), clf(ids), rtol=0, atol=0)
    assert glassgpt.load_meta(tmp_path / "ckpt")["labels"] == ["neg", "pos"]


def test_padding_does_not_change_a_rows_prediction(tiny_model):
    clf = classify.to_classifier(tiny_model, 4)
    short, long = [5, 9, 2], [7, 1, 3, 3, 8, 4, 6, 2, 11]
    ids, lengths = examples.pad_batch([short, long], pad_id=50)
    batched = classify.last_token_logits(clf, ids, lengths)
    alone = clf(torch.tensor([short]))[:, -1]
    # Same maths on different shapes: float32 rounding differs slightly between kernels.
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-5)
    ids_other_pad, _ = examples.pad_batch([short, long], pad_id=0)
    torch.testing.assert_close(classify.last_token_logits(clf, ids_other_pad, lengths), batched, rtol=0, atol=1e-6)


@pytest.mark.parametrize("trainable, blocks", [("head", []), ("last-block", [1]), ("last-2-blocks", [0, 1]),
                                               ("all", [0, 1])])
def test_freeze_keeps_chosen_blocks_norm_and_head_trainable(tiny_model, trainable, blocks):
    clf = classify.to_classifier(tiny_model, 2)
    examples.freeze(clf, trainable)
    for name, p in clf.named_parameters():
        expected = (name.startswith(("final_norm.", "out_head."))
                    or any(name.startswith(f"trf_blocks.{b}.") for b in blocks)
                    or trainable == "all")
        assert p.requires_grad == expected, name


def test_unknown_trainable_choice_is_refused(tiny_model):
    with pytest.raises(glassgpt.GlassError, match="last-N-blocks"):
        examples.freeze(tiny_model, "middle")
    with pytest.raises(glassgpt.GlassError, match="has 2 blocks"):
        examples.freeze(tiny_model, "last-5-blocks")


def test_confusion_matrix_rows_are_actual_columns_predicted():
    assert classify.confusion_matrix([0, 1, 1, 0], [0, 1, 0, 0], 2) == [[2, 1], [0, 1]]


# --- batches -----------------------------------------------------------------------------

def test_batches_depend_only_on_their_position_and_cover_each_epoch():
    first = [examples.sample_indices(10, 4, b, seed=1) for b in range(5)]  # 20 examples: two epochs
    again = [examples.sample_indices(10, 4, b, seed=1) for b in reversed(range(5))][::-1]
    assert first == again
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new shuffle each epoch


def test_ranks_and_micro_steps_read_different_examples():
    task = classify.ClassificationTask([[i + 1] for i in range(64)], [i % 2 for i in range(64)], [[1]], [0],
                                 ["a", "b"], pad_id=0, batch_size=4, grad_accum=2)
    seen = [tuple(task.train_batch(0, m, r, 2)["input_ids"].flatten().tolist()) for m in (0, 1) for r in (0, 1)]
    assert len(set(sum(seen, ()))) == 16


# --- instruction data --------------------------------------------------------------------

def test_prompt_follows_the_alpaca_template():
    assert instruct.format_prompt("Add.", "2 and 3") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\nAdd.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert "### Input" not in instruct.format_prompt("Say hi.")


def test_loss_mask_covers_exactly_the_response_tokens_and_one_eot():
    recs = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Translate to French.", "input": "good morning", "output": "Bonjour, tout le monde."}]
    examples = [instruct.encode_instruction(GPT2_TOK, r, max_length=1024) for r in recs]
    batch = instruct.collate_instructions(examples, GPT2_TOK.eot_id)
    assert batch["input_ids"].shape == batch["targets"].shape
    for row, (rec, (ids, prompt_len)) in enumerate(zip(recs, examples)):
        response = GPT2_TOK.encode(rec["output"]) + [GPT2_TOK.eot_id]
        targets = batch["targets"][row]
        kept = targets[targets != loss.IGNORE_INDEX].tolist()
        assert kept == response
        assert prompt_len == len(GPT2_TOK.encode(instruct.format_prompt(rec["instruction"], rec["input"])))
        # The kept targets sit where the model reads the prompt's last token and the response.
        assert (targets[:prompt_len - 1] == loss.IGNORE_INDEX).all()
        n = len(ids) - 1
        assert torch.equal(batch["input_ids"][row, :n], torch.tensor(ids[:-1]))
        assert torch.equal(targets[prompt_len - 1:n], torch.tensor(ids[1:])[prompt_len - 1:])
        assert (batch["input_ids"][row, n:] == GPT2_TOK.eot_id).all() and (targets[n:] == loss.IGNORE_INDEX).all()
    task = instruct.InstructionTask(examples, examples, GPT2_TOK.eot_id, batch_size=2)
    assert task.tokens(batch) == sum(len(GPT2_TOK.encode(r["output"])) + 1 for r in recs)


def test_long_responses_are_cut_to_the_context_and_long_prompts_refused():
    rec = {"instruction": "Count.", "output": " one" * 200}
    ids, prompt_len = instruct.encode_instruction(GPT2_TOK, rec, max_length=64)
    assert len(ids) == 65 and prompt_len < 64
    with pytest.raises(DataError, match="the prompt is .* tokens"):
        instruct.encode_instruction(GPT2_TOK, {"instruction": "word " * 100, "output": "x"}, max_length=64)


def test_malformed_records_are_reported_with_their_index(tmp_path):
    recs = [{"instruction": "a", "output": "b"}, {"instruction": "a"}, "text", {"instruction": "c", "output": ""},
            {"instruction": "d", "input": 5, "output": "e"}, {"instruction": "f", "input": None, "output": "g"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(recs))
    good, bad = instruct.load_instruction_records(path, on_bad="skip")
    assert [r["instruction"] for r in good] == ["a", "f"] and good[1]["input"] == ""
    assert [i for i, _ in bad] == [1, 2, 3, 4] and "missing 'output'" in bad[0][1]
    with pytest.raises(DataError, match=r"data.json record 2 of 6 is malformed \(missing 'output'\); 4 bad"):
        instruct.load_instruction_records(path, on_bad="error")


def test_instruction_jsonl_with_a_broken_line_skips_it(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{broken\n{"instruction": "c", "output": "d"}\n')
    good, bad = instruct.load_instruction_records(path)
    assert len(good) == 2 and bad[0][0] == 1 and "not valid JSON" in bad[0][1]


# --- training through train.fit and the command line -------------------------------------------

from glassgpt.cli import main as cli_main  # noqa: E402
from glassgpt.tokenizer import CharTokenizer  # noqa: E402
from glassgpt.training import TrainConfig, fit  # noqa: E402

MARKERS = {"x": "ex", "y": "why", "q": "queue"}


pytestmark = pytest.mark.usefixtures("one_thread")


def marker_texts(n, seed):
    """Random letters with one marker letter at a random place; the marker is the class.

    Separable, but only by attending back from the last token to the marker."""
    import random
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        body = [rng.choice("abcdef") for _ in range(rng.randint(3, 12))]
        marker = rng.choice(sorted(MARKERS))
        body.insert(rng.randrange(len(body) + 1), marker)
        rows.append(("".join(body), MARKERS[marker]))
    return rows


@pytest.fixture(scope="module")
def char_base(tmp_path_factory):
    """A random 2-block model with a char tokenizer (no eot: pads with 0), saved as a checkpoint."""
    tok = CharTokenizer("abcdefxyq")
    cfg = glassgpt.GPTConfig(vocab_size=tok.n_vocab, context_length=16, emb_dim=32, n_heads=4, n_layers=2)
    path = tmp_path_factory.mktemp("char_base") / "base"
    glassgpt.save_model(glassgpt.load_model("gpt2", device="cpu", config=cfg, seed=0), path, tok)
    return path


@pytest.fixture(scope="module")
def classify_run(char_base, tmp_path_factory):
    """`glassgpt finetune classify` on 300 marker texts: a run directory."""
    root = tmp_path_factory.mktemp("classify")
    train = write_csv(root / "train.csv", marker_texts(300, seed=0))
    val = write_csv(root / "val.csv", marker_texts(60, seed=1))
    run = root / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (module fixtures start before the autouse one_thread)
    try:
        rc = cli_main(["finetune", "classify", "--model", str(char_base), "--data", str(train), "--val", str(val),
                       "--out", str(run), "--trainable", "all", "--max-steps", "100", "--lr", "3e-3",
                       "--batch-size", "16", "--eval-every", "50", "--no-progress"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    return run


def test_classifier_reaches_high_accuracy_on_a_separable_task(classify_run):
    report = json.loads((classify_run / "confusion.json").read_text())
    assert report["labels"] == ["ex", "queue", "why"]
    assert report["accuracy"] >= 0.9 and sum(map(sum, report["matrix"])) == 60
    assert (classify_run / "best" / "config.json").is_file() and (classify_run / "latest" / "config.json").is_file()


def test_a_run_records_that_trainable_all_trained_every_part(classify_run):
    assert set(glassgpt.load_meta(classify_run)["trained"].values()) == {"trained"}


def test_classify_json_prints_the_label_and_its_probability(classify_run, capsys):
    assert cli_main(["classify", "abcyfed", "--model", str(classify_run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"label", "prob"} and out["label"] == "why" and 0.5 < out["prob"] <= 1.0
    assert cli_main(["classify", "qab", "--model", str(classify_run)]) == 0
    assert capsys.readouterr().out.split("\t")[0] == "queue"


def test_explain_shows_the_classifier_head(classify_run, capsys):
    assert cli_main(["explain", "abxc", "--model", str(classify_run), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    head = [s for s in data["stages"] if s.get("transition") == "hidden->classes"]
    assert len(head) == 1 and head[0]["name"] == "out_head"
    assert head[0]["weight_shape"] == [3, 32] and head[0]["shape"][-1] == 3
    assert data["next_token"]["kind"] == "class" and data["next_token"]["text"] in MARKERS.values()


def test_classify_refuses_a_language_model(char_base, capsys):
    assert cli_main(["classify", "abc", "--model", str(char_base)]) == 2
    assert "is a language model" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--text-column", "sms"], "column 'sms' is missing"),
    (["--lora-alpha", "4"], "--lora-alpha needs --lora-rank"),
    (["--lora-rank", "2", "--trainable", "all"], "drop --trainable"),
    (["--epochs", "1", "--max-steps", "3"], "not both"),
])
def test_finetune_classify_errors_are_one_line(char_base, tmp_path, capsys, extra, message):
    train = write_csv(tmp_path / "train.csv", marker_texts(20, seed=0))
    rc = cli_main(["finetune", "classify", "--model", str(char_base), "--data", str(train),
                   "--out", str(tmp_path / "run"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def _lora_classifier(char_base, seed=0):
    model = glassgpt.load_model(char_base, device="cpu")
    return lora.apply_lora(classify.to_classifier(model, 3, seed=seed), rank=2, alpha=4, seed=seed)


def _marker_task(tok, cfg):
    data = marker_texts(64, seed=2)
    ids = classify.encode_texts(tok, [t for t, _ in data], 16)
    labels = [sorted(MARKERS.values()).index(label) for _, label in data]
    return classify.ClassificationTask(ids[:48], labels[:48], ids[48:], labels[48:], sorted(MARKERS.values()),
                                 pad_id=0, batch_size=8, grad_accum=cfg.grad_accum, seed=cfg.seed,
                                 eval_batches=cfg.eval_batches)


def test_lora_trains_only_the_adapters_and_saves_a_plain_merged_checkpoint(char_base, tmp_path):
    tok = glassgpt.load_tokenizer(char_base)
    model = _lora_classifier(char_base)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k and "out_head" not in k}
    adapters = {k: v.clone() for k, v in lora.lora_state_dict(model).items()}
    cfg = TrainConfig(out=str(tmp_path / "run"), max_steps=6, lr=1e-2, warmup_steps=0, eval_every=6,
                      eval_batches=2, sample_tokens=0)
    fit(model, _marker_task(tok, cfg), cfg, tok, meta={"labels": sorted(MARKERS.values())})
    after = model.state_dict()
    for name, value in base.items():
        assert torch.equal(after[name], value), f"{name} changed: LoRA must leave the base weights alone"
    assert any(not torch.equal(after[k], v) for k, v in adapters.items() if k.endswith("lora_B"))
    # latest/ is a plain classifier that load_model reads; its logits are base + adapters.
    plain = glassgpt.load_model(tmp_path / "run" / "latest", device="cpu")
    assert not lora.has_lora(plain) and plain.cfg.num_classes == 3
    ids = torch.tensor([tok.encode("abxcdef"), tok.encode("qqabcde")])
    model.eval()
    torch.testing.assert_close(plain(ids), model(ids), rtol=1e-4, atol=1e-5)


def test_lora_run_resumes_exactly(char_base, tmp_path):
    tok = glassgpt.load_tokenizer(char_base)

    def run(out, steps, resume=False):
        model = _lora_classifier(char_base)
        # A flat schedule (min_lr = lr), so that stopping at step 3 is the same as being stopped there.
        cfg = TrainConfig(out=str(out), max_steps=steps, lr=1e-2, min_lr=1e-2, warmup_steps=0, eval_every=3,
                          eval_batches=1, sample_tokens=0)
        fit(model, _marker_task(tok, cfg), cfg, tok, resume=resume)
        return model

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "b", 6, resume=True)
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_finetune_classify_with_lora_prints_both_parameter_counts_and_resumes(char_base, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", marker_texts(40, seed=0))
    run = tmp_path / "run"
    args = ["finetune", "classify", "--model", str(char_base), "--data", str(train), "--out", str(run),
            "--lora-rank", "2", "--lora-alpha", "4", "--max-steps", "2", "--batch-size", "8", "--no-progress"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    m = re.search(r"trainable parameters: ([\d,]+) of ([\d,]+) .*with LoRA rank 2, alpha 4; "
                  r"without LoRA \(--trainable all\): ([\d,]+)", out)
    reference = _lora_classifier(char_base)
    assert m and int(m[1].replace(",", "")) == lora.count_parameters(reference, trainable_only=True)
    assert m[2] == m[3] == f"{sum(p.numel() for n, p in reference.named_parameters() if 'lora_' not in n):,}"
    assert cli_main(["finetune", "classify", "--resume", str(run), "--max-steps", "4", "--no-progress"]) == 0
    assert "done: step 4" in capsys.readouterr().out
    assert glassgpt.load_meta(run)["finetune"]["lora_rank"] == 2
    assert glassgpt.load_model(run, device="cpu").cfg.num_classes == 3
    # what explain marks: the adapters trained the blocks' linears, the new head trained, the rest stayed frozen
    assert glassgpt.load_meta(run)["trained"] == {"tok_emb": "frozen", "pos_emb": "frozen", "trf_blocks.0": "lora",
                                                  "trf_blocks.1": "lora", "final_norm": "frozen", "out_head": "trained"}


@pytest.fixture(scope="module")
def gpt2_tok_base(tmp_path_factory):
    """A random 1-block model with GPT-2's tokenizer (so it has <|endoftext|>), saved."""
    cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=96, emb_dim=16, n_heads=2, n_layers=1)
    path = tmp_path_factory.mktemp("gpt2_base") / "base"
    glassgpt.save_model(glassgpt.load_model("gpt2", device="cpu", config=cfg, seed=0), path, GPT2_TOK)
    return path


def test_finetune_instruct_skips_bad_records_and_chat_answers(gpt2_tok_base, tmp_path, capsys, monkeypatch):
    recs = [{"instruction": f"Repeat the word {w}.", "output": w} for w in ("red", "blue", "green", "cat", "dog")] * 4
    recs[3] = {"instruction": "no output here"}
    path = tmp_path / "data.json"
    path.write_text(json.dumps(recs))
    run = tmp_path / "run"
    rc = cli_main(["finetune", "instruct", "--model", str(gpt2_tok_base), "--data", str(path), "--out", str(run),
                   "--max-steps", "3", "--batch-size", "4", "--lr", "1e-3", "--sample-tokens", "4", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "skipped 1 malformed record(s)" in captured.err and "record 4 (missing 'output')" in captured.err
    assert glassgpt.load_meta(run)["finetune"]["kind"] == "instruct"
    from glassgpt.training import read_metrics
    evals = [r for r in read_metrics(run) if "val_loss" in r]  # a snapshot of the first val record's prompt
    assert evals and all(r["snapshot"]["prompt"].endswith("### Response:\n") for r in evals)
    assert all(len(r["snapshot"]["top"]) == 5 and len(r["snapshot"]["lens"]) == 1 for r in evals)
    assert cli_main(["chat", "Repeat the word red.", "--model", str(run), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    # Without an argument: one instruction per line of stdin, blank lines skipped.
    monkeypatch.setattr("sys.stdin", io.StringIO("Repeat the word red.\n\n  Repeat the word cat.\n"))
    monkeypatch.setattr(instruct, "respond", lambda model, tok, instruction, *rest: f"<{instruction}>")
    assert cli_main(["chat", "--model", str(run)]) == 0
    assert capsys.readouterr().out == "<Repeat the word red.>\n<Repeat the word cat.>\n"
    rc = cli_main(["finetune", "instruct", "--model", str(gpt2_tok_base), "--data", str(path),
                   "--out", str(tmp_path / "run2"), "--on-bad-record", "error", "--no-progress"])
    assert rc == 2 and "record 4 of 20 is malformed (missing 'output')" in capsys.readouterr().err


def test_respond_stops_at_eot_and_returns_only_the_answer(gpt2_tok_base):
    model = glassgpt.load_model(gpt2_tok_base, device="cpu")
    with torch.no_grad():  # every hidden state becomes all-ones, and only eot's row scores it
        model.final_norm.scale.zero_()
        model.final_norm.shift.fill_(1.0)
        model.out_head.weight.zero_()  # (tied: tok_emb too, which does not matter here)
        model.out_head.weight[GPT2_TOK.eot_id] = 1.0
    assert instruct.respond(model, GPT2_TOK, "Say nothing.", max_new_tokens=5) == ""


# --- faults and defaults --------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    ('text,label\n"a fine day",pos\n"a bad day",neg,really\n', r"d.csv:3: the row has 3 fields but the header has 2"),
    ('text,label\n"a fine day",pos\n"no label here"\n', r"d.csv:3: the row has 1 fields but the header has 2"),
    ('text,label\n"a fine day",pos\n"what",NaN\n"b",neg\n', r"d.csv:3 has no usable label in 'label' \('NaN'\)"),
    ('{"text": "a", "label": 1}\n\n{"text": "b", "label": NaN}\n', r"d.jsonl:3 has no usable label .*\(nan\)"),
    ('[{"text": "a", "label": "x"}, {"text": "b", "label": null}]', r"d.json record 2 of 2 has no usable label"),
])
def test_a_ragged_row_or_a_missing_label_is_an_error_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / ("d.csv" if content.startswith("text") else "d.jsonl" if content.startswith("{") else "d.json")
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        classify.load_classification_data(path)


QUESTIONS = ["is it going to rain today?", "where did you put the keys?", "can you help me with this?",
             "what time does the shop open?", "why is the sky blue?", "who wrote this letter?",
             "how far is the station?", "do you like green tea?", "will you come to the party?",
             "have you seen my brother?", "when does the train leave?", "which road goes to the town?"]
STATEMENTS = ["it is going to rain today.", "i put the keys on the table.", "you can help me with this.",
              "the shop opens at nine.", "the sky is blue in summer.", "my sister wrote this letter.",
              "the station is not far.", "i like green tea.", "we will come to the party.",
              "i have seen your brother.", "the train leaves at noon.", "this road goes to the town."]


@pytest.fixture(scope="module")
def question_csv(tmp_path_factory):
    """24 rows, two classes, separable by the last character: questions and statements."""
    import random
    rows = [(t, "question") for t in QUESTIONS] + [(t, "statement") for t in STATEMENTS]
    random.Random(0).shuffle(rows)
    return write_csv(tmp_path_factory.mktemp("qs") / "qs.csv", rows)


@pytest.fixture(scope="module")
def question_base(tmp_path_factory):
    """A random-init 2-block, 32-wide model with a char tokenizer over the question/statement texts."""
    tok = CharTokenizer(set("".join(QUESTIONS + STATEMENTS)))
    cfg = glassgpt.GPTConfig(vocab_size=tok.n_vocab, context_length=64, emb_dim=32, n_heads=4, n_layers=2)
    path = tmp_path_factory.mktemp("qs_base") / "base"
    glassgpt.save_model(glassgpt.load_model("gpt2", device="cpu", config=cfg, seed=0), path, tok)
    return path


def test_the_default_settings_learn_a_small_separable_task(question_base, question_csv, tmp_path, capsys):
    # The case: 24 rows, two classes, --trainable last-block --epochs 5, every other setting
    # the default. Before the fix (lr 5e-5 on a 32-wide model) the validation loss stayed at 0.63.
    run = tmp_path / "run"
    assert cli_main(["finetune", "classify", "--model", str(question_base), "--data", str(question_csv),
                     "--out", str(run), "--trainable", "last-block", "--epochs", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "training: 15 steps (5.00 epochs of 3 steps)" in out and "lr 0.0012" in out  # 5e-5 x 768 / 32
    assert "step 3: val_loss" in out and "step 15: val_loss" in out  # --no-progress hides only the bar
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] < 0.5 * vals[0]  # measured 0.55 -> 0.29
    assert not any("val_ppl" in r for r in records) and "val_ppl" not in out  # a classifier has no perplexity
    data = classify.load_classification_data(question_csv)
    train, _ = classify.split_validation(data, 0.1, seed=1337)
    model, tok = glassgpt.load_model(run, device="cpu"), glassgpt.load_tokenizer(run)
    assert classify.predict(model, tok, train.texts).argmax(-1).tolist() == train.labels  # every training row


def test_help_shows_the_defaults_a_run_uses(capsys):
    with pytest.raises(SystemExit):
        cli_main(["finetune", "classify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "peak learning rate (default 5e-05 x max(1, 768 / emb_dim)" in text and "6e-4" not in text
    assert "passes over the training data (default 5); give this or --max-steps, not both" in text
    assert examples.DATA_FORMATS in text


def test_the_training_docs_list_the_data_formats_that_help_shows():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    assert examples.DATA_FORMATS in " ".join(readme.split())


def test_finetune_resume_with_a_seed_continues_the_same_run(question_base, question_csv, tmp_path):
    # A flat schedule, so that stopping at step 3 is the same as being stopped there.
    flags = ["--model", str(question_base), "--data", str(question_csv), "--seed", "7", "--lr", "1e-3",
             "--min-lr", "1e-3", "--warmup-steps", "0", "--eval-every", "3", "--batch-size", "4", "--no-progress"]
    assert cli_main(["finetune", "classify", *flags, "--out", str(tmp_path / "a"), "--max-steps", "6"]) == 0
    assert cli_main(["finetune", "classify", *flags, "--out", str(tmp_path / "b"), "--max-steps", "3"]) == 0
    assert cli_main(["finetune", "classify", "--resume", str(tmp_path / "b"), "--max-steps", "6", "--no-progress"]) == 0
    losses = lambda run: [json.loads(line)["train_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # the same split, the same batches


def test_finetune_resume_refuses_data_that_changed(question_base, question_csv, tmp_path, capsys):
    data = tmp_path / "qs.csv"
    data.write_text(question_csv.read_text())
    run = tmp_path / "run"
    assert cli_main(["finetune", "classify", "--model", str(question_base), "--data", str(data), "--out", str(run),
                     "--max-steps", "2", "--no-progress"]) == 0
    data.write_text(data.read_text() + '"is this new?",question\n')
    capsys.readouterr()
    assert cli_main(["finetune", "classify", "--resume", str(run), "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "qs.csv changed since the run started" in err and err.count("\n") == 1


def test_eval_and_generate_refuse_a_classifier_run(classify_run, capsys):
    assert cli_main(["eval", "--model", str(classify_run), "--data", str(classify_run.parent / "train.csv")]) == 2
    assert cli_main(["generate", "abc", "--model", str(classify_run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("is a classifier (3 classes") == 2 and "Traceback" not in err


@pytest.mark.parametrize("name", ["confusion.json", "confusion.png"])
def test_a_confusion_file_that_is_a_link_is_refused_and_nothing_outside_changes(classify_run, tmp_path, capsys,
                                                                                 name):
    if name.endswith(".png"):
        pytest.importorskip("matplotlib")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("not glassgpt's\n")
    run = tmp_path / "run"
    shutil.copytree(classify_run, run, symlinks=True)
    (run / ".lock").unlink(missing_ok=True)
    (run / name).unlink()
    (run / name).symlink_to(outside / "victim.txt")
    assert cli_main(["finetune", "classify", "--resume", str(run), "--max-steps", "101", "--no-progress",
                     "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert f"{run / name} is a symbolic link" in err and "Traceback" not in err
    assert (outside / "victim.txt").read_text() == "not glassgpt's\n" and sorted(outside.iterdir()) == [
        outside / "victim.txt"]
