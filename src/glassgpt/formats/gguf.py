"""llama.cpp's GGUF file, both ways: a GPT-2 in llama.cpp's own layout, with GPT-2's tokenizer.

Written and read with `gguf`, llama.cpp's own Python package (`pip install 'glassgpt[gguf]'`).
The layout is what llama.cpp's GPT-2 loader asks for (src/models/gpt2.cpp; the names of
gguf-py's MODEL_TENSORS[GPT2]); shapes here are PyTorch's, row-major (GGUF lists them
reversed, ggml's ne0 first):

    token_embd.weight           [V, d]     tok_emb.weight
    position_embd.weight        [ctx, d]   pos_emb.weight
    blk.N.attn_norm.weight/bias [d]        norm1.scale/shift
    blk.N.attn_qkv.weight       [3d, d]    W_query, W_key, W_value stacked by rows (bias [3d], zeros
                                           when qkv_bias is off: llama.cpp requires one)
    blk.N.attn_output.weight    [d, d]     att.out_proj       (bias [d])
    blk.N.ffn_norm.weight/bias  [d]        norm2.scale/shift
    blk.N.ffn_up.weight         [4d, d]    ff.layers.0        (bias [4d])
    blk.N.ffn_down.weight       [d, 4d]    ff.layers.2        (bias [d])
    output_norm.weight/bias     [d]        final_norm.scale/shift
    output.weight               [V, d]     out_head.weight, only when it is not tok_emb.weight

nn.Linear's [out, in] is ggml's layout, so nothing is transposed (convert_hf_to_gguf.py
transposes Hugging Face's Conv1D weights; glassgpt's are Linear's already). The metadata is
convert_hf_to_gguf.py's for GPT-2 (`gpt2.context_length`, `embedding_length`,
`feed_forward_length`, `block_count`, `attention.head_count`, `attention.layer_norm_epsilon`)
and its tokenizer keys (`tokenizer.ggml.model` "gpt2", `pre` "gpt-2", `tokens`, `token_type`,
`merges`, `bos_token_id`/`eos_token_id`); `glassgpt.qkv_bias` records a model without qkv
biases, so that reading the file back gives the same config. The matrices are stored as
f32, bf16, q8_0 or q4_0 (blocks of 32 weights with one scale each); embeddings of positions,
norms and biases always as f32. Reading dequantizes to float32.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..config import GPTConfig
from ..errors import CheckpointError, GlassError
from ..model import GPTModel
from ..tokenizer import Tokenizer, get_tokenizer, gpt2_vocab
from .checks import Spelling, check_sizes, field
from .files import atomic_write

GGUF_DTYPES = ("f32", "bf16", "q8_0", "q4_0")
QUANT_BLOCK = 32  # q8_0 and q4_0 quantize rows in blocks of 32 weights
MAGIC = b"GGUF"
ARCH = "gpt2"
LAYER_NORM_EPS = 1e-5

# Per block: (llama.cpp's name, glassgpt's name); the qkv weights are stacked apart.
BLOCK_TENSORS = (("attn_norm.weight", "norm1.scale"), ("attn_norm.bias", "norm1.shift"),
                 ("attn_output.weight", "att.out_proj.weight"), ("attn_output.bias", "att.out_proj.bias"),
                 ("ffn_norm.weight", "norm2.scale"), ("ffn_norm.bias", "norm2.shift"),
                 ("ffn_up.weight", "ff.layers.0.weight"), ("ffn_up.bias", "ff.layers.0.bias"),
                 ("ffn_down.weight", "ff.layers.2.weight"), ("ffn_down.bias", "ff.layers.2.bias"))
OUTER_TENSORS = (("token_embd.weight", "tok_emb.weight"), ("position_embd.weight", "pos_emb.weight"),
                 ("output_norm.weight", "final_norm.scale"), ("output_norm.bias", "final_norm.shift"),
                 ("output.weight", "out_head.weight"))
QKV = ("W_query", "W_key", "W_value")

# How a GGUF file names GPT-2's sizes (checks.py words its errors so).
GGUF = Spelling({"vocab_size": "tokenizer.ggml.tokens", "context_length": f"{ARCH}.context_length",
                 "emb_dim": f"{ARCH}.embedding_length", "n_layers": f"{ARCH}.block_count"},
                "token_embd.weight", "position_embd.weight", r"blk\.(\d+)\.")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GlassError("GGUF files need llama.cpp's gguf package: pip install 'glassgpt[gguf]'") from None
    return gguf


def is_gguf_file(spec: str | os.PathLike) -> bool:
    """A file that starts with GGUF's magic (whatever it is called)."""
    path = Path(spec)
    if not path.is_file():  # before open(): opening a FIFO to read would wait for a writer
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# --- writing ------------------------------------------------------------------------------------

