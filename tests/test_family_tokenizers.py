"""Qwen3's tokenizer.json and Llama 3's tokenizer.model, and their chat formats, against the book's classes.

The files are made here, offline: a small byte-level BPE trained by the `tokenizers` library with
Qwen3's special tokens, and a tiktoken file with Meta's 128,000 ranks (all bytes, all byte pairs,
then three-byte tokens), so that the book's Llama3Tokenizer, which numbers its special tokens from
128,000, and ours agree on every id. Then a model folder with them: `glassgpt.load_model(DIR)`,
`load_tokenizer(DIR)`, `glassgpt generate --model DIR`, and a tokenizer of another vocabulary refused.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

import glassgpt
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.errors import TokenizerError
from glassgpt.families import FamilyConfig, Qwen3Model, build_model
from glassgpt.formats.families import export_family_book, export_family_hf
from glassgpt.formats.family_tokenizers import QWEN_SPECIALS, Llama3Tokenizer, Qwen3Tokenizer
from glassgpt.generate import generate

TEXT = ("The quick brown fox jumps over the lazy dog. Grouped-query attention shares keys and values; "
        "RoPE turns queries and keys by their position. Ünïcödé and emoji 🙂 too.\n") * 20
MESSAGES = ["Give me a short introduction to large language models.", "Hi!\nTwo lines, <think> typed in.", ""]


@pytest.fixture(scope="module")
def qwen_tokenizer_json(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(QWEN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("qwen") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def llama_tokenizer_model(tmp_path_factory) -> Path:
    singles = [bytes([i]) for i in range(256)]
    pairs = [bytes([i, j]) for i in range(256) for j in range(256)]
    triples = [bytes([97 + i % 26, 97 + (i // 26) % 26, 32 + i // 676]) for i in range(128_000 - 256 - 65_536)]
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(singles + pairs + triples)]
    path = tmp_path_factory.mktemp("llama") / "tokenizer.model"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_chat_ids_equal_the_books_tokenizer(qwen_tokenizer_json, thinking):
    ours = Qwen3Tokenizer(qwen_tokenizer_json)
    book = book_qwen.Qwen3Tokenizer(str(qwen_tokenizer_json), apply_chat_template=True, add_generation_prompt=True,
                                    add_thinking=thinking)
    for message in MESSAGES:
        assert ours.chat(message, thinking=thinking) == book.encode(message)
    ids = ours.chat(MESSAGES[0], thinking=thinking)
    assert ours.decode(ids) == book.decode(ids)
    # thinking off: an empty think block opens the reply; on: the model writes its own
    assert ours.decode(ids).endswith("<think>\n\n</think>\n\n") != thinking


def test_qwen3_plain_text_ids_equal_the_books_and_decode_back(qwen_tokenizer_json):
    ours = Qwen3Tokenizer(qwen_tokenizer_json)
    book = book_qwen.Qwen3Tokenizer(str(qwen_tokenizer_json), apply_chat_template=False)
    for text in [TEXT[:200], "<|endoftext|>", "a <|im_start|> b"] + MESSAGES:
        assert ours.encode(text) == book.encode(text)
        assert ours.decode(ours.encode(text)) == text


def test_llama3_chat_format_ids_equal_the_books(llama_tokenizer_model):
    ours = Llama3Tokenizer(llama_tokenizer_model)
    book_tok = book_llama.Llama3Tokenizer(str(llama_tokenizer_model))
    chat = book_llama.ChatFormat(book_tok)
    assert ours.n_vocab == 128_256 and ours.eot_id == 128_009
    for message in MESSAGES:
        assert ours.chat(message) == chat.encode(message)
        assert ours.encode(message) == book_tok.encode(message)
    assert ours.chat("hi", system_message="Be brief.") == chat.encode("hi", system_message="Be brief.")
    assert ours.decode(ours.encode(TEXT[:300])) == TEXT[:300]


QWEN_TINY = FamilyConfig(family="qwen3", vocab_size=416, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                         hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                         tie_embeddings=True)


def qwen_folder(path: Path, tokenizer_json: Path, cfg: FamilyConfig = QWEN_TINY) -> Path:
    torch.manual_seed(0)
    export_family_hf(build_model(cfg).eval(), path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return path


def test_load_model_and_load_tokenizer_read_a_qwen3_folder(tmp_path, qwen_tokenizer_json):
    folder = qwen_folder(tmp_path / "qwen", qwen_tokenizer_json)
    model = glassgpt.load_model(folder)
    tok = glassgpt.load_tokenizer(folder)
    assert isinstance(model, Qwen3Model) and model.cfg == QWEN_TINY and model.tied
    assert isinstance(tok, Qwen3Tokenizer)
    assert glassgpt.load_model(folder, dtype="bfloat16").tok_emb.weight.dtype == torch.bfloat16
    # the book's .pth with its config beside it loads through the same door, to the same logits
    export_family_book(model, tmp_path / "book" / "model.pth")
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        assert torch.equal(glassgpt.load_model(tmp_path / "book" / "model.pth")(ids), model(ids))


def test_glassgpt_generate_runs_a_qwen3_folder(tmp_path, qwen_tokenizer_json, capsys):
    from glassgpt.cli import main
    folder = qwen_folder(tmp_path / "qwen", qwen_tokenizer_json)
    assert main(["generate", "The quick", "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert out["prompt_ids"] == tok.encode("The quick")
    assert out["new_ids"] == generate(model, out["prompt_ids"], 5)[0, -5:].tolist()


def test_a_tokenizer_with_more_ids_than_the_model_has_rows_is_named_before_anything_runs(tmp_path,
                                                                                         qwen_tokenizer_json):
    small = FamilyConfig(**{**QWEN_TINY.to_dict(), "vocab_size": 97})
    folder = qwen_folder(tmp_path / "qwen", qwen_tokenizer_json, small)
    (folder / "model.safetensors").write_bytes(b"not read")  # refused before the weights are read
    for load in (glassgpt.load_model, glassgpt.load_tokenizer):
        with pytest.raises(TokenizerError, match=r"tokenizer.json has \d+ tokens but the model's vocab_size is 97"):
            load(folder)


def test_a_gemma_folder_is_refused_by_load_model_naming_its_architecture(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3"}))
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'} is a Gemma3ForCausalLM (gemma3): glassgpt covers Qwen3ForCausalLM "
        "(qwen3), LlamaForCausalLM (llama3), Olmo3ForCausalLM (olmo3), Cohere2ForCausalLM (tiny_aya) and "
        "GPT2LMHeadModel (gpt2)"]


def test_load_model_and_load_tokenizer_read_a_llama_folder_with_its_tokenizer_model(tmp_path, llama_tokenizer_model):
    from glassgpt.families import Llama3Model, RopeFreq
    from glassgpt.errors import ConfigError
    cfg = FamilyConfig(family="llama3", vocab_size=128_256, context_length=32, emb_dim=8, n_heads=2, n_layers=1,
                       hidden_dim=16, n_kv_groups=1, rope_base=500_000.0, rope_freq=RopeFreq(), norm_eps=1e-5,
                       tie_embeddings=True)
    torch.manual_seed(0)
    export_family_hf(build_model(cfg).eval(), tmp_path)
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(llama_tokenizer_model.read_bytes())  # as Meta's repos keep it
    model, tok = glassgpt.load_model(tmp_path), glassgpt.load_tokenizer(tmp_path)
    assert isinstance(model, Llama3Model) and model.cfg == cfg and isinstance(tok, Llama3Tokenizer)
    ids = tok.chat("hi")
    assert generate(model, ids, 3).shape == (1, len(ids) + 3)
    with pytest.raises(ConfigError, match="sets its own shapes: drop n_heads"):
        glassgpt.load_model(tmp_path, n_heads=2)
