"""Crafted and hostile files: every command answers each in one line, naming the file and the
field in the file's own words, within seconds, and allocates nothing the file does not justify.

Each test crafts one kind of lie (a safetensors header about its length or its tensors' sizes, a
config whose sizes would need terabytes or whose values are of the wrong kind, a .pth of garbage or
of non-tensors, a state dict whose tensors disagree, the TensorFlow folder's index and hparams.json,
tokenizer.json, meta.json, train_state.json, a GGUF file) and runs the command a reader would.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import struct
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import glassgpt
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, GlassError, TokenizerError
from glassgpt.formats import export_hf, load_meta, random_model, save_model

from helpers import assert_one_line_error, run

SECONDS = 30  # "within seconds": a deadline, not a speed test (the slowest answer takes well under one here)
PEAK_GROWTH = 1 << 30  # bytes the process's peak memory may grow by while it answers: nothing the file claims
CFG = GPTConfig(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, n_layers=2)


@contextlib.contextmanager
def bounded(argv):
    """Fail if answering waits past SECONDS or raises the process's peak memory by PEAK_GROWTH."""
    def expired(signum, frame):
        raise AssertionError(f"glassgpt {' '.join(argv)} gave no answer within {SECONDS} s")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: kilobytes)
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < PEAK_GROWTH, f"answering took {grown / 2**20:,.0f} MiB more memory at its peak"


def answer(capsys, *argv: str, words: tuple[str, ...] = ()) -> str:
    """`glassgpt ARGV`'s one-line error, after checking it came without a long wait or a large
    allocation, and named `words`."""
    with bounded(argv):
        code, _, err = run(list(argv), capsys)
    err = "\n".join(line for line in err.splitlines() if not line.startswith(("note:", "threads:")))
    assert_one_line_error(code, err, *words)
    return err.strip()


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture
def ckpt(tmp_path, model) -> Path:
    return save_model(model, tmp_path / "ckpt")


@pytest.fixture
def hf_dir(tmp_path, model) -> Path:
    return export_hf(model, tmp_path / "hf")


def write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# --- safetensors headers that lie ---------------------------------------------------------------

def test_a_safetensors_header_longer_than_the_file_is_refused(capsys, ckpt):
    st = ckpt / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])  # claims a terabyte of header
    answer(capsys, "info", "--model", str(ckpt), words=("model.safetensors", "header", "1,099,511,627,776"))


def test_a_tensor_whose_data_offsets_disagree_with_its_shape_is_named(capsys, ckpt):
    st = ckpt / "model.safetensors"
    write_header(st, {"tok_emb.weight": {"dtype": "F32", "shape": [50257, 32], "data_offsets": [0, 64]}}, b"\0" * 64)
    answer(capsys, "info", "--model", str(ckpt), words=("tok_emb.weight", "data_offsets", "6,432,896 bytes"))


def test_a_tensor_past_the_end_of_the_file_is_named(capsys, ckpt):
    st = ckpt / "model.safetensors"
    need = 50257 * 32 * 4
    write_header(st, {"tok_emb.weight": {"dtype": "F32", "shape": [50257, 32], "data_offsets": [0, need]}}, b"\0" * 100)
    answer(capsys, "generate", "hi", "--model", str(ckpt), words=("tok_emb.weight", "truncated"))


def test_a_tensor_of_a_dtype_safetensors_does_not_define_is_named(capsys, ckpt):
    write_header(ckpt / "model.safetensors", {"tok_emb.weight": {"dtype": "F128", "shape": [2], "data_offsets": [0, 32]}},
                 b"\0" * 32)
    answer(capsys, "info", "--model", str(ckpt), words=("tok_emb.weight", "'F128'"))


def test_a_pytorch_model_bin_of_non_tensors_is_one_line(capsys, hf_dir):
    (hf_dir / "model.safetensors").unlink()
    torch.save({"wte.weight": [1, 2, 3]}, hf_dir / "pytorch_model.bin")
    answer(capsys, "info", "--model", str(hf_dir), words=("pytorch_model.bin", "other things than tensors"))


def test_a_safetensors_header_that_is_not_json_is_refused(capsys, ckpt):
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 10)
    answer(capsys, "info", "--model", str(ckpt), words=("model.safetensors", "not JSON"))


# --- configs that claim terabytes, or values of the wrong kind ---------------------------------------

def test_a_hf_config_claiming_100000_layers_of_65536_beside_small_weights_is_refused_at_once(capsys, hf_dir):
    raw = json.loads((hf_dir / "config.json").read_text())
    raw.update(n_layer=100_000, n_embd=65_536, n_head=512)
    (hf_dir / "config.json").write_text(json.dumps(raw))
    answer(capsys, "generate", "hi", "--model", str(hf_dir), words=("config.json", "n_embd 65,536", "wte.weight"))


