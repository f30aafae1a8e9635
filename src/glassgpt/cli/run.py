"""The run lifecycle that `glassgpt train` and `glassgpt finetune` share, and their flags.

    run_training(args, command, setup, report)
      -> the run directory claimed once: checked, locked, recovered (training.loop.rundir)
      -> on --resume: the checkpoint to continue and the run's saved settings, said where from
      -> this process's rank (training.loop.distributed: WORLD_SIZE is read there, once)
      -> setup(args, start): the command's own part (model, tokenizer, task, TrainConfig, meta, the
         recipe, whose loop it runs and whose lines it prints): a `Prepared`
      -> fit(..., log=Printer): the progress bar, the evaluation lines and the samples
      -> report(result, ..., model): the command's summary; a signal ends in 128 + its number

The TrainConfig flags come from TrainConfig's fields (training/config.py: each field's
type, default, check and help are declared there once). Their defaults here are None, so a
resumed run knows which were given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import memory
from ..device import resolve_device
from ..engine import autotune
from ..formats import load_meta
from ..errors import GlassError
from ..training import TrainConfig, fit, recipes
from ..training.loop.checkpoint import checkpoint_bytes, resume_checkpoint
from ..training.loop.config import default, setting_type
from ..training.loop.distributed import Distributed, setup_distributed
from ..training.loop.rundir import RunDir, open_run_dir, saved_train_config
from .common import add_threads_arg, is_main_rank, say, set_threads
from .limits import number
from .progress import Printer

# A million passes is past any run, and keeps max_steps (epochs x steps per epoch) within 64 bits.
EPOCHS = number(float, lambda v: 0 < v <= 1e6, "a positive number of at most 1,000,000")


def add_train_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = (), shown: dict[str, str] | None = None,
                   epochs: str = "none: --max-steps", choices: dict[str, list[str]] | None = None) -> None:
    """Every TrainConfig field as a flag (but `exclude`), with --resume, --epochs, --no-progress, --threads.

    `shown` replaces the default that help states for some fields (finetuning has its own); `choices`
    the values a flag takes (--recipe: the registry's names)."""
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR/latest exactly where it stopped (RUN_DIR/best "
                                                       "if latest/ is gone; default: start a new run)")
    for f in dataclasses.fields(TrainConfig):
        if f.name not in exclude:
            _add_setting(p, f, (shown or {}).get(f.name), (choices or {}).get(f.name))
    p.add_argument("--epochs", type=EPOCHS, help=f"passes over the training data (default {epochs}); give this "
                                                         "or --max-steps, not both")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bar (on a terminal) or the progress lines (in a log); the evaluation "
                        "lines and samples still print (default: shown)")
    add_threads_arg(p)


def _add_setting(p: argparse.ArgumentParser, f: dataclasses.Field, shown: str | None,
                 choices: list[str] | None = None) -> None:
    m = f.metadata
    shown = shown if shown is not None else m["shown"] if m["shown"] is not None else f"{f.default}"
    text = m["help"] + (f" (default {shown})" if shown else "")
    flag = m["flag"] or "--" + f.name.replace("_", "-")
    kind = setting_type(f.name)
    if kind is bool:
        p.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true", default=None, help=text)
    elif choices or m["choices"]:
        p.add_argument(flag, dest=f.name, choices=choices or m["choices"], default=None, help=text)
    else:
        check = m["check"]
        parse = number(kind, check, check.words, check.most) if check else number(kind, lambda v: True, "a number")
        p.add_argument(flag, dest=f.name, type=parse, default=None, metavar=m["metavar"], help=text)


