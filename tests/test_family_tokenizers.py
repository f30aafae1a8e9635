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
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'} is a Gemma2ForCausalLM (gemma2): glassgpt covers Qwen3ForCausalLM "
        "(qwen3), Qwen3MoeForCausalLM (qwen3), LlamaForCausalLM (llama3), Gemma3ForCausalLM (gemma3), "
        "Qwen3_5ForCausalLM (qwen3_5), Olmo3ForCausalLM (olmo3), Cohere2ForCausalLM (tiny_aya), "
        "Gemma4ForCausalLM (gemma4) and "
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


# --- files read by what they are: the book's .pth without its JSON or its tokenizer, --tokenizer ---------

def book_files(tmp_path: Path, cfg: FamilyConfig = QWEN_TINY) -> Path:
    """The book's Qwen3/Llama files as a reader saves them: model.pth (torch.save of the state dict) and model.json."""
    torch.manual_seed(0)
    return export_family_book(build_model(cfg).eval(), tmp_path / "model.pth")


def test_a_qwen3_pth_without_its_json_is_named_with_what_its_tensors_tell_and_what_they_cannot(tmp_path, capsys):
    from glassgpt.cli import main
    pth = book_files(tmp_path)
    pth.with_suffix(".json").unlink()
    assert main(["explain", "--model", str(pth)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "looks like the book's Qwen3Model (llms_from_scratch.qwen3)" in err[0]
    # q_norm is a head wide, so the head counts are told; the RoPE base and the context length are not
    assert ("vocab_size 416, emb_dim 32, n_layers 2, hidden_dim 48, head_dim 16, n_heads 4, n_kv_groups 2" in err[0]
            and "but not context_length, rope_base" in err[0] and "as JSON in model.json beside it" in err[0])
    assert "another architecture" not in err[0]


def test_a_llama_pth_without_its_json_says_its_head_counts_cannot_be_told():
    from glassgpt.errors import CheckpointError
    from glassgpt.families import RopeFreq
    cfg = FamilyConfig(family="llama3", vocab_size=300, context_length=32, emb_dim=16, n_heads=4, n_layers=1,
                       hidden_dim=24, n_kv_groups=2, rope_base=500_000.0, rope_freq=RopeFreq(), norm_eps=1e-5)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        pth = book_files(Path(d), cfg)
        pth.with_suffix(".json").unlink()
        with pytest.raises(CheckpointError, match=r"Llama3Model .* tell vocab_size 300, emb_dim 16, n_layers 1, "
                                                  r"hidden_dim 24, tie_embeddings False, but not n_heads, n_kv_groups, "
                                                  r"context_length, rope_base, rope_freq"):
            glassgpt.load_model(pth)


def test_a_pth_without_its_tokenizer_names_its_folder_and_the_tokenizer_flag(tmp_path, capsys, monkeypatch):
    from glassgpt.cli import main
    pth = book_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # as a reader runs it: the file named without a folder
    assert main(["explain", "--model", "model.pth"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: model.pth's folder {tmp_path.resolve()} has no tokenizer.json: put the model's own "
                       "tokenizer.json beside its weights, or give it with --tokenizer FILE (tokenizer=FILE), or read "
                       "the prompt with GPT-2's (--tokenizer gpt2)")
    # the first line names where the config came from, and what nothing in it said
    assert err[0] == ("note: config: model.json beside model.pth, the book's Qwen3Model (llms_from_scratch.qwen3) "
                      "dict; assumed, as the book's code has them: norm_eps 1e-06")


def test_tokenizer_flag_reads_a_tokenizer_json_or_gpt2_in_place_of_the_models_own(tmp_path, qwen_tokenizer_json, capsys):
    from glassgpt.cli import main
    pth = book_files(tmp_path)
    assert main(["generate", "The quick", "--model", str(pth), "--tokenizer", str(qwen_tokenizer_json),
                 "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == Qwen3Tokenizer(qwen_tokenizer_json).encode("The quick")
    # GPT-2's tokenizer has more ids (50,257) than this model has rows (416): refused in one line
    assert main(["generate", "The quick", "--model", str(pth), "--tokenizer", "gpt2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --tokenizer gpt2 has 50,257 tokens but the model's vocab_size is 416: it is another model's "
        "tokenizer; use the one saved with these weights")
    assert glassgpt.formats.open(pth, tokenizer=qwen_tokenizer_json).tokenizer().n_vocab <= 416
    assert main(["info", "--model", str(pth), "--tokenizer", str(tmp_path / "nothing.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --tokenizer {tmp_path / 'nothing.json'}: no such file: give gpt2, a tokenizer.json or a "
        "tokenizer.model")


def test_every_command_that_reads_a_model_takes_tokenizer():
    """--model's commands take --tokenizer gpt2|FILE (train and eval keep their own gpt2|char|FILE)."""
    import argparse
    from glassgpt.cli import build_parser
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    def leaves(p):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return [leaf for s in subs for q in s.choices.values() for leaf in leaves(q)] if subs else [p]

    readers = [p for c in commands.values() for p in leaves(c)
               if any("--model" in a.option_strings for a in p._actions)]
    assert len(readers) >= 10
    lacking = [p.prog for p in readers if not any("--tokenizer" in a.option_strings for a in p._actions)]
    assert lacking == []
