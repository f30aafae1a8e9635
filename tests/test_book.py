"""The book's own models, both ways, against the book's own code (the `llms-from-scratch` package).

Random-weight `llms_from_scratch.ch04.GPTModel`s saved with `torch.save(model.state_dict())`
load into glassgpt with logits within an absolute 1e-5 (TOL), and draw the same greedy and
seeded tokens as `llms_from_scratch.ch05.generate`; a chapter 6 classifier head gives the same
class scores; `glassgpt export --format pth` loads strictly into GPTModel. TensorFlow
checkpoints in OpenAI's layout, written by real TensorFlow, load without TensorFlow and give
the logits that the book's `load_gpt2_params_from_tf_ckpt` + `load_weights_into_gpt` give.
Every bad file is one line and exit code 2, with nothing written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from llms_from_scratch.ch04 import GPTModel as BookGPTModel
from llms_from_scratch.ch05 import generate as book_generate
from llms_from_scratch.ch05 import load_gpt2_params_from_tf_ckpt, load_weights_into_gpt

import glassgpt
from glassgpt.formats.book import book_cfg
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.generate import pick_next
from glassgpt.formats.tensorflow import crc32c
from glassgpt.formats import read_config

from conftest import randomize_
from helpers import HPARAMS, Trap, assert_one_line_error, run

TOL = dict(atol=1e-5, rtol=0.0)  # fp32 logits vs the book's GPTModel: max |diff| <= 1e-5

# Sizes all different from each other; emb_dim 128 gives 2 heads by GPT-2's 64-per-head rule.
BOOK_CFG = {"vocab_size": 97, "context_length": 24, "emb_dim": 128, "n_heads": 2, "n_layers": 2,
            "drop_rate": 0.1, "qkv_bias": False}
# The CLI's tokenizer needs GPT-2's vocabulary.
BOOK_CFG_GPT2_VOCAB = dict(BOOK_CFG, vocab_size=50257, emb_dim=64, n_heads=1)
GPT_CONFIG_124M = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
                   "drop_rate": 0.1, "qkv_bias": False}


def book_model(cfg: dict, seed: int = 0) -> BookGPTModel:
    """The book's GPTModel with every parameter random (LayerNorm scales around 1), in eval mode."""
    torch.manual_seed(seed)
    return randomize_(BookGPTModel(cfg), seed=seed, std=0.1).eval()


def save_book(model: torch.nn.Module, path: Path, wrap: bool = False) -> Path:
    state = model.state_dict()
    torch.save({"model_state_dict": state, "epoch": 3} if wrap else state, path)
    return path


def ids_for(cfg: dict, t: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (2, t), generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


# --- state dicts saved by the book's GPTModel ----------------------------------------------------

@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("wrap", [False, True], ids=["state_dict", "model_state_dict"])
def test_book_state_dict_gives_the_books_logits(tmp_path, qkv_bias, wrap):
    cfg = dict(BOOK_CFG, qkv_bias=qkv_bias)
    book = book_model(cfg)
    glass = glassgpt.load_model(save_book(book, tmp_path / "model.pth", wrap=wrap))
    ids = ids_for(cfg)
    torch.testing.assert_close(logits(glass, ids), logits(book, ids), **TOL)


def test_config_comes_from_the_tensors(tmp_path):
    path = save_book(book_model(BOOK_CFG), tmp_path / "model.pth")
    cfg = glassgpt.load_model(path).cfg
    assert {k: getattr(cfg, k) for k in BOOK_CFG if k != "drop_rate"} == \
        {k: v for k, v in BOOK_CFG.items() if k != "drop_rate"}
    assert cfg.tie_embeddings is False and cfg.num_classes is None
    assert read_config(path) == cfg


def test_a_tied_state_dict_loads_tied(tmp_path):
    """torch.save keeps one tensor under two names: a tied model's head is its tok_emb."""
    model = randomize_(glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=97, context_length=24,
                                                                               emb_dim=64, n_heads=1, n_layers=1)))
    torch.save(model.state_dict(), tmp_path / "tied.pth")
    loaded = glassgpt.load_model(tmp_path / "tied.pth")
    assert loaded.tied
    torch.testing.assert_close(logits(loaded, ids_for(BOOK_CFG)), logits(model, ids_for(BOOK_CFG)), atol=0, rtol=0)


