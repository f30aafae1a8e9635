"""docs/models.md's traces of the book's models stay what tools/make_model_traces.py says they are.

The page shows, for each model, `glassgpt explain`'s output at the model's real widths (random weights, some
layers kept where the whole model does not fit a 24 GB machine). Regenerating them takes minutes, so the fast
tests hold the page to the tool instead:
- every model of the tool's MODELS has its trace on the page, and the command the page prints above it is
  the tool's own, and the page says how many layers were kept;
- each trace's widths (the header, and the shapes of tok_emb, the heads, the feed-forward, final_norm and
  out_head, in every table of stages shown) are those of the config the tool builds, checked by the same rule
  that the live trace of a small model of the same kind is checked by here (so the rule is what the trace prints);
- each trace has the lines and sections that `glassgpt explain` prints today for a model of that kind (a small
  one, the same pipeline in this process), so a trace whose format changed says: rerun the tool.
The slow test regenerates Gemma 3 270M's trace at its real shape and compares it with the page, line by line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from glassgpt.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"
_spec = importlib.util.spec_from_file_location("make_model_traces", ROOT / "tools" / "make_model_traces.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules["make_model_traces"] = tool  # (dataclasses look their module up)
_spec.loader.exec_module(tool)

PAGE_TEXT = PAGE.read_text(encoding="utf-8")
TRACES = tool.page_traces(PAGE_TEXT)
KEYS = list(tool.MODELS)
HEADER = re.compile(r"^(?P<name>[^\n:]+): (?P<blocks>[\d,]+) blocks, d (?P<d>[\d,]+), V (?P<V>[\d,]+), "
                    r"(?P<h>\d+) query heads, (?P<g>\d+) key/value groups$", re.M)
ROW = re.compile(r"^  (?P<name>[a-z_, ]+?) +(?P<shape>\[[\d, ]+\])", re.M)
TOKENS = 4  # "Every effort moves you" in GPT-2's tokenizer


def number(text: str) -> int:
    return int(text.replace(",", ""))


def tables(text: str) -> list[tuple[int, dict[str, list[int]]]]:
    """Each table of stages in a shown trace, with the --block it was read in: {row name: shape}."""
    found, block = [], 0
    for chunk in re.split(r"^(?=\[--block \d+)", text, flags=re.M):
        m = re.match(r"\[--block (\d+)", chunk)
        block = int(m[1]) if m else 0
        rows = {r["name"]: [number(x) for x in re.findall(r"[\d,]*\d", r["shape"])] for r in ROW.finditer(chunk)}
        if rows:
            found.append((block, rows))
    return found


def widths_disagree(text: str, cfg) -> list[str]:
    """Where a shown trace's widths differ from `cfg`'s (empty: they agree)."""
    h = cfg.n_heads
    g = getattr(cfg, "n_kv_groups", None) or cfg.n_kv_heads
    head = HEADER.search(text)
    if head is None:
        return ["no header line 'NAME: N blocks, d D, V V, H query heads, G key/value groups'"]
    wrong = [f"header {k} {head[k]} != {v}" for k, v in
             (("blocks", cfg.n_layers), ("d", cfg.emb_dim), ("V", cfg.vocab_size), ("h", h), ("g", g))
             if number(head[k]) != v]
    shown = tables(text)
    if not shown:
        return wrong + ["no table of stages"]
    for block, rows in shown:
        layer_type = cfg.layer_types[block] if getattr(cfg, "layer_types", None) else None
        hd = cfg.head_dim_of(layer_type) if hasattr(cfg, "head_dim_of") else (cfg.head_dim or cfg.emb_dim // h)
        ff = cfg.num_experts if getattr(cfg, "num_experts", 0) else cfg.hidden_dim
        want = {"tok_emb": [1, TOKENS, cfg.emb_dim], "queries": [1, h, TOKENS, hd], "keys, values": [1, g, TOKENS, hd],
                "ff": [1, TOKENS, ff], "final_norm": [1, TOKENS, cfg.emb_dim], "out_head": [1, TOKENS, cfg.vocab_size]}
        wrong += [f"block {block}: {name} {rows.get(name)} != {shape}" for name, shape in want.items()
                  if rows.get(name) != shape]
    return wrong


def skeleton(text: str) -> list[str]:
    """What a trace prints whatever the widths and weights: its unindented lines with the numbers taken out,
    every table's row names, and the first two words of each line of `where positions enter`."""
    lines, out, section = text.splitlines(), [], ""
    for line in lines:
        if line and not line.startswith(" "):
            section = line
            if not line.startswith(("model ", "tokens:")):
                out.append(re.sub(r"[\d,.]*\d", "#", line))
        elif ROW.match(line):
            out.append("row " + ROW.match(line)["name"])
        elif section == "where positions enter" and line.strip():
            out.append("positions " + " ".join(line.split()[:2]))
    return out


