"""What a training step runs: the model placed, sharded, in its precision, compiled, replicated.

    model (float32 master weights, what AdamW updates and checkpoints save)
      -> FSDP2 `fully_shard` per block          (--fsdp, under torchrun)
      -> a bfloat16 copy of it                   (--dtype bfloat16, not under FSDP: engine/mixed.py)
      -> the engine's fused kernels, on a twin   (except the book's recipe in float32: model.py's own)
      -> torch.compile                           (--compile)
      -> DistributedDataParallel                 (under torchrun, without FSDP)
    = `Compute.forward`, what the task's loss calls.

float16 (CUDA GPUs without bf16) autocasts with a GradScaler, and so does bfloat16 under
FSDP. AdamW: the book's recipe decays every parameter, and in float32 builds it exactly as
chapter 5 does (torch's default kernel: on a CPU one tensor at a time, 2 s a step for 163M
parameters); everything else runs the fused kernel, glassgpt's recipe decaying matrices only.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ...device import resolve_dtype
from ...engine import autotune, compiling
from ...engine.fused import fused
from ...engine.mixed import LowPrecisionCopy, keep_freed_memory
from ...errors import TrainError
from .config import TrainConfig, runs_as_book
from .distributed import Distributed


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute precision for `dtype` on `device` (float32: no autocast)."""
    dt = resolve_dtype(dtype, device)
    if dt == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # older GPUs: fp16 with a GradScaler instead
    if dt == torch.float16 and device.type != "cuda":
        raise TrainError("float16 training needs a CUDA GPU (it needs a grad scaler); on CPU use --dtype bfloat16")
    return dt


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the parameters with requires_grad (freezing and LoRA work)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise TrainError("the model has no parameter with requires_grad=True: nothing to train")
    betas = (cfg.beta1, cfg.beta2)
    if exact(cfg):  # torch.optim.AdamW(model.parameters(), lr=0.0004, weight_decay=0.1), torch's own kernel
        return torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    if runs_as_book(cfg):  # the book's decay on every parameter, on the fused kernel
        groups = [{"params": [p for _, p in named], "weight_decay": cfg.weight_decay}]
    else:
        groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]  # not biases, norms
    kind = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, **kind)
    except (RuntimeError, TypeError):  # a dtype/device the fused kernel does not cover
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas)


def with_dropout(model: nn.Module, drop_rate: float) -> nn.Module:
    """The same weights in a model whose dropout is `drop_rate` (a state dict cannot record it)."""
    new = type(model)(dataclasses.replace(model.cfg, drop_rate=drop_rate))
    new.load_state_dict(model.state_dict())
    return new


def exact(cfg: TrainConfig) -> bool:
    """Whether the step runs model.py's own kernels: the book's recipe in float32, uncompiled."""
    return runs_as_book(cfg) and cfg.dtype == "float32" and not cfg.compile


class Compute:
    """The model as the step runs it (see the module docstring), and the gradients' way back.

    Built in two parts: placing (and sharding) the master weights, so that the optimizer and
    a resume can use them; then `build`, once they hold their values."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, ranks: Distributed):
        if cfg.fsdp and ranks.world == 1:
            raise TrainError("--fsdp shards the model over the ranks of a torchrun job: run it under "
                             "torchrun --nproc_per_node N (N > 1)")
        self.cfg, self.ranks, self.amp = cfg, ranks, autocast_dtype(cfg.dtype, ranks.device)
        keep_freed_memory()  # every step frees and allocates the same large tensors again
        model.to(device=ranks.device, dtype=torch.float32).train()
        if cfg.fsdp:
            from torch.distributed.fsdp import fully_shard
            fused(model, in_place=True)  # before sharding: FSDP's hooks are on these very modules
            for block in getattr(model, "trf_blocks", []):
                fully_shard(block)
            fully_shard(model)
        self.model = model
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == torch.float16 else None
        self.low_precision = None
        self.fused_twin = None
        self.step_amp = self.amp
        self.forward: nn.Module = model

    def build(self) -> None:
        """The forward the step runs, from the master weights as they are now (after a resume)."""
        cfg, ranks, model = self.cfg, self.ranks, self.model
        compute = model
        if self.amp == torch.bfloat16 and not cfg.fsdp:
            self.low_precision = LowPrecisionCopy(model, torch.bfloat16)
            compute = self.low_precision.module
        # The step autocasts only when its model is float32 (a bf16 copy needs no casts).
        self.step_amp = self.amp if self.low_precision is None else torch.float32
        self.fused_twin = None
        if not cfg.fsdp and not exact(cfg):  # the fused kernels, on a twin sharing the weights
            compute = self.fused_twin = fused(compute)
            autotune.tune_training(compute)  # which attention its short sequences take (measured once here)
        if cfg.compile:
            compiling.use_cache()  # a resumed or repeated run loads the graphs this one compiles
        forward = torch.compile(compute) if cfg.compile else compute
        if ranks.world > 1 and not cfg.fsdp:
            from torch.nn.parallel import DistributedDataParallel
            device_ids = [ranks.device.index] if ranks.device.type == "cuda" else None
            forward = DistributedDataParallel(forward, device_ids=device_ids)
        self.forward = forward

    @property
    def eval_model(self) -> nn.Module:
        """What evaluations, samples and snapshots run: the fused twin the step runs, when there is one
        (it shares the weights the step trains: the bf16 copy's, which holds the master's after every
        step and needs no casts); else the bf16 copy; else the master weights themselves."""
        if self.fused_twin is not None:
            return self.fused_twin
        return self.low_precision.module if self.low_precision is not None else self.model

    def autocast(self):
        """Autocast for the step and for `eval_model`: on where that is float32 and the precision is not."""
        return autocast(self.ranks.device, self.step_amp)

    def sync(self, last_micro: bool):
        """Skip DDP's/FSDP's gradient all-reduce on all but the last micro-step."""
        if self.ranks.world == 1 or last_micro:
            if self.cfg.fsdp:
                self.model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.cfg.fsdp:
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.forward.no_sync()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        scaled = loss / self.cfg.grad_accum
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if self.low_precision is not None and (last_micro or self.ranks.world == 1):
            self.low_precision.grads_to_master()  # DDP sums the bf16 gradients at the last micro-step

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.Tensor | None:
        """Unscale, clip, step AdamW, clear the gradients, refresh the bf16 copy; the grad norm if clipped."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        grad_norm = None
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.low_precision is not None:
            self.low_precision.refresh()
        return grad_norm
