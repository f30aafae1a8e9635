"""Recipes: how a run trains, one object per regime, looked up by name in one registry.

A `Recipe` owns the settings it fixes (a flag for one of them is refused by name), its defaults
(a flag may change them), its epochs, its seeding, its evaluation line, and optionally its own
loop function; the task it trains on (its data, evaluation and per-epoch lines) is built by its
module:

    train             glassgpt   nanoGPT's: random windows, warm-up, cosine, clipping (data.py)
    train             book       the book's chapter 5, `train_model_simple` (book/ch05.py)
    finetune classify glassgpt   a classifier on the last real token (tasks/classify.py)
    finetune classify book       the book's chapter 6, `train_classifier_simple` (book/ch06.py);
                                 with --lora-rank, appendix E's replace_linear_with_lora (lora.py)
    finetune instruct glassgpt   Alpaca records, the loss on the response (tasks/instruct.py)
    finetune instruct book       the book's chapter 7, `train_model_simple` (book/ch07.py)
    train             book-appendix-d  the book's appendix D, `train_model` (appendix_d.py), its own loop

`register` adds one (a recipe that brings its own loop passes `loop`, a function of the `Run`
that `fit` hands it, in place of loop.train). The command line derives its flags from
TrainConfig and asks the registry which names `--recipe` takes and what each fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import GPTConfig
from ..errors import GlassError
from ..families import build_model
from ..formats import random_model
from ..model import GPTModel, init_name
from .book import appendix_d
from .book import ch05
from .book import ch06 as book_ch06
from .book import ch07 as book_ch07
from .tasks import data
from .loop.config import BOOK_DEFAULTS, BOOK_SETTINGS, TrainConfig


@dataclass(frozen=True)
class Recipe:
    name: str                                        # what --recipe says
    command: str                                     # "train", "finetune classify", "finetune instruct"
    summary: str                                     # what it trains as, for --help and refusals
    fixed: dict[str, Any] = field(default_factory=dict)     # TrainConfig settings it sets itself
    defaults: dict[str, Any] = field(default_factory=dict)  # its defaults, which a flag may change
    epochs: float | None = None                      # passes over the data when neither --epochs nor --max-steps
    loop: Callable[[Any], None] | None = None        # its own loop over fit's Run (None: loop.train)
    one_process: bool = False                        # refused under torchrun
    refused: tuple[str, ...] = ()                    # other flags (dest names) it does not take
    chapter: int | None = None                       # the book's chapter it runs as the book's code does
    log_line: str | None = None                      # its evaluation line, formatted with the step's record
                                                     # and global_step (None: glassgpt's `step N: ...`)
    task: Callable[..., Any] | None = None           # train's: (files, tokenizer, data, cfg, run_dir, expect)
                                                     # -> (task, fingerprint, the line on the data)
    settle: Callable[[TrainConfig, int], TrainConfig] | None = None  # the settings that depend on the
                                                     # data, from its steps per epoch (appendix D's warm-up)

    @property
    def seeds_globally(self) -> bool:
        """Whether it seeds torch's global generator and runs it on, as the book's code does (else
        glassgpt's: each draw from a generator of its own, so a resume needs no RNG state)."""
        return self.chapter is not None

    def new_model(self, cfg: GPTConfig, scheme: str, seed: int) -> GPTModel:
        """A random model for a new run: the book's `torch.manual_seed(seed); GPTModel(cfg)` for the
        book's initialisation under the book's recipes; else drawn from its own generator (and then
        the seed, as the book's code seeds before training)."""
        if self.seeds_globally and getattr(cfg, "family", None) is not None:  # the bonus code's Qwen3Model, ...
            torch.manual_seed(seed)  # as ch05/14_ch05_with_other_llms builds it (PyTorch's default init)
            return build_model(cfg)
        if self.seeds_globally and init_name(scheme) == "pytorch-default":
            torch.manual_seed(seed)  # and torch's generator left where the notebook leaves it for training
            return GPTModel(cfg)
        model = random_model(cfg, torch.device("cpu"), torch.float32, seed, scheme)
        self.seed_before_training(seed)
        return model

    def seed_before_training(self, seed: int) -> None:
        """The book's code seeds once the weights are there, then trains."""
        if self.seeds_globally:
            torch.manual_seed(seed)

    def refuse_flags(self, given: dict[str, Any]) -> None:
        """Refuse, by name, a flag this recipe fixes or does not take (`given`: dest -> value or None)."""
        self.refuse_fixed(given)
        for name in self.refused:
            if given.get(name) is not None:
                raise GlassError(f"--recipe {self.name} does not take --{name.replace('_', '-')} ({self.summary}): "
                                 f"drop it, or run without --recipe {self.name}")

    def refuse_fixed(self, given: dict[str, Any]) -> None:
        """A setting this recipe fixes, given anyway (`given`: setting -> value, None when not given)."""
        for name, value in self.fixed.items():
            if given.get(name) is not None:
                flag = "--" + name.replace("_", "-")
                raise GlassError(f"--recipe {self.name} sets {flag} itself ({value}, as {self.summary}): drop it, "
                                 f"or run without --recipe {self.name}")

    def train_config(self, given: dict[str, Any], base: dict[str, Any] | None = None) -> TrainConfig:
        """The run's TrainConfig: `given` settings (None: not given) over `base`, over the recipe's own."""
        self.refuse_fixed(given)
        values = {**self.defaults, **self.fixed, **(base or {}), "recipe": self.config_name}
        values.update({k: v for k, v in given.items() if v is not None and k != "recipe"})  # (the name: this one)
        return TrainConfig.from_dict(values)

    @property
    def config_name(self) -> str:
        """TrainConfig.recipe: how the loop's machinery runs (config.RECIPES): the book's chapters share one."""
        return BOOK if self.chapter is not None else "glassgpt"


REGISTRY: dict[tuple[str, str], Recipe] = {}
BOOK = "book"  # the name --recipe gives the book's chapters (each command runs its own chapter)


def register(recipe: Recipe) -> Recipe:
    REGISTRY[(recipe.command, recipe.name)] = recipe
    return recipe


def recipe(command: str, name: str | None) -> Recipe:
    """The recipe `name` of `command` (None: glassgpt's own)."""
    found = REGISTRY.get((command, name or "glassgpt"))
    if found is None:
        raise GlassError(f"glassgpt {command} has no recipe {name!r}: use {' or '.join(names(command))}")
    return found


def names(command: str) -> list[str]:
    return [name for cmd, name in REGISTRY if cmd == command]


BOOK_CH05 = "chapter 5 trains: a constant lr, no warm-up, no clipping, one process"
BOOK_CH07 = "chapter 7 trains: train_model_simple on every weight, a constant lr, one process"
BOOK_APPENDIX_D = ("appendix D trains: train_model, a warm-up, a cosine to min_lr, clipping after the warm-up, "
                   "one process, whole epochs, the model saved at the end (no mid-run checkpoints, no resume)")
BOOK_CH06 = "chapter 6 trains: train_classifier_simple, a constant lr, no warm-up, no clipping, one process"

register(Recipe("glassgpt", "train", "nanoGPT's loop: random windows, warm-up, cosine, clipping", task=data.text_task))
register(Recipe(BOOK, "train", BOOK_CH05, BOOK_SETTINGS, BOOK_DEFAULTS, epochs=10, one_process=True,
                chapter=5, log_line=ch05.LINE, task=ch05.book_task))
register(Recipe("book-appendix-d", "train", BOOK_APPENDIX_D, appendix_d.RECIPE_SETTINGS, appendix_d.RECIPE_DEFAULTS,
                epochs=appendix_d.D4_SETTINGS["n_epochs"], loop=appendix_d.train_run, one_process=True,
                refused=("max_steps", "save_every", "log_every", "resume"), chapter=5, log_line=appendix_d.ITER_LINE,
                task=ch05.book_task, settle=appendix_d.settle))
register(Recipe("glassgpt", "finetune classify", "a classifier head on the last real token", epochs=5))
register(Recipe(BOOK, "finetune classify", BOOK_CH06, BOOK_SETTINGS, book_ch06.DEFAULTS, epochs=book_ch06.EPOCHS,
                one_process=True, refused=("trainable", "val_fraction", "text_column",
                                           "label_column", "labels"), chapter=6, log_line=ch05.LINE))
register(Recipe("glassgpt", "finetune instruct", "Alpaca records, the loss on the response tokens", epochs=2))
register(Recipe(BOOK, "finetune instruct", BOOK_CH07, BOOK_SETTINGS, book_ch07.DEFAULTS, epochs=book_ch07.EPOCHS,
                one_process=True, refused=("trainable", "lora_rank", "lora_alpha", "val", "val_fraction", "max_length",
                                           "on_bad_record"), chapter=7, log_line=ch05.LINE))