def section_of(key: str) -> str:
    """The page's text from the heading of `key`'s trace to its marker."""
    marker = PAGE_TEXT.index(f"<!-- trace: {key} -->")
    return PAGE_TEXT[PAGE_TEXT.rindex("\n### ", 0, marker):marker]


def test_the_page_shows_one_trace_of_every_model_the_tool_makes():
    assert sorted(TRACES) == sorted(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_the_page_prints_the_tools_command_and_the_layers_it_kept(key):
    section = section_of(key)
    for block, _ in tool.MODELS[key].blocks:
        assert tool.shell_line(tool.command(key, block)) in section, f"{key}: the page's command is not the tool's"
    kept = tool.MODELS[key].kept.get("n_layers")
    if kept is not None:
        released = tool.released_dict(key)["n_layers"]
        assert f"{kept} of its {released} layers" in section, f"{key}: the page does not say the layers kept"


@pytest.mark.parametrize("key", KEYS)
def test_each_trace_on_the_page_has_the_widths_of_its_config(key):
    assert widths_disagree(TRACES[key], tool.config_of(key)) == []


def test_a_trace_of_other_widths_is_caught():
    """The check can fail: Llama 3.2 1B's trace against Gemma 3 270M's config, and against its own with twice the
    query heads (32 wide each: the header and the queries' shape both disagree)."""
    cfg = tool.config_of("llama3")
    assert widths_disagree(TRACES["llama3"], tool.config_of("gemma3"))
    wrong = widths_disagree(TRACES["llama3"], dataclasses.replace(cfg, n_heads=cfg.n_heads * 2))
    assert "header h 32 != 64" in wrong and "block 0: queries [1, 32, 4, 64] != [1, 64, 4, 32]" in wrong


def test_a_trace_of_another_kind_is_caught():
    """The skeleton tells the kinds apart: Qwen3.5's linear layers and QK-norm against Llama 3's plain blocks."""
    assert skeleton(TRACES["qwen3.5"]) != skeleton(TRACES["llama3"])


def small_trace(key: str, where: Path) -> str:
    """`key`'s model made small by the tool and traced by `glassgpt explain` in this process, as the page shows it."""
    tool.write_model(key, where, small=True)
    outputs = []
    for block, _ in tool.MODELS[key].blocks:
        out = where / f"block{block}.txt"
        assert main([*tool.command(key, block, small=True), "--out", str(out)]) == 0
        outputs.append(out.read_text(encoding="utf-8"))
    return tool.shown(key, outputs)


@pytest.mark.parametrize("key", KEYS)
def test_the_trace_today_prints_what_the_page_shows(key, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    small = small_trace(key, tmp_path)
    assert widths_disagree(small, tool.config_of(key, small=True)) == [], "the width rule is not the trace's"
    assert skeleton(TRACES[key]) == skeleton(small), (
        f"glassgpt explain prints another trace for {key} today than docs/models.md shows: rerun "
        f"`PYTHONPATH=src python tools/make_model_traces.py {key}`")


@pytest.mark.slow
def test_gemma3s_trace_at_its_real_shape_is_the_pages():
    assert tool.traces("gemma3").splitlines() == TRACES["gemma3"].splitlines()