def test_a_hf_config_claiming_more_layers_than_the_weights_hold_names_n_layer(capsys, hf_dir):
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, "n_layer": 100_000}))
    answer(capsys, "generate", "hi", "--model", str(hf_dir), words=("n_layer 100,000", "2 blocks"))


@pytest.mark.parametrize("name, value", [("n_embd", "768"), ("n_layer", 2.0), ("n_head", True),
                                         ("n_positions", -16), ("tie_word_embeddings", "false")])
def test_a_hf_config_value_of_the_wrong_kind_is_named_as_the_file_names_it(capsys, hf_dir, name, value):
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, name: value}))
    err = answer(capsys, "info", "--model", str(hf_dir), words=("config.json", name, repr(value)))
    assert "emb_dim" not in err  # glassgpt's name for n_embd: not a word of this file


def test_a_glassgpt_config_claiming_100000_layers_is_refused_by_its_own_name(capsys, ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "n_layers": 100_000, "emb_dim": 65_536, "n_heads": 512}))
    answer(capsys, "generate", "hi", "--model", str(ckpt), words=("config.json", "emb_dim 65,536", "tok_emb.weight"))


@pytest.mark.parametrize("name, value", [("emb_dim", "32"), ("qkv_bias", "yes"), ("drop_rate", "0.1")])
def test_a_glassgpt_config_value_of_the_wrong_kind_is_named(capsys, ckpt, name, value):
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, name: value}))
    answer(capsys, "info", "--model", str(ckpt), words=("config.json", name, repr(value)))


def test_a_config_file_that_would_need_terabytes_is_refused_with_the_numbers(capsys, tmp_path):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"n_layers": 100_000, "emb_dim": 65_536, "n_heads": 512}))
    err = answer(capsys, "generate", "hi", "--model", str(path), words=("huge.json", "n_layers 100,000", "GiB"))
    assert "parameters" in err


def test_a_json_file_far_too_big_for_a_config_is_refused_without_reading_it(capsys, ckpt):
    with open(ckpt / "config.json", "r+b") as f:
        f.truncate(100 << 20)  # a sparse 100 MiB file: reading it would be the allocation refused
    answer(capsys, "info", "--model", str(ckpt), words=("config.json", "104,857,600 bytes"))


# --- .pth files: garbage, non-tensors, tensors that disagree ------------------------------------------

def test_a_pth_of_garbage_is_one_line(capsys, tmp_path):
    path = tmp_path / "model.pth"
    path.write_bytes(b"garbage!" * 100)
    answer(capsys, "info", "--model", str(path), words=("model.pth", "not a PyTorch file"))


@pytest.mark.parametrize("obj", [[1, 2, 3], {"tok_emb.weight": 3}, {"epoch": 2}, {}])
def test_a_pth_of_non_tensors_is_one_line(capsys, tmp_path, obj):
    path = tmp_path / "model.pth"
    torch.save(obj, path)
    answer(capsys, "info", "--model", str(path), words=("model.pth", "no state dict"))


def book_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k != "out_head.weight"}


def save_pth(state: dict, tmp_path: Path) -> str:
    """model.pth with its cfg beside it (emb_dim 32 has no GPT-2 head count of its own)."""
    torch.save(state, tmp_path / "model.pth")
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": 2}))
    return str(tmp_path / "model.pth")


def test_a_state_dict_whose_embeddings_disagree_on_emb_dim_is_named(capsys, tmp_path, model):
    state = book_state(model)
    state["pos_emb.weight"] = torch.zeros(16, 48)
    torch.save(state, tmp_path / "model.pth")
    answer(capsys, "info", "--model", str(tmp_path / "model.pth"), words=("pos_emb.weight", "[16, 48]", "[50257, 32]"))


def test_a_state_dict_with_a_block_numbered_past_the_rest_is_refused_before_building(capsys, tmp_path, model):
    state = book_state(model)
    state["trf_blocks.99999.norm1.scale"] = torch.ones(32)  # would make a 100,000-block model
    torch.save(state, tmp_path / "model.pth")
    answer(capsys, "generate", "hi", "--model", str(tmp_path / "model.pth"), words=("trf_blocks.99999", "0..n_layers-1"))


def test_a_state_dict_tensor_of_the_wrong_shape_is_named_with_both_shapes(capsys, tmp_path, model):
    state = book_state(model)
    state["trf_blocks.1.ff.layers.0.weight"] = torch.zeros(100, 32)
    answer(capsys, "generate", "hi", "--model", save_pth(state, tmp_path),
           words=("trf_blocks.1.ff.layers.0.weight", "[100, 32]", "[128, 32]"))


def test_a_state_dict_of_integer_weights_is_named(capsys, tmp_path, model):
    state = book_state(model)
    state["trf_blocks.0.norm1.scale"] = torch.ones(32, dtype=torch.int64)
    torch.save(state, tmp_path / "model.pth")
    answer(capsys, "info", "--model", str(tmp_path / "model.pth"), words=("trf_blocks.0.norm1.scale", "int64"))


