"""GGUF, both ways: `glassgpt export --format gguf` writes llama.cpp's GPT-2 layout with GPT-2's
tokenizer, checked with gguf's own reader; glassgpt reads it back (`--model model.gguf`) with the
same greedy tokens; and, where llama-cpp-python is installed, llama.cpp runs it with glassgpt's
float32 greedy tokens.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import glassgpt
from glassgpt.config import GPTConfig
from glassgpt.engine import quantize_int4
from glassgpt.formats import random_model
from glassgpt.formats.gguf import _reader
from glassgpt.generate import generate
from glassgpt.tokenizer import gpt2_vocab

from conftest import skip_unless_required
from helpers import assert_one_line_error, run

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'glassgpt[gguf]') is not installed")

# The book's layout (no qkv biases, its own out_head) and GPT-2's (biases, tied): both must survive.
BOOK = GPTConfig(vocab_size=50257, context_length=32, emb_dim=64, n_heads=4, n_layers=2,
                 qkv_bias=False, tie_embeddings=False)
GPT2 = GPTConfig(vocab_size=50257, context_length=32, emb_dim=64, n_heads=2, n_layers=3)
PROMPT = "Every effort moves you"


def model_of(cfg: GPTConfig, seed: int = 0) -> glassgpt.GPTModel:
    """GPT-2's initialisation, with norms and biases random too, so that every tensor is checked."""
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=[BOOK, GPT2], ids=["book-layout", "gpt2-layout"])
def exported(request, tmp_path_factory):
    """(model, {dtype: path}) of a model written with `glassgpt export --format gguf`."""
    model = model_of(request.param)
    folder = tmp_path_factory.mktemp("gguf")
    glassgpt.save_model(model, folder / "ckpt")
    paths = {}
    for dtype in ("f32", "bf16", "q8_0") if request.param is BOOK else ("f32",):  # each file parses in seconds
        paths[dtype] = folder / f"model-{dtype}.gguf"
        assert glassgpt.cli.main(["export", str(folder / "ckpt"), "--format", "gguf", "--dtype", dtype,
                                  "--out", str(paths[dtype])]) == 0
    return model, paths


def reader(path: Path):
    """gguf's own GGUFReader of `path`, parsed once for the whole module (glassgpt's cache keeps it)."""
    reader = _reader(path)
    assert isinstance(reader, gguf.GGUFReader)
    return reader


def greedy(model, n: int = 12) -> list[int]:
    ids = glassgpt.get_tokenizer("gpt2").encode(PROMPT)
    return generate(model, torch.tensor([ids]), n)[0, len(ids):].tolist()


# --- the file, read with gguf's own reader --------------------------------------------------------

