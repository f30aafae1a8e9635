"""Chapter 5 with the next models: `glassgpt train --recipe book --model qwen3-0.6b|llama3.2-1b` (or a
Qwen3 / Llama config .json) against the book's ch05/14_ch05_with_other_llms loop, side by side.

The notebooks run chapter 5's `train_model_simple` on the book's own Qwen3Model / Llama3Model, with
windows of `train_context_length` tokens while the model keeps its context_length, and a sample of
`generate_and_print_sample` whose context is `model.cfg["context_length"]`. The notebooks cannot be
imported, so the book's side here is the installed `llms_from_scratch` (the same classes, the same
`train_model_simple`) with that one sampling function as the notebooks write it. A tiny config (2 blocks
32 wide, 4 query heads in 2 key/value groups, windows of 16) on the first 6,000 characters of
the-verdict, one epoch: every printed line and the weights it ends with, bit for bit (one thread both).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main

from helpers import CH05_TEXT as TEXT, one_line_error

ch02 = pytest.importorskip("llms_from_scratch.ch02", reason="the README's test command installs llms-from-scratch")
from llms_from_scratch import ch05 as book_ch05  # noqa: E402
from llms_from_scratch.llama3 import Llama3Model  # noqa: E402
from llms_from_scratch.qwen3 import Qwen3Model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tiktoken")

WINDOW = 16  # the notebooks' train_context_length (256 there)
TINY = {  # the notebooks' config dicts at a tiny size; GPT-2's vocabulary (the tokenizer both sides read)
    "qwen3": dict(vocab_size=50257, context_length=64, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=48,
                  head_dim=8, qk_norm=True, n_kv_groups=2, rope_base=1_000_000.0),
    "llama3": dict(vocab_size=50257, context_length=64, emb_dim=32, n_heads=4, n_layers=2, hidden_dim=48,
                   n_kv_groups=2, rope_base=500_000.0,
                   rope_freq=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_context_length=8192)),
}
BOOK_CLASS = {"qwen3": Qwen3Model, "llama3": Llama3Model}


def notebook_sample(model, tokenizer, device, start_context):
    """generate_and_print_sample as the two notebooks write it: the context is the model's
    `cfg["context_length"]` (chapter 5's reads `model.pos_emb`, which these models do not have)."""
    model.eval()
    encoded = book_ch05.text_to_token_ids(start_context, tokenizer).to(device)
    with torch.no_grad():
        token_ids = book_ch05.generate_text_simple(model=model, idx=encoded, max_new_tokens=50,
                                                   context_size=model.cfg["context_length"])
    print(book_ch05.token_ids_to_text(token_ids, tokenizer).replace("\n", " "))
    model.train()


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verdict") / "verdict-6000.txt"
    path.write_text(TEXT[0], encoding="utf-8")
    return path


def book_run(family: str, text: str):
    """The notebook: loaders (batch 2, stride = window), seed, model, AdamW, train_model_simple, 1 epoch."""
    torch.set_num_threads(1)
    split = int(0.90 * len(text))
    kw = dict(batch_size=2, max_length=WINDOW, stride=WINDOW, num_workers=0)
    train_loader = ch02.create_dataloader_v1(text[:split], drop_last=True, shuffle=True, **kw)
    val_loader = ch02.create_dataloader_v1(text[split:], drop_last=False, shuffle=False, **kw)
    torch.manual_seed(123)
    model = BOOK_CLASS[family]({**TINY[family], "dtype": torch.float32})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
        mp.setattr(book_ch05, "generate_and_print_sample", notebook_sample)
        book_ch05.train_model_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=1, eval_freq=5,
                                     eval_iter=5, start_context="Every effort moves you",
                                     tokenizer=ch02.tiktoken.get_encoding("gpt2"))
    return printed.getvalue().splitlines(), model.state_dict()


