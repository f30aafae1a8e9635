"""train.py and `glassgpt train/eval/plot/tokenizer`: the loop, checkpoints, resume, torchrun."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassgpt.training.loop import checkpoint as checkpoint_mod
from glassgpt.formats.glassgpt import nonfinite_tensor, sha256, verify_checkpoint
from glassgpt.training.loop.checkpoint import recover_checkpoints
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.training.tasks.data import TextTask, load_corpus
from glassgpt.errors import CheckpointError
from glassgpt.errors import RunDirError, TrainError
from glassgpt.training import TrainConfig, fit, read_metrics
from glassgpt.training.loop.compute import make_optimizer
from glassgpt.training.loop.config import grad_accum_for, lr_at
from glassgpt.formats import load_model, load_tokenizer, random_model, save_model
from glassgpt.model import GPTModel

WORDS = "the quick brown fox jumps over lazy dog and cat sat on mat".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)]
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(tmp_path, corpus, out="run", drop_rate=0.0, seed=0, **overrides):
    """(model, task, cfg, tokenizer) for a 2-layer, 32-wide char model on the generated corpus."""
    tok, train, val = load_corpus(corpus, "char", tmp_path / "cache")
    gcfg = GPTConfig(vocab_size=tok.n_vocab, context_length=16, emb_dim=32, n_heads=2, n_layers=2, drop_rate=drop_rate)
    model = random_model(gcfg, torch.device("cpu"), torch.float32, seed)
    values = dict(out=str(tmp_path / out), batch_size=4, max_steps=8, lr=3e-3, warmup_steps=2, eval_every=4,
                  eval_batches=2, sample_tokens=8, plot=False)
    values.update(overrides)
    cfg = TrainConfig(**values)
    task = TextTask(train, val, 16, cfg.batch_size, tokenizer=tok, seed=cfg.seed, eval_batches=cfg.eval_batches,
                    sample_tokens=cfg.sample_tokens)
    return model, task, cfg, tok


def losses(run_dir) -> list[float]:
    return [r["train_loss"] for r in read_metrics(run_dir)]


# --- settings and schedule ------------------------------------------------------------------

def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    cfg = TrainConfig(out="x", lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)
    assert lr_at(1000, TrainConfig(out="x", lr=6e-4, max_steps=1000)) == pytest.approx(6e-5)  # default lr/10


def test_batch_tokens_sets_the_accumulation():
    assert grad_accum_for(491_520, 12 * 1024, world=8) == 5  # nanoGPT's GPT-2 setting: ~0.5M tokens
    assert grad_accum_for(100, 1000) == 1


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 0, "batch_size must be a positive integer"),
    ("max_steps", -1, "max_steps must be a positive integer"),
    ("lr", float("nan"), "lr must be a positive number, got nan"),
    ("lr", 0, "lr must be a positive number, got 0"),
    ("grad_clip", -1.0, "grad_clip must be a number >= 0"),
    ("recipe", "nanogpt", "recipe must be glassgpt or book"),
    ("beta2", 1.0, r"beta2 must be in \[0, 1\)"),
    ("dtype", "int8", "dtype must be float32, bfloat16"),
    ("seed", -3, r"seed must be an integer in \[0, 2\*\*64\), got -3"),
    ("seed", 2**64, r"seed must be an integer in \[0, 2\*\*64\), got 18446744073709551616"),
    ("eval_batches", 2**63, "eval_batches must be a positive integer"),
    ("min_lr", 1e-2, "min_lr 0.01 is above lr 0.0006"),
    ("weight_decay", 1e300, "weight_decay 1e[+]300 x lr 0.0006 .* must stay below 1"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(TrainError, match=message):
        TrainConfig(out="x", **{field: value})


def test_weight_decay_applies_to_matrices_only():
    model = random_model(GPTConfig(vocab_size=11, context_length=8, emb_dim=8, n_heads=2, n_layers=1),
                         torch.device("cpu"), torch.float32)
    decay, no_decay = make_optimizer(model, TrainConfig(out="x", weight_decay=0.3), torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_saves_cost_at_most_a_tenth_of_the_training_time_unless_save_every_says():
    from glassgpt.training.loop.checkpoint import SavePolicy
    policy = SavePolicy(None, checkpoint_bytes=2_000_000_000)  # a 163M model and its AdamW moments: ~8 s
    policy.trained(40.0)
    assert not policy.due(5, evaluated=True)  # 40 s trained: a save would cost a fifth of it
    policy.trained(40.0)
    assert policy.due(10, evaluated=True) and not policy.due(10, evaluated=False)
    policy.saved(20.0)  # measured: this disk is slower, so the next save waits longer
    policy.trained(150.0)
    assert not policy.due(15, evaluated=True)
    policy.trained(50.0)
    assert policy.due(20, evaluated=True)
    cheap = SavePolicy(None, checkpoint_bytes=10_000_000)  # under a second: at every evaluation
    assert cheap.due(1, evaluated=True)
    every = SavePolicy(7, checkpoint_bytes=2_000_000_000)
    assert every.due(14, evaluated=False) and not every.due(15, evaluated=True)


# --- the loop ----------------------------------------------------------------------------------

def test_tiny_model_overfits_a_small_text(tmp_path):
    path = tmp_path / "fox.txt"
    path.write_text("the quick brown fox jumps over the lazy dog.\n" * 100)
    model, task, cfg, tok = tiny(tmp_path, path, max_steps=150, eval_every=150, sample_tokens=0, lr=3e-3,
                                 warmup_steps=10)
    result = fit(model, task, cfg, tok)
    assert result["train_loss"] < 0.5 and result["val_loss"] < 0.5  # from ln(29) = 3.4 at the start
    assert not result["interrupted"] and result["step"] == 150 and result["tokens"] == 150 * 4 * 16


def test_metrics_log_every_step_and_validation_on_eval_steps(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus)
    fit(model, task, cfg, tok)
    records = read_metrics(cfg.out)
    assert [r["step"] for r in records] == list(range(1, 9))
    logged = {"step", "tokens", "train_loss", "lr", "grad_norm", "tokens_per_s"}  # the schema, not a speed
    assert all(logged <= set(r) for r in records)
    assert [r["tokens"] for r in records] == [64 * s for s in range(1, 9)]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) and isinstance(r["sample"], str) for r in evals)
    assert json.loads((Path(cfg.out) / "train_config.json").read_text())["max_steps"] == 8


def test_fit_prints_nothing_and_hands_every_step_to_log(tmp_path, corpus, capfd):
    model, task, cfg, tok = tiny(tmp_path, corpus, plot=True)
    events = []
    fit(model, task, cfg, tok, log=events.append)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # the library never prints: the command line does, from the events
    assert [e["event"] for e in events] == ["start"] + ["step"] * 8 + ["end"]
    evals = [e for e in events if e["event"] == "step" and "val_loss" in e]
    assert [e["step"] for e in evals] == [4, 8] and all(isinstance(e["sample"], str) for e in evals)
    assert events[-1]["step"] == 8 and events[-1]["plot"] == str(Path(cfg.out) / "loss.png")


def test_each_evaluation_records_a_snapshot_of_the_sample_prompt(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus)
    fit(model, task, cfg, tok)
    evals = [r for r in read_metrics(cfg.out) if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and all("snapshot" in r for r in evals)
    snap = evals[-1]["snapshot"]
    assert snap["prompt_ids"] == task.sample_prompt_ids and snap["prompt"] == tok.decode(task.sample_prompt_ids)
    assert len(snap["top"]) == 5 and len(snap["lens"]) == 2 and snap["lens"][-1]["id"] == snap["top"][0]["id"]
    assert [e["prob"] for e in snap["top"]] == sorted((e["prob"] for e in snap["top"]), reverse=True)
    assert snap["greedy"] == tok.decode(glassgpt_generate(load_model(Path(cfg.out) / "latest"), snap["prompt_ids"], 8))
    assert not any("snapshot" in r for r in read_metrics(cfg.out) if "val_loss" not in r)


def glassgpt_generate(model, ids, n):
    from glassgpt import generate
    return generate(model, ids, n)[0, len(ids):].tolist()


def test_only_parameters_that_require_grad_change(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=3)
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("final_norm")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, task, cfg, tok)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"final_norm.scale", "final_norm.shift"}


def test_bfloat16_trains_a_bf16_copy_and_updates_float32_master_weights(tmp_path, corpus, monkeypatch):
    from glassgpt.engine import LowPrecisionCopy
    copies = []
    init = LowPrecisionCopy.__init__
    monkeypatch.setattr(LowPrecisionCopy, "__init__", lambda self, *a, **k: (init(self, *a, **k), copies.append(self))[0])
    model, task, cfg, tok = tiny(tmp_path, corpus, dtype="bfloat16", max_steps=4)
    result = fit(model, task, cfg, tok)
    assert math.isfinite(result["train_loss"]) and math.isfinite(result["val_loss"])
    assert len(copies) == 1 and copies[0].master is model
    assert all(p.dtype == torch.bfloat16 for p in copies[0].module.parameters())
    # The master keeps float32 precision: AdamW's small updates are not rounded away to bf16.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    w = model.trf_blocks[0].att.W_query.weight
    assert not torch.equal(w, w.bfloat16().float())
    # and the copy holds the master's final weights, rounded
    assert torch.equal(copies[0].module.trf_blocks[0].att.W_query.weight, w.bfloat16())


def test_batch_tokens_picks_the_accumulation_from_the_first_batch(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=2, batch_tokens=256)  # 4 x 16 per micro-batch
    fit(model, task, cfg, tok)
    assert json.loads((Path(cfg.out) / "train_config.json").read_text())["grad_accum"] == 4
    assert read_metrics(cfg.out)[-1]["tokens"] == 2 * 256


def test_checkpoint_is_a_model_that_load_model_reads_with_its_tokenizer(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=4)
    fit(model, task, cfg, tok, meta={"note": "kept"})
    for spec in (cfg.out, Path(cfg.out) / "latest", Path(cfg.out) / "best"):
        loaded = load_model(spec)
        ids = torch.tensor([[1, 2, 3, 4]])
        model.eval()
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
        assert load_tokenizer(spec).to_dict() == tok.to_dict()
    meta = json.loads((Path(cfg.out) / "latest" / "meta.json").read_text())
    assert meta["note"] == "kept" and meta["train"]["step"] == 4


def test_starting_over_an_existing_run_is_refused(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=2)
    fit(model, task, cfg, tok)
    with pytest.raises(RunDirError, match="already holds a training run .* pass --resume"):
        fit(model, task, cfg, tok)


def test_the_run_draws_loss_png(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=4, plot=True)
    result = fit(model, task, cfg, tok)
    png = Path(cfg.out) / "loss.png"
    assert result["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_snapshots_tokens_and_says_when_a_run_has_none(tmp_path, corpus, capsys):
    model, task, cfg, tok = tiny(tmp_path, corpus)
    fit(model, task, cfg, tok)
    run = Path(cfg.out)
    assert main(["plot", str(run), "--out", str(tmp_path / "with.png")]) == 0
    assert capsys.readouterr().err == ""
    records = read_metrics(run)  # a run made before snapshots: the same records without them
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "snapshot"}) + "\n"
                                               for r in records))
    assert main(["plot", str(run), "--out", str(tmp_path / "without.png")]) == 0
    err = capsys.readouterr().err
    assert "has no snapshots" in err and "the plot shows the loss alone" in err
    from PIL import Image
    with_, without = Image.open(tmp_path / "with.png"), Image.open(tmp_path / "without.png")
    assert with_.height > without.height  # a second panel: the next token's probabilities


# --- resume ----------------------------------------------------------------------------------

class InterruptAt:
    """A task that sends this process `sig` while building the batch of step `step`."""

    def __init__(self, task, step, sig=signal.SIGINT):
        self.task, self.step, self.sig = task, step, sig

    def train_batch(self, step, micro, rank, world):
        if step == self.step and micro == 0:
            os.kill(os.getpid(), self.sig)
        return self.task.train_batch(step, micro, rank, world)

    def __getattr__(self, name):
        return getattr(self.task, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_after_an_interrupt_reproduces_the_uninterrupted_losses(tmp_path, corpus, dtype):
    # Dropout and gradient accumulation on, so RNG and micro-steps must both resume exactly;
    # in bfloat16 the bf16 copy is rebuilt from the saved float32 master weights.
    common = dict(drop_rate=0.1, grad_accum=2, max_steps=8, eval_every=4, dtype=dtype)
    model, task, cfg, tok = tiny(tmp_path, corpus, out="straight", **common)
    fit(model, task, cfg, tok)

    model, task, cfg2, tok = tiny(tmp_path, corpus, out="stopped", **common)
    first = fit(model, InterruptAt(task, step=2), cfg2, tok)
    assert first["interrupted"] and first["step"] == 3  # the step under way finishes, then it saves
    assert json.loads((Path(cfg2.out) / "latest" / "train_state.json").read_text())["step"] == 3

    fresh, task, cfg2, tok = tiny(tmp_path, corpus, out="stopped", seed=99, **common)  # other weights
    second = fit(fresh, task, cfg2, tok, resume=True)
    assert second["step"] == 8 and not second["interrupted"]
    assert losses(cfg2.out) == losses(cfg.out)  # exactly, step for step
    vals = lambda run: [(r["val_loss"], r["snapshot"]) for r in read_metrics(run) if "val_loss" in r]  # noqa: E731
    assert vals(cfg2.out) == vals(cfg.out)  # the snapshots too: the same weights predict the same tokens
    straight = load_model(Path(cfg.out) / "latest").state_dict()
    resumed = load_model(Path(cfg2.out) / "latest").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_sigterm_also_saves_and_stops(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=6)
    result = fit(model, InterruptAt(task, step=1, sig=signal.SIGTERM), cfg, tok)
    assert result["interrupted"] and result["step"] == 2
    assert verify_checkpoint(Path(cfg.out) / "latest")["step"] == 2
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is put back


def test_resume_of_a_finished_run_with_more_steps_continues(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=4)
    fit(model, task, cfg, tok)
    cfg.max_steps = 6
    result = fit(model, task, cfg, tok, resume=True)
    assert result["step"] == 6 and [r["step"] for r in read_metrics(cfg.out)] == list(range(1, 7))


# --- checkpoints that a crash or a bad disk damaged -----------------------------------------------

@pytest.fixture
def stopped_run(tmp_path, corpus):
    """A run saved at step 4 (latest and best) that was meant to go to 8."""
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=8)
    assert fit(model, InterruptAt(task, step=3), cfg, tok)["step"] == 4
    return tmp_path, corpus, cfg


def test_a_crash_while_writing_keeps_the_previous_checkpoint(stopped_run, monkeypatch):
    tmp_path, corpus, cfg = stopped_run
    real = checkpoint_mod._save_tensors

    def disk_full(path, tensors):
        if path.name == "optimizer.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(checkpoint_mod, "_save_tensors", disk_full)
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=8)
    with pytest.raises(CheckpointError, match=r"could not write the checkpoint .*latest \(No space left on device\): "
                                              r"the previous latest/ \(step 4\) is unchanged"):
        fit(model, task, cfg, tok, resume=True)
    run = Path(cfg.out)
    assert verify_checkpoint(run / "latest")["step"] == 4
    assert not list(run.glob(".latest*"))  # the half-written directory is gone
    monkeypatch.setattr(checkpoint_mod, "_save_tensors", real)
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=8)
    assert fit(model, task, cfg, tok, resume=True)["step"] == 8


def test_a_crash_between_the_renames_is_undone(stopped_run):
    tmp_path, corpus, cfg = stopped_run
    run = Path(cfg.out)
    os.replace(run / "latest", run / ".latest.old")          # old one moved away ...
    half = run / ".latest.tmp-dead"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half a file")  # ... new one never finished
    recover_checkpoints(run)
    assert verify_checkpoint(run / "latest")["step"] == 4 and not half.exists()
    assert load_model(run / "latest").cfg.n_layers == 2
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=8)
    os.replace(run / "latest", run / ".latest.old")
    assert fit(model, task, cfg, tok, resume=True)["step"] == 8  # fit recovers by itself


def test_a_corrupt_checkpoint_is_refused_and_the_other_still_loads(stopped_run):
    tmp_path, corpus, cfg = stopped_run
    run = Path(cfg.out)
    weights = run / "latest" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last tensor: safetensors would load it silently
    weights.unlink()  # a new file (best/ shares the old one: a checkpoint's files are never changed in place)
    weights.write_bytes(bytes(data))
    model, task, cfg, tok = tiny(tmp_path, corpus, max_steps=8)
    with pytest.raises(CheckpointError, match=r"latest/model.safetensors is corrupt \(its sha256 differs"):
        fit(model, task, cfg, tok, resume=True)
    assert load_model(run / "best").cfg.emb_dim == 32


def test_latest_and_best_of_one_step_share_their_files(stopped_run):
    run = Path(stopped_run[2].out)
    assert verify_checkpoint(run / "latest")["step"] == verify_checkpoint(run / "best")["step"] == 4
    for f in (run / "latest").iterdir():
        assert f.samefile(run / "best" / f.name)  # hard links: the pair costs the bytes of one


def test_a_checkpoint_without_its_state_file_is_refused(stopped_run):
    tmp_path, corpus, cfg = stopped_run
    (Path(cfg.out) / "latest" / "train_state.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete training checkpoint"):
        verify_checkpoint(Path(cfg.out) / "latest")


# --- command line --------------------------------------------------------------------------------

TINY_FLAGS = ["--tokenizer", "char", "--n-layers", "2", "--n-heads", "2", "--emb-dim", "32", "--context-length", "16",
              "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2",
              "--no-progress", "--no-plot"]


def test_cli_train_resume_eval_generate_plot(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--max-steps", "3", *TINY_FLAGS]) == 0
    assert main(["train", "--resume", str(run), "--max-steps", "6", "--no-progress"]) == 0
    assert json.loads((run / "train_config.json").read_text())["plot"] is False  # kept from the first run
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    out = capsys.readouterr().out
    assert "done: step 6" in out and "glassgpt generate" in out
    final_val = read_metrics(run)[-1]["val_loss"]

    assert main(["eval", "--model", str(run), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(final_val, abs=1e-6)  # the same windows as training used
    assert result["perplexity"] == pytest.approx(math.exp(final_val), rel=1e-6)

    assert main(["generate", "the", "--model", str(run), "--max-new-tokens", "5", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["new_ids"]) == 5
    if importlib.util.find_spec("matplotlib"):
        assert main(["plot", str(run)]) == 0 and (run / "loss.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--lr", "-1"], "--lr: must be a positive number"),
    (["--drop-rate", "1.5"], r"--drop-rate: must be in \[0, 1\)"),
    (["--dtype", "int8"], "--dtype: invalid choice"),
    (["--n-heads", "3"], "emb_dim \\(32\\) must be divisible by n_heads \\(3\\)"),
])
def test_cli_bad_values_are_one_line_errors(tmp_path, corpus, capsys, argv, message):
    flags = TINY_FLAGS.copy()
    if argv[0] in flags:
        i = flags.index(argv[0])
        del flags[i:i + 2]
    code = _exit_code(lambda: main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *flags, *argv]))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_cli_refuses_an_existing_run_and_resume_with_data_flags(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--max-steps", "1", *TINY_FLAGS]) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(corpus), "--out", str(run), "--max-steps", "1", *TINY_FLAGS]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--data", str(corpus)]) == 2
    assert "drop --data" in capsys.readouterr().err
    assert main(["train", "--data", str(corpus)]) == 2
    assert "needs --data PATH and --out RUN_DIR" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_cli_tokenizer_train_then_train_with_it(tmp_path, corpus, capsys):
    tok_file = tmp_path / "bpe.json"
    assert main(["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300", "--out", str(tok_file)]) == 0
    assert "learned 300 tokens" in capsys.readouterr().out
    flags = TINY_FLAGS.copy()
    flags[1] = str(tok_file)
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "2", *flags]) == 0
    assert load_model(tmp_path / "run").cfg.vocab_size == 300
    assert load_tokenizer(tmp_path / "run").to_dict() == json.loads(tok_file.read_text())
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\x00\x01")
    assert main(["tokenizer", "train", "--data", str(bad), "--vocab-size", "300", "--out", str(tok_file)]) == 2
    assert "bin.txt looks binary" in capsys.readouterr().err


def test_cli_init_continues_from_a_checkpoint(tmp_path, corpus):
    first = tmp_path / "first"
    assert main(["train", "--data", str(corpus), "--out", str(first), "--max-steps", "2", *TINY_FLAGS]) == 0
    flags = ["--context-length", "16", "--batch-size", "4", "--lr", "3e-3", "--no-progress", "--no-plot"]
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "second"), "--init", str(first),
                 "--max-steps", "2", *flags]) == 0  # the checkpoint's architecture and char tokenizer
    assert load_tokenizer(tmp_path / "second").to_dict() == load_tokenizer(first).to_dict()
    assert read_metrics(tmp_path / "second")[0]["train_loss"] < read_metrics(first)[0]["train_loss"]


def _exit_code(fn) -> int:
    try:
        return fn()
    except SystemExit as e:
        return e.code


# --- torchrun -----------------------------------------------------------------------------------

def _torchrun_train(tmp_path, corpus, out, nproc, *flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "glassgpt", "train", "--data", str(corpus), "--out", str(out), "--cache-dir", str(tmp_path / "c"),
           *TINY_FLAGS, "--max-steps", "6", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_two_cpu_ranks_match_one_process_with_the_same_global_batch(tmp_path, corpus, mode):
    """2 ranks x batch 2 (gloo) against 1 process x batch 4: the same windows, so the same losses
    up to float summation order (tolerance 1e-4 absolute, observed ~1e-6)."""
    _torchrun_train(tmp_path, corpus, tmp_path / "two", 2, "--batch-size", "2", *(["--fsdp"] if mode == "fsdp" else []))
    flags = [f for f in TINY_FLAGS if f != "--no-progress"]
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "one"), "--cache-dir", str(tmp_path / "c"),
                 *flags, "--batch-size", "4", "--max-steps", "6", "--no-progress"]) == 0
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(two) == len(one) == 6
    assert max(abs(a - b) for a, b in zip(two, one)) < 1e-4
    assert load_model(tmp_path / "two").cfg.vocab_size == load_model(tmp_path / "one").cfg.vocab_size


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path, corpus):
    """torch.compile (inductor, needs a C compiler on CPU) changes the kernels, not the maths."""
    model, task, cfg, tok = tiny(tmp_path, corpus, out="eager", max_steps=4)
    fit(model, task, cfg, tok)
    model, task, cfg2, tok = tiny(tmp_path, corpus, out="compiled", max_steps=4, compile=True)
    fit(model, task, cfg2, tok)
    assert max(abs(a - b) for a, b in zip(losses(cfg.out), losses(cfg2.out))) < 1e-4


# --- faults: a diverging run, damaged files, a checkpoint that moved --------------------------------

def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("note:", "threads:"))]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _train(corpus, run, *flags):
    return main(["train", "--data", str(corpus), "--out", str(run), *TINY_FLAGS, *flags])


def test_a_diverging_run_stops_before_anything_non_finite_is_saved(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    # lr 1e4 with an evaluation (and a sample) at every step: neither NaN weights in latest/ nor a
    # traceback from the sampler.
    assert _train(corpus, run, "--lr", "1e4", "--warmup-steps", "0", "--eval-every", "1", "--max-steps", "30") == 2
    line = _one_line_error(capsys)
    step = verify_checkpoint(run / "latest")["step"]
    assert re.search(rf"training diverged at step {step + 1}: the (training|validation) loss is nan|"
                     rf"training diverged at step {step + 1}: the weights hold NaN|"
                     rf"training diverged at step {step + 1}: the sample's scores are NaN or infinite", line), line
    assert f"the last good checkpoints are {run}/latest (step {step}) and {run}/best" in line
    assert "Lower --lr (now 10000)" in line
    for name in ("latest", "best"):  # both finite, both load
        assert nonfinite_tensor(load_model(run / name).named_parameters()) is None
    assert main(["generate", "the", "--model", str(run), "--max-new-tokens", "3", "--json"]) == 0


def test_a_run_that_diverges_before_its_first_save_says_there_is_no_checkpoint(tmp_path, corpus):
    model, task, cfg, tok = tiny(tmp_path, corpus, lr=1e30, warmup_steps=0, max_steps=20, eval_every=10)
    with pytest.raises(TrainError, match=r"training diverged at step \d+: .*; nothing non-finite was saved and there "
                                         r"is no saved checkpoint\. Lower --lr \(now 1e\+30\)"):
        fit(model, task, cfg, tok)
    assert not (Path(cfg.out) / "latest").exists() and not (Path(cfg.out) / "best").exists()


def _rewrite_tensor(ckpt: Path, name: str, value: float) -> None:
    """Put `value` into one tensor of a checkpoint and record the new sha256, as an older
    glassgpt that saved a diverged run did."""
    from safetensors.torch import load_file, save_file
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    tensors[name][0] = value
    save_file(tensors, path, metadata={"format": "pt"})
    state = json.loads((ckpt / "train_state.json").read_text())
    state["files"]["model.safetensors"] = sha256(path)
    (ckpt / "train_state.json").write_text(json.dumps(state))


@pytest.fixture
def finished_run(tmp_path, corpus):
    run = tmp_path / "run"
    assert _train(corpus, run, "--max-steps", "3") == 0
    return run


@pytest.mark.parametrize("command", [
    ["generate", "the", "--max-new-tokens", "2"],
    ["explain", "the"],
    ["eval", "--data", "CORPUS"],
])
def test_loading_a_checkpoint_with_non_finite_weights_names_the_tensor(finished_run, corpus, capsys, command):
    for ckpt in ("latest", "best"):
        _rewrite_tensor(finished_run / ckpt, "trf_blocks.1.att.W_key.weight", float("nan"))
    capsys.readouterr()
    argv = [str(corpus) if a == "CORPUS" else a for a in command] + ["--model", str(finished_run)]
    assert main(argv) == 2
    line = _one_line_error(capsys)
    assert "tensor 'trf_blocks.1.att.W_key.weight' holds NaN or infinite values" in line


@pytest.mark.parametrize("command", [
    ["generate", "the", "--max-new-tokens", "2"],
    ["explain", "the"],
    ["eval", "--data", "CORPUS"],
])
def test_a_flipped_bit_in_best_is_a_one_line_error_for_readers(finished_run, corpus, capsys, command):
    weights = finished_run / "best" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    argv = [str(corpus) if a == "CORPUS" else a for a in command] + ["--model", str(finished_run)]
    assert main(argv) == 2
    assert "best/model.safetensors is corrupt (its sha256 differs" in _one_line_error(capsys)


def test_readers_find_the_checkpoint_a_crash_between_renames_left_without_writing(finished_run, corpus, capsys):
    os.replace(finished_run / "best", finished_run / ".best.old")
    os.replace(finished_run / "latest", finished_run / ".latest.old")
    before = sorted(p.name for p in finished_run.iterdir())
    assert main(["generate", "the", "--model", str(finished_run), "--max-new-tokens", "2", "--json"]) == 0
    assert main(["explain", "the", "--model", str(finished_run), "--format", "json"]) == 0
    assert main(["eval", "--model", str(finished_run), "--data", str(corpus), "--cache-dir", str(finished_run.parent / "c")]) == 0
    assert sorted(p.name for p in finished_run.iterdir()) == before  # nothing renamed, nothing written


def test_resume_falls_back_to_best_when_latest_is_gone_and_says_so(finished_run, capsys):
    best_step = verify_checkpoint(finished_run / "best")["step"]
    shutil.rmtree(finished_run / "latest")
    capsys.readouterr()
    assert main(["train", "--resume", str(finished_run), "--max-steps", "5", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"note: {finished_run}/latest is missing: resuming from {finished_run}/best (step {best_step})" in err
    assert [r["step"] for r in read_metrics(finished_run)] == list(range(1, 6))


def test_garbage_in_metrics_jsonl_does_not_stop_resume_eval_or_plot(finished_run, corpus, capsys):
    with open(finished_run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x00garbage\n{\"step\": \"x\"}\n[1, 2]\n")
    assert main(["train", "--resume", str(finished_run), "--max-steps", "4", "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(finished_run)] == [1, 2, 3, 4]
    assert main(["eval", "--model", str(finished_run), "--data", str(corpus), "--cache-dir",
                 str(finished_run.parent / "c")]) == 0
    assert main(["plot", str(finished_run)]) == 0


def test_a_damaged_train_config_falls_back_to_the_checkpoints_copy(finished_run, corpus, capsys):
    (finished_run / "train_config.json").write_bytes(b"{\"batch_size\": 4, \xff")
    capsys.readouterr()
    assert main(["train", "--resume", str(finished_run), "--max-steps", "4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"note: {finished_run}/train_config.json is damaged" in err and "using the copy saved in" in err
    assert json.loads((finished_run / "train_config.json").read_text())["max_steps"] == 4  # written whole again
    (finished_run / "train_config.json").write_text("[]")
    assert main(["eval", "--model", str(finished_run), "--data", str(corpus), "--cache-dir",
                 str(finished_run.parent / "c")]) == 0
    assert "train_config.json is damaged" in capsys.readouterr().err


def test_a_run_with_relative_paths_resumes_from_another_directory(tmp_path, corpus, monkeypatch):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(corpus, work / "data" / "words.txt")
    monkeypatch.chdir(work)
    assert main(["train", "--data", "data/words.txt", "--out", "runs/r", *TINY_FLAGS, "--max-steps", "2"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", str(work / "runs" / "r"), "--max-steps", "4", "--no-progress"]) == 0
    assert not (elsewhere / "runs").exists()  # the cache stayed in the run directory
    assert [r["step"] for r in read_metrics(work / "runs" / "r")] == [1, 2, 3, 4]


def test_resume_refuses_data_that_changed(finished_run, corpus, capsys):
    original = corpus.read_text()
    try:
        corpus.write_text(original.replace("fox", "cat", 1))
        capsys.readouterr()
        assert main(["train", "--resume", str(finished_run), "--max-steps", "4", "--no-progress"]) == 2
        assert "the data changed since the run started" in _one_line_error(capsys)
    finally:
        corpus.write_text(original)


def test_resume_refuses_another_seed(finished_run, capsys):
    capsys.readouterr()
    assert main(["train", "--resume", str(finished_run), "--seed", "5", "--no-progress"]) == 2
    assert "with its seed 1337" in _one_line_error(capsys)


def test_eval_and_generate_refuse_a_classifier_with_one_line(tmp_path, corpus, capsys):
    from glassgpt.training.tasks import classify
    base = load_model(_finished(tmp_path, corpus))
    clf_dir = tmp_path / "clf"
    from glassgpt.formats import save_model
    save_model(classify.to_classifier(base, 2), clf_dir, load_tokenizer(tmp_path / "base"))
    capsys.readouterr()
    assert main(["eval", "--model", str(clf_dir), "--data", str(corpus), "--cache-dir", str(tmp_path / "c")]) == 2
    assert "is a classifier (2 classes" in _one_line_error(capsys)
    assert main(["generate", "the", "--model", str(clf_dir)]) == 2
    assert "is a classifier (2 classes" in _one_line_error(capsys)
    assert capsys.readouterr().out == ""


def _finished(tmp_path, corpus) -> Path:
    run = tmp_path / "base"
    assert _train(corpus, run, "--max-steps", "1") == 0
    return run


# --- what a run prints ------------------------------------------------------------------------------

def test_no_progress_hides_only_the_bar(tmp_path, corpus, capsys):
    assert _train(corpus, tmp_path / "run", "--max-steps", "6") == 0  # TINY_FLAGS has --no-progress
    out, err = capsys.readouterr()
    assert "step 3: val_loss" in out and "step 6: val_loss" in out and out.count("  sample: ") == 2
    assert "train: step" not in err


def test_progress_written_to_a_file_is_a_few_plain_lines(tmp_path, corpus, capfd):
    flags = [f for f in TINY_FLAGS if f != "--no-progress"]
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), *flags, "--max-steps", "40",
                 "--eval-every", "10"]) == 0
    out, err = capfd.readouterr()
    progress = [line for line in err.splitlines() if line.startswith("train: step")]
    assert "\r" not in err and len(progress) == len(set(progress))  # tqdm on a file: a line per refresh
    assert 2 <= len(progress) <= 11 and progress[-1].startswith("train: step 40/40")
    assert out.count("val_loss") == 4


def test_eval_says_how_its_windows_are_drawn(finished_run, corpus, capsys):
    assert main(["eval", "--model", str(finished_run), "--data", str(corpus), "--cache-dir",
                 str(finished_run.parent / "c")]) == 0
    out = capsys.readouterr().out
    # 2 batches of 4 windows of 16 tokens over a val split of ~1,700 tokens: no overlap
    assert re.search(r"\(8 windows of 16 tokens, evenly spaced over the [\d,]+ val tokens \(128 of them scored\)\)", out)
    assert main(["eval", "--model", str(finished_run), "--data", str(corpus), "--cache-dir",
                 str(finished_run.parent / "c"), "--eval-batches", "100", "--batch-size", "100"]) == 0
    assert re.search(r"10,000 windows of 16 tokens, evenly spaced over the [\d,]+ val tokens "
                     r"\(so they overlap: 160,000 predictions scored\)", capsys.readouterr().out)


def test_eval_of_a_model_without_a_run_scores_each_token_once_in_few_forward_passes(tmp_path, corpus, capsys,
                                                                                     monkeypatch):
    """Without a run's --eval-batches, 20 batches of 8 windows over a split that holds far fewer side by
    side scored each token many times (the-verdict: 160 windows over 515 validation tokens, 4x the time
    of --recipe book); the windows that cover the split are enough."""
    tok, _, val = load_corpus(corpus, "char", tmp_path / "c")
    model = random_model(GPTConfig(vocab_size=tok.n_vocab, context_length=256, emb_dim=32, n_heads=2, n_layers=2),
                         torch.device("cpu"), torch.float32, 0)
    save_model(model, tmp_path / "m", tokenizer=tok)
    forwards = []
    original = GPTModel.forward
    monkeypatch.setattr(GPTModel, "forward",
                        lambda self, ids, *a, **k: forwards.append(tuple(ids.shape)) or original(self, ids, *a, **k))
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(corpus), "--cache-dir", str(tmp_path / "c"),
                 "--json"]) == 0
    covering = -(-(len(val) - 1) // 256)
    assert 1 < covering < 8 and json.loads(capsys.readouterr().out)["windows"] == covering
    assert forwards == [(covering, 256)]  # one forward pass, where there were 20


# --- threads ------------------------------------------------------------------------------------------

def test_thread_rule_gives_small_models_one_thread_and_wide_ones_every_core():
    from glassgpt.device import pick_threads
    assert pick_threads(128, 8) == (1, "small model, emb_dim 128 < 512")
    assert pick_threads(511, 8)[0] == 1
    assert pick_threads(512, 8, busy=0.0)[0] == 8 and pick_threads(768, 2, busy=0.0)[0] == 2
    assert pick_threads(768, 2, busy=1.0) == (1, "2 cores, 1.0 busy with other work now")  # a shared core stalls all


@pytest.mark.parametrize("flags, threads, why", [([], 1, "small model"), (["--threads", "3"], 3, "--threads")])
def test_train_sets_and_prints_its_threads(tmp_path, corpus, capsys, monkeypatch, flags, threads, why):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    from glassgpt.device import usable_cores
    threads = min(threads, usable_cores())  # (more than the cores is capped: tests/test_edges.py)
    assert _train(corpus, tmp_path / "run", "--max-steps", "1", *flags) == 0
    assert f"threads: {threads} ({why}" in capsys.readouterr().out
    assert torch.get_num_threads() == threads


def test_generate_takes_threads_too(finished_run, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["generate", "the", "--model", str(finished_run), "--max-new-tokens", "1", "--threads", "2"]) == 0
    assert "threads: 2 (--threads" in capsys.readouterr().err and torch.get_num_threads() == 2


def test_a_text_small_enough_to_memorise_gets_a_note_naming_the_books_recipe(tmp_path, corpus, capsys):
    small = tmp_path / "small.txt"
    small.write_text(corpus.read_text()[:3000])
    assert main(["train", "--data", str(small), "--out", str(tmp_path / "a"), "--max-steps", "1", *TINY_FLAGS]) == 0
    err = capsys.readouterr().err
    assert "note: the training split is 2,700 tokens, 169 windows of 16" in err and "--recipe book" in err
    big = [*TINY_FLAGS[:TINY_FLAGS.index("--context-length")], "--context-length", "8",
           *TINY_FLAGS[TINY_FLAGS.index("--context-length") + 2:]]  # the corpus: over 1,000 windows of 8
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "b"), "--max-steps", "1", *big]) == 0
    assert "note: the training split" not in capsys.readouterr().err
