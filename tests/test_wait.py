"""A reader's wait, not only the step: what `generate` does before its first token, `--compile` only where it
was measured to pay, compiled code kept across processes, and `info`'s words on what to run here.

The decisions are tested on injected measurements (no timing here); two slow tests compile a tiny model
in fresh processes, over a temporary cache root, to see the cache written, reused and read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import glassgpt
from glassgpt.config import PRESETS
from glassgpt.engine import autotune, compiling
from glassgpt.engine.advice import advise, compile_line, dtype_line
from glassgpt.engine.autotune import Choices, linear_shapes

from helpers import SMALL, run

GPT2 = PRESETS["gpt2"]
AVX512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def small_checkpoint(tmp_path):
    model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(**SMALL))
    return glassgpt.save_model(model, tmp_path / "small", tokenizer=glassgpt.get_tokenizer("gpt2"))


def fresh_process(code: str, cache_root: Path | None, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c code args` with glassgpt's cache root under `cache_root` (None: the user's) and no inductor
    cache of the user's."""
    cmd, env = command(code, cache_root, *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def command(code: str, cache_root: Path | None, *args: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    if cache_root is not None:
        env["XDG_CACHE_HOME"] = str(cache_root)
    return [sys.executable, "-c", code, *args], env


def side_by_side(*runs: tuple, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """fresh_process for each (code, cache_root, *args), all at once (each compile is mostly one core's work)."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in (command(*r) for r in runs)]
    done = []
    for proc, (cmd, _) in zip(procs, (command(*r) for r in runs)):
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


# --- start-up: nothing the command does not need ---------------------------------------------

HEAVY = ["torch._dynamo", "torch._inductor", "sympy", "transformers", "matplotlib", "setuptools", "glassgpt.explain",
         "glassgpt.training"]


def test_generate_loads_no_compiler_and_no_library_it_does_not_use(small_checkpoint):
    # torch._dynamo alone was 1.5 s of every start-up: building the model's frame on the meta device
    # drew initial weights through torch._refs, whose first call imports it (formats/checks.on_meta).
    # The explain and training modules load only for the commands that use them. The second process is a user's every day: the kernels built and the autotune's choice kept (a first
    # use on a machine builds them, which needs setuptools, and measures).
    code = ("import sys\nfrom glassgpt.cli import main\n"
            "assert main(['generate', 'Every effort', '--model', sys.argv[1], '--max-new-tokens', '3']) == 0\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    for _ in range(2):
        done = fresh_process(code, None, str(small_checkpoint))
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_measuring_again_what_an_earlier_process_left_unsettled_loads_no_compiler_either(small_checkpoint, tmp_path):
    """A close or disturbed measurement is taken again by the next process (autotune.SETTLED_LEAD): every decision
    left unsettled here, the next `generate` measures each again without importing what a start-up avoids (the
    autotune's scratch layers once came from to_empty, which imports sympy)."""
    import shutil
    from glassgpt.engine import native
    from conftest import needs_kernels

    needs_kernels()
    shutil.copytree(native.cache_dir() / "kernels", tmp_path / "glassgpt" / "kernels")  # built: nothing to compile
    code = ("import sys\nfrom glassgpt.cli import main\n"
            "assert main(['generate', 'Every effort', '--model', sys.argv[1], '--max-new-tokens', '3']) == 0\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    done = fresh_process(code, tmp_path, str(small_checkpoint))
    assert done.returncode == 0, done.stderr[-2000:]
    cache = tmp_path / "glassgpt" / "autotune.json"
    entries = json.loads(cache.read_text())
    [(key, entry)] = [(k, v) for k, v in entries.items() if "| training |" not in k]
    assert {"step", f"linear {4 * SMALL['emb_dim']}x{SMALL['emb_dim']}", "attention prompt"} <= set(entry["winners"])
    entry["unsettled"] = {decision: 1 for decision in entry["winners"]}
    cache.write_text(json.dumps(entries))
    done = fresh_process(code, tmp_path, str(small_checkpoint))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "close or disturbed to be measured again at the next start" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    again = json.loads(cache.read_text())[key]
    assert all(again["unsettled"].get(decision, 2) == 2 for decision in entry["winners"])  # each measured again


def test_a_frame_on_the_meta_device_has_every_shape_and_no_values():
    from glassgpt.formats.checks import meta_model

    frame = meta_model(GPT2)
    real = glassgpt.GPTModel(glassgpt.GPTConfig(**SMALL))
    assert {k: v.shape for k, v in meta_model(glassgpt.GPTConfig(**SMALL)).state_dict().items()} == \
        {k: v.shape for k, v in real.state_dict().items()}
    assert all(p.device.type == "meta" for p in frame.parameters())
    assert frame.out_head.weight is frame.tok_emb.weight


# --- whether --compile pays: decided from what was measured here -------------------------------

RECORD = {"compiling": 10_000.0, "plain": 20.0, "compiled": 10.0}  # 10 s to compile, 10 ms saved a token


def test_compile_is_skipped_where_the_native_step_decodes_and_the_note_says_why():
    decision = compiling.decide(None, True, 100_000, {"native": 5.0, "engine": 10.0})
    assert not decision.compile
    assert "native step decodes every token here with or without it (measured 2.00x" in decision.note
    assert "assumed" in decision.note  # no compile measured: its cost is an assumption, said as one


def test_with_nothing_measured_compile_runs_and_the_note_says_what_it_assumed():
    decision = compiling.decide(None, False, 100)
    assert decision.compile
    assert "nothing measured yet" in decision.note and "assumed to pay" in decision.note


@pytest.mark.parametrize("new_tokens, compiles", [(999, False), (1000, False), (1001, True)])
def test_compile_runs_only_beyond_the_measured_break_even(new_tokens, compiles):
    decision = compiling.decide(RECORD, False, new_tokens)
    assert decision.compile == compiles
    assert "beyond 1,000 new tokens" in decision.note
    assert "compiling took 10.0 s, a step 10.00 ms compiled against 20.00 ms plain" in decision.note
    assert f"generates {new_tokens:,}" in decision.note


def test_a_compiled_step_measured_no_faster_never_compiles():
    decision = compiling.decide({"compiling": 1.0, "plain": 10.0, "compiled": 10.5}, False, 10**9)
    assert not decision.compile and "no faster" in decision.note
    assert compiling.pays_beyond({"compiling": 1.0, "plain": 10.0, "compiled": 10.5}, False) is None


def test_generate_compile_where_the_native_step_decodes_compiles_nothing(tmp_path, capsys, monkeypatch):
    from glassgpt.cli import core

    def refuse(model):
        raise AssertionError("compiled where it cannot pay")
    monkeypatch.setattr(core, "compile_for_generation", refuse)
    monkeypatch.setattr(autotune, "native_step_chosen", lambda engine, cache: True)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    code, out, err = run(["generate", "Hi", "--model", str(path), "--max-new-tokens", "4", "--compile",
                          "--json"], capsys)
    assert code == 0, err
    assert len(json.loads(out)["new_ids"]) == 4
    assert "note: --compile skipped: the native step decodes every token here" in err


# --- info: the dtype and flags to use on this CPU ---------------------------------------------

def choices(precision: str, products_ms: float, step_ms: float | None = None, step: str = "native",
            compile_record: dict | None = None) -> Choices:
    """autotune's record of a gpt2-shaped model at `precision`: its products taking `products_ms` a token."""
    shapes = linear_shapes(GPT2)
    per_call = products_ms / sum(shapes.values())
    c = Choices("a CPU", precision)
    for out, inp in shapes:
        c.winners[f"linear {out}x{inp}"] = "glassgpt"
        c.ms[f"linear {out}x{inp}"] = {"glassgpt": per_call, "torch": 2 * per_call}
    if step_ms is not None:
        c.winners["step"] = step
        c.ms["step"] = {"native": step_ms, "engine": 1.5 * step_ms} if step == "native" else \
            {"native": 1.5 * step_ms, "engine": step_ms}
    if compile_record is not None:
        c.ms[compiling.COMPILE] = compile_record
    return c


def test_info_names_bfloat16_on_a_cpu_with_avx512_bf16_and_says_it_assumed():
    line = dtype_line(GPT2, AVX512 | {"avx512_bf16"}, {"float32": choices("float32", 10.0)})
    assert line.startswith("dtype: --dtype bfloat16")
    assert "this CPU has avx512_bf16" in line and "half float32's bytes" in line
    assert "--dtype int4 for the fastest" in line and "assumed from the CPU's flags" in line


def test_info_without_avx512_bf16_says_the_kernel_widens_each_weight():
    line = dtype_line(GPT2, AVX512, {})
    assert line.startswith("dtype: --dtype bfloat16") and "lacks avx512_bf16" in line and "assumed" in line


def test_info_without_the_kernels_names_float32_and_why():
    line = dtype_line(GPT2, frozenset({"avx2"}), {}, missing="this CPU lacks avx512f; PyTorch's own operators run")
    assert line.startswith("dtype: float32: glassgpt's kernels do not run here (this CPU lacks avx512f)")


def test_info_with_only_the_avx2_gemv_names_float32_and_bfloat16_and_what_has_no_kernel():
    line = dtype_line(GPT2, frozenset({"avx2", "fma"}), {}, missing="this CPU lacks avx512f; PyTorch's own operators run",
                      gemv=True)
    assert line.startswith("dtype: float32 or --dtype bfloat16: glassgpt's AVX-512 kernels do not run here "
                           "(this CPU lacks avx512f); its AVX2 matrix-vector kernel multiplies both"), line
    assert "int8 and int4 have no kernel here" in line and "--dtype auto measures" in line


def test_info_names_the_fastest_precision_measured_here_with_the_figures():
    measured = {"float32": choices("float32", 8.0, 12.0), "bfloat16": choices("bfloat16", 4.0, 6.5),
                "int4": choices("int4", 1.5, 2.25), "int8": None}
    line = dtype_line(GPT2, AVX512 | {"avx512_bf16"}, measured)
    assert line.startswith("dtype: --dtype int4 for the fastest decoding here")
    assert "decoding step a token, measured on this machine: int4 2.25 ms, bfloat16 6.50 ms, float32 12.00 ms" in line
    assert "not measured yet: int8" in line and "assumed" not in line


def test_info_compares_products_where_not_every_precision_has_timed_a_step():
    measured = {"float32": choices("float32", 8.0, 12.0), "int8": choices("int8", 3.0)}
    line = dtype_line(GPT2, AVX512, measured)
    assert "--dtype int8 for the fastest" in line and "matrix-vector products a token" in line
    assert "int8 3.00 ms, float32 8.00 ms" in line


@pytest.mark.parametrize("record, words", [
    (choices("int8", 3.0, 4.0, step="native"), "not for generate here: the native step decodes"),
    (choices("int8", 3.0, 4.0, step="engine", compile_record=RECORD), "pays only beyond 1,000 new tokens"),
    (choices("int8", 3.0, 4.0, step="engine", compile_record={"compiling": 5.0, "plain": 4.0, "compiled": 4.0}),
     "never pays here"),
    (choices("int8", 3.0, 4.0, step="engine"), "the first `generate --compile` compiles and measures"),
    (None, "the first `generate` times the native step"),
])
def test_info_says_when_compile_pays_from_what_was_measured(record, words):
    assert words in compile_line(record)


def test_info_prints_the_advice_for_this_cpu(capsys):
    code, out, err = run(["info", "--model", "gpt2"], capsys)
    assert code == 0, err
    section = out.split("\non this CPU\n", 1)[1].splitlines()
    assert section[0].startswith("  dtype: ") and section[1].startswith("  --compile: ")
    assert advise(GPT2, "float32", AVX512, {})[1].startswith("--compile: nothing measured yet")


# --- compiled code kept across processes -----------------------------------------------------

COMPILE_TWICE = """
import sys, torch, glassgpt
from torch._dynamo.utils import counters
from glassgpt.engine import compile_for_generation
torch.set_num_threads(1)
model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=64, context_length=16, emb_dim=16,
                                                               n_heads=2, n_layers=1))
glassgpt.generate(compile_for_generation(model), [1, 2, 3], 3)
import os
print(os.environ["TORCHINDUCTOR_CACHE_DIR"], counters["inductor"]["fxgraph_cache_miss"],
      counters["inductor"]["fxgraph_cache_hit"])
"""


GENERATE_ON_THE_ENGINE = """
import sys
from glassgpt.engine import autotune
autotune.native_step_chosen = lambda engine, cache: False  # as on a CPU where the PyTorch engine decodes
from glassgpt.cli import main
sys.exit(main(['generate', 'Every effort', '--model', sys.argv[1], '--max-new-tokens', sys.argv[2],
               '--compile', '--threads', '1']))
"""


@pytest.fixture(scope="module")
def compiled_twice(tmp_path_factory):
    """The two compile checks below, each a first process and a second one, run side by side (a compile keeps
    one core busy; one after the other they were 106 s of the suite). Returns (first, second) per check and
    each check's cache root."""
    kept, decided = tmp_path_factory.mktemp("kept"), tmp_path_factory.mktemp("decided")
    model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(**SMALL))
    checkpoint = str(glassgpt.save_model(model, decided / "small", tokenizer=glassgpt.get_tokenizer("gpt2")))
    first = side_by_side((COMPILE_TWICE, kept), (GENERATE_ON_THE_ENGINE, decided, checkpoint, "6"))
    # the record the first generate kept, read before the second process can change it
    saved = json.loads((decided / "glassgpt" / "autotune.json").read_text()) if first[1].returncode == 0 else {}
    second = side_by_side((COMPILE_TWICE, kept), (GENERATE_ON_THE_ENGINE, decided, checkpoint, "6"))
    return {"kept": (first[0], second[0], kept), "decided": (first[1], second[1], saved)}


@pytest.mark.slow
def test_compiled_code_is_kept_under_glassgpt_cache_root_and_a_later_process_reuses_it(compiled_twice):
    first, second, root = compiled_twice["kept"]
    assert first.returncode == 0, first.stderr[-2000:]
    where, missed, _ = first.stdout.split()[-3:]
    assert where == str(root / "glassgpt" / "inductor") and int(missed) > 0
    assert any((root / "glassgpt" / "inductor").rglob("*.py"))  # the compiled code, on disk
    assert second.returncode == 0, second.stderr[-2000:]
    _, missed, hit = second.stdout.split()[-3:]
    assert int(missed) == 0 and int(hit) > 0


@pytest.mark.slow
def test_the_first_compile_is_measured_and_kept_and_the_next_command_decides_from_it(compiled_twice):
    first, second, saved = compiled_twice["decided"]
    assert first.returncode == 0, first.stderr[-2000:]
    assert "note: --compile: nothing measured yet" in first.stderr
    record = [v["ms"][compiling.COMPILE] for v in saved.values() if compiling.COMPILE in v.get("ms", {})]
    assert len(record) == 1 and set(record[0]) == {"compiling", "plain", "compiled"}
    assert record[0]["compiling"] > 0
    assert second.returncode == 0, second.stderr[-2000:]
    note = next(line for line in second.stderr.splitlines() if line.startswith("note: --compile"))
    assert f"compiling took {record[0]['compiling'] / 1e3:.1f} s" in note