def test_head_count_comes_from_the_flag_or_the_json_beside_the_weights(tmp_path):
    cfg = dict(BOOK_CFG, n_heads=4)  # not GPT-2's rule: 128 / 64 would be 2
    book = book_model(cfg)
    path = save_book(book, tmp_path / "model.pth")
    ids = ids_for(cfg)
    by_rule = glassgpt.load_model(path)
    assert by_rule.cfg.n_heads == 2
    assert not torch.allclose(logits(by_rule, ids), logits(book, ids), **TOL)
    torch.testing.assert_close(logits(glassgpt.load_model(path, n_heads=4), ids), logits(book, ids), **TOL)
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    beside = glassgpt.load_model(path)
    assert beside.cfg.n_heads == 4 and beside.cfg.drop_rate == 0.1
    torch.testing.assert_close(logits(beside, ids), logits(book, ids), **TOL)


def test_a_json_beside_the_weights_that_contradicts_them_is_refused(tmp_path):
    path = save_book(book_model(BOOK_CFG), tmp_path / "model.pth")
    (tmp_path / "config.json").write_text(json.dumps(dict(BOOK_CFG, emb_dim=768)))
    with pytest.raises(CheckpointError, match="emb_dim"):
        glassgpt.load_model(path)


def test_a_preset_name_stays_a_preset_whatever_lies_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").write_bytes(b"not a model")
    (tmp_path / "gpt2-book").mkdir()
    (tmp_path / "gpt2-book" / "hparams.json").write_text(json.dumps(HPARAMS))
    for name in ("gpt2", "gpt2-book"):
        assert read_config(name) == glassgpt.PRESETS[name]
        assert glassgpt.load_tokenizer(name).n_vocab == 50257 and glassgpt.load_meta(name) == {}
    assert glassgpt.formats.open("gpt2").notes() == []


def test_info_and_explain_say_which_head_count_rule_was_used(tmp_path, capsys):
    path = save_book(book_model(BOOK_CFG_GPT2_VOCAB), tmp_path / "model.pth")
    code, out, _ = run(["info", "--model", str(path)], capsys)
    assert code == 0 and "n_heads 1 by GPT-2's rule, 64 per head" in out
    code, out, _ = run(["info", "--model", str(path), "--n-heads", "4"], capsys)
    assert code == 0 and "n_heads 4 as given with --n-heads" in out
    code, out, _ = run(["explain", "Every effort", "--model", str(path), "--color", "never"], capsys)
    assert code == 0 and "n_heads 1 by GPT-2's rule" in out


# --- generation: the same tokens as the book's generate -------------------------------------------

@pytest.fixture(scope="module")
def book_pair(tmp_path_factory):
    """(the book's model, glassgpt's load of its model.pth), context_length 24."""
    book = book_model(BOOK_CFG, seed=3)
    path = save_book(book, tmp_path_factory.mktemp("book") / "model.pth")
    return book, glassgpt.load_model(path)


def test_greedy_tokens_equal_the_books_generate(book_pair):
    book, glass = book_pair
    prompt = ids_for(BOOK_CFG, t=5)[:1]
    expected = book_generate(book, prompt, max_new_tokens=22, context_size=BOOK_CFG["context_length"])
    assert torch.equal(glassgpt.generate(glass, prompt, 22), expected)


@pytest.mark.parametrize("seed", [0, 123])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "full-forward"])
def test_seeded_temperature_top_k_samples_equal_the_books_generate(book_pair, seed, use_cache):
    """torch.manual_seed(seed) + the book's generate == glassgpt's generate(seed=seed), past the
    24-token context too (both slide the window)."""
    book, glass = book_pair
    prompt = ids_for(BOOK_CFG, t=5)[:1]
    torch.manual_seed(seed)
    expected = book_generate(book, prompt, max_new_tokens=22, context_size=BOOK_CFG["context_length"],
                             temperature=1.4, top_k=25)
    got = glassgpt.generate(glass, prompt, 22, temperature=1.4, top_k=25, seed=seed, use_cache=use_cache)
    assert torch.equal(got, expected)


