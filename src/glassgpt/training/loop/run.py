"""A training run: the machinery that stands around the loop (loop.py), behind the names it calls.

    Run.open(...)        claims the run directory (rundir.py) unless the caller did, finds this
                         process's rank (distributed.py), places the model and builds AdamW
                         (compute.py), resumes from latest/ (checkpoint.py), writes
                         train_config.json, catches SIGINT/SIGTERM (faults.py); at the end it
                         draws loss.png (metrics.py) and leaves `run.result`
    run.begin_step       the learning rate (config.lr_at); glassgpt's recipe seeds the step's
                         dropout from (seed, step, rank), so resume needs no RNG state
    run.batch            the task's micro-batch, on the device, its tokens counted
    run.optimizer_step   clip, AdamW, the bf16 copy refreshed (compute.py)
    run.end_step         the loss agreed over the ranks and checked finite: the step's record
    run.log              metrics.jsonl (every log_every steps, and every evaluation and sample)
                         and the caller's `log` callback (every step)
    run.save             latest/ and best/ when checkpoint.SavePolicy says so

Run directory (cfg.out):
    train_config.json   the TrainConfig (the effective grad_accum included)
    metrics.jsonl       one record per logged step (metrics.py)
    latest/, best/      training checkpoints: a loadable glassgpt checkpoint (`glassgpt generate
                        --model RUN_DIR`) plus optimizer, RNG and loop state (checkpoint.py)
    loss.png            the loss and the snapshots against tokens seen (needs matplotlib)
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ...errors import NonFiniteError
from ...formats.files import atomic_write
from ...formats.glassgpt import nonfinite_tensor
from ...tokenizer import Tokenizer
from .checkpoint import SavePolicy, checkpoint_bytes, load_checkpoint, save_checkpoints
from .compute import Compute, make_optimizer
from .config import TrainConfig, grad_accum_for, lr_at, runs_as_book
from .distributed import Distributed, setup_distributed
from .faults import StopRequests, diverged, writing
from .metrics import append_metrics, plot_run, truncate_metrics
from .rundir import RunDir, open_run_dir

Log = Callable[[dict[str, Any]], None]
STEP_KEYS = {"step", "tokens", "train_loss", "lr", "tokens_per_s", "elapsed_s", "grad_norm"}  # every step's


class Run:
    def __init__(self, model: nn.Module, task, cfg: TrainConfig, tokenizer: Tokenizer | None,
                 meta: dict[str, Any], log: Log | None, ranks: Distributed, run_dir: Path):
        self.task, self.cfg, self.tokenizer, self.meta, self.ranks = task, cfg, tokenizer, meta, ranks
        self.emit, self.run_dir = log or (lambda event: None), run_dir
        self.trained = trained_parts(model)  # what this run trains and what it leaves frozen, before placement
        self.compute = Compute(model, cfg, ranks)  # placed (and sharded): the master weights
        self.model = self.compute.model
        self.optimizer = make_optimizer(self.model, cfg, ranks.device)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.policy = SavePolicy(cfg.save_every, checkpoint_bytes(self.model))
        self.stop = StopRequests()
        self.perplexity = task.perplexity
        self.step = self.start_step = self.tokens = 0
        self.elapsed, self.best_val = 0.0, math.inf
        self.last_val: float | None = None
        self.last_train: float | None = None
        self.finite_at = -1  # the step at which the weights were last checked finite
        self.stopping, self.grad_norm = False, None
        self.window = [0, 0.0]  # tokens and seconds since the last metrics line
        self.result: dict[str, Any] = {}

    @classmethod
    @contextlib.contextmanager
    def open(cls, model, task, cfg: TrainConfig, tokenizer, meta, log: Log | None, resume: bool,
             run_dir: RunDir | None, ranks: Distributed | None) -> Iterator["Run"]:
        """The run, from claiming its directory to its result (see the module docstring)."""
        own_ranks = ranks is None
        ranks = ranks or setup_distributed(cfg.device)
        try:
            claim = contextlib.nullcontext(run_dir) if run_dir else open_run_dir(cfg.out, resume, ranks.is_main)
            with claim as claimed:
                run = cls(model, task, cfg, tokenizer, meta, log, ranks, claimed.path)
                run.begin(claimed.resume)
                with run.stop:
                    yield run
                run.end()
        finally:
            if own_ranks:
                ranks.close()

    # -- starting ------------------------------------------------------------------------------
    def begin(self, resume: bool) -> None:
        cfg, task, ranks = self.cfg, self.task, self.ranks
        if resume:
            self._load()
        self.start_step = self.step
        if cfg.batch_tokens is not None:
            probe = task.tokens(task.train_batch(self.step, 0, ranks.rank, ranks.world))
            cfg.grad_accum = grad_accum_for(cfg.batch_tokens, probe, ranks.world)
        self.compute.build()  # the bf16 copy, the fused twin, compile, DDP: from the weights as loaded
        ranks.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if ranks.is_main:
            text = json.dumps(cfg.to_dict(), indent=2)
            with writing(self.run_dir, "train_config.json"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(self.run_dir / "train_config.json", lambda tmp: Path(tmp).write_text(text))
                truncate_metrics(self.run_dir, self.step)
        if ranks.is_main:
            self.emit({"event": "start", "step": self.step, "max_steps": cfg.max_steps, "resumed": resume})
        if self.step >= cfg.max_steps:
            self.note(f"{self.run_dir} is already at step {self.step:,} of max_steps {cfg.max_steps:,}: "
                      "pass a larger --max-steps to train further")

    def say(self, line: str) -> None:
        """A line a recipe's own loop prints where the book's code prints it (stdout)."""
        if self.ranks.is_main:
            self.emit({"event": "line", "text": line})

    def note(self, text: str) -> None:
        if self.ranks.is_main:
            self.emit({"event": "note", "text": text})

    # -- one step ---------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        cfg, rank = self.cfg, self.ranks.rank
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        if not runs_as_book(cfg):  # the book's recipes run torch's generator on, as its code does
            # (torch.manual_seed would also queue seeds for every absent accelerator, each step)
            seed = int(np.random.SeedSequence([cfg.seed, step, rank]).generate_state(1)[0])
            torch.default_generator.manual_seed(seed)
            if self.ranks.device.type == "cuda":
                torch.cuda.manual_seed(seed)
        self.t0, self.loss_sum, self.n_tokens = time.perf_counter(), torch.zeros((), device=self.ranks.device), 0

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        batch = self.task.train_batch(step, micro, self.ranks.rank, self.ranks.world)
        self.n_tokens += self.task.tokens(batch)
        return {k: v.to(self.ranks.device, non_blocking=True) for k, v in batch.items()}

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float()

    def optimizer_step(self) -> None:
        self.grad_norm = self.compute.step(self.optimizer, self.params)

    def end_step(self, step: int) -> dict[str, Any]:
        """The step's record; the ranks agree on the loss, the tokens and whether to stop."""
        loss, tokens, self.stopping = self.ranks.agree(self.loss_sum / self.cfg.grad_accum, self.n_tokens,
                                                       self.stop.requested)
        seconds = time.perf_counter() - self.t0
        self.step, self.tokens, self.elapsed, self.last_train = step + 1, self.tokens + tokens, self.elapsed + seconds, loss
        self.policy.trained(seconds)
        self.window = [self.window[0] + tokens, self.window[1] + seconds]
        if not math.isfinite(loss):
            raise diverged(self.run_dir, self.step, f"the training loss is {loss}", self.cfg)
        record = {"step": self.step, "tokens": self.tokens, "train_loss": loss, "lr": lr_at(step, self.cfg),
                  "tokens_per_s": self.window[0] / max(self.window[1], 1e-9), "elapsed_s": round(self.elapsed, 3)}
        if self.grad_norm is not None:
            record["grad_norm"] = float(self.grad_norm)
        return record

    def log(self, record: dict[str, Any]) -> None:
        """metrics.jsonl every log_every steps and on every evaluation or sample; `log` every step."""
        if self.step % self.cfg.log_every == 0 or set(record) - STEP_KEYS:
            self.window = [0, 0.0]
            if self.ranks.is_main:
                with writing(self.run_dir, "metrics.jsonl"):
                    append_metrics(self.run_dir, record)
        if self.ranks.is_main:
            self.emit({"event": "step", "max_steps": self.cfg.max_steps, **record})

    # -- evaluation: its checks --------------------------------------------------------------------
    def validation(self, val: float) -> dict[str, Any]:
        if not math.isfinite(val):
            raise diverged(self.run_dir, self.step, f"the validation loss is {val}", self.cfg)
        self.last_val = val
        return {"val_loss": val, **({"val_ppl": self.ppl(val)} if self.perplexity else {})}

    def ppl(self, loss: float | None) -> float | None:
        """exp(loss) for tasks whose loss is per-token cross-entropy (None if it would overflow)."""
        return math.exp(loss) if self.perplexity and loss is not None and loss < 700 else None

    def check_weights_finite(self) -> None:
        """Before an evaluation or a save: every rank checks its weights, and all agree."""
        if self.finite_at == self.step:
            return
        bad = nonfinite_tensor(self.model.named_parameters())
        if self.ranks.any(bad is not None):
            raise diverged(self.run_dir, self.step, f"the weights hold NaN or infinite values "
                                                    f"({bad or 'on another rank'})", self.cfg)
        self.finite_at = self.step

    @contextlib.contextmanager
    def diverges_on_nonfinite(self, what: str):
        try:
            yield
        except NonFiniteError:
            raise diverged(self.run_dir, self.step, f"{what} are NaN or infinite", self.cfg) from None

    # -- checkpoints (checkpoint.py writes and reads them) -------------------------------------------
    def save(self, evaluated: bool) -> None:
        """latest/ when the SavePolicy says so (and at the end, or when stopping); best/ on a new
        best validation loss, at the same moments (every one of them when --save-every is given)."""
        latest = self.step == self.cfg.max_steps or self.stopping or self.policy.due(self.step, evaluated)
        best = (evaluated and self.last_val is not None and self.last_val < self.best_val
                and (latest or self.cfg.save_every is not None))
        if best:
            self.best_val = self.last_val
        if latest or best:
            t0 = time.perf_counter()
            self._save(["latest"] * latest + ["best"] * best)
            self.policy.saved(time.perf_counter() - t0)

    def _save(self, names: list[str]) -> None:
        """Write checkpoints `names`. Every rank calls this (FSDP gathers)."""
        self.check_weights_finite()
        cfg = self.cfg
        meta = {**self.meta, "trained": self.trained, "train": {"step": self.step, "tokens": self.tokens, "val_loss": self.last_val,
                                       "train_loss": self.last_train}}
        state = {
            "step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed,
            "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
            "last_val_loss": self.last_val, "world_size": self.ranks.world, "grad_accum": cfg.grad_accum,
            "scheduler": {"kind": "constant" if runs_as_book(cfg) else "warmup_cosine", "lr": cfg.lr,
                          "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
                          "next_lr": lr_at(self.step, cfg)},
            "scaler": self.compute.scaler.state_dict() if self.compute.scaler else None,
            "train_config": cfg.to_dict(),
            "task": self.task.state_dict(),
        }
        save_checkpoints(self.run_dir, names, self.model, self.optimizer, state, tokenizer=self.tokenizer,
                         meta=meta, export=self.task.checkpoint_model, fsdp=cfg.fsdp,
                         is_main=self.ranks.is_main)
        self.ranks.barrier()

    def _load(self) -> None:
        state = load_checkpoint(self.run_dir, self.model, self.optimizer)
        if self.compute.scaler and state.get("scaler"):
            self.compute.scaler.load_state_dict(state["scaler"])
        if state.get("task"):
            self.task.load_state_dict(state["task"])
        self.step, self.tokens = state["step"], state["tokens"]
        self.elapsed = state.get("elapsed_s", 0.0)
        self.best_val = state["best_val_loss"] if state.get("best_val_loss") is not None else math.inf
        self.last_val = state.get("last_val_loss")

    # -- the end -----------------------------------------------------------------------------------
    def end(self) -> None:
        interrupted = (self.stop.signal or signal.SIGINT) if self.stopping else None  # (or another rank's)
        plot = None
        if self.ranks.is_main and self.cfg.plot and not interrupted and self.step > self.start_step:
            with writing(self.run_dir, "loss.png"):
                plot = plot_run(self.run_dir)
            if plot is None:
                self.note("matplotlib is not installed, so no loss.png (pip install 'glassgpt[plot]')")
        val = self.last_val
        self.result = {"step": self.step, "tokens": self.tokens, "train_loss": self.last_train, "val_loss": val,
                       "val_ppl": self.ppl(val), "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                       "elapsed_s": self.elapsed, "interrupted": interrupted is not None, "signal": interrupted,
                       "run_dir": str(self.run_dir), "plot": str(plot) if plot else None}
        if self.ranks.is_main:
            self.emit({"event": "end", **self.result})


def trained_parts(model: nn.Module) -> dict[str, str]:
    """Each part of a GPTModel (tok_emb, pos_emb, trf_blocks.N, final_norm, out_head) and what training
    does to it, from requires_grad: "trained", "frozen", "lora" (only its LoRA adapters train; each save
    merges them into its weights) or "partly trained". Checkpoints record it as meta.json's "trained",
    for explain's picture, page and text."""
    parts = ["tok_emb", "pos_emb", *(f"trf_blocks.{i}" for i in range(len(model.trf_blocks))), "final_norm",
             "out_head"]
    parts = [p for p in parts if p != "pos_emb" or hasattr(model, "pos_emb")]  # Qwen3 and Llama 3 have none
    out = {}
    for part in parts:
        params = list(model.get_submodule(part).named_parameters())
        adapters = [p.requires_grad for name, p in params if name.rpartition(".")[2] in ("lora_A", "lora_B")]
        own = [p.requires_grad for name, p in params if name.rpartition(".")[2] not in ("lora_A", "lora_B")]
        if not any(own):
            out[part] = "lora" if any(adapters) else "frozen"
        else:
            out[part] = "trained" if all(own) else "partly trained"
    return out
