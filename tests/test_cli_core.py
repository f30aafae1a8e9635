"""`glassgpt generate | info | download`: right answers on stdout, one-line errors with exit code 2.

Most tests call `glassgpt.cli.main([...])` in-process with a tiny random model (a
JSON config with GPT-2's vocabulary and a narrow body); one runs the real
`glassgpt` command in a subprocess, offline, with the full gpt2 preset.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import glassgpt
from glassgpt.engine import quantize_int8

from conftest import stored_bytes
from helpers import SMALL, assert_one_line_error, run


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


# --- generate -----------------------------------------------------------------------------

def test_generate_json_gives_prompt_ids_new_ids_and_text(small, capsys):
    code, out, err = run(["generate", "Every effort moves you", "--model", small, "--max-new-tokens", "5",
                          "--temperature", "0", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"prompt_ids", "new_ids", "text"}
    assert result["prompt_ids"] == [6109, 3626, 6100, 345]
    assert len(result["new_ids"]) == 5
    tok = glassgpt.get_tokenizer("gpt2")
    assert result["text"] == tok.decode(result["prompt_ids"] + result["new_ids"])
    # The same ids as the library, with the same seeded random weights.
    model = glassgpt.load_model(small, seed=0)
    expected = glassgpt.generate(model, result["prompt_ids"], max_new_tokens=5)[0, 4:].tolist()
    assert result["new_ids"] == expected
    assert "random weights" in err


def test_generate_streams_the_prompt_and_its_continuation(small, capsys):
    code, json_out, _ = run(["generate", "Hello", "--model", small, "--max-new-tokens", "6", "--json"], capsys)
    code, out, _ = run(["generate", "Hello", "--model", small, "--max-new-tokens", "6"], capsys)
    assert code == 0
    assert out == json.loads(json_out)["text"] + "\n"


def test_generate_with_a_seed_is_reproducible(small, capsys):
    argv = ["generate", "Hi", "--model", small, "--max-new-tokens", "8", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--json"]
    first = json.loads(run(argv, capsys)[1])
    assert json.loads(run(argv, capsys)[1]) == first


def test_generate_from_a_checkpoint_uses_its_tokenizer(tmp_path, capsys):
    text = "abcdefgh "
    cfg = glassgpt.GPTConfig(vocab_size=9, context_length=16, emb_dim=8, n_heads=2, n_layers=1)
    model = glassgpt.load_model("gpt2", config=cfg)
    tok = glassgpt.get_tokenizer("char", text=text)
    path = glassgpt.save_model(model, tmp_path / "ckpt", tokenizer=tok)
    code, out, err = run(["generate", "abc", "--model", str(path), "--max-new-tokens", "20", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["prompt_ids"] == tok.encode("abc")
    assert len(result["new_ids"]) == 20  # past context_length: the window slides
    assert "random weights" not in err


@pytest.mark.parametrize("argv, words", [
    (["--max-new-tokens", "-1"], ["max-new-tokens", "-1"]),
    (["--max-new-tokens", "ten"], ["max-new-tokens", "ten"]),
    (["--temperature", "-0.5"], ["temperature", "-0.5"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--top-p", "0"], ["top-p", "0"]),
    (["--top-p", "1.5"], ["top-p", "1.5"]),
    (["--top-k", "0"], ["top-k", "0"]),
    (["--dtype", "float8"], ["float8"]),
    (["--device", "tpu9"], ["tpu9"]),
])
def test_bad_generate_values_are_one_line_errors(small, capsys, argv, words):
    code, out, err = run(["generate", "Hi", "--model", small] + argv, capsys)
    assert_one_line_error(code, err, *words)
    assert out == ""


def test_empty_prompt_is_a_one_line_error(small, capsys):
    code, _, err = run(["generate", "", "--model", small], capsys)
    assert_one_line_error(code, err, "empty")


@pytest.mark.parametrize("model, words", [
    ("gpt5", ["gpt5", "gpt2-medium"]),
    ("./no/such/checkpoint", ["no/such/checkpoint"]),
])
def test_missing_model_is_a_one_line_error(capsys, model, words):
    code, _, err = run(["generate", "Hi", "--model", model], capsys)
    assert_one_line_error(code, err, *words)


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, capsys):
    cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=8, emb_dim=8, n_heads=2, n_layers=1)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    code, _, err = run(["generate", "Hi", "--model", str(path)], capsys)
    assert_one_line_error(code, err, "model.safetensors")


def test_checkpoint_whose_tokenizer_outgrows_the_model_is_refused(tmp_path, capsys):
    cfg = glassgpt.GPTConfig(vocab_size=100, context_length=8, emb_dim=8, n_heads=2, n_layers=1)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    code, _, err = run(["generate", "Hi", "--model", str(path)], capsys)  # no tokenizer.json: GPT-2's
    assert_one_line_error(code, err, "50,257", "100")


def test_unknown_command_and_version(capsys):
    code, _, err = run(["fly"], capsys)
    assert_one_line_error(code, err, "fly")
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and glassgpt.__version__ in out


# --- info ----------------------------------------------------------------------------------

def test_info_prints_gpt2_parameter_totals(capsys):
    code, out, err = run(["info", "--model", "gpt2"], capsys)
    assert code == 0, err
    assert "124,439,808" in out and "163,037,184" in out
    assert "emb_dim" in out and "768" in out


def test_info_json_holds_config_and_parameters(small, capsys):
    code, out, err = run(["info", "--model", small, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    model = glassgpt.load_model(small)
    assert info["config"] == model.cfg.to_dict()
    assert info["parameters"]["total"] == model.num_parameters()
    assert info["parameters"]["total_untied"] == model.num_parameters(count_tied_twice=True)
    assert info["parameters"]["tied"] is True
    rows = {row["name"]: row["params"] for row in info["parameters"]["modules"]}
    assert rows["tok_emb"] == 50257 * 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_info_reports_the_bytes_a_real_model_of_that_dtype_stores(small, capsys, dtype):
    code, out, err = run(["info", "--model", small, "--dtype", dtype, "--json"], capsys)
    assert code == 0, err
    mem = json.loads(out)["memory"]
    model = glassgpt.load_model(small, dtype="bfloat16" if dtype == "int8" else dtype)
    if dtype == "int8":
        model = quantize_int8(model)
    assert mem["dtype"] == dtype and mem["weights"] == stored_bytes(model)


@pytest.mark.parametrize("spec", ["gpt2-xl", "checkpoint"])
def test_info_reads_the_config_without_building_any_weights(tmp_path, capsys, monkeypatch, spec):
    cfg, total = glassgpt.PRESETS["gpt2-xl"], 1_557_611_200  # GPT-2 XL's parameters, tok_emb counted once
    if spec == "checkpoint":
        cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=8, emb_dim=8, n_heads=2, n_layers=3)
        model = glassgpt.load_model("gpt2", config=cfg)
        spec, total = str(glassgpt.save_model(model, tmp_path / "ckpt")), model.num_parameters()

    def no_weights(*args, **kwargs):
        raise AssertionError("info built a model")

    monkeypatch.setattr(glassgpt.GPTModel, "__init__", no_weights)
    code, out, err = run(["info", "--model", spec, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["config"] == cfg.to_dict() and info["parameters"]["total"] == total


def test_info_of_a_missing_model_is_a_one_line_error(capsys):
    code, _, err = run(["info", "--model", "gpt-two"], capsys)
    assert_one_line_error(code, err, "gpt-two")


# --- download --------------------------------------------------------------------------------

def test_download_offline_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: the env alone is too late
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, out, err = run(["download", "someone/not-cached-gpt2"], capsys)
    assert_one_line_error(code, err, "someone/not-cached-gpt2")
    assert out == ""


# --- the real command ------------------------------------------------------------------------

def test_real_command_generates_offline_with_random_weights_and_says_so(tmp_path):
    exe = shutil.which("glassgpt")
    cmd = [exe] if exe else [sys.executable, "-m", "glassgpt"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        cmd + ["generate", "Every effort moves you", "--model", "gpt2", "--max-new-tokens", "10",
               "--temperature", "0", "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_ids"] == [6109, 3626, 6100, 345]
    assert len(out["new_ids"]) == 10
    assert all(0 <= i < 50257 for i in out["new_ids"])
    assert out["text"].startswith("Every effort moves you")
    assert "random weights" in result.stderr
    assert "Traceback" not in result.stderr
    # The same ids as the library's seeded gpt2 preset.
    model = glassgpt.load_model("gpt2", seed=0)
    expected = glassgpt.generate(model, torch.tensor([out["prompt_ids"]]), max_new_tokens=10)[0, 4:].tolist()
    assert out["new_ids"] == expected


def test_the_random_weights_note_is_one_line_not_a_python_warning_too(small, capsys):
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "random weights" in line]
    assert len(lines) == 1 and lines[0].startswith(f"note: {small} has random weights")
    assert "RandomWeightsWarning" not in err and "warnings.warn" not in err


# --- one command line, tried as a new user would ------------------------------------------------

@pytest.mark.parametrize("spec", ["modle.pth", "models/modle.pth", "gpt2/124M", "./run/best"])
def test_a_mistyped_model_says_no_model_and_every_kind_of_spec_it_could_be(spec, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["generate", "Hi", "--model", spec], capsys)
    assert_one_line_error(code, err, f"no model {spec!r}", "a preset (gpt2,", ".pth", "gpt2/124M", "Hugging Face id")
    assert "missing" not in err and "no such file" not in err and "could not fetch" not in err


def test_a_typo_next_to_a_real_file_asks_about_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.pth").write_bytes(b"")
    code, _, err = run(["info", "--model", "modle.pth"], capsys)
    assert_one_line_error(code, err, "no model 'modle.pth' (did you mean 'model.pth'?)")


def test_a_mistyped_flag_asks_did_you_mean_and_points_to_the_subcommands_help(capsys):
    code, _, err = run(["generate", "Hi", "--temprature", "1.4"], capsys)
    assert_one_line_error(code, err, "--temprature 1.4", "did you mean --temperature?", "'glassgpt generate --help'")


def test_a_mistyped_flag_of_a_nested_subcommand_points_to_its_own_help(capsys):
    code, _, err = run(["finetune", "classify", "--data", "x.csv", "--lrr", "1e-4"], capsys)
    assert_one_line_error(code, err, "--lrr", "did you mean --lr?", "'glassgpt finetune classify --help'")


def test_an_abbreviated_flag_is_refused_not_guessed(capsys):
    code, _, err = run(["generate", "Hi", "--max-new-token", "3"], capsys)
    assert_one_line_error(code, err, "--max-new-token", "did you mean --max-new-tokens?")


def test_no_parser_takes_abbreviations():
    from helpers import subparsers
    from glassgpt.cli import build_parser
    parser = build_parser()
    assert not parser.allow_abbrev
    assert all(not sub.allow_abbrev for _, sub in subparsers(parser))