def test_top_k_cuts_before_the_temperature_as_the_book_does():
    """1.0 and the float32 just below it are two logits, but divided by 1.7 they round to
    one value: top-1 of the raw logits keeps only the first (the book), top-1 of the
    divided ones would keep both."""
    logits_ = torch.full((1, 5), -3.0)
    logits_[0, 0] = 1.0
    logits_[0, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert logits_[0, 0] / 1.7 == logits_[0, 1] / 1.7
    picks = {int(pick_next(logits_, 1.7, top_k=1, generator=torch.Generator().manual_seed(s))) for s in range(40)}
    assert picks == {0}


def test_the_books_eos_is_dropped_where_glassgpt_keeps_it(book_pair):
    """The one documented difference: the book stops before eos_id, glassgpt appends it."""
    book, glass = book_pair
    prompt = ids_for(BOOK_CFG, t=5)[:1]
    eos = int(glassgpt.generate(glass, prompt, 3)[0, -1])  # the greedy third token
    expected = book_generate(book, prompt, 10, BOOK_CFG["context_length"], eos_id=eos)
    got = glassgpt.generate(glass, prompt, 10, eos_id=eos)
    assert torch.equal(got[:, :-1], expected) and int(got[0, -1]) == eos


# --- chapter 6: a classifier head ---------------------------------------------------------------

def test_a_chapter_6_classifier_gives_the_same_class_scores(tmp_path):
    book = book_model(dict(BOOK_CFG, qkv_bias=True), seed=4)
    torch.manual_seed(5)
    book.out_head = torch.nn.Linear(BOOK_CFG["emb_dim"], 2)  # as chapter 6 does
    path = save_book(book.eval(), tmp_path / "review_classifier.pth")
    glass = glassgpt.load_model(path)
    assert glass.cfg.num_classes == 2
    ids = ids_for(BOOK_CFG)
    torch.testing.assert_close(logits(glass, ids)[:, -1, :], logits(book, ids)[:, -1, :], **TOL)


def test_a_classifier_pth_labels_a_text_on_the_command_line(tmp_path, capsys):
    book = book_model(BOOK_CFG_GPT2_VOCAB, seed=4)
    book.out_head = torch.nn.Linear(BOOK_CFG_GPT2_VOCAB["emb_dim"], 2)
    path = save_book(book.eval(), tmp_path / "review_classifier.pth")
    code, out, err = run(["classify", "You won a free cruise!", "--model", str(path), "--json"], capsys)
    assert code == 0, err
    assert 0.0 <= json.loads(out)["prob"] <= 1.0


# --- back to the book: glassgpt export --format pth ----------------------------------------------

@pytest.mark.parametrize("spec", ["tied-gpt2-shape", "classifier"])
def test_export_book_loads_strictly_into_the_books_gptmodel_with_the_same_logits(tmp_path, capsys, spec):
    cfg = glassgpt.GPTConfig(vocab_size=97, context_length=24, emb_dim=64, n_heads=4, n_layers=2)
    if spec == "classifier":
        cfg = glassgpt.GPTConfig(**{**cfg.to_dict(), "tie_embeddings": False, "num_classes": 3})
    glass = randomize_(glassgpt.load_model("gpt2", config=cfg))
    ckpt = glassgpt.save_model(glass, tmp_path / "ckpt")
    code, out, err = run(["export", str(ckpt), "--format", "pth", "--out", str(tmp_path / "model.pth")], capsys)
    assert code == 0, err
    book_dict = json.loads((tmp_path / "model.json").read_text())
    assert book_dict == book_cfg(cfg) and f"cfg = {book_dict!r}" in out
    book = BookGPTModel(book_dict)
    if spec == "classifier":
        book.out_head = torch.nn.Linear(64, 3)
        assert "model.out_head = torch.nn.Linear(64, 3)" in out
    book.load_state_dict(torch.load(tmp_path / "model.pth", weights_only=True), strict=True)
    ids = ids_for(BOOK_CFG)
    torch.testing.assert_close(logits(book.eval(), ids), logits(glass, ids), **TOL)


def test_export_hf_writes_what_export_hf_writes(tmp_path, capsys):
    glass = randomize_(glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(
        vocab_size=97, context_length=24, emb_dim=64, n_heads=4, n_layers=1)))
    ckpt = glassgpt.save_model(glass, tmp_path / "ckpt")
    code, _, err = run(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], capsys)
    assert code == 0, err
    glassgpt.export_hf(glass, tmp_path / "direct")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes()


