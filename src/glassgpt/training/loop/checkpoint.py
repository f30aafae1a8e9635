"""Training checkpoints: `latest/` and `best/` of a run directory, written whole and resumed exactly.

A training checkpoint is a glassgpt checkpoint (config.json, model.safetensors,
tokenizer.json, meta.json: `glassgpt generate --model RUN_DIR` loads it) plus what the
loop needs to go on as if it had never stopped:
    optimizer.safetensors   AdamW's moments, keyed by parameter name ("NAME/exp_avg")
    train_model.safetensors the training model's own tensors, when the loadable model is
                            another one (LoRA: base + adapters beside the merged model)
    train_state.json        the loop's facts (step, tokens, schedule, best val loss, ...),
                            the optimizer's param groups, torch/numpy/python/CUDA RNG
                            states, and the sha256 of every other file; written last
Nothing is pickled: tensors in safetensors, everything else in JSON.

latest/ and best/ saved at the same step share their files (hard links). When to save is
`SavePolicy`'s: at the evaluations while a save costs under a tenth of the time trained
since the last one (a 163M model's 2 GB took 7-20 s on this project's CPU, about one to
three training steps), every `save_every` steps when that is given, and at the end.

Writing: a checkpoint is filled in `.latest.tmp-XXXX/`, then the old one is renamed to
`.latest.old` and the new one into place (`recover_checkpoints` undoes a crash between
the two renames; readers that must not write look for `.latest.old` themselves). A
write that fails (a full disk, a file-size limit, a read-only disk) removes its
temporary directory and raises a CheckpointError that says which checkpoint is still
there. Reading: a checkpoint without train_state.json, whose files do not match their
recorded sha256, or whose weights hold NaN or infinity, is refused with a
CheckpointError. `--resume` continues `latest/`, or `best/` when `latest/` is gone.

`export(model)` (a task's `checkpoint_model`) picks the model written as the loadable
checkpoint when it is not the training model itself. Under FSDP every rank calls
`save_checkpoints`, which gathers the full weights and optimizer state to rank 0's CPU
memory (they must fit there) and writes a plain GPTModel; `load_checkpoint` reads the
files on every rank and keeps each rank's shard, so RUN_DIR must be on storage that all
nodes see. Leaves out: sharded (per-rank) checkpoint files.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from ...errors import CheckpointError
from ...model import GPTModel
from ...tokenizer import Tokenizer
from ...formats.glassgpt import (STATE_FORMAT, checkpoint_step, model_from_state, save_model, sha256,
                               verify_checkpoint)
from ...formats.files import atomic_write, read_safetensors, refuse_link, upgrade_name

# --- saving ----------------------------------------------------------------------------------

SAVE_BUDGET = 0.1        # a save at an evaluation may cost up to this share of the time trained since the last
CHEAP_SAVE_S = 1.0       # saves quicker than this are always made
ESTIMATED_BYTES_PER_S = 250e6  # the first save's cost, until one is measured (this project's CPU: 100-300 MB/s)
# Called with (NAME, "renamed"): NAME/ moved to .NAME.old, the new one not yet in place; and with (NAME,
# "published"): the new NAME/ in place, .NAME.old not yet removed. Tests hold a save there to read it.
save_step_hook: Callable[[str, str], None] | None = None


class SavePolicy:
    """When latest/ (and best/) are written: every `save_every` steps if given; otherwise at an
    evaluation when the time trained since the last save is at least 10x what that save took
    (the first one's estimated from its bytes), so checkpoints cost at most ~10% of a run, and
    saves under a second come at every evaluation. The end of a run and a stop always save."""

    def __init__(self, save_every: int | None, checkpoint_bytes: int):
        self.save_every = save_every
        self.cost_s = checkpoint_bytes / ESTIMATED_BYTES_PER_S  # what the next save will take
        self.trained_s = 0.0  # since the last save

    def trained(self, seconds: float) -> None:
        self.trained_s += seconds

    def due(self, step: int, evaluated: bool) -> bool:
        if self.save_every:
            return step % self.save_every == 0
        return evaluated and (self.cost_s < CHEAP_SAVE_S or self.trained_s * SAVE_BUDGET >= self.cost_s)

    def saved(self, seconds: float) -> None:
        self.cost_s, self.trained_s = seconds, 0.0


def checkpoint_bytes(model: nn.Module) -> int:
    """About what one save writes: the weights (each tensor once) and AdamW's two float32
    moments per trainable parameter."""
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    return weights + 2 * 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_checkpoints(run_dir: Path, names: Sequence[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                     state: dict[str, Any], *, tokenizer: Tokenizer | None, meta: dict[str, Any],
                     export: Callable[[nn.Module], nn.Module] | None = None, fsdp: bool = False,
                     is_main: bool = True) -> None:
    """Write checkpoints `names` ("latest" and/or "best") of `run_dir`; only `is_main` writes.

    `state` holds the loop's facts for train_state.json; the optimizer's param groups,
    the RNG states, the tensor aliases and the files' sha256 are added here. Every rank
    calls this, since under FSDP gathering the weights takes all of them.
    """
    live: dict[str, torch.Tensor] = {}
    if fsdp:  # gathered on every rank
        live = {k: full_tensor(v) for k, v in model.state_dict().items()}
    optim = _optimizer_tensors(model, optimizer)
    if not is_main:
        return
    if fsdp:
        exported = model_from_state(model.cfg, live)  # a plain CPU model of the gathered weights
    else:
        exported = export(model) if export else model
        if exported is not model:  # the training model's own tensors, kept beside it for --resume
            live = {k: full_tensor(v) for k, v in model.state_dict().items()}
    written: Path | None = None
    for name in names:
        if written is None:
            written = _publish(run_dir, name, lambda tmp: _write(tmp, model, exported, live, optim,
                                                                 tokenizer, meta, state))
        else:  # the same step's files again, hard-linked: the pair costs the bytes of one
            src = written
            _publish(run_dir, name, lambda tmp: _link_files(src, tmp))


def _write(path: Path, model: nn.Module, exported: nn.Module, live: dict[str, torch.Tensor],
           optim: tuple[dict[str, torch.Tensor], list[dict]], tokenizer: Tokenizer | None,
           meta: dict[str, Any], state: dict[str, Any]) -> None:
    save_model(exported, path, tokenizer, meta)
    aliases: dict[str, str] = {}
    if exported is not model:
        aliases = _save_tensors(path / "train_model.safetensors", live)
    tensors, groups = optim
    _save_tensors(path / "optimizer.safetensors", tensors)
    record = {
        "format": STATE_FORMAT, **state, "optimizer": {"param_groups": groups},
        "rng": _rng_state(), "model_aliases": aliases,
        "files": {p.name: sha256(p) for p in sorted(path.iterdir()) if p.is_file()},
    }
    text = json.dumps(record, indent=1)  # written last: it marks the checkpoint whole
    atomic_write(path / "train_state.json", lambda tmp: Path(tmp).write_text(text))


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state keyed by parameter name ("name/exp_avg"), and the groups as JSON."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"{names[id(p)]}/{key}"] = full_tensor(value)
    return tensors, groups


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor (gathering an FSDP shard from every rank)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu()


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """safetensors refuses shared tensors: save each storage once; return {alias: saved name}."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, t in tensors.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else (name,)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t.contiguous()
    atomic_write(path, lambda tmp: save_file(unique, tmp, metadata={"format": "pt"}))
    return aliases


# --- writing a directory whole -----------------------------------------------------------------

def _publish(run_dir: Path, name: str, fill) -> Path:
    """Write checkpoint NAME whole into a temp dir with `fill(tmp)`, then swap it in by renames.
    The temp dir is new (mkdtemp), its files created exclusively (atomic_write), and NAME or
    .NAME.old as a symbolic link is refused: nothing is written or removed outside RUN_DIR."""
    final, old = run_dir / name, run_dir / f".{name}.old"
    refuse_link(final)
    refuse_link(old)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".{name}.tmp-"))
        fill(tmp)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):  # a full disk, a file-size limit, a read-only disk
            raise _write_error(run_dir / name, e) from None
        raise
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    if save_step_hook:
        save_step_hook(name, "renamed")
    os.replace(tmp, final)  # a crash between the two renames leaves .NAME.old: recover_checkpoints
    _fsync_dir(run_dir)
    if save_step_hook:
        save_step_hook(name, "published")
    shutil.rmtree(old, ignore_errors=True)
    return final


