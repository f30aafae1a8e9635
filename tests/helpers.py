"""What several test modules share, in one place: test modules import from here or conftest.py,
never from each other (tests/test_layout.py checks it). Fixtures live in conftest.py.

- the command line: `run` it in-process, and what a one-line error looks like;
- chapter 5's small setting (tests/test_book_ch05.py, tests/test_appendix_d.py);
- a character model that has learnt a text by heart, and decoding with a chosen step (the engine's
  and the native step's tests);
- a gpt2/124M folder written by TensorFlow (the book's tests, the crafted files);
- a pickled object that must never be unpickled;
- every described model but GPT-2 at a tiny size, random (check's and diff's tests of them), Gemma 4 and transformers' own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import glassgpt
from glassgpt.cli import main
from glassgpt.engine import Engine
from glassgpt.formats import random_model

import llms_from_scratch.ch02 as _book_ch02
import llms_from_scratch.ch03 as _book_ch03
import llms_from_scratch.qwen3 as _book_qwen
from glassgpt.families import FamilyConfig, RopeFreq
from glassgpt.formats.families import config_to_hf
from glassgpt.tokenizer import CharTokenizer

from conftest import shared_data


# --- the command line -----------------------------------------------------------------------------

def run(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `glassgpt ARGV`, argparse's own exits included."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *words):
    """Exit code 2 and one line on stderr, `error: ...`, holding each of `words`; no traceback."""
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]


def one_line_error(capsys) -> str:
    """The one error line of a command, around its notes (and its threads line)."""
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("note:", "threads:"))]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def subparsers(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, parser) for every subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias is the same parser
                    seen.add(id(sub))
                    yield f"{path} {name}".strip(), sub
                    yield from subparsers(sub, f"{path} {name}".strip())


# --- chapter 5, small ------------------------------------------------------------------------------

CH05_SMALL = dict(vocab_size=50257, context_length=32, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.1, qkv_bias=False)
CH05_FLAGS = ["--model", "gpt2-book", "--n-layers", "2", "--emb-dim", "32", "--n-heads", "4", "--context-length", "32",
              "--threads", "1", "--no-progress"]
CH05_TEXT = [shared_data("the-verdict.txt").read_text(encoding="utf-8")[:6000]]  # (its stand-in when ../shared is absent)


def book_loaders(text: str, batch_size: int = 2):
    """The notebook's loaders: split by characters at 90%, windows at stride context_length."""
    from llms_from_scratch import ch02

    split = int(0.90 * len(text))
    kw = dict(batch_size=batch_size, max_length=CH05_SMALL["context_length"], stride=CH05_SMALL["context_length"], num_workers=0)
    return (ch02.create_dataloader_v1(text[:split], drop_last=True, shuffle=True, **kw),
            ch02.create_dataloader_v1(text[split:], drop_last=False, shuffle=False, **kw))


# --- a model that has learnt a text, and the decoding step it runs --------------------------------

# Our own words, so the fixture model is the same on every machine (no ../shared needed).
LEARNT_TEXT = (
    "The model reads a row of numbers for every token, adds where the token stands, and "
    "passes the sum through the same block again and again. Each block lets every token "
    "look back at the ones before it, then widens each row four times and narrows it again. "
    "At the end one matrix turns every row into a score for each word it knows, and the "
    "last row's scores say which word comes next. Then it does it all once more."
)


