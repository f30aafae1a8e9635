"""The training loop: `fit(model, task, cfg, tokenizer)`, with evaluation, checkpoints and resume.

What to train on is a `Task` (pretraining: `data.TextTask`; finetuning: finetune.py's
tasks); how to train is a `TrainConfig`. `fit` knows nothing of text, labels or
instructions. It is nanoGPT's loop with the engineering written out:

- AdamW over the parameters with `requires_grad=True` only (freezing and LoRA work),
  weight decay on matrices (>= 2-D) only, fused kernels where available;
- learning rate: linear warm-up for `warmup_steps`, then cosine decay to `min_lr`
  (lr / 10 by default) at `max_steps` (nanoGPT's schedule);
- gradient accumulation (`grad_accum`, or `batch_tokens` to aim at a global batch
  size in tokens), clipping at `grad_clip`; master weights stay float32: bfloat16 runs
  forward and backward on a bf16 copy of them (engine/mixed.py; autocast under FSDP),
  float16 autocast with a GradScaler on GPUs without bf16; `compile`;
- under `torchrun`: DistributedDataParallel (gloo on CPU, NCCL on GPUs), or FSDP2's
  `fully_shard` per transformer block with `fsdp=True`. Each rank asks the task for its
  own batch (rank, world); losses are averaged over ranks for the log; rank 0 logs
  and writes; evaluation runs on every rank in step, so FSDP's collectives line up;
- a tqdm bar (step, loss, tokens/s, ETA) on a terminal, a plain line every tenth of
  the run otherwise; `metrics.jsonl`; validation loss (and perplexity, for tasks that
  predict tokens) every `eval_every` steps with a generated sample; `loss.png` at the end;
- a run that diverges stops before anything non-finite is saved: the loss is checked
  every step, and the weights (and validation loss) before every evaluation and save;
- one process per run directory (rundir.lock_run_dir), held for the whole run.

The task's contract (`Task` below): `train_batch(step, micro, rank, world)` must be a
function of its arguments only. With the per-step seeding of torch's RNG (dropout),
that is what makes `resume` exact without a data cursor.

Run directory (`cfg.out`):
    train_config.json   the TrainConfig (the effective grad_accum included)
    metrics.jsonl       one object per logged step: step, tokens, train_loss, lr,
                        tokens_per_s, grad_norm, elapsed_s; val_loss, val_ppl, the task's
                        metrics and `sample` on evaluation steps
    latest/, best/      training checkpoints: a loadable glassgpt checkpoint (`glassgpt
                        generate --model RUN_DIR`) plus optimizer, RNG and loop state;
                        checkpoint.py writes them whole and reads them back for resume
    loss.png            train/val loss against tokens seen (needs matplotlib)

latest/ is saved every `save_every` steps (default: at each evaluation), best/ on a new
best validation loss. Ctrl-C or SIGTERM finishes the current step, saves `latest/` and
returns `{"interrupted": True, "signal": SIGINT or SIGTERM, ...}` (a second one aborts
at once).

Optional Task attribute `perplexity = False`: the task's loss is not per-token
cross-entropy over a vocabulary (classification), so no `val_ppl` is reported.

Optional Task method `checkpoint_model(model) -> nn.Module`: the model to write as the
loadable checkpoint when it is not the training model itself (LoRA: the merged
model); the training model's own state is then kept beside it for resume. Under FSDP
a save writes a plain GPTModel of the gathered weights instead (checkpoint.py).
Leaves out: tensor/pipeline parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..formats.glassgpt import nonfinite_tensor
from .checkpoint import full_tensor, load_checkpoint, saved_checkpoints, save_checkpoints
from ..engine.fused import fused
from ..engine.mixed import LowPrecisionCopy
from ..device import resolve_device, resolve_dtype
from ..errors import GlassError, NonFiniteError, TrainError
from .rundir import lock_run_dir
from ..tokenizer import Tokenizer
from ..formats.files import atomic_write

RUN_MARKERS = ("train_config.json", "metrics.jsonl", "latest", "best")


@dataclass
class TrainConfig:
    """How to train. Every field has a `glassgpt train` flag; saved as RUN_DIR/train_config.json."""

    out: str                       # the run directory
    batch_size: int = 8            # windows per micro-batch, per rank
    grad_accum: int = 1            # micro-batches per optimizer step
    max_steps: int = 1000          # optimizer steps
    lr: float = 6e-4               # peak learning rate
    min_lr: float | None = None    # end of the cosine decay; None: lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1      # on >= 2-D parameters only
    grad_clip: float = 1.0         # max global grad norm; 0: no clipping
    eval_every: int = 100          # steps between evaluations (and the last step)
    eval_batches: int = 20         # validation batches per evaluation
    save_every: int | None = None  # steps between `latest/` saves; None: at every evaluation
    seed: int = 1337
    dtype: str = "float32"         # float32 | bfloat16 | float16 | auto: the autocast precision
    compile: bool = False          # torch.compile the model for training
    device: str | None = None      # cpu | cuda | cuda:N | None (auto); torchrun: cuda:LOCAL_RANK
    log_every: int = 1             # steps between metrics.jsonl lines
    sample_tokens: int = 40        # tokens generated at each evaluation (0: none)
    beta1: float = 0.9             # AdamW betas
    beta2: float = 0.95
    batch_tokens: int | None = None  # target global batch in tokens: sets grad_accum
    fsdp: bool = False             # shard parameters, gradients and optimizer state (torchrun)
    plot: bool = True              # draw loss.png when the run ends

    def __post_init__(self) -> None:
        positive = ("batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "log_every")
        for name in positive + ("save_every", "batch_tokens"):
            value = getattr(self, name)
            if value is None and name in ("save_every", "batch_tokens"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "sample_tokens", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TrainError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("lr", "weight_decay", "grad_clip") + (("min_lr",) if self.min_lr is not None else ()):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise TrainError(f"{name} must be a number >= 0, got {value!r}")
        if self.lr == 0:
            raise TrainError("lr must be > 0, got 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise TrainError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto", "fp32", "bf16", "fp16"):
            raise TrainError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if not self.out:
            raise TrainError("out (the run directory) must be given")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise TrainError(f"unknown training setting(s) {unknown}: valid ones are {sorted(fields)}")
        return cls(**values)


class Task(Protocol):
    """What to train on. `fit` knows nothing of text, labels or instructions."""

    def train_batch(self, step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        """Micro-batch `micro` of step `step` for `rank` of `world`: a function of these alone."""

    def eval_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        """A fixed set of validation batches (empty: no validation)."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A scalar loss; `batch` is already on the model's device."""

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens in a batch: for tokens/s and the x-axis of plots."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Extra metrics at evaluation time ({} if none), e.g. accuracy."""

    def sample(self, model: nn.Module) -> str | None:
        """A short generated sample at evaluation time, or None."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.max_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def grad_accum_for(batch_tokens: int, tokens_per_micro_batch: int, world: int = 1) -> int:
    """Micro-steps per optimizer step so that a step sees about `batch_tokens` tokens in all."""
    return max(1, round(batch_tokens / (tokens_per_micro_batch * world)))


# --- devices, precision, ranks ---------------------------------------------------------

@dataclass
class Distributed:
    device: torch.device
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # fit started the process group, so fit ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Distributed:
    """One process, or one rank of a `torchrun` job (read from its RANK/WORLD_SIZE/LOCAL_RANK).

    GPUs: NCCL, rank r on cuda:LOCAL_RANK. CPUs: gloo.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world == 1:
        return Distributed(dev)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Distributed(dev, dist.get_rank(), dist.get_world_size(), owns)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The autocast precision for `dtype` on `device` (float32: autocast off)."""
    dt = resolve_dtype(dtype, device)
    if dt == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # older GPUs: fp16 with a GradScaler instead
    if dt == torch.float16 and device.type != "cuda":
        raise TrainError("float16 training needs a CUDA GPU (it needs a grad scaler); on CPU use --dtype bfloat16")
    return dt


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over trainable parameters; weight decay on matrices only (not biases, norms)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise TrainError("the model has no parameter with requires_grad=True: nothing to train")
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    kind = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kind)
    except (RuntimeError, TypeError):  # a dtype/device the fused kernel does not cover
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


@torch.no_grad()
def evaluate_loss(model: nn.Module, task: Task, dtype: str = "float32") -> float | None:
    """Mean task loss over `task.eval_batches()` (None if there are none), in eval mode."""
    device = next(model.parameters()).device
    amp = autocast_dtype(dtype, device)
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for batch in task.eval_batches():
        with autocast(device, amp):
            total += float(task.loss(model, _to_device(batch, device)))
        n += 1
    model.train(was_training)
    return total / n if n else None


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def check_out_dir(run_dir: str | os.PathLike, resume: bool) -> None:
    """Refuse to start a new run over an old one, or to resume a run that is not there."""
    run_dir = Path(run_dir)
    if resume:
        if not any((run_dir / m).exists() for m in ("train_config.json", "latest", "best")):
            raise TrainError(f"{run_dir} is not a training run (no train_config.json, latest/ or best/): "
                             "nothing to resume")
        return
    if run_dir.is_file():
        raise TrainError(f"--out {run_dir} is a file: give a directory for the run")
    found = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if found:
        raise TrainError(f"{run_dir} already holds a training run ({found[0]}): pass --resume {run_dir} "
                         "to continue it, or another --out for a new run")


def saved_train_config(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None
                       ) -> tuple[dict[str, Any], str | None]:
    """(a run's TrainConfig values, None), from RUN_DIR/train_config.json; when that file is
    damaged or gone, (the copy in the checkpoint's train_state.json, a note that says so)."""
    path = Path(run_dir) / "train_config.json"
    problem = _valid_train_config(lambda: json.loads(path.read_text(encoding="utf-8")))
    if not isinstance(problem, str):
        return problem, None
    ckpt = Path(checkpoint) if checkpoint is not None else Path(run_dir) / "latest"
    copy = _valid_train_config(lambda: json.loads((ckpt / "train_state.json").read_text())["train_config"])
    if isinstance(copy, str):
        raise TrainError(f"{path} is {problem}, and {ckpt} holds no copy of the run's settings: they are lost; "
                         "start a new run (--init RUN_DIR keeps the weights)")
    return copy, f"{path} is {problem}: using the copy saved in {ckpt}"


def _valid_train_config(read) -> dict[str, Any] | str:
    """The values `read()` returns if TrainConfig takes them, else what was wrong (a str)."""
    try:
        values = read()
        TrainConfig.from_dict(values)
        return values
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, TypeError, KeyError, AttributeError, GlassError) as e:
        return f"damaged ({type(e).__name__}: {str(e)[:80]})"


# --- Ctrl-C and SIGTERM -------------------------------------------------------------------

class _StopRequests:
    """The first SIGINT/SIGTERM asks the loop to save and stop after this step; a second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the first signal received
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signal = True, signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


# --- progress: a bar on a terminal, plain lines in a log ---------------------------------------

class _Progress:
    """A tqdm bar when stderr is a terminal. Written to a file or a pipe, tqdm leaves a line
    per refresh (and its last state again after each line written above it), so there a
    plain line goes to stderr every tenth of the run (or minute, if sooner) and at the end.
    `write` prints evaluation lines to stdout in both cases, above the bar."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="train")
        self.every = max(1, (total - start) // 10)
        self.last_step, self.last_time = start, time.monotonic()
        self.record: dict[str, Any] = {}

    def set_postfix(self, record: dict[str, Any]) -> None:
        self.record = record
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['train_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)

    def update(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            return
        now = time.monotonic()
        if not self.enabled or not (step - self.last_step >= self.every or now - self.last_time >= 60
                                    or step == self.total):
            return
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        line = f"train: step {step:,}/{self.total:,}  {rate:.1f} step/s"
        if self.record:
            r = self.record
            line += f"  loss {r['train_loss']:.4f}  lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s"
        if step < self.total:
            line += f"  eta {_duration((self.total - step) / max(rate, 1e-9))}"
        print(line, file=sys.stderr, flush=True)
        self.last_step, self.last_time = step, now

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# --- the loop ---------------------------------------------------------------------------------

def fit(model: nn.Module, task: Task, cfg: TrainConfig, tokenizer: Tokenizer | None,
        meta: dict[str, Any] | None = None, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train `model` on `task` as `cfg` says; return the final metrics.

    `meta` is saved with every checkpoint (meta.json) next to the training facts.
    `resume=True` continues `cfg.out/latest` exactly (on CPU: the same losses, step for
    step, as a run that was never stopped). Returns {"step", "tokens", "train_loss",
    "val_loss", "val_ppl", "best_val_loss", "elapsed_s", "interrupted", "signal", "run_dir",
    "plot"}. `progress`: a bar on a terminal, periodic lines otherwise (False: neither;
    the evaluation lines and samples are printed either way).
    """
    ranks = setup_distributed(cfg.device)
    try:
        if resume:
            check_out_dir(cfg.out, resume)  # before the lock creates the directory
        with lock_run_dir(cfg.out) if ranks.is_main else contextlib.nullcontext():
            check_out_dir(cfg.out, resume)  # (again: another process may have started a run there)
            return _Run(model, task, cfg, tokenizer, meta or {}, ranks, progress).run(resume)
    finally:
        if ranks.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class _Run:
    def __init__(self, model: nn.Module, task: Task, cfg: TrainConfig, tokenizer: Tokenizer | None,
                 meta: dict[str, Any], ranks: Distributed, progress: bool):
        self.model, self.task, self.cfg, self.tokenizer, self.meta = model, task, cfg, tokenizer, meta
        self.ranks, self.device, self.progress = ranks, ranks.device, progress
        self.run_dir = Path(cfg.out)
        self.amp = autocast_dtype(cfg.dtype, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == torch.float16 else None
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self.best_val = math.inf
        self.last_val: float | None = None
        self.last_train: float | None = None
        self.finite_at = -1  # the step at which the weights were last checked finite
        self.perplexity = getattr(task, "perplexity", True)

    # -- setting up ------------------------------------------------------------------------
    def _prepare(self, resume: bool) -> None:
        cfg, model = self.cfg, self.model
        if cfg.fsdp and self.ranks.world == 1:
            raise TrainError("--fsdp shards the model over the ranks of a torchrun job: run it under "
                             "torchrun --nproc_per_node N (N > 1)")
        # Master weights in float32; cfg.dtype picks the autocast precision.
        model.to(device=self.device, dtype=torch.float32)
        model.train()
        if cfg.fsdp:
            from torch.distributed.fsdp import fully_shard
            fused(model, in_place=True)  # before sharding: FSDP's hooks are on these very modules
            for block in getattr(model, "trf_blocks", []):
                fully_shard(block)
            fully_shard(model)
        self.optimizer = make_optimizer(model, cfg, self.device)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if resume:
            self._load()
        if cfg.batch_tokens is not None:
            probe = self.task.tokens(self.task.train_batch(self.step, 0, self.ranks.rank, self.ranks.world))
            cfg.grad_accum = grad_accum_for(cfg.batch_tokens, probe, self.ranks.world)
        # bfloat16 without FSDP: forward and backward run on a bf16 copy of the float32 model,
        # which stays the master that AdamW updates and checkpoints save (engine/mixed.py).
        self.low_precision = None
        compute = model
        if self.amp == torch.bfloat16 and not cfg.fsdp:
            self.low_precision = LowPrecisionCopy(model, torch.bfloat16)
            compute = self.low_precision.module
        # The training step autocasts only when its model is float32 (a bf16 copy needs no casts).
        self.step_amp = self.amp if self.low_precision is None else torch.float32
        if not cfg.fsdp:  # the glass model's blocks on fused kernels (engine/fused.py), sharing its weights
            compute = fused(compute)
        forward = torch.compile(compute) if cfg.compile else compute
        if self.ranks.world > 1 and not cfg.fsdp:
            from torch.nn.parallel import DistributedDataParallel
            forward = DistributedDataParallel(forward, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.forward = forward
        if self.ranks.world > 1:
            dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if self.ranks.is_main:
            text = json.dumps(cfg.to_dict(), indent=2)
            with self._writing("train_config.json"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(self.run_dir / "train_config.json", lambda tmp: Path(tmp).write_text(text))
                self._truncate_metrics()

    def _sync(self, last_micro: bool):
        """Skip DDP's/FSDP's gradient all-reduce on all but the last micro-step."""
        if self.ranks.world == 1 or last_micro:
            if self.cfg.fsdp:
                self.model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.cfg.fsdp:
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.forward.no_sync()

    # -- one optimizer step ------------------------------------------------------------------
    def _train_step(self, step: int) -> tuple[torch.Tensor, float | None, int]:
        cfg, rank, world = self.cfg, self.ranks.rank, self.ranks.world
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks are a function of the step: seed this device's generator.
        # (torch.manual_seed would also queue seeds for every absent accelerator, each step.)
        seed = _step_seed(cfg.seed, step, rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        loss_sum = torch.zeros((), device=self.device)
        n_tokens = 0
        for micro in range(cfg.grad_accum):
            batch = _to_device(self.task.train_batch(step, micro, rank, world), self.device)
            n_tokens += self.task.tokens(batch)
            last = micro == cfg.grad_accum - 1
            with self._sync(last):
                with autocast(self.device, self.step_amp):
                    loss = self.task.loss(self.forward, batch)
                scaled = loss / cfg.grad_accum
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if self.low_precision is not None and (last or world == 1):
                self.low_precision.grads_to_master()  # DDP's all-reduce sums the bf16 gradients at the last micro-step
            loss_sum += loss.detach().float()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            grad_norm = full_tensor(grad_norm) if hasattr(grad_norm, "full_tensor") else grad_norm
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.low_precision is not None:
            self.low_precision.refresh()
        return loss_sum / cfg.grad_accum, grad_norm, n_tokens

    # -- the loop --------------------------------------------------------------------------------
    def run(self, resume: bool) -> dict[str, Any]:
        cfg, main = self.cfg, self.ranks.is_main
        self._prepare(resume)
        start, interrupted = self.step, None
        self.progress_view = bar = _Progress(start, cfg.max_steps, self.progress and main)
        if start >= cfg.max_steps and main:
            bar.write(f"{self.run_dir} is already at step {start:,} of max_steps {cfg.max_steps:,}: "
                      "pass a larger --max-steps to train further")
        window_tokens, window_time = 0, 0.0
        try:
            with _StopRequests() as stop:
                for step in range(start, cfg.max_steps):
                    t0 = time.perf_counter()
                    loss, grad_norm, n_tokens = self._train_step(step)
                    loss_mean, step_tokens, stopping = self._reduce(loss, n_tokens, stop.requested)
                    dt = time.perf_counter() - t0
                    self.step, self.tokens, self.elapsed = step + 1, self.tokens + step_tokens, self.elapsed + dt
                    window_tokens, window_time = window_tokens + step_tokens, window_time + dt
                    self.last_train = loss_mean
                    if not math.isfinite(loss_mean):
                        raise self._diverged(f"the training loss is {loss_mean}")
                    done = self.step == cfg.max_steps
                    evaluated = self.step % cfg.eval_every == 0 or done
                    if self.step % cfg.log_every == 0 or evaluated:
                        record = {"step": self.step, "tokens": self.tokens, "train_loss": loss_mean,
                                  "lr": lr_at(step, cfg), "tokens_per_s": window_tokens / max(window_time, 1e-9),
                                  "elapsed_s": round(self.elapsed, 3)}
                        if grad_norm is not None:
                            record["grad_norm"] = float(grad_norm)
                        bar.set_postfix(record)
                        window_tokens, window_time = 0, 0.0
                        if evaluated:
                            record.update(self._evaluate())
                        if main:
                            self._append_metrics(record)
                    bar.update(self.step)
                    self._checkpoint_after_step(evaluated, save=done or stopping)
                    if stopping:
                        interrupted = stop.signal or signal.SIGINT  # (or another rank was signalled)
                        break
        finally:
            bar.close()
        plot = None
        if main and cfg.plot and not interrupted and self.step > start:
            with self._writing("loss.png"):
                plot = plot_run(self.run_dir)
            if plot is None and self.progress:
                print("note: matplotlib is not installed, so no loss.png (pip install 'glassgpt[plot]')")
        val = self.last_val
        return {"step": self.step, "tokens": self.tokens, "train_loss": self.last_train, "val_loss": val,
                "val_ppl": self._ppl(val), "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                "elapsed_s": self.elapsed, "interrupted": interrupted is not None, "signal": interrupted,
                "run_dir": str(self.run_dir), "plot": str(plot) if plot else None}

    def _ppl(self, loss: float | None) -> float | None:
        """exp(loss) for tasks whose loss is per-token cross-entropy (None if it would overflow)."""
        if not self.perplexity or loss is None or not loss < 700:
            return None
        return math.exp(loss)

    # -- a run that diverges, a disk that fails ---------------------------------------------------
    def _diverged(self, what: str) -> TrainError:
        return TrainError(f"training diverged at step {self.step:,}: {what}; nothing non-finite was saved and "
                          f"{saved_checkpoints(self.run_dir)}. Lower --lr (now {self.cfg.lr:g}) or raise "
                          f"--warmup-steps (now {self.cfg.warmup_steps:,})")

    def _check_weights_finite(self) -> None:
        """Before an evaluation or a save: every rank checks its weights, and all agree."""
        if self.finite_at == self.step:
            return
        bad = nonfinite_tensor(self.model.named_parameters())
        flag = torch.tensor(float(bad is not None), device=self.device)
        if self.ranks.world > 1:
            dist.all_reduce(flag)
        if flag.item() > 0:
            raise self._diverged(f"the weights hold NaN or infinite values ({bad or 'on another rank'})")
        self.finite_at = self.step

    @contextlib.contextmanager
    def _writing(self, what: str):
        """A full disk, a file-size limit or a read-only disk while writing `what`: one line, not a traceback."""
        try:
            yield
        except OSError as e:
            raise TrainError(f"could not write {self.run_dir / what} ({e.strerror or e}): "
                             f"{saved_checkpoints(self.run_dir)}; free some space or give a writable "
                             "run directory") from None

    def _reduce(self, loss: torch.Tensor, n_tokens: int, stop: bool) -> tuple[float, int, bool]:
        """(mean loss over ranks, tokens over ranks, whether any rank was asked to stop).

        One all-reduce, every step: all ranks then agree on when to stop and save.
        """
        stats = torch.stack([loss.float(), torch.tensor(float(n_tokens), device=self.device),
                             torch.tensor(float(stop), device=self.device)])
        if self.ranks.world > 1:
            dist.all_reduce(stats)
        loss_sum, tokens, stops = stats.tolist()
        return loss_sum / self.ranks.world, int(tokens), stops > 0

    def _checkpoint_after_step(self, evaluated: bool, save: bool) -> None:
        """latest/ every save_every steps (default: at each evaluation), best/ on a new best val loss."""
        cfg = self.cfg
        save = save or (self.step % cfg.save_every == 0 if cfg.save_every else evaluated)
        best = evaluated and self.last_val is not None and self.last_val < self.best_val
        if best:
            self.best_val = self.last_val
        if save or best:
            self._save(["latest"] * save + ["best"] * best)

    def _evaluate(self) -> dict[str, Any]:
        self._check_weights_finite()
        out: dict[str, Any] = {}
        val = evaluate_loss(self.model, self.task, self.cfg.dtype)
        if val is not None:
            if not math.isfinite(val):
                raise self._diverged(f"the validation loss is {val}")
            self.last_val = val
            out["val_loss"] = val
            if self.perplexity:
                out["val_ppl"] = self._ppl(val)
        was_training = self.model.training
        self.model.eval()
        with autocast(self.device, self.amp):
            out.update(self.task.evaluate(self.model))
            try:
                sample = self.task.sample(self.model) if self.cfg.sample_tokens else None
            except NonFiniteError:
                raise self._diverged("the sample's scores are NaN or infinite") from None
        self.model.train(was_training)
        if sample is not None:
            out["sample"] = sample
        if self.ranks.is_main:
            metrics = "  ".join(f"{k} {v:.4f}" if v is not None else f"{k} -" for k, v in out.items() if k != "sample")
            self.progress_view.write(f"step {self.step:,}: {metrics}")
            if sample is not None:
                self.progress_view.write("  sample: " + sample.replace("\n", "\n          "))
        return out

    # -- metrics.jsonl -----------------------------------------------------------------------------
    def _append_metrics(self, record: dict[str, Any]) -> None:
        with self._writing("metrics.jsonl"), open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _truncate_metrics(self) -> None:
        """On resume, drop lines logged after the checkpoint (they will be logged again)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [json.dumps(r, ensure_ascii=False) + "\n" for r in read_metrics(self.run_dir) if r["step"] <= self.step]
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(kept), encoding="utf-8"))

    # -- checkpoints (checkpoint.py writes and reads them) -------------------------------------------
    def _save(self, names: list[str]) -> None:
        """Write checkpoints `names` (latest and/or best). Every rank calls this (FSDP gathers)."""
        self._check_weights_finite()
        cfg = self.cfg
        meta = {**self.meta, "train": {"step": self.step, "tokens": self.tokens, "val_loss": self.last_val,
                                       "train_loss": self.last_train}}
        state = {
            "step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed,
            "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
            "last_val_loss": self.last_val, "world_size": self.ranks.world, "grad_accum": cfg.grad_accum,
            "scheduler": {"kind": "warmup_cosine", "lr": cfg.lr, "min_lr": cfg.min_lr,
                          "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
                          "next_lr": lr_at(self.step, cfg)},
            "scaler": self.scaler.state_dict() if self.scaler else None, "train_config": cfg.to_dict(),
        }
        save_checkpoints(self.run_dir, names, self.model, self.optimizer, state, tokenizer=self.tokenizer,
                         meta=meta, export=getattr(self.task, "checkpoint_model", None), fsdp=cfg.fsdp,
                         is_main=self.ranks.is_main)
        if self.ranks.world > 1:
            dist.barrier()

    def _load(self) -> None:
        state = load_checkpoint(self.run_dir, self.model, self.optimizer)
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.tokens = state["step"], state["tokens"]
        self.elapsed = state.get("elapsed_s", 0.0)
        self.best_val = state["best_val_loss"] if state.get("best_val_loss") is not None else math.inf
        self.last_val = state.get("last_val_loss")


# --- metrics and the loss plot ------------------------------------------------------------------

def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl. Lines that are not a record (a half-written
    last line, bytes a disk or an editor damaged) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise TrainError(f"{run_dir} has no metrics.jsonl: is it a training run directory?")
    records = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(ValueError):  # UnicodeDecodeError is a ValueError too
            record = json.loads(line.decode("utf-8"))
            if isinstance(record, dict) and all(type(record.get(k)) is int for k in ("step", "tokens")):
                records.append(record)
    return records


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path | None:
    """Draw train and validation loss against tokens seen into RUN_DIR/loss.png (or `out`).

    Returns the path, or None when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [(r["tokens"], r["train_loss"]) for r in records if isinstance(r.get("train_loss"), (int, float))]
    val = [(r["tokens"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    if train:
        x, y = zip(*train)
        ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (each logged step)")
        w = len(y) // 25
        if w > 1:  # a centred running mean shows the trend through the noise, without lag
            mean = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(x[(w - 1) // 2:][:len(mean)], mean, color="tab:blue", linewidth=1.6,
                    label=f"train (mean of {w} steps)")
    if val:
        x, y = zip(*val)
        ax.plot(x, y, "o-", color="tab:orange", linewidth=1.6, markersize=4, label="validation")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.set_title(run_dir.resolve().name)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    out = Path(out) if out is not None else run_dir / "loss.png"
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    return out
