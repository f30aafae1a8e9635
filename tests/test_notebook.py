"""The example notebook runs in a real Jupyter kernel (nbclient + ipykernel), offline, and its results
show themselves inline: the picture (an <svg>) and the key lines, as text/html."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "your_own_model.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel imports the glassgpt these tests import (a checkout's src/, or the installed one).
    src = str(Path(__import__("glassgpt").__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
    client.km = client.kernel_manager_class(kernel_name="python3")
    client.km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    with client.setup_kernel(env=env):
        client.execute(cleanup_kc=False)
    return [c for c in nb.cells if c.cell_type == "code"]


def html_of(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.outputs if o.output_type == "execute_result")


def test_the_books_model_shows_itself_as_a_picture_and_its_next_token(executed):
    html = html_of(executed[1])
    assert "<svg" in html and "the book&#x27;s GPTModel" in html and "next token: id" in html


def test_the_check_cells_show_the_verdict_and_the_planted_mistake(executed):
    assert "<svg" in html_of(executed[2]) and "matches the book&#x27;s formulas at every stage" in html_of(executed[2])
    buggy = html_of(executed[3])
    assert "trf_blocks.0.norm1 is the first stage that differs" in buggy and "unbiased" in buggy


def test_chapter_5s_model_pth_is_loaded_and_traced(executed):
    html = html_of(executed[4])
    assert "<svg" in html and "next token: id" in html


def test_passage_comparison_and_diff_show_their_picture_and_key_lines():
    import glassgpt
    from glassgpt.explain.compare import compare
    from glassgpt.explain.diff import diff_weights
    from glassgpt.explain.passage import passage
    from readers import book_model

    a, b = book_model(seed=1), book_model(seed=2)
    tok = glassgpt.get_tokenizer("gpt2")
    shown = {"passage": passage(a, tok, "Every effort moves you forward")._repr_html_(),
             "compare": compare(a, b, tok, "Every effort moves you")._repr_html_(),
             "diff": diff_weights(a, b)._repr_html_()}
    for name, html in shown.items():
        assert html.startswith('<div class="glassgpt"><svg') and "<pre" in html, name
    assert "moved" in shown["diff"] and "KL" in shown["compare"]


def test_every_result_gets_its_views_from_the_one_registry_and_none_is_patched_onto_its_class():
    # The analyses' result types inherit Result and define no view of their own: Result looks each up
    # in result.VIEWS, which views/__init__.py fills. A renderer registered there is the one used.
    import glassgpt
    from glassgpt.explain import result, views
    from glassgpt.explain.compare import Comparison
    from glassgpt.explain.diff import WeightDiff
    from glassgpt.explain.passage import Passage
    from glassgpt.explain.pieces import PieceResult, SlidingWindows
    from glassgpt.explain.trace import Trace
    from glassgpt.explain.verify import CheckResult
    from glassgpt.explain.why import Why

    for cls in (Trace, Why, Passage, Comparison, WeightDiff, CheckResult, PieceResult, SlidingWindows):
        assert issubclass(cls, result.Result) and "_repr_html_" not in vars(cls), cls.__name__
        assert {"picture", "html"} <= set(result.VIEWS[cls]), cls.__name__
    assert result.VIEWS[Trace]["text"] is views.render_text and result.VIEWS[Why]["html"] is views.why_html

    from readers import book_model
    tr = glassgpt.trace(book_model(seed=1), glassgpt.get_tokenizer("gpt2"), "Every effort")
    original = result.VIEWS[Trace]
    try:
        result.VIEWS[Trace] = {**original, "text": lambda t, **options: f"{len(t.tokens)} tokens, {options}"}
        assert tr.to_text(color=True) == "2 tokens, {'color': True, 'attention_layer': None, 'heatmap': None}"
    finally:
        result.VIEWS[Trace] = original
    assert "next token" in tr.to_text() and tr.picture().fit_canvas is not None
    assert tr._repr_html_().startswith('<div class="glassgpt"><svg')


CHECK_AS_YOU_GO = Path(__file__).resolve().parents[1] / "examples" / "check_as_you_go.ipynb"


@pytest.fixture(scope="module")
def check_as_you_go(tmp_path_factory):
    nb = nbformat.read(CHECK_AS_YOU_GO, as_version=4)
    src = str(Path(__import__("glassgpt").__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
    client.km = client.kernel_manager_class(kernel_name="python3")
    client.km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    with client.setup_kernel(env=env):
        client.execute(cleanup_kc=False)
    return [c for c in nb.cells if c.cell_type == "code"]


def test_check_as_you_go_has_one_cell_per_chapter_each_showing_its_verdict(check_as_you_go):
    chapters = {c.source.splitlines()[0].split(":")[0] for c in check_as_you_go[1:]}
    assert chapters == {f"# Chapter {n}" for n in range(2, 8)}
    windows = html_of(check_as_you_go[1])
    assert "<svg" in windows and "makes the book&#x27;s windows" in windows and "blue: inputs" in windows
    attention = html_of(check_as_you_go[2])
    assert "<svg" in attention and "row 0 of head 0 of the attention weights is NaN: every position is masked, " \
                                   "including the diagonal" in attention
    for cell, words in zip(check_as_you_go[3:], ("TransformerBlock matches", "generate picks the same tokens",
                                                  "calc_accuracy_loader gives glassgpt&#x27;s accuracy",
                                                  "custom_collate_fn pads with 50256")):
        assert words in html_of(cell), html_of(cell)[-500:]
