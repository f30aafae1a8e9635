"""Finetuning: classifier head, instruction data and its loss mask, LoRA, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

import glassgpt
from glassgpt import finetune as ft
from glassgpt.finetune import DataError

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
    a = ft.load_classification_data(write_csv(tmp_path / "d.csv", rows))
    b = ft.load_classification_data(write_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": l} for t, l in rows]))
    assert a == b
    assert a.label_names == ["neg", "pos"] and a.labels == [1, 0, 1]


def test_numeric_labels_sort_numerically(tmp_path):
    recs = [{"text": f"t{i}", "label": lab} for i, lab in enumerate([10, 2, 1, 2])]
    data = ft.load_classification_data(write_jsonl(tmp_path / "d.jsonl", recs))
    assert data.label_names == ["1", "2", "10"]


def test_custom_columns_are_read(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("x", "1"), ("y", "0")], header=("sms", "spam"))
    data = ft.load_classification_data(path, text_column="sms", label_column="spam")
    assert data.texts == ["x", "y"] and data.label_names == ["0", "1"]


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("   \n", "is empty"),
    ("text,label\n", "no rows"),
    ("words,label\n\"a\",x\n\"b\",y\n", "column 'text' is missing"),
    ("text,label\n\"a\",x\n\"b\",x\n", "at least two classes"),
    ("text,label\n\"\",x\n\"b\",y\n", "record 0 has an empty"),
])
def test_bad_classification_files_fail_with_one_clear_error(tmp_path, content, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        ft.load_classification_data(path)


def test_unknown_label_in_validation_data_is_refused(tmp_path):
    path = write_csv(tmp_path / "val.csv", [("a", "pos"), ("b", "maybe")])
    with pytest.raises(DataError, match=r"record 1 has the label 'maybe'.*\['neg', 'pos'\]"):
        ft.load_classification_data(path, label_names=["neg", "pos"])


def test_invalid_jsonl_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{oops\n')
    with pytest.raises(DataError, match="record 1 is not valid JSON"):
        ft.load_classification_data(path)


def test_split_validation_is_seeded_and_disjoint():
    data = ft.ClassificationData([f"t{i}" for i in range(20)], [i % 2 for i in range(20)], ["a", "b"])
    train, val = ft.split_validation(data, 0.25, seed=3)
    again, _ = ft.split_validation(data, 0.25, seed=3)
    assert len(val.texts) == 5 and len(train.texts) == 15
    assert set(train.texts).isdisjoint(val.texts) and train == again


def test_max_length_truncates_texts_to_their_first_tokens():
    ids = ft.encode_texts(GPT2_TOK, ["one two three four five"], max_length=3)
    assert ids == [GPT2_TOK.encode("one two three four five")[:3]]


# --- classification: model ---------------------------------------------------------------

def test_to_classifier_keeps_the_body_and_adds_a_new_untied_head(tiny_model):
    clf = ft.to_classifier(tiny_model, 3)
    assert clf.cfg.num_classes == 3 and not clf.cfg.tie_embeddings and not clf.tied
    assert tuple(clf.out_head.weight.shape) == (3, tiny_model.cfg.emb_dim) and clf.out_head.bias is not None
    base = tiny_model.state_dict()
    for name, value in clf.state_dict().items():
        if not name.startswith("out_head."):
            assert torch.equal(value, base[name]), name


def test_classifier_checkpoint_reloads_with_load_model_and_keeps_labels(tiny_model, tmp_path):
    clf = ft.to_classifier(tiny_model, 2)
    glassgpt.save_model(clf, tmp_path / "ckpt", meta={"labels": ["neg", "pos"]})
    back = glassgpt.load_model(tmp_path / "ckpt", device="cpu")
    ids = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(back(ids), clf(ids), rtol=0, atol=0)
    assert glassgpt.load_meta(tmp_path / "ckpt")["labels"] == ["neg", "pos"]


def test_padding_does_not_change_a_rows_prediction(tiny_model):
    clf = ft.to_classifier(tiny_model, 4)
    short, long = [5, 9, 2], [7, 1, 3, 3, 8, 4, 6, 2, 11]
    ids, lengths = ft.pad_batch([short, long], pad_id=50)
    batched = ft.last_token_logits(clf, ids, lengths)
    alone = clf(torch.tensor([short]))[:, -1]
    # Same maths on different shapes: float32 rounding differs slightly between kernels.
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-5)
    ids_other_pad, _ = ft.pad_batch([short, long], pad_id=0)
    torch.testing.assert_close(ft.last_token_logits(clf, ids_other_pad, lengths), batched, rtol=0, atol=1e-6)


@pytest.mark.parametrize("trainable, blocks", [("head", []), ("last-block", [1]), ("last-2-blocks", [0, 1]),
                                               ("all", [0, 1])])
def test_freeze_keeps_chosen_blocks_norm_and_head_trainable(tiny_model, trainable, blocks):
    clf = ft.to_classifier(tiny_model, 2)
    ft.freeze(clf, trainable)
    for name, p in clf.named_parameters():
        expected = (name.startswith(("final_norm.", "out_head."))
                    or any(name.startswith(f"trf_blocks.{b}.") for b in blocks)
                    or trainable == "all")
        assert p.requires_grad == expected, name


def test_unknown_trainable_choice_is_refused(tiny_model):
    with pytest.raises(glassgpt.GlassError, match="last-N-blocks"):
        ft.freeze(tiny_model, "middle")
    with pytest.raises(glassgpt.GlassError, match="has 2 blocks"):
        ft.freeze(tiny_model, "last-5-blocks")


def test_confusion_matrix_rows_are_actual_columns_predicted():
    assert ft.confusion_matrix([0, 1, 1, 0], [0, 1, 0, 0], 2) == [[2, 1], [0, 1]]


# --- batches -----------------------------------------------------------------------------

def test_batches_depend_only_on_their_position_and_cover_each_epoch():
    first = [ft.sample_indices(10, 4, b, seed=1) for b in range(5)]  # 20 examples: two epochs
    again = [ft.sample_indices(10, 4, b, seed=1) for b in reversed(range(5))][::-1]
    assert first == again
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new shuffle each epoch


def test_ranks_and_micro_steps_read_different_examples():
    task = ft.ClassificationTask([[i + 1] for i in range(64)], [i % 2 for i in range(64)], [[1]], [0],
                                 ["a", "b"], pad_id=0, batch_size=4, grad_accum=2)
    seen = [tuple(task.train_batch(0, m, r, 2)["input_ids"].flatten().tolist()) for m in (0, 1) for r in (0, 1)]
    assert len(set(sum(seen, ()))) == 16


# --- instruction data --------------------------------------------------------------------

def test_prompt_follows_the_alpaca_template():
    assert ft.format_prompt("Add.", "2 and 3") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\nAdd.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert "### Input" not in ft.format_prompt("Say hi.")


def test_loss_mask_covers_exactly_the_response_tokens_and_one_eot():
    recs = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Translate to French.", "input": "good morning", "output": "Bonjour, tout le monde."}]
    examples = [ft.encode_instruction(GPT2_TOK, r, max_length=1024) for r in recs]
    batch = ft.collate_instructions(examples, GPT2_TOK.eot_id)
    assert batch["inputs"].shape == batch["targets"].shape
    for row, (rec, (ids, prompt_len)) in enumerate(zip(recs, examples)):
        response = GPT2_TOK.encode(rec["output"]) + [GPT2_TOK.eot_id]
        targets = batch["targets"][row]
        kept = targets[targets != ft.IGNORE_INDEX].tolist()
        assert kept == response
        assert prompt_len == len(GPT2_TOK.encode(ft.format_prompt(rec["instruction"], rec["input"])))
        # The kept targets sit where the model reads the prompt's last token and the response.
        assert (targets[:prompt_len - 1] == ft.IGNORE_INDEX).all()
        n = len(ids) - 1
        assert torch.equal(batch["inputs"][row, :n], torch.tensor(ids[:-1]))
        assert torch.equal(targets[prompt_len - 1:n], torch.tensor(ids[1:])[prompt_len - 1:])
        assert (batch["inputs"][row, n:] == GPT2_TOK.eot_id).all() and (targets[n:] == ft.IGNORE_INDEX).all()
    task = ft.InstructionTask(examples, examples, GPT2_TOK.eot_id, batch_size=2)
    assert task.tokens(batch) == sum(len(GPT2_TOK.encode(r["output"])) + 1 for r in recs)


def test_long_responses_are_cut_to_the_context_and_long_prompts_refused():
    rec = {"instruction": "Count.", "output": " one" * 200}
    ids, prompt_len = ft.encode_instruction(GPT2_TOK, rec, max_length=64)
    assert len(ids) == 65 and prompt_len < 64
    with pytest.raises(DataError, match="the prompt is .* tokens"):
        ft.encode_instruction(GPT2_TOK, {"instruction": "word " * 100, "output": "x"}, max_length=64)


def test_malformed_records_are_reported_with_their_index(tmp_path):
    recs = [{"instruction": "a", "output": "b"}, {"instruction": "a"}, "text", {"instruction": "c", "output": ""},
            {"instruction": "d", "input": 5, "output": "e"}, {"instruction": "f", "input": None, "output": "g"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(recs))
    good, bad = ft.load_instruction_records(path, on_bad="skip")
    assert [r["instruction"] for r in good] == ["a", "f"] and good[1]["input"] == ""
    assert [i for i, _ in bad] == [1, 2, 3, 4] and "missing 'output'" in bad[0][1]
    with pytest.raises(DataError, match=r"record 1 is malformed \(missing 'output'\); 4 bad"):
        ft.load_instruction_records(path, on_bad="error")


def test_instruction_jsonl_with_a_broken_line_skips_it(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{broken\n{"instruction": "c", "output": "d"}\n')
    good, bad = ft.load_instruction_records(path)
    assert len(good) == 2 and bad[0][0] == 1 and "not valid JSON" in bad[0][1]


# --- LoRA --------------------------------------------------------------------------------

def test_lora_wraps_attention_and_feed_forward_and_starts_at_the_base_model(tiny_model):
    ids = torch.randint(0, 97, (2, 9))
    before = tiny_model(ids)
    ft.apply_lora(tiny_model, rank=4, alpha=8)
    wrapped = [name for name, m in tiny_model.named_modules() if isinstance(m, ft.LoRALinear)]
    assert len(wrapped) == 6 * tiny_model.cfg.n_layers
    assert {p.requires_grad for n, p in tiny_model.named_parameters() if "lora_" in n} == {True}
    assert not any(p.requires_grad for n, p in tiny_model.named_parameters() if "lora_" not in n)
    torch.testing.assert_close(tiny_model(ids), before, rtol=0, atol=0)  # B = 0


def test_lora_keeps_a_classifier_head_trainable(tiny_model):
    clf = ft.apply_lora(ft.to_classifier(tiny_model, 2), rank=2, alpha=2)
    trainable = {n for n, p in clf.named_parameters() if p.requires_grad}
    assert {"out_head.weight", "out_head.bias"} <= trainable
    d, L = clf.cfg.emb_dim, clf.cfg.n_layers
    per_block = 4 * (2 * d + d * 2) + (2 * d + 4 * d * 2) + (2 * 4 * d + d * 2)
    assert ft.count_parameters(clf, trainable_only=True) == L * per_block + 2 * d + 2


def _perturb_adapters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_merged_model_gives_the_logits_of_base_plus_adapters(tiny_model):
    ft.apply_lora(tiny_model, rank=4, alpha=16)
    _perturb_adapters(tiny_model)
    ids = torch.randint(0, 97, (3, 12))
    with_adapters = tiny_model(ids)
    copy = ft.merged_model(tiny_model)
    assert not ft.has_lora(copy) and ft.has_lora(tiny_model)
    # Folding B A into W reorders float32 sums: equal up to rounding.
    torch.testing.assert_close(copy(ids), with_adapters, rtol=1e-4, atol=1e-5)
    ft.merge_lora(tiny_model)
    assert not ft.has_lora(tiny_model)
    assert set(tiny_model.state_dict()) == set(copy.state_dict())
    torch.testing.assert_close(tiny_model(ids), with_adapters, rtol=1e-4, atol=1e-5)


def test_merged_checkpoint_loads_as_a_plain_model(tiny_model, tmp_path):
    ft.apply_lora(tiny_model, rank=2, alpha=4)
    _perturb_adapters(tiny_model, seed=1)
    ids = torch.randint(0, 97, (1, 6))
    glassgpt.save_model(ft.merged_model(tiny_model), tmp_path / "m")
    back = glassgpt.load_model(tmp_path / "m", device="cpu")
    torch.testing.assert_close(back(ids), tiny_model(ids), rtol=1e-4, atol=1e-5)
