"""glassgpt train and finetune on Qwen3 (families/): the same loop, recipes and checkpoints as GPT-2.

Every model is a tiny random Qwen3 (d 32, 4 query heads sharing 2 key/value groups of 16, QK-norm,
tied head), trained for a handful of steps through the CLI in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import glassgpt
from glassgpt.cli import main
from glassgpt.families import FamilyConfig, Qwen3Model, build_model, random_family_model
from glassgpt.formats.glassgpt import save_model
from glassgpt.tokenizer import get_tokenizer

from conftest import shared_data

TINY = dict(family="qwen3", emb_dim=32, n_heads=4, n_layers=2, hidden_dim=48, head_dim=16, n_kv_groups=2,
            rope_base=10_000.0, qk_norm=True, tie_embeddings=True)


def val_losses(run: Path) -> list[float]:
    return [r["val_loss"] for r in records(run) if r.get("val_loss") is not None]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def saved_model(run: Path) -> torch.nn.Module:
    """The checkpoint's tensors read straight from its files, into the glass class of its config."""
    values = json.loads((run / "latest" / "config.json").read_text())
    values.pop("glassgpt_version")
    model = build_model(FamilyConfig.from_dict(values))
    model.load_state_dict(load_file(run / "latest" / "model.safetensors"), strict=False)
    model.tie_weights()
    return model.eval()


def test_glassgpt_train_lowers_a_tiny_qwen3s_loss_and_its_checkpoint_reopens_with_the_same_logits(tmp_path):
    config = tmp_path / "qwen3-tiny.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 1, "context_length": 32}))  # vocab: the tokenizer's
    run = tmp_path / "run"
    assert main(["train", "--data", str(shared_data("the-verdict.txt")), "--model", str(config), "--tokenizer", "char",
                 "--out", str(run), "--max-steps", "30", "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "0",
                 "--eval-every", "10", "--eval-batches", "4", "--no-plot", "--no-progress", "--threads", "1"]) == 0
    first = records(run)[0]
    assert first["step"] == 1 and len(val_losses(run)) == 3
    assert val_losses(run)[-1] < first["train_loss"] - 0.5  # from ln(vocab): letter frequencies learnt in 30 steps
    reopened = glassgpt.load_model(str(run))  # what --model RUN_DIR opens
    assert isinstance(reopened, Qwen3Model) and reopened.tied and reopened.cfg.n_kv_groups == 2
    x = torch.randint(0, reopened.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reopened(x), saved_model(run)(x))


def test_drop_rate_for_a_qwen3_is_refused_in_one_line(tmp_path, capsys):
    config = tmp_path / "qwen3-tiny.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 1, "context_length": 32}))
    code = main(["train", "--data", str(shared_data("the-verdict.txt")), "--model", str(config), "--tokenizer", "char",
                 "--out", str(tmp_path / "run"), "--drop-rate", "0.1", "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("Qwen3 and Llama 3 have no dropout, so drop_rate 0.1 cannot apply: drop --drop-rate")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with GPT-2's tokenizer, saved as a glassgpt checkpoint (what finetune starts from)."""
    path = tmp_path_factory.mktemp("qwen3") / "base"
    cfg = FamilyConfig(**TINY, vocab_size=50_257, context_length=256)
    save_model(random_family_model(cfg, seed=3), path, get_tokenizer("gpt2"))
    # Chapter 7's record layout, written here (../shared may be absent in a fresh clone).
    records = [{"instruction": f"Rewrite sentence {i} in the passive voice.", "input": f"The cat saw bird {i}.",
                "output": f"Bird {i} was seen by the cat."} for i in range(40)]
    (path.parent / "instructions.json").write_text(json.dumps(records))
    return path


def finetune(base: Path, out: Path, *extra: str) -> int:
    return main(["finetune", "instruct", "--model", str(base), "--data", str(base.parent / "instructions.json"),
                 "--out", str(out), "--max-steps", "6", "--batch-size", "4", "--eval-every", "3", "--lr", "1e-2",
                 "--warmup-steps", "0", "--no-plot", "--no-progress", "--threads", "1", *extra])


def test_instruction_finetuning_of_a_tiny_qwen3_lowers_its_val_loss(base, tmp_path):
    run = tmp_path / "ft"
    assert finetune(base, run) == 0
    losses = val_losses(run)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert isinstance(glassgpt.load_model(str(run)), Qwen3Model)


def test_lora_on_a_tiny_qwen3_changes_only_the_matrices_it_adapts(base, tmp_path):
    run = tmp_path / "lora"
    assert finetune(base, run, "--lora-rank", "4", "--lora-alpha", "8") == 0
    before, after = load_file(base / "model.safetensors"), load_file(run / "latest" / "model.safetensors")
    assert before.keys() == after.keys()
    adapted = (".att.W_query.", ".att.W_key.", ".att.W_value.", ".att.out_proj.", ".ff.fc1.", ".ff.fc2.", ".ff.fc3.")
    for name in before:
        assert torch.equal(before[name], after[name]) != any(a in name for a in adapted), name
    assert val_losses(run)[-1] < val_losses(run)[0]
    assert isinstance(glassgpt.load_model(str(run)), Qwen3Model)