def test_book_round_trip_keeps_the_head_count(tmp_path, capsys):
    """glassgpt -> export --format book (the alias) -> glassgpt: the .json beside the .pth carries n_heads."""
    glass = randomize_(glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(
        vocab_size=97, context_length=24, emb_dim=48, n_heads=4, n_layers=1)))
    ckpt = glassgpt.save_model(glass, tmp_path / "ckpt")
    run(["export", str(ckpt), "--format", "book", "--out", str(tmp_path / "model.pth")], capsys)
    back = glassgpt.load_model(tmp_path / "model.pth")
    assert back.cfg.n_heads == 4
    torch.testing.assert_close(logits(back, ids_for(BOOK_CFG)), logits(glass, ids_for(BOOK_CFG)), atol=0, rtol=0)


# --- the gpt2-book presets ------------------------------------------------------------------------

def test_gpt2_book_is_the_books_gpt_config_124m_with_163_009_536_parameters():
    with torch.device("meta"):
        book = BookGPTModel(GPT_CONFIG_124M)
        glass = glassgpt.GPTModel(glassgpt.PRESETS["gpt2-book"])
    assert book_cfg(glassgpt.PRESETS["gpt2-book"]) == GPT_CONFIG_124M
    assert glass.num_parameters() == sum(p.numel() for p in book.parameters()) == 163_009_536


@pytest.mark.parametrize("size, emb_dim, n_layers, n_heads", [
    ("medium", 1024, 24, 16), ("large", 1280, 36, 20), ("xl", 1600, 48, 25)])
def test_gpt2_book_siblings_are_the_books_model_configs(size, emb_dim, n_layers, n_heads):
    cfg = glassgpt.PRESETS[f"gpt2-{size}-book"]
    expected = dict(GPT_CONFIG_124M, emb_dim=emb_dim, n_layers=n_layers, n_heads=n_heads)
    assert book_cfg(cfg) == expected and not cfg.tie_embeddings
    with torch.device("meta"):
        assert glassgpt.GPTModel(cfg).num_parameters() == sum(p.numel() for p in BookGPTModel(expected).parameters())


def test_info_explains_the_gpt2_book_difference_in_one_line(capsys):
    code, out, _ = run(["info", "--model", "gpt2-book", "--json"], capsys)
    assert code == 0
    init, note = json.loads(out)["notes"]
    assert "the book's initialisation" in init  # a random model says in one line how it was drawn
    for number in ("27,648", "[50257, 768]", "163,009,536", "124,439,808"):
        assert number in note
    assert glassgpt.formats.open("gpt2").notes() == []


# --- every command opens the book's files ----------------------------------------------------------

@pytest.fixture(scope="module")
def book_pth(tmp_path_factory) -> Path:
    return save_book(book_model(BOOK_CFG_GPT2_VOCAB, seed=6), tmp_path_factory.mktemp("cmd") / "model.pth")


@pytest.mark.parametrize("argv", [
    ["generate", "Every effort moves you", "--max-new-tokens", "3", "--json"],
    ["info"],
    ["explain", "Every effort moves you", "--format", "json"],
    ["chat", "Say hi", "--max-new-tokens", "2"],
], ids=lambda argv: argv[0])
def test_commands_open_a_book_state_dict(book_pth, capsys, argv):
    code, out, err = run(argv + ["--model", str(book_pth)], capsys)
    assert code == 0, err
    assert out