def test_the_file_has_llama_cpps_gpt2_names_shapes_and_metadata(exported):
    model, paths = exported
    cfg = model.cfg
    file = reader(paths["f32"])
    value = lambda key: file.fields[key].contents()  # noqa: E731
    assert value("general.architecture") == "gpt2"
    assert (value("gpt2.context_length"), value("gpt2.embedding_length"), value("gpt2.block_count"),
            value("gpt2.attention.head_count"), value("gpt2.feed_forward_length")) == (
        cfg.context_length, cfg.emb_dim, cfg.n_layers, cfg.n_heads, 4 * cfg.emb_dim)
    assert value("gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    d, shapes = cfg.emb_dim, {t.name: list(reversed(t.shape.tolist())) for t in file.tensors}
    want = {"token_embd.weight": [cfg.vocab_size, d], "position_embd.weight": [cfg.context_length, d],
            "output_norm.weight": [d], "output_norm.bias": [d]}
    if not cfg.tie_embeddings:
        want["output.weight"] = [cfg.vocab_size, d]
    for i in range(cfg.n_layers):
        want.update({f"blk.{i}.attn_norm.weight": [d], f"blk.{i}.attn_norm.bias": [d],
                     f"blk.{i}.attn_qkv.weight": [3 * d, d], f"blk.{i}.attn_qkv.bias": [3 * d],
                     f"blk.{i}.attn_output.weight": [d, d], f"blk.{i}.attn_output.bias": [d],
                     f"blk.{i}.ffn_norm.weight": [d], f"blk.{i}.ffn_norm.bias": [d],
                     f"blk.{i}.ffn_up.weight": [4 * d, d], f"blk.{i}.ffn_up.bias": [4 * d],
                     f"blk.{i}.ffn_down.weight": [d, 4 * d], f"blk.{i}.ffn_down.bias": [d]})
    assert shapes == want


def test_the_values_are_the_models_with_q_k_v_stacked_by_rows(exported):
    model, paths = exported
    sd, d = model.state_dict(), model.cfg.emb_dim
    tensors = {t.name: t for t in reader(paths["f32"]).tensors}

    def value(name):
        t = tensors[name]
        return torch.from_numpy(np.array(t.data)).reshape(list(reversed(t.shape.tolist())))

    g = "trf_blocks.1."
    qkv = value("blk.1.attn_qkv.weight")
    for part, rows in zip(("W_query", "W_key", "W_value"), qkv.split(d)):
        assert torch.equal(rows, sd[g + f"att.{part}.weight"])
    bias = value("blk.1.attn_qkv.bias")
    assert torch.equal(bias, torch.cat([sd[g + f"att.{p}.bias"] for p in ("W_query", "W_key", "W_value")])
                       if model.cfg.qkv_bias else torch.zeros(3 * d))
    for theirs, ours in (("token_embd.weight", "tok_emb.weight"), ("position_embd.weight", "pos_emb.weight"),
                         ("blk.1.ffn_up.weight", g + "ff.layers.0.weight"), ("blk.1.ffn_down.bias", g + "ff.layers.2.bias"),
                         ("blk.1.attn_norm.weight", g + "norm1.scale"), ("output_norm.bias", "final_norm.shift")):
        assert torch.equal(value(theirs), sd[ours]), theirs


@pytest.mark.parametrize("exported", [BOOK], ids=["book-layout"], indirect=True)  # (the one layout with every dtype)
def test_the_matrices_are_stored_as_the_asked_dtype_and_the_rest_as_f32(exported):
    _, paths = exported
    for dtype, kind in (("bf16", "BF16"), ("q8_0", "Q8_0")):
        types = {t.name: t.tensor_type.name for t in reader(paths[dtype]).tensors}
        assert types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == kind
        assert types["position_embd.weight"] == types["blk.0.ffn_up.bias"] == types["output_norm.weight"] == "F32"


def test_the_tokenizer_is_gpt2s_in_llama_cpps_keys(exported):
    _, paths = exported
    fields = reader(paths["f32"]).fields
    tokens, merges = gpt2_vocab()
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.tokens"].contents() == tokens
    assert fields["tokenizer.ggml.merges"].contents() == merges
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[50256] == gguf.TokenType.CONTROL and set(types[:50256]) == {gguf.TokenType.NORMAL}
    assert fields["tokenizer.ggml.eos_token_id"].contents() == fields["tokenizer.ggml.bos_token_id"].contents() == 50256


# --- read back by glassgpt ------------------------------------------------------------------------

def test_a_gguf_round_trip_gives_the_same_config_and_greedy_tokens(exported):
    model, paths = exported
    want = greedy(model)
    for dtype in sorted(set(paths) & {"f32", "q8_0"}):  # q8_0 is lossy, yet keeps these greedy tokens
        back = glassgpt.load_model(paths[dtype])
        assert back.cfg == model.cfg, dtype
        assert greedy(back) == want, dtype


def test_q4_0_read_back_is_within_a_step_of_each_weight_and_keeps_the_int4_paths_tokens(tmp_path):
    # q4_0 is symmetric (w = (q - 8) * d per block of 32, d = the block's largest |w| / 8); glassgpt's
    # int4 keeps a scale and a minimum per group of 32 (engine/int4.py), so the two round each weight
    # differently: each within its own step. On this model both keep float32's greedy tokens; on a
    # random model with near-ties (the book-layout one here) they part after a few tokens, as any
    # two roundings may.
    model = model_of(GPT2)
    glassgpt.save_model(model, tmp_path / "ckpt")
    path = tmp_path / "model-q4_0.gguf"
    assert glassgpt.cli.main(["export", str(tmp_path / "ckpt"), "--format", "gguf", "--dtype", "q4_0",
                              "--out", str(path)]) == 0
    assert "Q4_0" in {t.tensor_type.name for t in reader(path).tensors}
    back = glassgpt.load_model(path)
    w, w_back = model.trf_blocks[0].ff.layers[0].weight, back.trf_blocks[0].ff.layers[0].weight
    step = w.view(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 8  # q4_0's d per block
    assert ((w_back - w).view(w.shape[0], -1, 32).abs() <= step * 1.001).all()
    int4 = quantize_int4(copy.deepcopy(model))
    assert greedy(back, 20) == greedy(int4, 20) == greedy(model, 20)


def test_an_f32_round_trip_is_bit_exact_and_bf16_is_within_bf16s_rounding(exported):
    model, paths = exported
    for dtype, tol in (("f32", 0.0), ("bf16", 2 ** -8)):
        if dtype not in paths:
            continue
        back = glassgpt.load_model(paths[dtype]).state_dict()
        for name, t in model.state_dict().items():
            torch.testing.assert_close(back[name], t, atol=0, rtol=tol, msg=lambda m: f"{dtype} {name}: {m}")


def test_generate_runs_a_gguf_file_with_its_own_tokenizer(exported, capsys):
    model, paths = exported
    code, out, _ = run(["generate", PROMPT, "--model", str(paths.get("q8_0", paths["f32"])), "--json", "--max-new-tokens", "12"], capsys)
    assert code == 0
    assert json.loads(out)["new_ids"] == greedy(model)


# --- bad input -----------------------------------------------------------------------------------

def test_an_existing_out_is_refused_unless_forced(exported, capsys):
    _, paths = exported
    before = paths["f32"].read_bytes()
    code, _, err = run(["export", "gpt2", "--format", "gguf", "--out", str(paths["f32"])], capsys)
    assert_one_line_error(code, err, "exists", "--force")
    assert paths["f32"].read_bytes() == before


def test_q8_0_of_a_width_that_is_no_multiple_of_32_names_the_sizes_that_would_be(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=50257, context_length=8, emb_dim=48, n_heads=2, n_layers=1)
    glassgpt.save_model(model_of(cfg), tmp_path / "ckpt")
    code, _, err = run(["export", str(tmp_path / "ckpt"), "--format", "gguf", "--dtype", "q8_0",
                        "--out", str(tmp_path / "m.gguf")], capsys)
    assert_one_line_error(code, err, "emb_dim 48", "32", "64")
    assert not (tmp_path / "m.gguf").exists()


def test_a_model_with_another_tokenizer_is_refused(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=12, context_length=8, emb_dim=32, n_heads=2, n_layers=1)
    glassgpt.save_model(model_of(cfg), tmp_path / "ckpt", tokenizer=glassgpt.get_tokenizer("char", text="abcdefghijkl"))
    code, _, err = run(["export", str(tmp_path / "ckpt"), "--format", "gguf", "--out", str(tmp_path / "m.gguf")], capsys)
    assert_one_line_error(code, err, "GPT-2's BPE", "'char'")


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path, capsys):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = run(["info", "--model", str(tmp_path / "llama.gguf")], capsys)
    assert_one_line_error(code, err, "'llama'", "general.architecture")


# --- llama.cpp itself -----------------------------------------------------------------------------

# Each llama.cpp run has a process of its own: on this repo's Xeon, llama.cpp's AMX kernels (the
# "extra buffer types" that repack q8_0 weights) crash (ggml_backend_amx_mul_mat, llama.cpp issue
# 20824), and so does opening a second model in one process; the plain CPU kernels do not.
LLAMA_GREEDY = """
import json, sys
import numpy as np
from llama_cpp import llama as L
defaults = L.llama_cpp.llama_model_default_params
def no_repacking():
    params = defaults()
    params.use_extra_bufts = False
    return params
L.llama_cpp.llama_model_default_params = no_repacking
path, n_ctx, prompt, n = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = L.Llama(model_path=path, n_ctx=n_ctx, n_threads=1, verbose=False)
tokens = llm.tokenize(sys.argv[5].encode(), add_bos=False)
llm.eval(prompt)
out = []
for _ in range(n):
    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    out.append(int(np.argmax(logits)))
    llm.eval([out[-1]])
print(json.dumps({"tokens": tokens, "greedy": out}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("exported, dtype", [(BOOK, "f32"), (GPT2, "f32"), (BOOK, "q8_0")],
                         ids=["book-layout-f32", "gpt2-layout-f32", "book-layout-q8_0"], indirect=["exported"])
def test_llama_cpp_runs_the_export_with_glassgpts_float32_greedy_tokens(exported, dtype):
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        skip_unless_required("llama-cpp-python is not installed (CMAKE_ARGS='-DGGML_NATIVE=ON' pip install "
                             "llama-cpp-python builds llama.cpp; .ci/run does): nothing runs the file",
                             "GLASSGPT_REQUIRE_LLAMA_CPP")
    model, paths = exported
    prompt = glassgpt.get_tokenizer("gpt2").encode(PROMPT)
    done = subprocess.run([sys.executable, "-c", LLAMA_GREEDY, str(paths[dtype]), str(model.cfg.context_length),
                           json.dumps(prompt), "12", PROMPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["tokens"] == prompt  # llama.cpp's GPT-2 BPE is glassgpt's
    if dtype == "f32":
        assert ran["greedy"] == greedy(model)
    else:  # q8_0 rounds the activations too, so a random model's near-ties part after the first token
        assert ran["greedy"][0] == greedy(model)[0]
