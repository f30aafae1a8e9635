"""Write docs/models.md's traces of the book's models at their real widths, with random weights.

    PYTHONPATH=src python tools/make_model_traces.py              every model, one at a time (about twenty minutes)
    PYTHONPATH=src python tools/make_model_traces.py gemma3 olmo3 two of them
    PYTHONPATH=src python tools/make_model_traces.py --print gemma3   print the block, leave the page alone

Nothing is downloaded. Each model is made as a reader would make it from the book's notebook: its config dict
(explain/gallery.py's SHAPES, the notebooks' own values) written as JSON beside a state dict of random weights
(families.random_family_model: N(0, 0.02) matrices, norms as the model's init has them, drawn from a generator
seeded with SEED), then `glassgpt explain` is run on that `.pth` in a fresh process, once per kind of block
(`--block N`), and its standard output goes into the page between `<!-- trace: KEY -->` and the end of the
```text block that follows it. Llama 3.2 1B is glassgpt's own preset, whose random weights are drawn the same way.

A model too big for a 24 GB machine in float32 keeps its real widths (emb_dim, heads, head sizes, vocabulary,
feed-forward and expert widths) and fewer layers: one period of its layer pattern (Model.kept says which), so that every
kind of block is still there. The page says so beside each trace; tests/test_model_traces.py holds the page to
this file's configs and to what the trace prints today.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"
PROMPT = "Every effort moves you"
SEED = 123
TOP_K = 5
S, F, L = "sliding_attention", "full_attention", "linear_attention"


@dataclass(frozen=True)
class Model:
    """One trace on the page: the model, where its config comes from, what it keeps, and the blocks opened."""

    key: str                     # the page's marker; the gallery's key, where it has one
    name: str
    file: str                    # the .pth the command reads ("" for a preset)
    kept: dict[str, Any] = field(default_factory=dict)  # what differs from the released config (fewer layers)
    blocks: tuple[tuple[int, str], ...] = ((0, ""),)    # (--block N, what kind it is) to open, one of each kind
    preset: str | None = None


MODELS = {m.key: m for m in (
    Model("llama3", "Llama 3.2 1B", "", preset="llama3.2-1b"),
    Model("qwen3-moe", "Qwen3 30B-A3B", "qwen3-30b-a3b.pth", kept={"n_layers": 1}),
    Model("gemma3", "Gemma 3 270M", "gemma3-270m.pth", blocks=((0, "sliding"), (5, "full"))),
    Model("olmo3", "OLMo 3 7B", "olmo3-7b.pth", kept={"n_layers": 4, "layer_types": [S, S, S, F]},
          blocks=((0, "sliding"), (3, "full"))),
    Model("tiny-aya", "Tiny Aya 3.35B", "tiny-aya.pth", kept={"n_layers": 4, "layer_types": [S, S, S, F]},
          blocks=((0, "sliding, RoPE"), (3, "full, no position signal"))),
    Model("qwen3.5", "Qwen3.5 0.8B", "qwen3.5-0.8b.pth", blocks=((0, "linear"), (3, "full"))),
    Model("gemma4", "Gemma 4 E2B", "gemma4-e2b.pth",
          kept={"n_layers": 10, "layer_types": [S, S, S, S, F] * 2, "num_kv_shared_layers": 5},
          blocks=((0, "sliding"), (4, "full"))),
)}

# The same models made small (the tests): each model's own layer pattern, every width shrunk.
SMALL = {
    "llama3": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "n_kv_groups": 2, "hidden_dim": 128,
               "n_layers": 2, "context_length": 64},
    "qwen3-moe": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "n_kv_groups": 2, "head_dim": 16,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_hidden_dim": 32, "context_length": 64},
    "gemma3": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "head_dim": 16, "hidden_dim": 128,
               "context_length": 64, "sliding_window": 8, "query_pre_attn_scalar": 16},
    "olmo3": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "hidden_dim": 128,
              "context_length": 64, "sliding_window": 8, "rope_orig_max": 32},
    "tiny-aya": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                 "hidden_dim": 128, "context_length": 64, "sliding_window": 8},
    "qwen3.5": {"vocab_size": 50_257, "emb_dim": 64, "n_heads": 4, "head_dim": 16, "hidden_dim": 128,
                "context_length": 64, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "n_layers": 4,
                "layer_types": [L, L, L, F]},
    "gemma4": {"vocab_size": 50_257, "vocab_size_per_layer_input": 50_257, "emb_dim": 64, "hidden_dim": 128,
               "n_heads": 4, "head_dim": 16, "global_head_dim": 32, "context_length": 64, "sliding_window": 8,
               "hidden_size_per_layer_input": 8},
}


def released_dict(key: str) -> dict[str, Any]:
    """The released model's config dict, as its notebook writes it (Llama 3.2 1B: glassgpt's preset's fields)."""
    from glassgpt.config import FAMILY_PRESETS
    from glassgpt.explain.gallery import SHAPES
    from glassgpt.families.gemma4 import get_gemma4_dense_config

    if key == "llama3":
        return FAMILY_PRESETS["llama3.2-1b"].to_dict()
    if key == "gemma4":
        return get_gemma4_dense_config("E2B").to_dict()
    return dict(SHAPES[key]["book"])