def test_eval_train_init_and_finetune_open_a_book_state_dict(book_pth, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("Every effort moves you forward, one step at a time. " * 40)
    code, out, err = run(["eval", "--model", str(book_pth), "--data", str(text), "--context-length", "16",
                          "--cache-dir", str(tmp_path / "cache"), "--batch-size", "2", "--eval-batches", "1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["loss"] > 0
    code, _, err = run(["train", "--data", str(text), "--out", str(tmp_path / "run"), "--init", str(book_pth),
                        "--context-length", "16", "--batch-size", "2", "--max-steps", "2", "--no-progress",
                        "--eval-batches", "1", "--sample-tokens", "1", "--no-plot"], capsys)
    assert code == 0, err
    assert glassgpt.load_model(tmp_path / "run").cfg.emb_dim == BOOK_CFG_GPT2_VOCAB["emb_dim"]
    labelled = tmp_path / "train.csv"
    labelled.write_text("text,label\n" + "You won a free cruise!,spam\nSee you at lunch,ham\n" * 8)
    code, _, err = run(["finetune", "classify", "--model", str(book_pth), "--data", str(labelled),
                        "--out", str(tmp_path / "ft"), "--max-steps", "2", "--batch-size", "2", "--no-progress",
                        "--eval-batches", "1", "--no-plot"], capsys)
    assert code == 0, err
    assert glassgpt.load_model(tmp_path / "ft").cfg.num_classes == 2


# --- the OpenAI folder (gpt_download.py's gpt2/124M), written by real TensorFlow --------------------

def test_openai_folder_loads_without_tensorflow_with_the_books_logits(openai_dir, monkeypatch):
    import tensorflow as tf
    params = load_gpt2_params_from_tf_ckpt(tf.train.latest_checkpoint(str(openai_dir)), HPARAMS)
    book = BookGPTModel({"vocab_size": HPARAMS["n_vocab"], "context_length": HPARAMS["n_ctx"],
                         "emb_dim": HPARAMS["n_embd"], "n_heads": HPARAMS["n_head"],
                         "n_layers": HPARAMS["n_layer"], "drop_rate": 0.0, "qkv_bias": True})
    load_weights_into_gpt(book, params)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # any import of tensorflow now fails
    glass = glassgpt.load_model(openai_dir)
    ids = torch.randint(0, HPARAMS["n_vocab"], (2, 13), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(glass, ids), logits(book.eval(), ids), **TOL)
    assert glass.tied  # OpenAI's GPT-2 has one [V, d] matrix; the book copies it into out_head
    assert read_config(openai_dir) == glass.cfg


def test_openai_folder_uses_its_gpt2_vocabulary_files(openai_dir, openai_copy, capsys):
    tok = glassgpt.load_tokenizer(openai_dir)
    assert tok.encode("Every effort moves you") == [6109, 3626, 6100, 345]
    code, out, err = run(["generate", "Every effort moves you", "--model", str(openai_dir),
                          "--max-new-tokens", "3", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["prompt_ids"] == [6109, 3626, 6100, 345]
    code, out, _ = run(["info", "--model", str(openai_dir)], capsys)
    assert "n_heads 2 from hparams.json" in out
    encoder = json.loads((openai_copy / "encoder.json").read_text())
    encoder["Every"], encoder["Ġeffort"] = encoder["Ġeffort"], encoder["Every"]
    (openai_copy / "encoder.json").write_text(json.dumps(encoder))
    with pytest.raises(CheckpointError, match="encoder.json"):
        glassgpt.load_tokenizer(openai_copy)


def test_crc32c_of_the_standard_check_string():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C (RFC 3720)
    assert crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


# --- bad input: one line, exit code 2, nothing written -----------------------------------------------

def export_fails(capsys, tmp_path, model, *words, extra=()):
    out = tmp_path / "exported" / "model.pth"
    code, _, err = run(["export", str(model), "--format", "book", "--out", str(out), *extra], capsys)
    assert_one_line_error(code, err, *words)
    assert not out.parent.exists()


def test_a_pth_with_pickled_code_is_refused_by_name_and_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    state = dict(book_model(BOOK_CFG).state_dict())
    state["tok_emb.weight"] = Trap(str(marker))
    torch.save(state, tmp_path / "evil.pth")
    export_fails(capsys, tmp_path, tmp_path / "evil.pth", "evil.pth", "pickled code")
    assert not marker.exists()


def test_a_state_dict_of_another_architecture_names_its_first_unexpected_key(tmp_path, capsys):
    import transformers
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_positions=24, n_embd=32,
                                                              n_layer=1, n_head=2, bos_token_id=None,
                                                              eos_token_id=None))
    torch.save(hf.state_dict(), tmp_path / "hf.pth")
    export_fails(capsys, tmp_path, tmp_path / "hf.pth", "'transformer.wte.weight'", "tok_emb.weight")


def test_a_truncated_pth_is_one_line(tmp_path, capsys):
    path = save_book(book_model(BOOK_CFG), tmp_path / "model.pth")
    path.write_bytes(path.read_bytes()[:3000])
    export_fails(capsys, tmp_path, path, "model.pth", "truncated")


def test_a_head_count_that_does_not_divide_the_width_is_one_line(tmp_path, capsys):
    path = save_book(book_model(BOOK_CFG), tmp_path / "model.pth")
    export_fails(capsys, tmp_path, path, "--n-heads 5", "emb_dim 128", extra=("--n-heads", "5"))
    with pytest.raises(ConfigError, match="not a multiple of 64"):
        glassgpt.load_model(save_book(book_model(dict(BOOK_CFG, emb_dim=96, n_heads=4)), tmp_path / "w96.pth"))


def test_n_heads_for_a_model_that_sets_its_own_is_one_line(tmp_path, capsys):
    export_fails(capsys, tmp_path, "gpt2-book", "--n-heads", extra=("--n-heads", "4"))


@pytest.mark.parametrize("damage, words", [
    ("truncate-data", ("model.ckpt.data-00000-of-00001", "truncated")),
    ("flip-data", ("model.ckpt.data-00000-of-00001", "CRC-32C")),
    ("truncate-index", ("model.ckpt.index", "truncated")),
    ("flip-index", ("model.ckpt.index", "corrupt")),
    ("no-hparams", ("hparams.json",)),
    ("no-data", ("model.ckpt.data-00000-of-00001", "missing")),
])
def test_a_damaged_openai_folder_is_one_line(openai_copy, tmp_path, capsys, damage, words):
    data, index = openai_copy / "model.ckpt.data-00000-of-00001", openai_copy / "model.ckpt.index"
    if damage == "truncate-data":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip-data":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    elif damage == "truncate-index":
        index.write_bytes(index.read_bytes()[:-20])
    elif damage == "flip-index":
        raw = bytearray(index.read_bytes())
        raw[40] ^= 0x01  # inside a record
        index.write_bytes(bytes(raw))
    elif damage == "no-hparams":
        (openai_copy / "hparams.json").unlink()
    else:
        data.unlink()
    export_fails(capsys, tmp_path, openai_copy, *words)


def test_info_and_export_say_a_state_dict_cannot_record_dropout_and_what_is_assumed(tmp_path, capsys):
    pth = save_book(book_model(BOOK_CFG_GPT2_VOCAB, seed=2), tmp_path / "model.pth")
    code, out, _ = run(["info", "--model", str(pth), "--json"], capsys)
    assert code == 0 and json.loads(out)["config"]["drop_rate"] == 0.0
    (note,) = [n for n in json.loads(out)["notes"] if "dropout" in n]
    assert "drop_rate 0.0 is assumed" in note and "cannot record dropout" in note and "0.1" in note
    code, _, err = run(["export", str(pth), "--format", "hf", "--out", str(tmp_path / "hf")], capsys)
    assert code == 0 and "cannot record dropout" in err
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": 1, "drop_rate": 0.1}))
    code, out, _ = run(["info", "--model", str(pth), "--json"], capsys)
    assert json.loads(out)["config"]["drop_rate"] == 0.1
    assert any("drop_rate 0.1 from model.json" in n for n in json.loads(out)["notes"])