def llama_tensors(model: GPTModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp's name, float32 tensor) for every tensor of the GGUF file, in glassgpt's shapes."""
    cfg, sd = model.cfg, model.state_dict()
    for theirs, ours in OUTER_TENSORS:
        if theirs != "output.weight" or not model.tied:
            yield theirs, sd[ours]
    for i in range(cfg.n_layers):
        g = f"trf_blocks.{i}."
        yield f"blk.{i}.attn_qkv.weight", torch.cat([sd[f"{g}att.{p}.weight"] for p in QKV])  # [3d, d]
        if cfg.qkv_bias:
            yield f"blk.{i}.attn_qkv.bias", torch.cat([sd[f"{g}att.{p}.bias"] for p in QKV])
        else:
            yield f"blk.{i}.attn_qkv.bias", torch.zeros(3 * cfg.emb_dim)
        for theirs, ours in BLOCK_TENSORS:
            yield f"blk.{i}.{theirs}", sd[g + ours]


def check_exportable(cfg: GPTConfig, tokenizer: Tokenizer, dtype: str) -> None:
    """Refuse, before anything is written, what llama.cpp's GPT-2 cannot run or this dtype cannot store."""
    if dtype not in GGUF_DTYPES:
        raise GlassError(f"unknown GGUF dtype {dtype!r}: use one of {', '.join(GGUF_DTYPES)}")
    if cfg.num_classes is not None:
        raise GlassError(f"a classifier ({cfg.num_classes} classes) has no next-token head for llama.cpp to run: "
                         "export a language model")
    if tokenizer.to_dict() != {"type": "gpt2"}:
        raise GlassError(f"llama.cpp's GPT-2 runs GPT-2's BPE, and this model's tokenizer is {tokenizer.name!r} "
                         f"({tokenizer.n_vocab:,} tokens): export a model trained with the gpt2 tokenizer")
    if cfg.vocab_size < tokenizer.n_vocab:
        raise GlassError(f"vocab_size {cfg.vocab_size:,} is smaller than GPT-2's {tokenizer.n_vocab:,} tokens")
    if dtype in ("q8_0", "q4_0") and cfg.emb_dim % QUANT_BLOCK:
        fits = [d for d in range(QUANT_BLOCK, 2 * cfg.emb_dim + QUANT_BLOCK, QUANT_BLOCK) if d % cfg.n_heads == 0]
        raise GlassError(f"{dtype} stores rows in blocks of {QUANT_BLOCK} weights, and emb_dim {cfg.emb_dim} is not "
                         f"a multiple of {QUANT_BLOCK} (e.g. {', '.join(map(str, fits[:4]))} would be): "
                         "use --dtype f32 or bf16")


def write_gguf(model: GPTModel, path: str | os.PathLike, tokenizer: Tokenizer | None = None,
               dtype: str = "f32", name: str = "glassgpt") -> Path:
    """Write `model` as a GGUF file that llama.cpp runs, its matrices stored as `dtype`
    (f32, bf16, q8_0, q4_0), with GPT-2's tokenizer. Written to a temporary name and renamed."""
    gguf = _gguf()
    tokenizer = tokenizer or get_tokenizer("gpt2")
    cfg, path = model.cfg, Path(path)
    check_exportable(cfg, tokenizer, dtype)
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    file_type = {"f32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}[dtype]

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_name(name)
        w.add_context_length(cfg.context_length)
        w.add_embedding_length(cfg.emb_dim)
        w.add_feed_forward_length(4 * cfg.emb_dim)
        w.add_block_count(cfg.n_layers)
        w.add_head_count(cfg.n_heads)
        w.add_layer_norm_eps(LAYER_NORM_EPS)
        w.add_file_type(getattr(gguf.LlamaFileType, file_type))
        w.add_bool("glassgpt.qkv_bias", cfg.qkv_bias)
        _add_gpt2_tokenizer(w, gguf, cfg.vocab_size, tokenizer.eot_id)
        for tensor_name, t in llama_tensors(model):
            data = t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
            if data.ndim == 2 and tensor_name != "position_embd.weight" and dtype != "f32":
                w.add_tensor(tensor_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(tensor_name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)
    return path


def _add_gpt2_tokenizer(w, gguf, vocab_size: int, eot_id: int) -> None:
    """GPT-2's BPE as llama.cpp's "gpt2" tokenizer, padded with unused tokens to vocab_size rows
    (as convert_hf_to_gguf.py pads a vocabulary smaller than the embedding)."""
    tokens, merges = gpt2_vocab()
    types = [gguf.TokenType.CONTROL if i == eot_id else gguf.TokenType.NORMAL for i in range(len(tokens))]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot_id)
    w.add_eos_token_id(eot_id)


# --- reading ------------------------------------------------------------------------------------

def _reader(path: str | os.PathLike):
    """gguf's reader of `path`, kept while the file is unchanged: parsing GPT-2's 100,000 tokenizer
    strings takes seconds, and the config, the tensors and the tokenizer all come from one parse."""
    stat = Path(path).stat()
    return _cached_reader(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int, size: int):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # a truncated or crafted header fails in many ways inside the reader
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path} is truncated or not a GGUF file that glassgpt reads ({reason})") from None


def _value(reader, key: str, source: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise CheckpointError(f"{source} lacks {key!r}: it is not a GPT-2 written for llama.cpp")
        return default
    try:
        return f.contents()
    except Exception:
        raise CheckpointError(f"{source}: {key} cannot be read: the file is corrupt") from None


def read_gguf(path: str | os.PathLike, tensors: bool = True) -> tuple[GPTConfig, Iterator[tuple[str, torch.Tensor]] | None]:
    """(config, glassgpt-named float32 tensors, dequantized one at a time) of a GPT-2 GGUF file.
    The config is checked against the tensors' shapes before anything is read or built."""
    source = str(path)
    reader = _reader(path)
    arch = _value(reader, "general.architecture", source)
    if arch != ARCH:
        raise CheckpointError(f"{source} holds a {arch!r} model; glassgpt runs GPT-2 (general.architecture 'gpt2')")
    raw = {k: _value(reader, k, source, None) for k in
           (f"{ARCH}.context_length", f"{ARCH}.embedding_length", f"{ARCH}.block_count",
            f"{ARCH}.attention.head_count", f"{ARCH}.feed_forward_length", "glassgpt.qkv_bias")}
    infos = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist())) for name, t in infos.items()}
    sizes = {ours: field(raw, f"{ARCH}.{theirs}", source) for ours, theirs in
             (("context_length", "context_length"), ("emb_dim", "embedding_length"),
              ("n_heads", "attention.head_count"), ("n_layers", "block_count"))}
    vocab = shapes.get("token_embd.weight", (0,))[0]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != vocab:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens holds {len(tokens.data):,} tokens, but token_embd.weight "
                              f"has {vocab:,} rows: llama.cpp needs one row per token")
    if raw[f"{ARCH}.feed_forward_length"] not in (None, 4 * sizes["emb_dim"]):
        raise CheckpointError(f"{source}: {ARCH}.feed_forward_length is {raw[f'{ARCH}.feed_forward_length']!r}; "
                              f"GPT-2's is 4 x embedding_length = {4 * sizes['emb_dim']}")
    if sizes["emb_dim"] % sizes["n_heads"]:
        raise CheckpointError(f"{source}: {ARCH}.embedding_length {sizes['emb_dim']} is not divisible by "
                              f"{ARCH}.attention.head_count {sizes['n_heads']}")
    qkv_bias = raw["glassgpt.qkv_bias"] if isinstance(raw["glassgpt.qkv_bias"], bool) else True
    cfg = GPTConfig(vocab_size=max(vocab, 1), **sizes, qkv_bias=qkv_bias,
                    tie_embeddings="output.weight" not in infos)
    check_sizes(cfg, shapes, GGUF, source, source)
    return cfg, (_tensors(infos, cfg, source) if tensors else None)