def glass_run(family: str, text: Path, out: Path, *flags: str):
    config = out.parent / f"{family}-tiny.json"
    config.write_text(json.dumps({"family": family, **TINY[family]}), encoding="utf-8")
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        assert main(["train", "--recipe", "book", "--model", str(config), "--data", str(text), "--out", str(out),
                     "--context-length", str(WINDOW), "--threads", "1", "--no-progress", *flags]) == 0
    return printed.getvalue().splitlines(), said.getvalue()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_first_epoch_prints_the_notebooks_lines_and_ends_with_its_weights(family, text, tmp_path):
    book_lines, book_state = book_run(family, text.read_text(encoding="utf-8"))
    lines, said = glass_run(family, text, tmp_path / "run", "--epochs", "1")
    ours = [line for line in lines if line.startswith(("Ep ", "Every effort moves you"))]
    assert book_lines[0].startswith("Ep 1 (Step 000000): Train loss ") and len(book_lines) >= 3
    assert ours == book_lines  # every evaluation line and the sample, character for character
    saved = load_file(tmp_path / "run" / "latest" / "model.safetensors")
    assert set(book_state) <= set(saved)
    for name, value in book_state.items():
        assert torch.equal(saved[name], value), name  # bit for bit
    assert "ch05-qwen3.ipynb" in said if family == "qwen3" else "ch05-llama32.ipynb" in said


def test_a_config_json_that_leaves_norm_eps_gets_the_books_for_its_family(tmp_path):
    """The book's Qwen3 RMSNorm has eps 1e-6, its Llama's nn.RMSNorm 1e-5: a config .json that does not say
    takes its family's (the llama test above differs in the fifth digit with 1e-6)."""
    from glassgpt.formats import get_config
    for family, eps in (("qwen3", 1e-6), ("llama3", 1e-5)):
        path = tmp_path / f"{family}.json"
        path.write_text(json.dumps({"family": family, **TINY[family]}), encoding="utf-8")
        assert get_config(path).norm_eps == eps


@pytest.mark.parametrize("preset,family", [("qwen3-0.6b", "qwen3"), ("llama3.2-1b", "llama3")])
def test_a_preset_keeps_its_context_trains_its_own_head_for_the_notebooks_40_epochs(preset, family, tmp_path):
    text, out = tmp_path / "text.txt", tmp_path / "run"  # long enough for 256-token windows, stand-in or not
    text.write_text(TEXT[0] * 8, encoding="utf-8")
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        assert main(["train", "--recipe", "book", "--model", preset, "--n-layers", "1", "--emb-dim", "32",
                     "--n-heads", "4", "--data", str(text), "--out", str(out), "--max-steps", "1",
                     "--threads", "1", "--no-progress"]) == 0
    note = said.getvalue()
    assert "windows of 256 tokens (train_context_length; the model keeps context_length" in note
    assert "its own out_head" in note and "bfloat16" in note and "GPT-2 tokenizer" in note
    cfg = json.loads((out / "latest" / "config.json").read_text())
    assert cfg["family"] == family and cfg["tie_embeddings"] is False
    assert cfg["context_length"] in (40_960, 131_072) and cfg["vocab_size"] == 50257
    saved = load_file(out / "latest" / "model.safetensors")
    assert saved["out_head.weight"].data_ptr() != saved["tok_emb.weight"].data_ptr()
    assert not torch.equal(saved["out_head.weight"], saved["tok_emb.weight"])
    # the notebooks' 40 epochs when neither --epochs nor --max-steps is given
    from glassgpt.training.book.ch05 import NEXT_MODELS
    assert NEXT_MODELS[family].epochs == 40 and NEXT_MODELS[family].window == 256


def test_a_window_longer_than_the_models_context_is_refused_in_one_line(text, tmp_path, capsys):
    config = tmp_path / "qwen3.json"
    config.write_text(json.dumps({"family": "qwen3", **TINY["qwen3"]}), encoding="utf-8")
    assert main(["train", "--recipe", "book", "--model", str(config), "--data", str(text), "--out",
                 str(tmp_path / "run"), "--context-length", "128", "--no-progress"]) != 0
    message = one_line_error(capsys)
    assert "--context-length 128 is longer than" in message and "context_length 64" in message