def _write_error(path: Path, e: Exception) -> CheckpointError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    step = checkpoint_step(path)
    kept = (f"the previous {path.name}/ (step {step:,}) is unchanged" if step is not None
            else f"there was no earlier {path.name}/ checkpoint")
    return CheckpointError(f"could not write the checkpoint {path} ({reason}): {kept}; free some space "
                           "or give a writable run directory")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _link_files(src: Path, dest: Path) -> None:
    """Hard links where the file system has them (a checkpoint's files are never changed in
    place, only replaced whole by `_publish`, so two names for one file are safe), else copies."""
    for f in src.iterdir():
        try:
            os.link(f, dest / f.name)
        except OSError:
            shutil.copy2(f, dest / f.name)


def recover_checkpoints(run_dir: str | os.PathLike) -> None:
    """Undo what a crash during a save left: put `.NAME.old` back if NAME is missing; drop temp dirs."""
    run_dir = Path(run_dir)
    for name in ("latest", "best"):
        final, old = run_dir / name, run_dir / f".{name}.old"
        refuse_link(old)
        refuse_link(final)
        if old.is_dir():
            if final.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)
        for tmp in run_dir.glob(f".{name}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)


def saved_checkpoints(run_dir: str | os.PathLike) -> str:
    """'the last good checkpoints are RUN/latest (step 8) and RUN/best (step 4)', or 'there is no saved
    checkpoint': what survives, for a message about a run that stopped."""
    run_dir = Path(run_dir)
    found = [f"{run_dir / name} (step {step:,})" for name in ("latest", "best")
             if (step := checkpoint_step(run_dir / name)) is not None]
    if not found:
        return "there is no saved checkpoint"
    return f"the last good checkpoint{'s are' if len(found) > 1 else ' is'} {' and '.join(found)}"


def resume_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, str | None]:
    """(the checkpoint `--resume` continues, a note when it is not latest/): best/ if latest/ is gone."""
    run_dir = Path(run_dir)
    latest, best = run_dir / "latest", run_dir / "best"
    if latest.is_dir():
        return latest, None
    step = checkpoint_step(best)
    if step is None:
        raise CheckpointError(f"{run_dir} has no latest/ or best/ checkpoint to resume from (it stopped "
                              "before its first save): start the run again")
    return best, f"{latest} is missing: resuming from {best} (step {step:,})"