def test_a_cfg_beside_a_pth_with_a_string_n_heads_is_named(capsys, tmp_path, model):
    torch.save(book_state(model), tmp_path / "model.pth")
    (tmp_path / "model.json").write_text(json.dumps({"n_heads": "2"}))
    answer(capsys, "info", "--model", str(tmp_path / "model.pth"), words=("model.json", "n_heads", "'2'"))


# --- the TensorFlow folder: hparams.json and the index ---------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"n_embd": "64"}, ("hparams.json", "n_embd", "'64'")),
    ({"n_layer": 100_000}, ("hparams.json", "n_layer 100,000")),
    ({"n_embd": 65_536, "n_head": 1}, ("hparams.json", "n_embd 65,536", "model/wte")),
])
def test_hparams_json_that_lies_is_named_in_its_own_words(capsys, openai_copy, change, words):
    h = json.loads((openai_copy / "hparams.json").read_text())
    (openai_copy / "hparams.json").write_text(json.dumps({**h, **change}))
    answer(capsys, "generate", "hi", "--model", str(openai_copy), words=words)


def test_a_garbage_index_is_one_line(capsys, openai_copy):
    (openai_copy / "model.ckpt.index").write_bytes(b"\x01" * 200)
    answer(capsys, "info", "--model", str(openai_copy), words=("model.ckpt.index",))


def test_a_data_file_shorter_than_the_index_says_is_refused_before_reading(capsys, openai_copy):
    data = openai_copy / "model.ckpt.data-00000-of-00001"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    answer(capsys, "generate", "hi", "--model", str(openai_copy), words=("model.ckpt.data-00000-of-00001", "truncated"))


# --- the small JSON files beside the weights ----------------------------------------------------------

@pytest.mark.parametrize("spec, words", [
    ({"type": "char", "chars": 5}, ("chars", "5")),
    ({"type": "bpe", "tokens": "abc"}, ("tokens",)),
    ({"type": "bpe", "tokens": ["!!"] * 300}, ("base64",)),
    ({"type": "wordpiece"}, ("wordpiece",)),
])
def test_a_crafted_tokenizer_json_is_named(capsys, ckpt, spec, words):
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    answer(capsys, "generate", "hi", "--model", str(ckpt), words=("tokenizer.json",) + words)


@lru_cache(maxsize=1)
def learned_bpe() -> dict:
    """A small byte-level BPE as train_bpe saves it: 256 bytes, then 44 merges."""
    from glassgpt.tokenizer import train_bpe
    return train_bpe("the cat sat on the mat, the dog sat on the log. " * 20, 300).to_dict()


def merges_out_of_order(spec: dict) -> dict:
    tokens = list(spec["tokens"])
    tokens[256], tokens[-1] = tokens[-1], tokens[256]  # the last merge before the pieces it is made of
    return {**spec, "tokens": tokens}


def a_byte_missing(spec: dict) -> dict:
    tokens = list(spec["tokens"])
    tokens[65], tokens[256] = tokens[256], tokens[65]  # 'A' moved past the first 256
    return {**spec, "tokens": tokens}


HOSTILE_TOKENIZERS = {  # what is wrong -> (the spec, the words of its one line)
    "a pattern that backtracks without end": (lambda s: {**s, "pattern": r"(?:a|aa)+(?=b)|\s"},
                                              ("pattern", "backtrack without end")),
    "an empty pattern": (lambda s: {**s, "pattern": ""}, ("pattern must be a non-empty regular expression",)),
    "a pattern that matches nothing": (lambda s: {**s, "pattern": "(?!)"}, ("pattern '(?!)' matches nothing",)),
    "a pattern that drops spaces": (lambda s: {**s, "pattern": r"\w+|[^\w\s]"}, ("pattern", "drops text")),
    "a pattern that is not a regex": (lambda s: {**s, "pattern": "[a-z"}, ("pattern", "not a regular expression")),
    "a pattern that is not a string": (lambda s: {**s, "pattern": 5}, ("pattern must be a string",)),
    "merges out of order": (merges_out_of_order, ("tokens[256]", "not the merge of two earlier tokens")),
    "a byte missing": (a_byte_missing, ("tokens must start with the 256 single bytes", "byte 65")),
    "no tokens": (lambda s: {**s, "tokens": []}, ("tokens must be a list of at least 256",)),
}