def trained_model(steps: int = 300) -> tuple[glassgpt.GPTModel, list[int]]:
    """A 2-block character model that has learnt LEARNT_TEXT by heart."""
    ids = glassgpt.get_tokenizer("char", text=LEARNT_TEXT).encode(LEARNT_TEXT)
    cfg = glassgpt.GPTConfig(vocab_size=max(ids) + 1, context_length=64, emb_dim=64, n_heads=4, n_layers=2)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=0).train()
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=gen)
        x = torch.stack([data[s:s + 64] for s in starts])
        y = torch.stack([data[s + 1:s + 65] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), ids


def decode_with(engine: Engine, step: str) -> None:
    """Make the engine decode with `step` ("native": step.py; "engine": its PyTorch forward), this engine only."""
    engine.choices = dataclasses.replace(engine.choices, winners={**engine.choices.winners, "step": step}, path=None)


def copy_of(model: glassgpt.GPTModel, dtype: torch.dtype = torch.float32) -> glassgpt.GPTModel:
    """A model of its own with `model`'s weights, in `dtype` (to quantize without touching `model`)."""
    clone = random_model(model.cfg, torch.device("cpu"), torch.float32)
    clone.load_state_dict(model.state_dict())
    return clone.to(dtype).eval()


def prompts(ids: list[int], n: int = 4, length: int = 12) -> torch.Tensor:
    """`n` prompts of `length` ids, from evenly spaced places in `ids`."""
    step = len(ids) // n
    return torch.tensor([ids[i * step: i * step + length] for i in range(n)])


# --- the book's gpt2/124M folder, written by TensorFlow -------------------------------------------

HPARAMS = {"n_vocab": 50257, "n_ctx": 24, "n_embd": 32, "n_head": 2, "n_layer": 2}


def openai_arrays(h: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under OpenAI's variable names and shapes (convolutions as [1, in, out])."""
    rng = np.random.default_rng(seed)
    d = h["n_embd"]

    def r(*shape, around=0.0):
        return (around + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    arrays = {"model/wte": r(h["n_vocab"], d), "model/wpe": r(h["n_ctx"], d),
              "model/ln_f/g": r(d, around=1.0), "model/ln_f/b": r(d)}
    for i in range(h["n_layer"]):
        p = f"model/h{i}/"
        arrays.update({
            p + "ln_1/g": r(d, around=1.0), p + "ln_1/b": r(d), p + "ln_2/g": r(d, around=1.0), p + "ln_2/b": r(d),
            p + "attn/c_attn/w": r(1, d, 3 * d), p + "attn/c_attn/b": r(3 * d),
            p + "attn/c_proj/w": r(1, d, d), p + "attn/c_proj/b": r(d),
            p + "mlp/c_fc/w": r(1, d, 4 * d), p + "mlp/c_fc/b": r(4 * d),
            p + "mlp/c_proj/w": r(1, 4 * d, d), p + "mlp/c_proj/b": r(d),
        })
    return arrays


def write_openai_folder(path: Path, h: dict = HPARAMS) -> Path:
    """A gpt2/124M-style folder: a checkpoint written by TensorFlow's own SaveV2, hparams.json,
    the `checkpoint` pointer, and GPT-2's encoder.json and vocab.bpe."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # read by TensorFlow only
    import tensorflow as tf

    path.mkdir(parents=True)
    arrays = openai_arrays(h)
    tf.raw_ops.SaveV2(prefix=str(path / "model.ckpt"), tensor_names=list(arrays),
                      shape_and_slices=[""] * len(arrays), tensors=[tf.constant(a) for a in arrays.values()])
    (path / "hparams.json").write_text(json.dumps(h))
    (path / "checkpoint").write_text('model_checkpoint_path: "model.ckpt"\n'
                                     'all_model_checkpoint_paths: "model.ckpt"\n')
    for name in ("encoder.json", "vocab.bpe"):
        (path / name).write_bytes(resources.files("glassgpt").joinpath("vocab", name).read_bytes())
    return path


# --- a file that must never be unpickled ----------------------------------------------------------

class Trap:
    """Unpickling this object would create a file: weights_only must refuse it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# --- the command line's small model (test_cli_*) ---

SMALL = {"vocab_size": 50257, "context_length": 16, "emb_dim": 16, "n_heads": 2, "n_layers": 1}



# --- tiny Qwen3 and Llama 3.2 (test_families*, test_family_*) ---

V = 97


TINY = {
    "qwen3": FamilyConfig(family="qwen3", vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
                          hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=10_000.0, qk_norm=True, norm_eps=1e-6),
    "llama3": FamilyConfig(family="llama3", vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
                           hidden_dim=48, n_kv_groups=2, rope_base=500_000.0, norm_eps=1e-5,
                           rope_freq=RopeFreq(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_context_length=16)),
}


# the same kinds over a character tokenizer, for the views that read text (test_family_explain, test_family_views)
CHAR_TEXT = "every effort moves you"
CHAR_TOK = CharTokenizer.from_text(CHAR_TEXT + " abcdefghijklmnopqrstuvwxyz")
CHAR_QWEN = FamilyConfig(family="qwen3", vocab_size=CHAR_TOK.n_vocab, context_length=32, emb_dim=32, n_heads=4,
                         n_layers=2, hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                         tie_embeddings=True)
CHAR_LLAMA = FamilyConfig(family="llama3", vocab_size=CHAR_TOK.n_vocab, context_length=32, emb_dim=32, n_heads=8,
                          n_layers=2, hidden_dim=48, n_kv_groups=2, rope_base=500_000.0, norm_eps=1e-5,
                          rope_freq=RopeFreq(factor=8.0, original_context_length=16))


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm scales around 1), so no mapping mistake hides behind ones and zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise * 3)
    return model.eval()


def ids(n: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


def transformers_config(family: str, cfg: FamilyConfig):
    from transformers import LlamaConfig, Qwen3Config
    raw = config_to_hf(cfg)
    raw.pop("architectures"), raw.pop("model_type"), raw.pop("torch_dtype")
    if family == "llama3":
        raw.pop("head_dim")
    return (Qwen3Config if family == "qwen3" else LlamaConfig)(**raw, attn_implementation="eager")



# --- planted mistakes that several piece tests use (test_pieces*) ---

class MaskDiagonal(_book_ch03.CausalAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask = torch.triu(torch.ones_like(self.mask), diagonal=0)  # planted: diagonal=0


def named(cls, name):
    return type(name, (cls,), {})


class StrideSkips(_book_ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        self.input_ids, self.target_ids = [], []
        ids = tokenizer.encode(txt, allowed_special={"<|endoftext|>"})
        for i in range(0, len(ids) - max_length, stride + 1):  # planted: stride + 1
            self.input_ids.append(torch.tensor(ids[i:i + max_length]))
            self.target_ids.append(torch.tensor(ids[i + 1:i + max_length + 1]))



# --- a model's description against its module (test_anatomy, and every model kind's test) ---

def check_description(model: torch.nn.Module):
    """glassgpt.describe(model), proven to agree with the module: every described part's shape, the tie
    by storage, each norm's formula on a probe (kinds.description_mismatches); its Anatomy."""
    from glassgpt.kinds import description_mismatches
    anatomy = glassgpt.describe(model)
    assert description_mismatches(model, anatomy) == []
    return anatomy


# --- every described model but GPT-2, tiny and random ---------------------------------------------------

from glassgpt.families import FamilyConfig, Gemma3Config, Olmo3Config, Qwen3_5Config, TinyAyaConfig  # noqa: E402
from glassgpt.variants import GQAConfig, MLAConfig, MoEConfig, SWAConfig  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"
TINY_GPT = dict(vocab_size=101, context_length=32, emb_dim=32, n_heads=4, n_layers=3, qkv_bias=True)
DESCRIBED = {  # every described model but GPT-2, tiny (tests/test_check_described.py, test_diff_described.py)
    "qwen3-moe": FamilyConfig(family="qwen3", vocab_size=300, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                              hidden_dim=48, n_kv_groups=2, rope_base=1_000_000.0, head_dim=8, qk_norm=True,
                              num_experts=8, num_experts_per_tok=3, moe_hidden_dim=24),
    "gemma3": Gemma3Config(vocab_size=300, context_length=64, emb_dim=32, n_heads=4, n_layers=4, hidden_dim=48,
                           head_dim=8, n_kv_groups=2, rope_local_base=10_000.0, rope_base=1_000_000.0,
                           sliding_window=4, layer_types=(SLIDING, FULL, SLIDING, FULL), query_pre_attn_scalar=24),
    "olmo3": Olmo3Config(vocab_size=300, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32,
                         head_dim=8, n_kv_heads=1, sliding_window=4, layer_types=(SLIDING, SLIDING, FULL, SLIDING),
                         rope_base=10_000.0, rope_type="yarn", rope_factor=8.0, rope_orig_max=16,
                         rope_attention_factor=1.2),
    "tiny-aya": TinyAyaConfig(vocab_size=300, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32,
                              head_dim=8, n_kv_heads=1, sliding_window=4, layer_types=(SLIDING, SLIDING, FULL, SLIDING),
                              rope_base=10_000.0, logit_scale=0.25),
    "qwen3.5": Qwen3_5Config.from_book_dict("qwen3_5", {
        "vocab_size": 300, "context_length": 64, "emb_dim": 32, "n_heads": 4, "n_layers": 3, "hidden_dim": 64,
        "head_dim": 8, "qk_norm": True, "n_kv_groups": 2, "rope_base": 10_000_000.0, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
    "gqa": GQAConfig(**TINY_GPT, n_kv_groups=2),
    "mla": MLAConfig(**TINY_GPT, latent_dim=8),
    "swa": SWAConfig(**TINY_GPT, sliding_window_size=4, sliding_window_stride=2),
    "moe": MoEConfig(**TINY_GPT, num_experts=4, num_experts_per_tok=2, hidden_dim=24),
}
VARIANTS = ("gqa", "mla", "swa", "moe")


def tiny_described(name: str, seed: int = 0) -> torch.nn.Module:
    """The model of DESCRIBED[name], every parameter random (a norm's weight around its resting value: 0 for the
    (1 + w) norms, 1 for the others; large enough that routing, the window and the gates change the numbers)."""
    cfg = DESCRIBED[name]
    from glassgpt.families import build_model
    from glassgpt.variants import build_model as build_variant

    model = build_variant(cfg) if name in VARIANTS else build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    zero_centred = name in ("gemma3", "qwen3.5")
    with torch.no_grad():
        for path, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in path or "scale" in path or "shift" in path:
                p.copy_((0.0 if zero_centred or "shift" in path else 1.0) + 0.3 * noise)
            elif "A_log" in path or "dt_bias" in path:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * 0.3)
    return model.eval()


def tiny_transformers(name: str, attn: str = "sdpa") -> torch.nn.Module:
    """A tiny random transformers model of each described architecture it has (seeded), with its attention
    implementation `attn` ("sdpa", transformers' default, or "eager")."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
    windows = dict(sliding_window=4, layer_types=[SLIDING, FULL])
    make = {"qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8)),
            "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
            "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, **windows, head_dim=8,
                                                                       query_pre_attn_scalar=8)),
            "olmo3": lambda: tf.Olmo3ForCausalLM(tf.Olmo3Config(**common, **windows, eos_token_id=None,
                                                                pad_token_id=None)),
            "cohere2": lambda: tf.Cohere2ForCausalLM(tf.Cohere2Config(**common, **windows, eos_token_id=None,
                                                                      pad_token_id=None, bos_token_id=None))}
    return make[name]().eval()


GEMMA4 = dict(vocab_size=300, emb_dim=16, hidden_dim=32, n_layers=4, n_heads=2, head_dim=8, n_kv_heads=1,
              global_head_dim=16, context_length=64, sliding_window=4, layer_types=(SLIDING, FULL) * 2,
              vocab_size_per_layer_input=300, hidden_size_per_layer_input=4, num_kv_shared_layers=2,
              use_double_wide_mlp=True, final_logit_softcap=30.0)


def tiny_gemma4(**changes) -> torch.nn.Module:
    """E2B's kind, small: per-layer inputs, the last 2 layers kv-shared, proportional RoPE on the full layers; every
    weight random and each layer_scalar away from 1, so that a part left out or added changes the numbers."""
    from glassgpt.families.gemma4 import Gemma4Config, Gemma4DenseModel
    model = Gemma4DenseModel(Gemma4Config(**{**GEMMA4, **changes}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path, p in model.named_parameters():
            p.copy_((1.0 if "norm" in path else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
        for path, b in model.named_buffers():
            if path.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model.eval()


class RMSNormCentred(_book_qwen.RMSNorm):
    """The book's Qwen3 RMSNorm with a LayerNorm's centring planted: checked alone (test_check_findings) and as a
    whole model's final_norm (test_check_unlisted)."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)  # planted: a LayerNorm's centring
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def assert_planted_piece(planted: dict, outside: set, case: str) -> None:
    """A planted mistake in a single piece (planted[case] = (run, stage, where, prop, mistake)) is found at its
    stage and position, named by its property in one line, and by the catalogue's line unless it is `outside` it."""
    run, stage, where, prop, mistake = planted[case]
    result = run()
    assert not result.ok, result.to_text()
    assert (result.stage, result.where, result.prop, result.mistake) == (stage, where, prop, mistake), result.to_text()
    assert "\n" not in result.finding and "no known mistake" not in result.finding
    if case in outside:
        assert mistake is None
    else:
        assert "The line: " in result.finding