def train_config_from_args(args: argparse.Namespace, base: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from the flags given, over `base` (a saved config, or a command's defaults)."""
    values = dict(base)
    for field in dataclasses.fields(TrainConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    return TrainConfig.from_dict(values)


def given_flags(args: argparse.Namespace, names) -> list[str]:
    """The flags among `names` (dest names) that the command line gave."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name, None) is not None]


# --- the lifecycle --------------------------------------------------------------------------------

@dataclass
class Start:
    """Where a run starts: its claimed directory, and on --resume the checkpoint and saved settings."""

    run_dir: RunDir
    ranks: Distributed
    checkpoint: Path | None = None
    saved: dict[str, Any] | None = None  # the run's TrainConfig values


@dataclass
class Prepared:
    """What a command's setup hands the lifecycle: the run to fit, and its recipe (its loop, its lines)."""

    model: Any
    tokenizer: Any
    task: Any
    cfg: TrainConfig
    meta: dict[str, Any]
    recipe: recipes.Recipe


Setup = Callable[[argparse.Namespace, Start], Prepared]


def run_training(args: argparse.Namespace, command: str, setup: Setup,
                 report: Callable[[dict, TrainConfig, Any, Any, Any], None]) -> int:
    """Claim the run directory, set up (the command's `setup`), fit, report: see the module docstring."""
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise GlassError("--resume RUN_DIR writes to RUN_DIR: drop --out")
    if args.epochs is not None and args.max_steps is not None:
        raise GlassError("give --epochs or --max-steps, not both")
    check_evaluation_sizes(args)
    with open_run_dir(args.resume or args.out, bool(args.resume), is_main_rank()) as run_dir:
        start = _resumed(args, run_dir) if args.resume else Start(run_dir, None)
        device = args.device or (start.saved or {}).get("device")
        start.ranks = setup_distributed(device)
        try:
            prepared = setup(args, start)
            model, tokenizer, task, cfg = prepared.model, prepared.tokenizer, prepared.task, prepared.cfg
            recorded = load_meta(start.checkpoint).get("threads") if start.checkpoint else None
            prepared.meta["threads"] = set_threads(args.threads, model.cfg.emb_dim, file=sys.stdout,
                                                   recorded=recorded)  # saved with each checkpoint
            if model.tok_emb.weight.device.type == "cpu":
                say(autotune.training_note())
            _checkpoint_note(model, cfg)
            printer = Printer(progress=not args.no_progress, line=prepared.recipe.log_line)
            try:
                result = fit(model, task, cfg, tokenizer, log=printer, meta=prepared.meta, run_dir=run_dir,
                             ranks=start.ranks, loop=prepared.recipe.loop)
            finally:
                printer.close()  # (a run that ends in an error leaves no bar behind)
        finally:
            start.ranks.close()
    if result["interrupted"]:
        say(f"interrupted at step {result['step']:,}: saved {cfg.out}/latest; continue with: "
            f"{command} --resume {cfg.out}", file=sys.stderr)
        return 128 + int(result["signal"])
    if is_main_rank():
        report(result, cfg, task, tokenizer, model)
    return 0


EVAL_WINDOW_BYTES = 16  # a window's start in the float64 linspace and its int64 copy (training/data.py)


def check_evaluation_sizes(args: argparse.Namespace) -> None:
    """What each evaluation allocates, refused before the run starts where the memory available cannot hold
    it: --sample-tokens (a sample that long) and --eval-batches x --batch-size (the windows' starts)."""
    free = memory.available_memory(resolve_device(args.device))
    if getattr(args, "sample_tokens", None):
        n = args.sample_tokens
        note = memory.fit_note(n * memory.TOKEN_BYTES, free, f"--sample-tokens {n:,} (a sample of {n:,} tokens "
                               f"at each evaluation, {memory.TOKEN_BYTES} bytes each)",
                               f"--sample-tokens {free.ram // memory.TOKEN_BYTES:,} fits")
        if note:
            say(f"note: {note}", file=sys.stderr)
    if getattr(args, "eval_batches", None):
        batch = args.batch_size or default("batch_size")
        windows = args.eval_batches * batch
        note = memory.fit_note(windows * EVAL_WINDOW_BYTES, free,
                               f"--eval-batches {args.eval_batches:,} x --batch-size {batch:,} ({windows:,} windows "
                               f"at each evaluation, {EVAL_WINDOW_BYTES} bytes for each one's start)",
                               f"--eval-batches {max(1, free.ram // EVAL_WINDOW_BYTES // batch):,} fits")
        if note:
            say(f"note: {note}", file=sys.stderr)


def _resumed(args: argparse.Namespace, run_dir: RunDir) -> Start:
    """The checkpoint --resume continues and the run's saved settings, with a note on where each comes from;
    a --seed other than the run's is refused (another seed draws other batches)."""
    ckpt, note = resume_checkpoint(run_dir.path)
    saved, damaged = saved_train_config(run_dir.path, ckpt)
    for line in (note, damaged):
        if line:
            say(f"note: {line}", file=sys.stderr)
    if args.seed is not None and args.seed != saved.get("seed"):
        raise GlassError(f"--resume continues {run_dir.path} with its seed {saved.get('seed')} (another seed draws "
                         "other batches, so it would not be the same run): drop --seed")
    return Start(run_dir, None, ckpt, {**saved, "out": str(run_dir.path)})  # written where it is now


def _checkpoint_note(model, cfg: TrainConfig) -> None:
    """Say what a checkpoint costs when it is large: a 163M model and its AdamW state are 2 GB."""
    size = checkpoint_bytes(model)
    if size < 256 * 2**20:
        return
    when = (f"every {cfg.save_every:,} steps" if cfg.save_every else
            "at the evaluations while a save costs under a tenth of the time trained since the last one")
    say(f"note: each checkpoint is {size / 1e9:.2f} GB (weights and AdamW's moments); latest/ is saved {when} "
        "and at the end, best/ on a new best validation loss then (sharing latest/'s files when both are saved "
        "at one step); --save-every N to choose", file=sys.stderr)


# --- signals: a clean exit with the shell's code -------------------------------------------------

class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop: unwinds like Ctrl-C, so `finally` blocks remove temp files."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def stoppable(run):
    """Wrap a training command so that every way it stops ends in a line and the shell's exit code.

    In the loop, SIGINT and SIGTERM save latest/ (fit) and the command returns 128 + the
    signal (130, 143). Before or after it, SIGTERM unwinds like Ctrl-C, so temporary files
    are removed, and exits 143. SIGXFSZ is ignored, so a file-size limit (ulimit -f) is an
    error that names the file rather than a core dump.
    """
    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        if threading.current_thread() is not threading.main_thread():
            return run(args)
        handlers = {signal.SIGTERM: _raise_terminated}
        if hasattr(signal, "SIGXFSZ"):
            handlers[signal.SIGXFSZ] = signal.SIG_IGN
        old = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            return run(args)
        except Terminated:
            say("terminated (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return wrapped