class _BookTokenizerForChapter2:
    """The notebook's own Qwen3Tokenizer where chapter 2's GPTDatasetV1 and chapter 5's text_to_token_ids pass
    tiktoken's `allowed_special` (the notebook's GPTDatasetV1 calls plain `tokenizer.encode(txt)`)."""

    def __init__(self, book):
        self.book = book

    def encode(self, text, allowed_special=None):
        return self.book.encode(text)

    def decode(self, ids):
        return self.book.decode(ids)


def test_the_notebook_with_qwen3s_own_tokenizer_json_and_the_run_keeps_that_file(text, tmp_path):
    """--tokenizer tokenizer.json (a tiny byte-level BPE with Qwen3's specials, as the hub's file is built):
    the lines equal the notebook's loop on the book's Qwen3Tokenizer; the checkpoint holds the file, and
    generate reads it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from llms_from_scratch.qwen3 import Qwen3Tokenizer
    from torch.utils.data import DataLoader
    from glassgpt.formats.family_tokenizers import QWEN_SPECIALS

    raw = text.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([raw], trainers.BpeTrainer(vocab_size=300, special_tokens=list(QWEN_SPECIALS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cfg = {**TINY["qwen3"], "vocab_size": tok.get_vocab_size()}

    torch.set_num_threads(1)
    book_tok = _BookTokenizerForChapter2(Qwen3Tokenizer(str(path), apply_chat_template=False))
    split = int(0.90 * len(raw))
    loader = lambda part, train: DataLoader(ch02.GPTDatasetV1(part, book_tok, WINDOW, WINDOW), batch_size=2,  # noqa: E731
                                            shuffle=train, drop_last=train, num_workers=0)
    train_loader, val_loader = loader(raw[:split], True), loader(raw[split:], False)
    torch.manual_seed(123)
    model = Qwen3Model({**cfg, "dtype": torch.float32})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
        mp.setattr(book_ch05, "generate_and_print_sample", notebook_sample)
        book_ch05.train_model_simple(model, train_loader, val_loader, optimizer, "cpu", num_epochs=1, eval_freq=5,
                                     eval_iter=5, start_context="Every effort moves you", tokenizer=book_tok)
    book_lines = printed.getvalue().splitlines()

    config, out = tmp_path / "qwen3.json", tmp_path / "run"
    config.write_text(json.dumps({"family": "qwen3", **cfg}), encoding="utf-8")
    lines, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(lines), contextlib.redirect_stderr(said):
        assert main(["train", "--recipe", "book", "--model", str(config), "--tokenizer", str(path), "--data",
                     str(text), "--out", str(out), "--context-length", str(WINDOW), "--epochs", "1",
                     "--threads", "1", "--no-progress"]) == 0
    ours = [line for line in lines.getvalue().splitlines() if line.startswith(("Ep ", "Every effort moves you"))]
    assert book_lines[0].startswith("Ep 1 (Step 000000)") and ours == book_lines
    assert f"the tokenizer {path}" in said.getvalue()
    assert (out / "latest" / "tokenizer.json").read_bytes() == path.read_bytes()  # the file itself, kept
    generated = io.StringIO()
    with contextlib.redirect_stdout(generated), contextlib.redirect_stderr(io.StringIO()):
        assert main(["generate", "Every effort", "--model", str(out), "--max-new-tokens", "3",
                     "--threads", "1"]) == 0
    assert generated.getvalue().startswith("Every effort")


def test_a_checkpoints_record_of_a_tokenizer_file_is_refused_in_one_line_naming_the_flag():
    from glassgpt.errors import TokenizerError
    from glassgpt.tokenizer import tokenizer_from_dict
    with pytest.raises(TokenizerError, match=r"names the tokenizer file 'tokenizer.model'.*--tokenizer PATH"):
        tokenizer_from_dict({"type": "file", "name": "llama3", "file": "tokenizer.model", "sha256": "0" * 64})