def config_dict(key: str, small: bool = False) -> dict[str, Any]:
    """The dict the trace is made from: the released one with MODELS[key].kept, or SMALL[key], applied."""
    return released_dict(key) | MODELS[key].kept | (SMALL[key] if small else {})


def config_of(key: str, small: bool = False):
    """The glass config of config_dict(key), read as `glassgpt explain --model X.pth` reads the JSON beside it."""
    from glassgpt.formats.families import config_from_book
    from glassgpt.formats.glassgpt import config_from_values

    values = config_dict(key, small)
    return config_from_values(values, key) if key == "llama3" else config_from_book(values)


def command(key: str, block: int = 0, small: bool = False) -> list[str]:
    """The `glassgpt explain` arguments of one trace, run where write_model wrote (small: a preset's fields as
    small.json, which glassgpt reads as random weights too)."""
    m = MODELS[key]
    model = (["--model", "small.json" if small else m.preset, "--seed", str(SEED)] if m.preset
             else ["--model", m.file, "--tokenizer", "gpt2"])
    return ["explain", PROMPT, *model, "--top-k", str(TOP_K), "--dtype", "float32"] + (
        ["--block", str(block)] if block else [])


def shell_line(argv: list[str]) -> str:
    """`argv` as the page writes it: `glassgpt explain "the prompt" ...`."""
    return "glassgpt " + " ".join(f'"{a}"' if " " in a else a for a in argv)


def write_model(key: str, where: Path, small: bool = False) -> None:
    """The .pth of random weights and its config dict beside it (a preset: nothing, or small, its fields)."""
    from glassgpt.families import random_family_model

    m = MODELS[key]
    if m.preset:
        if small:
            (where / "small.json").write_text(json.dumps(config_of(key, small).to_dict()))
        return
    model = random_family_model(config_of(key, small), seed=SEED)
    torch.save(model.state_dict(), where / m.file)
    del model
    gc.collect()  # before `glassgpt explain` reads it back in a process of its own
    (where / m.file).with_suffix(".json").write_text(json.dumps(config_dict(key, small), indent=1))


def run_explain(argv: list[str], where: Path) -> str:
    """`glassgpt explain` in a fresh process (the model's memory goes with it), in `where`; its standard output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "-m", "glassgpt", *argv], cwd=where, env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"glassgpt {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def stage_rows(text: str) -> list[str]:
    """The trace's table of stages: the lines from `ids` to `out_head`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ids "))
    end = next(i for i, line in enumerate(lines) if line.lstrip().startswith("out_head "))
    return lines[start:end + 1]


def shown(key: str, outputs: list[str]) -> str:
    """What the page shows of one model's runs: the first (--block 0) whole up to its next tokens, the section
    `why this token` (the same tokens as dot products) elided; of each other kind of block, its table of stages
    (or a line saying it is block 0's)."""
    first = outputs[0].rstrip("\n")
    head, sep, _ = first.partition("\nwhy this token")
    text = head.rstrip("\n")
    if sep:
        text += "\n\n[why this token: the same top tokens as dot products h · W[id], elided here]"
    for (block, kind), out in zip(MODELS[key].blocks[1:], outputs[1:]):
        rows = stage_rows(out)
        if rows == stage_rows(first):
            text += f"\n\n[--block {block} ({kind}): the same table of stages as block 0's]"
        else:
            text += f"\n\n[--block {block} ({kind}): its table of stages]\n" + "\n".join(rows)
    return text + "\n"


def traces(key: str, small: bool = False) -> str:
    """The page's block for `key`: its model written, then each --block of MODELS[key].blocks traced."""
    with tempfile.TemporaryDirectory(prefix=f"trace-{key}-") as tmp:
        write_model(key, Path(tmp), small)
        return shown(key, [run_explain(command(key, block, small), Path(tmp)) for block, _ in MODELS[key].blocks])


MARKED = re.compile(r"(<!-- trace: (?P<key>[\w.-]+) -->\n```text\n)(?P<text>.*?)(^```)", re.S | re.M)


def page_traces(page: str) -> dict[str, str]:
    """The traces the page shows, by key."""
    return {m["key"]: m["text"] for m in MARKED.finditer(page)}


def replace_trace(page: str, key: str, text: str) -> str:
    if key not in page_traces(page):
        raise SystemExit(f"{PAGE} has no '<!-- trace: {key} -->' above a ```text block: add one")
    return MARKED.sub(lambda m: m[1] + (text if m["key"] == key else m["text"]) + m[4], page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys", nargs="*", metavar="KEY", help=f"the models (default: all): {', '.join(MODELS)}")
    parser.add_argument("--print", action="store_true", help="print the blocks; leave the page alone")
    parser.add_argument("--small", action="store_true", help="the small shapes the tests use")
    args = parser.parse_args(argv)
    unknown = [k for k in args.keys if k not in MODELS]
    if unknown:
        parser.error(f"no model {unknown[0]!r}: choose from {', '.join(MODELS)}")
    for key in args.keys or list(MODELS):
        text = traces(key, small=args.small)
        if args.print or args.small:
            print(f"--- {key}\n{text}", end="")
        else:
            PAGE.write_text(replace_trace(PAGE.read_text(encoding="utf-8"), key, text), encoding="utf-8")
            print(f"{key}: written into {PAGE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
