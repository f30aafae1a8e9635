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