@pytest.mark.parametrize("what", HOSTILE_TOKENIZERS)
def test_a_hostile_tokenizer_file_is_one_line_naming_the_file_and_field(tmp_path, what):
    make, words = HOSTILE_TOKENIZERS[what]
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(make(learned_bpe())))
    with bounded(["get_tokenizer", str(path)]), pytest.raises(TokenizerError) as err:
        glassgpt.get_tokenizer(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert all(w in message for w in words), message


@pytest.mark.parametrize("command", ["explain", "generate"])
@pytest.mark.parametrize("what", ["a pattern that backtracks without end", "an empty pattern",
                                  "a pattern that matches nothing"])
def test_a_hostile_tokenizer_in_a_checkpoint_is_one_line(capsys, ckpt, command, what):
    make, words = HOSTILE_TOKENIZERS[what]
    (ckpt / "tokenizer.json").write_text(json.dumps(make(learned_bpe())))
    answer(capsys, command, "hi", "--model", str(ckpt), words=("tokenizer.json",) + words)


def test_train_with_a_tokenizer_that_encodes_to_nothing_is_refused_before_it_reads_the_data(tmp_path, capsys):
    """`(?!)` once encoded every text to [] and train failed later with "cannot mmap an empty file"."""
    make, words = HOSTILE_TOKENIZERS["a pattern that matches nothing"]
    (tmp_path / "tok.json").write_text(json.dumps(make(learned_bpe())))
    (tmp_path / "data.txt").write_text("the cat sat on the mat. " * 200)
    answer(capsys, "train", "--data", str(tmp_path / "data.txt"), "--tokenizer", str(tmp_path / "tok.json"),
           "--out", str(tmp_path / "run"), "--max-steps", "1", words=("tok.json",) + words)


def test_a_learned_tokenizer_still_loads_and_round_trips(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(learned_bpe()))
    tok = glassgpt.get_tokenizer(path)
    text = "the cat sat on the mat -- Über 1,234"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode("the cat")) < len("the cat")


def test_a_pattern_that_gives_up_at_encoding_is_one_line():
    """A pattern past the load-time checks (built directly) that makes tiktoken's regex engine give up
    on a text: a TokenizerError, not a PanicException."""
    import tiktoken
    from glassgpt.tokenizer import TiktokenTokenizer
    enc = tiktoken.Encoding(name="x", pat_str=r"(?:a|aa)+(?=b)|\s", mergeable_ranks={bytes([b]): b for b in range(256)},
                            special_tokens={})
    tok = TiktokenTokenizer(enc, {}, "x.json")
    with pytest.raises(TokenizerError, match="x.json: the tokenizer's pattern gave up on this text"):
        tok.encode("a" * 64 + "c")


@pytest.mark.parametrize("meta, words", [({"labels": 5}, ("labels", "5")), ({"labels": [1, 2]}, ("labels",)),
                                         ({"finetune": "yes"}, ("finetune",))])
def test_a_crafted_meta_json_is_named(ckpt, meta, words):
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        load_meta(ckpt)
    assert "meta.json" in str(err.value) and all(w in str(err.value) for w in words)


@pytest.mark.parametrize("state, words", [
    ({"format": "glassgpt-train-state/1", "step": 1, "files": {"../../etc/passwd": "0" * 64}}, ("files", "passwd")),
    ({"format": "glassgpt-train-state/1", "step": 1, "files": ["model.safetensors"]}, ("files",)),
    ({"format": "glassgpt-train-state/1", "step": "7", "files": {}}, ("step", "'7'")),
    ({"format": "something/9", "files": {}}, ("format", "something/9")),
])
def test_a_crafted_train_state_json_is_named(capsys, ckpt, state, words):
    (ckpt / "train_state.json").write_text(json.dumps(state))
    answer(capsys, "generate", "hi", "--model", str(ckpt), words=("train_state.json",) + words)


# --- GGUF files -------------------------------------------------------------------------------

def test_a_gguf_of_garbage_after_its_magic_is_one_line(capsys, tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 1 << 60) + b"\x07" * 100)
    answer(capsys, "info", "--model", str(path), words=("model.gguf",))


def test_a_truncated_gguf_is_one_line(capsys, tmp_path, model):
    pytest.importorskip("gguf")
    from glassgpt.formats.gguf import write_gguf
    path = write_gguf(model, tmp_path / "model.gguf")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    answer(capsys, "generate", "hi", "--model", str(path), words=("model.gguf", "truncated"))


def test_a_gguf_whose_block_count_lies_is_named(capsys, tmp_path, model):
    gguf = pytest.importorskip("gguf")
    from glassgpt.formats.gguf import write_gguf
    path = write_gguf(model, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields["gpt2.block_count"].parts[-1][0] = 100_000  # edit the value in place
    del reader
    answer(capsys, "generate", "hi", "--model", str(path), words=("gpt2.block_count 100,000", "2 blocks"))


def test_every_crafted_answer_is_a_glass_error():
    """Library callers get the same one-line errors as GlassError subclasses."""
    with pytest.raises(GlassError):
        glassgpt.load_model("/nonexistent/model.pth")
