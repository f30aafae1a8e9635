"""How to train: `TrainConfig`, each setting declared once, with its type, default, check and help.

The command line builds its flags from these fields (`glassgpt train --batch-size`, ...:
cli/run.py), so a setting's name, type, default, allowed values and help are written here
and nowhere else. A run saves its TrainConfig as RUN_DIR/train_config.json.

Two recipes (`recipe`):
    glassgpt  nanoGPT's: random windows, AdamW with decay on matrices only, warm-up then a
              cosine, clipping; each step seeds its own dropout, so a resumed run needs no
              RNG state to go on exactly
    book      the book's chapter 5 (`train_model_simple`): the book's loaders, AdamW with decay
              on every parameter at a constant lr, no clipping; torch's global RNG runs on as
              in the book's code (its state is saved with each checkpoint)
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from ...config import from_fields
from ...errors import TrainError

RECIPES = ("glassgpt", "book")
DTYPES = ("float32", "bfloat16", "float16", "auto")


# What glassgpt's recipe does with a text as small as the book's, measured (benchmarks/RESULTS.md,
# bench_book_ch05.py --defaults: the-verdict, the book's 46,080 tokens, scored on the book's windows).
# `glassgpt train --help` and train's note on a small text both say it.
SMALL_TEXT_FINDING = ("glassgpt's random windows generalise better than the book's fixed ones (val 6.02 against "
                      "6.53 on the-verdict) but do not memorise the text (train 3.32 against 0.30), so its samples "
                      "do not recite it: --recipe book trains as chapter 5 does")


@dataclass(frozen=True)
class Check:
    """A condition on a setting's value, and the words an error uses for it ("a positive integer")."""

    ok: Callable[[Any], bool]
    words: str
    most: int = 2**63 - 1  # the largest integer the flag's parser reads (64 bits; a seed's 2**64 - 1)

    def __call__(self, value: Any) -> bool:
        return self.ok(value)


def _int(v) -> bool:
    """An integer that fits in 64 bits (torch's and numpy's counters)."""
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE_INT = Check(lambda v: _int(v) and v > 0, "a positive integer")
NONNEG_INT = Check(lambda v: _int(v) and v >= 0, "a non-negative integer")
POSITIVE = Check(lambda v: _number(v) and v > 0, "a positive number")
NONNEG = Check(lambda v: _number(v) and v >= 0, "a number >= 0")
FRACTION = Check(lambda v: _number(v) and 0 <= v < 1, "in [0, 1)")
SEED = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64, "an integer in [0, 2**64)",
             2**64 - 1)


def setting(default: Any, help: str, check: Check | None = None, *, shown: str | None = None,
            choices: tuple[str, ...] | None = None, flag: str | None = None, metavar: str | None = None) -> Any:
    """A TrainConfig field: its default, its help (the default is added to it: `shown`, else the
    value), the check its values must pass, and how its flag reads (`flag`, `choices`, `metavar`)."""
    default_kw = {} if default is dataclasses.MISSING else {"default": default}  # MISSING: required
    return field(**default_kw, metadata={"help": help, "check": check, "shown": shown, "choices": choices,
                                            "flag": flag, "metavar": metavar})


