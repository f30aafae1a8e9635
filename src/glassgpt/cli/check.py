"""`glassgpt check my_gpt.py:GPTModel --config cfg.json`: a reader's own implementation against the book's formulas."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from ..errors import GlassError
from ..explain.verify import DEFAULT_TEXT
from ..explain.verify_family import check  # GPT-2, or a Qwen3/Llama port of the book's classes
from ..formats.files import read_json
from .limits import seed


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check your own GPTModel against the book's formulas, stage by stage",
                       description="Build FILE's CLASS with the config (as the book builds GPTModel(GPT_CONFIG_124M), "
                                   "after torch.manual_seed), run it on a prompt with hooks on its submodules, and "
                                   "compute every stage again with glassgpt's model.py on the same weights: the first "
                                   "stage that differs, where, and the known mistake that reproduces it. Exit code 1 "
                                   "when a stage differs.")
    p.add_argument("target", metavar="FILE:CLASS", help="the Python file and the class in it, e.g. my_gpt.py:GPTModel")
    p.add_argument("--config", required=True, metavar="JSON",
                   help="the config dict the class takes, as a .json file (e.g. the book's GPT_CONFIG_124M)")
    p.add_argument("--weights", metavar="PTH", help="a state dict to load into it (default: its random weights)")
    p.add_argument("--seed", type=seed, default=123, help="torch.manual_seed before building it (default: 123)")
    p.add_argument("--prompt", default=DEFAULT_TEXT, help=f"the prompt to run (default: {DEFAULT_TEXT!r})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    cls = load_class(args.target)
    config = read_json(args.config, what="config")
    if isinstance(config.get("dtype"), str):  # the book's Qwen3/Llama dicts hold a torch dtype; JSON its name
        config["dtype"] = getattr(torch, config["dtype"].removeprefix("torch."), None)
        if not isinstance(config["dtype"], torch.dtype):
            raise GlassError(f"{args.config}: dtype must name a torch dtype such as \"float32\" or \"bfloat16\"")
    torch.manual_seed(args.seed)
    try:
        model = cls(config)
        if args.weights:
            model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    except GlassError:
        raise
    except Exception as err:  # the reader's own code: one line, where and what
        raise GlassError(f"{args.target}({args.config}) failed: {type(err).__name__}: {err}") from None
    result = check(model, args.prompt)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.to_text())
    return 0 if result.ok else 1


def load_class(target: str) -> type:
    """The class named by FILE:CLASS, imported from the file; a one-line GlassError if it cannot be."""
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
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise GlassError(f"{path} has no class {name!r}: it defines {', '.join(found) or 'no classes'}")
    return cls
