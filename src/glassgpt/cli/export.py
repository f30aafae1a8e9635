"""`glassgpt export`: hand a model to the book's code (`--format pth`), to transformers (`--format hf`),
or to llama.cpp (`--format gguf`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..errors import GlassError
from ..formats import export_hf
from ..formats.book import book_cfg, book_state_dict
from ..formats.files import atomic_write, clean_leftovers
from ..formats.gguf import write_gguf
from ..formats.families import export_family_book, export_family_hf
from ..kinds import describe
from .common import add_source_args, open_model


FORMATS = ("pth", "hf", "gguf")
FORMAT_ALIASES = {"book": "pth"}  # its name before: the README's readers may still type it


def export_format(text: str) -> str:
    return FORMAT_ALIASES.get(text, text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a model for the book's GPTModel, Hugging Face transformers or llama.cpp",
                       description="Load MODEL (any --model spec) and write it in another layout: 'pth' is a "
                                   "state dict that the book's GPTModel(cfg).load_state_dict("
                                   "torch.load(PATH, weights_only=True)) accepts, with its cfg in a .json beside "
                                   "it; 'hf' is a directory that transformers' GPT2LMHeadModel.from_pretrained loads; "
                                   "'gguf' is one file in llama.cpp's GPT-2 layout, with GPT-2's tokenizer, that "
                                   "llama.cpp runs (and glassgpt reads back: --model model.gguf).")
    p.add_argument("model", metavar="MODEL", help="preset, checkpoint or run directory, Hugging Face-layout "
                                                  "directory, hub id, .pth state dict, OpenAI gpt2/124M folder, "
                                                  "or .gguf file")
    p.add_argument("--format", type=export_format, choices=FORMATS, required=True,
                   help="pth: one .pth state dict for the book's GPTModel (+ its cfg .json; 'book' names it too); "
                        "hf: a directory with config.json + model.safetensors; gguf: one .gguf file for llama.cpp")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="the .pth file (pth), directory (hf) or .gguf file (gguf) to write")
    p.add_argument("--dtype", choices=("f32", "bf16", "q8_0", "q4_0"), default="f32",
                   help="gguf only: how the matrices are stored: f32 (exact), bf16 (half the bytes), q8_0 "
                        "(llama.cpp's 8-bit blocks of 32 weights, a quarter), q4_0 (4-bit blocks of 32 with one "
                        "scale, about an eighth: the layout ollama users pull most) (default: f32)")
    p.add_argument("--force", action="store_true", help="write over an existing --out (default: refuse)")
    add_source_args(p)
    p.set_defaults(run=run_export)


def clean_interrupted(out: Path, fmt: str) -> list[Path]:
    """Remove what an export to `out` that was killed left (temporary files and directories whose process
    is gone), and `out` itself when that was all it held (an hf directory from before exports were whole)."""
    written = {"pth": [out, out.with_suffix(".json")], "gguf": [out], "hf": [out, out / "model.safetensors",
                                                                         out / "config.json"]}[fmt]
    removed = [path for dest in written for path in clean_leftovers(dest)]
    if removed and fmt == "hf" and out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
        removed.append(out)
    return removed


def run_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.format == "pth" and (out.is_dir() or out.suffix == ".json"):
        raise GlassError(f"--out {out} must be a file name such as model.pth (its cfg goes beside it, as .json)")
    if args.format == "gguf" and out.is_dir():
        raise GlassError(f"--out {out} is a directory: give a file name such as model.gguf")
    if args.dtype != "f32" and args.format != "gguf":
        raise GlassError(f"--dtype {args.dtype} is for --format gguf; {args.format} is written in float32")
    removed = clean_interrupted(out, args.format)
    if removed:
        print(f"note: removed what an interrupted export left: {', '.join(str(p) for p in removed)}")
    if out.exists() and not args.force:
        raise GlassError(f"--out {out} exists: pass --force to write over it, or choose another name")
    source = open_model(args, dropout_matters=True)  # the cfg it writes holds drop_rate
    model = source.load("cpu", "float32")
    anatomy = describe(model)
    if args.format not in anatomy.exports:
        raise GlassError(_not_written(anatomy, type(model).__name__, args.format))
    if anatomy.positions.kind != "learned":  # RoPE: the families' layouts (the book's Qwen3Model, Llama3Model, ...)
        return _export_family(args, model, out)
    if args.format == "gguf":
        write_gguf(model, out, source.tokenizer(), args.dtype, name=Path(str(args.model)).name or "glassgpt")
        print(f"wrote {out} ({model.num_parameters():,} parameters, matrices in {args.dtype}, GPT-2's tokenizer): "
              f"llama.cpp runs it (llama-cli -m {out}), and so does glassgpt (--model {out})")
        return 0
    if args.format == "hf":
        export_hf(model, out)
        print(f"wrote {out}/config.json and model.safetensors: "
              f"transformers.GPT2LMHeadModel.from_pretrained({str(out)!r}) loads it")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = book_cfg(model.cfg)
    cfg_path = out.with_suffix(".json")
    atomic_write(out, lambda tmp: torch.save(book_state_dict(model), tmp))
    atomic_write(cfg_path, lambda tmp: Path(tmp).write_text(json.dumps(cfg, indent=2) + "\n"))
    print(f"wrote {out} ({model.num_parameters():,} parameters, float32) and its cfg {cfg_path}")
    print("load it with the book's code (llms_from_scratch.ch04.GPTModel, or your own from chapter 4):")
    print(f"    cfg = {cfg!r}")
    print("    model = GPTModel(cfg)")
    if model.cfg.num_classes is not None:  # chapter 6 swaps the head before loading
        print(f"    model.out_head = torch.nn.Linear({model.cfg.emb_dim}, {model.cfg.num_classes})")
    print(f"    model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")
    return 0


LAYOUTS = {"pth": "the book's class's state dict", "hf": "transformers' folder", "gguf": "GPT-2's llama.cpp layout"}


def _not_written(anatomy, name: str, fmt: str) -> str:
    """One line: the layout asked for is not one the model's description says glassgpt writes it in."""
    if not anatomy.exports:
        return (f"glassgpt does not export this model ({anatomy.name}) yet: --format {fmt} writes {LAYOUTS[fmt]}, "
                "and that layout has no place for what it changes")
    return f"--format {fmt} writes {LAYOUTS[fmt]}; export a {name} as {' or '.join(anatomy.exports)}"


def _export_family(args: argparse.Namespace, model, out: Path) -> int:
    """A Qwen3 or Llama 3.2 model: the book's Qwen3Model/Llama3Model .pth (+ its config .json), or an HF folder."""
    name = type(model).__name__
    if args.format == "hf":
        export_family_hf(model, out)
        print(f"wrote {out}/config.json and model.safetensors: transformers.AutoModelForCausalLM.from_pretrained("
              f"{str(out)!r}) loads it (copy the tokenizer files beside them)")
        return 0
    export_family_book(model, out)
    load = f"torch.load({str(out)!r}, weights_only=True)"
    print(f"wrote {out} and {out.with_suffix('.json')}: the book's {name}(cfg).load_state_dict({load}) accepts it, "
          "with cfg the .json's dict (its dtype a torch dtype)")
    return 0