# --- resuming ----------------------------------------------------------------------------------

def load_checkpoint(run_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Put RUN_DIR/latest's (else best's) weights, optimizer state and RNG states back; return its
    train_state.json.

    The loop's own counters (step, tokens, best val loss, grad scaler) are in the
    returned state for the caller to take back.
    """
    run_dir = Path(run_dir)
    recover_checkpoints(run_dir)
    path, _ = resume_checkpoint(run_dir)
    state = _upgraded(verify_checkpoint(path))
    source = path / "train_model.safetensors"
    tensors = _load_tensors(source if source.is_file() else path / "model.safetensors")  # (names upgraded as read)
    aliases = dict(state.get("model_aliases") or {})
    own = model.state_dict()
    if isinstance(model, GPTModel) and model.tied:
        aliases.setdefault("out_head.weight", "tok_emb.weight")  # save_model stores a tied matrix once
    for alias, name in aliases.items():
        if alias in own and alias not in tensors:
            tensors[alias] = tensors[name]
    _load_into(model, tensors, str(path))
    _load_optimizer(path, state, model, optimizer)
    _set_rng_state(state["rng"])
    return state


def _load_optimizer(path: Path, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state saved by parameter name, mapped back to this optimizer's parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    saved = state["optimizer"]["param_groups"]
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [g["params"] for g in saved] != current:
        raise CheckpointError(f"{path}: the optimizer was saved for other trainable parameters than "
                              "this model has: resume with the same model and freezing settings")
    index = {name: i for i, name in enumerate(n for group in current for n in group)}
    # Hyperparameters come from the checkpoint; kernel choices stay this machine's.
    keep = ("fused", "foreach", "capturable", "differentiable")
    groups = [{**g, "params": [index[n] for n in g["params"]], "betas": tuple(g["betas"]),
               **{k: now[k] for k in keep if k in now}} for g, now in zip(saved, optimizer.param_groups)]
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in _load_tensors(path / "optimizer.safetensors").items():
        name, field = key.rsplit("/", 1)
        if hasattr(params[name], "device_mesh") and value.dim() > 0:
            value = _shard_like(value, params[name])
        per_param.setdefault(index[name], {})[field] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def _upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """train_state.json with the parameter names it records (the optimizer's groups, the model's
    aliases) as the tensor files' readers upgrade them (files.upgrade_name)."""
    groups = [{**g, "params": [upgrade_name(n) for n in g["params"]]} for g in state["optimizer"]["param_groups"]]
    aliases = {upgrade_name(a): upgrade_name(n) for a, n in (state.get("model_aliases") or {}).items()}
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}, "model_aliases": aliases}


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(read_safetensors(path))


def _load_into(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not fit this model (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}): resume with the model the run was started with")
    state = {}
    for name, value in tensors.items():
        target = own[name]
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(f"{source}: {name} has shape {list(value.shape)}, the model needs {list(target.shape)}")
        value = value.to(dtype=target.dtype)
        state[name] = _shard_like(value, target) if hasattr(target, "device_mesh") else value
    model.load_state_dict(state)


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full`, placed like the FSDP parameter `like` (no communication)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


# --- RNG states, as JSON ------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": {"keys": np_state[1].tolist(), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
             "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state(("MT19937", np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in state["cuda"]])