@dataclass
class TrainConfig:
    """How to train. Every field is a `glassgpt train` flag; saved as RUN_DIR/train_config.json."""

    out: str = setting(dataclasses.MISSING, "the run directory: checkpoints, metrics.jsonl, loss.png (required for a new run; "
                             "with --resume: RUN_DIR)", shown="", metavar="RUN_DIR")
    recipe: str = setting("glassgpt", "glassgpt: nanoGPT's loop (random windows, warm-up, cosine, clipping); "
                                      "book: the book's chapter 5 exactly (its loaders, constant lr, no "
                                      "clipping, the model's own kernels in float32); book-appendix-d: the "
                                      "book's appendix D, train_model (warm-up, cosine, clipping). On a text as small as "
                                      f"the book's, {SMALL_TEXT_FINDING}; GPT-2's initialisation (an "
                                      "OpenAI-layout --model) loses under both", choices=RECIPES)
    batch_size: int = setting(8, "sequences per micro-batch and rank", POSITIVE_INT)
    grad_accum: int = setting(1, "micro-batches per optimizer step", POSITIVE_INT)
    batch_tokens: int | None = setting(None, "target tokens per optimizer step over all ranks: sets --grad-accum",
                                       POSITIVE_INT, shown="off")
    max_steps: int = setting(1000, "optimizer steps", POSITIVE_INT)
    lr: float = setting(6e-4, "peak learning rate", POSITIVE)
    min_lr: float | None = setting(None, "learning rate at the end of the cosine", NONNEG, shown="lr/10")
    warmup_steps: int = setting(100, "linear warm-up steps", NONNEG_INT)
    weight_decay: float = setting(0.1, "AdamW weight decay (glassgpt: on matrices only; book: on every parameter)",
                                  NONNEG)
    grad_clip: float = setting(1.0, "clip the gradient norm at this (0: off)", NONNEG)
    beta1: float = setting(0.9, "AdamW beta1", FRACTION)
    beta2: float = setting(0.95, "AdamW beta2 (the book's: 0.999, torch's default)", FRACTION)
    eval_every: int = setting(100, "steps between evaluations (and the last step)", POSITIVE_INT)
    eval_batches: int = setting(20, "validation batches per evaluation", POSITIVE_INT)
    save_every: int | None = setting(None, "steps between saves of latest/", POSITIVE_INT,
                                     shown="at the evaluations, while a save costs under a tenth of the time "
                                           "trained since the last one, and at the end")
    log_every: int = setting(1, "steps between metrics.jsonl lines", POSITIVE_INT)
    sample_tokens: int = setting(40, "tokens sampled at each evaluation (0: none)", NONNEG_INT)
    seed: int = setting(1337, "seed for initialisation, batches and dropout (a resumed run keeps its own)",
                        SEED)
    dtype: str = setting("float32", "compute precision; the weights and AdamW stay float32: bfloat16 trains a bf16 "
                                    "copy of them (autocast under --fsdp), float16 autocasts with a grad scaler "
                                    "(CUDA), auto picks bfloat16 where it measured faster", choices=DTYPES)
    compile: bool = setting(False, "torch.compile the model", shown="off")
    device: str | None = setting(None, "cpu, cuda, cuda:N or auto (under torchrun cuda:LOCAL_RANK)", shown="auto")
    fsdp: bool = setting(False, "under torchrun: shard the model over the ranks (FSDP2) instead of replicating it",
                         shown="off")
    plot: bool = setting(True, "do not draw RUN_DIR/loss.png at the end", flag="--no-plot", shown="it is drawn")

    def __post_init__(self) -> None:
        if self.dtype in ("fp32", "bf16", "fp16"):  # the short spellings older runs saved
            self.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.dtype]
        for f in dataclasses.fields(self):
            value, check, choices = getattr(self, f.name), f.metadata["check"], f.metadata["choices"]
            if check is not None and value is not None and not check(value):
                raise TrainError(f"{f.name} must be {check.words}, got {value!r}")
            if choices is not None and value not in choices:
                raise TrainError(f"{f.name} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
        if not self.out:
            raise TrainError("out (the run directory) must be given")
        # AdamW multiplies each weight by 1 - lr x weight_decay a step: at 1 or more it zeroes or flips them all.
        # (A huge lr is the loop's to catch: it diverges, and says "Lower --lr".)
        if self.weight_decay > 1 and self.lr * self.weight_decay >= 1:
            raise TrainError(f"weight_decay {self.weight_decay:g} x lr {self.lr:g} is {self.lr * self.weight_decay:g}: "
                             "AdamW multiplies each weight by 1 - lr x weight_decay a step, so it must stay below 1: "
                             "lower --weight-decay")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise TrainError(f"min_lr {self.min_lr:g} is above lr {self.lr:g}: the cosine falls from lr to min_lr, so "
                             "give a --min-lr of at most --lr")

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        return from_fields(cls, values, TrainError, "training setting")


def setting_type(name: str) -> type:
    """The Python type of TrainConfig's field `name` (int for `int | None`)."""
    hint = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


# What `--recipe book` sets, as chapter 5's `torch.optim.AdamW(model.parameters(), lr=0.0004,
# weight_decay=0.1)` and `train_model_simple` do: a constant lr, no warm-up, no clipping, one process.
BOOK_SETTINGS = {"warmup_steps": 0, "min_lr": None, "grad_clip": 0.0, "grad_accum": 1, "batch_tokens": None,
                 "fsdp": False}
# ... and the notebook's choices, which a flag may change: batch 2, eval_freq 5, eval_iter 5,
# torch.manual_seed(123), torch's AdamW betas, the 50 tokens of generate_and_print_sample.
BOOK_DEFAULTS = {"lr": 4e-4, "weight_decay": 0.1, "batch_size": 2, "eval_every": 5, "eval_batches": 5, "seed": 123,
                 "beta1": 0.9, "beta2": 0.999, "sample_tokens": 50}


def runs_as_book(cfg: TrainConfig | dict[str, Any]) -> bool:
    """Whether a run (its TrainConfig, or the values it saved) trains as the book's loops do: a
    constant lr, evaluations when global_step % eval_freq == 0, AdamW decaying every parameter, and
    torch's global generator run on (every one of the book's recipes, recipes.py)."""
    return (cfg.get("recipe") if isinstance(cfg, dict) else cfg.recipe) == "book"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr
    (nanoGPT's schedule); the book's recipe keeps lr constant."""
    if runs_as_book(cfg):
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.max_steps:
        return cfg.final_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.final_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.final_lr)


def grad_accum_for(batch_tokens: int, tokens_per_micro_batch: int, world: int = 1) -> int:
    """Micro-steps per optimizer step so that a step sees about `batch_tokens` tokens in all."""
    return max(1, round(batch_tokens / (tokens_per_micro_batch * world)))


def evaluation_due(step: int, cfg: TrainConfig) -> bool:
    """Whether the `step`-th optimizer step (counting from 1) ends with an evaluation: every
    eval_every steps and at the last (glassgpt); the book's loop evaluates when its global_step,
    counted from 0, is a multiple of eval_freq: after the 1st, 6th, 11th, ... step, not at the end."""
    if runs_as_book(cfg):
        return (step - 1) % cfg.eval_every == 0
    return step % cfg.eval_every == 0 or step == cfg.max_steps


def default(name: str) -> Any:
    """TrainConfig's default for setting `name`."""
    return TrainConfig.__dataclass_fields__[name].default
