"""`glassgpt check my_gpt.py:GPTModel --config cfg.json`, `glassgpt check my_attention.py:MultiHeadAttention
--args ch03`: a reader's own implementation, whole or one piece, against the book's formulas;
`glassgpt check my_qwen3.py:Qwen3Model --against transformers`: the layer debugger."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from ..errors import GlassError
from ..explain.debugger import AGAINST, debug
from ..explain.loading import load_state_dict
from ..explain.pieces import PRESETS, build, check as check_piece, is_whole_model
from ..explain.pieces.cache import has_cache_api
from ..explain.verify import DEFAULT_TEXT, check  # GPT-2, or any other described model
from ..formats.files import read_json
from .limits import seed


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check your own GPTModel, or any piece of it, against the book's formulas",
                       description="Build FILE's CLASS (after torch.manual_seed) and run it on the book's inputs "
                                   "against glassgpt's formula for it in float64: a whole GPTModel stage by stage "
                                   "(with --config, as the book builds GPTModel(GPT_CONFIG_124M)), or one piece of "
                                   "chapters 2 to 7: an attention class, LayerNorm, GELU, FeedForward, "
                                   "TransformerBlock, GPTDatasetV1, create_dataloader_v1, generate, calc_loss_batch, "
                                   "custom_collate_fn, ..., the pieces of Qwen3, Llama 3.2 and the bonus models (Gemma 3, "
                                   "OLMo 3, Qwen3.5, Tiny Aya; --args names the model) (NAME may be a function). Says the first thing that "
                                   "differs and the known mistake that reproduces it. Exit code 1 when it differs.")
    p.add_argument("target", metavar="FILE:NAME",
                   help="the Python file and the class or function in it, e.g. my_attention.py:MultiHeadAttention")
    p.add_argument("--args", metavar="JSON|PRESET",
                   help="the constructor's arguments: a JSON object ('{\"d_in\": 768, \"d_out\": 768, ...}', or "
                        f"a .json file; a model's config dict is mapped to a piece's arguments), or the book's for a "
                        f"chapter's examples or a tiny model: {', '.join(PRESETS)} (default: the book's for the "
                        "class's chapter or model)")
    p.add_argument("--config", metavar="JSON",
                   help="the config dict a GPTModel takes, as a .json file (e.g. the book's GPT_CONFIG_124M)")
    p.add_argument("--weights", metavar="PTH", help="a state dict to load into it (default: its random weights)")
    p.add_argument("--seed", type=seed, default=123, help="torch.manual_seed before building it (default: 123)")
    p.add_argument("--prompt", default=DEFAULT_TEXT, help=f"a whole model's prompt (default: {DEFAULT_TEXT!r}; a "
                                                          "Qwen3/Llama port reads it as UTF-8 bytes, its tokenizer "
                                                          "not being loaded)")
    p.add_argument("--against", choices=AGAINST,
                   help="the layer debugger: a whole GPT-2, Qwen3 or Llama 3 model (its class, built on a tiny "
                        "random config or on --config) given transformers' random weights, layer by layer against "
                        "transformers' model: [OK]/[DIFF]/[SHAPE] per layer, then the first cause")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    obj = load_class(args.target)
    notes: list[str] = []
    if args.against:
        if args.weights:
            raise GlassError("--against transformers gives both models the same random weights: leave out --weights")
        result = debug(obj, _config(args), against=args.against, seed=args.seed)
    else:
        if isinstance(obj, type):
            obj, notes = _build(obj, args)
        whole = is_whole_model(obj) and not has_cache_api(obj)  # a cached model: its cache against no cache
        result = check(obj, args.prompt) if whole else check_piece(obj, args.prompt)
    out = result.to_dict() | ({"load_notes": notes} if notes else {})
    print(json.dumps(out, indent=2) if args.json else "\n".join([result.to_text()] + [f"note: {n}" for n in notes]))
    return 0 if result.ok else 1


def _config(args: argparse.Namespace):
    if args.config and args.args:
        raise GlassError("give --config (a GPTModel's config) or --args (a piece's arguments), not both")
    config = read_json(args.config, what="config", kind="config") if args.config else _args(args.args)
    if isinstance(config, dict) and isinstance(config.get("dtype"), str):  # the book's Qwen3/Llama dicts hold a torch dtype; JSON its name
        config["dtype"] = getattr(torch, config["dtype"].removeprefix("torch."), None)
        if not isinstance(config["dtype"], torch.dtype):
            raise GlassError(f"{args.config or args.args}: dtype must name a torch dtype such as \"float32\" or \"bfloat16\"")
    return config


def _build(cls: type, args: argparse.Namespace):
    """(the model, notes on its --weights): a state dict that does not load is one line naming why."""
    model = build(cls, _config(args), seed=args.seed)
    if not args.weights:
        return model, []
    try:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
    except Exception as err:  # the reader's own file: one line, where and what
        raise GlassError(f"{args.weights} does not load: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise GlassError(f"{args.weights} holds a {type(state).__name__}, not a state dict: save one with "
                         "torch.save(model.state_dict(), path)")
    return model, load_state_dict(model, state, source=args.weights)


def _args(text: str | None):
    """--args: None, a preset's name, a JSON object, or a .json file holding one."""
    if text is None or text in PRESETS:
        return text
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise GlassError(f"--args is not a JSON object: {err.msg} at character {err.pos}") from None
    if Path(text).suffix == ".json":
        return read_json(text, what="arguments", kind="config")
    raise GlassError(f"--args {text!r}: give a JSON object of the constructor's arguments, a .json file, or one of "
                     f"{', '.join(PRESETS)}")


def load_class(target: str):
    """The class (or function, or object) named by FILE:NAME, imported from the file; a one-line
    GlassError if it cannot be."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise GlassError(f"{target!r}: give FILE:CLASS, e.g. my_gpt.py:GPTModel")
    path = Path(path_text)
    if not path.is_file():
        raise GlassError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"glassgpt_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # so that it imports the files beside it, as it does at home
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise GlassError(f"{path} does not import: a syntax error at line {err.lineno}: {err.msg}") from None
    except Exception as err:
        raise GlassError(f"{path} does not import: {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and getattr(v, "__module__", None) == module.__name__)
        raise GlassError(f"{path} has no class {name!r}: it defines {', '.join(found) or 'no classes'}")
    return obj