def _tensors(infos: dict, cfg: GPTConfig, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    gguf = _gguf()
    d = cfg.emb_dim

    def read(name: str) -> torch.Tensor:
        t = infos.get(name)
        if t is None:
            raise CheckpointError(f"{source} has no tensor {name!r}: llama.cpp's GPT-2 needs it")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)  # a copy: the map is read-only
        except Exception as e:
            raise CheckpointError(f"{source}: tensor {name!r} {list(shape)} {t.tensor_type.name} cannot be read "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    for theirs, ours in OUTER_TENSORS:
        if theirs != "output.weight" or not cfg.tie_embeddings:
            yield ours, read(theirs)
    for i in range(cfg.n_layers):
        qkv, bias = read(f"blk.{i}.attn_qkv.weight"), read(f"blk.{i}.attn_qkv.bias")
        if qkv.shape != (3 * d, d) or bias.shape != (3 * d,):
            raise CheckpointError(f"{source}: blk.{i}.attn_qkv is {list(qkv.shape)} (bias {list(bias.shape)}), "
                                  f"llama.cpp's GPT-2 needs [{3 * d}, {d}] (bias [{3 * d}])")
        for part, w, b in zip(QKV, qkv.split(d), bias.split(d)):
            yield f"trf_blocks.{i}.att.{part}.weight", w.contiguous()
            if cfg.qkv_bias:
                yield f"trf_blocks.{i}.att.{part}.bias", b.contiguous()
        for theirs, ours in BLOCK_TENSORS:
            yield f"trf_blocks.{i}.{ours}", read(f"blk.{i}.{theirs}")


def gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """GPT-2's BPE, after checking that the file's tokenizer is GPT-2's (its tokens and merges)."""
    source = str(path)
    reader = _reader(path)
    model = _value(reader, "tokenizer.ggml.model", source)
    tokens, merges = gpt2_vocab()
    theirs = _value(reader, "tokenizer.ggml.tokens", source)
    if model != "gpt2" or theirs[:len(tokens)] != tokens or _value(reader, "tokenizer.ggml.merges", source) != merges:
        raise CheckpointError(f"{source}: its tokenizer (tokenizer.ggml.model {model!r}) is not GPT-2's BPE, "
                              "which is the one glassgpt runs")
    return get_tokenizer("gpt2")


def gguf_dtype_note(path: str | os.PathLike) -> str | None:
    """One line on how the matrices are stored (q8_0, bf16, ...), for `info`."""
    reader = _reader(path)
    kinds = sorted({t.tensor_type.name.lower() for t in reader.tensors
                    if len(t.shape) == 2 and t.name != "position_embd.weight"})
    total = sum(math.prod(int(n) for n in t.shape.tolist()) for t in reader.tensors)
    return (f"a GGUF file: matrices stored as {', '.join(kinds)} (positions, norms and biases as f32; "
            f"{total:,} numbers), read back as float32")
