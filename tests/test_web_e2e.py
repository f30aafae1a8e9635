"""The page in a real headless browser: Debian's chromium, driven by Playwright.

uvicorn serves the app on 127.0.0.1 from a background thread, with the gpt2 preset
(random weights, GPT-2's real shapes). At 1400 px: a prompt shows the shapes [1, 4, 768]
and [1, 4, 50257]; Append adds the greedy token and then a clicked one, by keyboard and by
mouse, and gives the focus back to the control used; Append after an edit traces the edited
text; a long prompt (attention weights omitted) hides the previous heatmap and streams its
progress; an API error shows on the page. At 360 px: the page is no wider than the screen.
Served on a run directory (a metrics.jsonl written here in the training engineer's snapshot
format), the page shows a slider over the evaluations, and moving it shows each one's
snapshot; the header names the run, not its path; the SVG's every text lies inside it, as
chromium measures it. Served on a tiny Qwen3 model, the page shows its four answers, RoPE and
the key/value groups, says in one line why GPT-2's panels are empty, and draws its why grid and a
prompt token's share.
Screenshots go to artifacts/.

A missing /usr/bin/chromium skips, unless GLASSGPT_REQUIRE_BROWSER=1 (set by CI, which
installs it), where it fails; a missing Playwright fails.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

import pytest
from playwright.sync_api import sync_playwright

from glassgpt.web import create_app
from glassgpt.web.server import serving
from glassgpt.config import GPTConfig
import glassgpt
from glassgpt.formats import About, load_model, load_tokenizer, random_model

from conftest import skip_unless_required

CHROMIUM = os.environ.get("GLASSGPT_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# Root in a container: no sandbox; and nothing that reaches for the network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LONG_PROMPT = " ".join(["Every effort moves you"] * 25)  # 100 tokens: 12 x 12 x 100 x 100 attention weights, over the page's budget


@pytest.fixture(scope="module")
def server_url():
    model = load_model("gpt2", device="cpu", dtype="float32")
    app = create_app(model, load_tokenizer("gpt2"), glassgpt.formats.open("gpt2"))
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        skip_unless_required(f"no chromium at {CHROMIUM} (apt-get install chromium)", "GLASSGPT_REQUIRE_BROWSER")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def snapshot(step: int, top: str, prob: float) -> dict:
    """One evaluation's snapshot, in the format the training loop writes."""
    return {"prompt": "Every effort moves you", "prompt_ids": [6109, 3626, 6100, 345],
            "top": [{"id": 760 + k, "text": top if k == 0 else f" t{k}", "prob": prob / (k + 1)} for k in range(5)],
            "greedy": f"Every effort moves you{top}{top}",
            "lens": [{"layer": i, "id": 760, "text": top, "prob": prob * (i + 1) / 2} for i in range(2)]}


TRAINED = {"tok_emb": "frozen", "pos_emb": "frozen", "trf_blocks.0": "frozen", "trf_blocks.1": "trained",
           "final_norm": "trained", "out_head": "trained"}  # as a run that finetuned the last block records it


@pytest.fixture(scope="module")
def run_url(tmp_path_factory):
    """A run directory's page: an untied model of the book's layout, and three evaluations by hand."""
    run = tmp_path_factory.mktemp("runs") / "verdict-run"
    run.mkdir()
    records = [{"step": 1, "tokens": 512, "train_loss": 10.9, "lr": 4e-4}]
    for k, (step, top, prob) in enumerate(((0, " the", 0.0001), (5, ",", 0.05), (10, " know", 0.61))):
        records.append({"step": step, "tokens": 512 * step, "train_loss": 9.0 - k, "val_loss": 9.5 - k,
                        "snapshot": snapshot(step, top, prob)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = GPTConfig(vocab_size=50257, context_length=64, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=False,
                    tie_embeddings=False)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=0)
    app = create_app(model, load_tokenizer("gpt2"), About(str(run.resolve()), trained=TRAINED), run_dir=run)
    with serving(app) as url:
        yield url


@pytest.fixture
def open_page(browser, server_url, run_url):
    """open_page(width, url) -> a page showing the default prompt's trace; checks, at the end, that the page
    logged no errors and asked nothing of another host."""
    contexts, console, requests = [], [], []

    def open_at(width: int, url: str = server_url):
        context = browser.new_context(viewport={"width": width, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url + "/")
        page.wait_for_selector("#token-count[data-count]")  # the page traced its default prompt
        return page

    yield open_at
    for context in contexts:
        context.close()
    assert all(url.startswith((server_url, run_url)) for url in requests if not url.startswith(("data:", "blob:"))), \
        requests
    errors = [m for m in console if m.startswith(("error", "pageerror"))
              and "400" not in m]  # the browser logs a deliberate 400 as a failed resource
    assert not errors, errors


def settled(page) -> None:
    """Wait until no request is in flight (a streamed answer's headers come long before its end)."""
    page.wait_for_selector("body:not(.busy)", state="attached")


def trace_prompt(page, text: str, count: int) -> None:
    page.fill("#prompt", text)
    with page.expect_response("**/api/explain") as answer:
        page.click("#run")
    assert answer.value.ok
    settled(page)
    page.wait_for_selector(f'#token-count[data-count="{count}"]')


def focused(page) -> str:
    return page.evaluate("document.activeElement.id || document.activeElement.dataset.focus || document.activeElement.tagName")


def test_page_shows_the_shapes_and_steps_through_generation(open_page):
    page = open_page(1400)
    trace_prompt(page, "Every effort moves you", 4)
    flow = page.inner_text("#flow")
    assert "[1, 4, 768]" in flow and "[1, 4, 50257]" in flow
    assert "50,257 → 768" in flow and "768 → 50,257" in flow  # the two transitions
    assert "= tok_emb.weight" in flow  # out_head's weight is tok_emb's (tied)
    assert page.is_visible("#random-banner") and "Random weights" in page.inner_text("#random-banner")
    assert page.locator("#bars .bar-row[data-id]").count() == 10
    assert page.is_visible("#heatmap") and page.locator("#att-layer option").count() == 12
    assert page.locator("#lens tbody tr").count() == 12
    # the trace's controls, drawn from their one declaration (explain/options.py), with its defaults
    assert page.input_value("#opt-top_k") == "10" and page.locator("#opt-block option").count() == 12
    assert page.is_checked("#opt-embedding_check") and "one_hot" in page.inner_text("#flow")
    page.fill("#opt-top_k", "5")
    with page.expect_response("**/api/explain"):
        page.dispatch_event("#opt-top_k", "change")
    settled(page)
    page.wait_for_function("document.querySelectorAll('#bars .bar-row[data-id]').length === 5")
    page.fill("#opt-top_k", "10")
    with page.expect_response("**/api/explain"):
        page.dispatch_event("#opt-top_k", "change")
    settled(page)
    page.wait_for_function("document.querySelectorAll('#bars .bar-row[data-id]').length === 10")

    greedy = int(page.get_attribute("#bars .bar-row.chosen", "data-id"))
    page.focus("#append")
    with page.expect_response("**/api/append"):
        page.keyboard.press("Enter")  # by keyboard: the focus must come back to Append
    settled(page)
    page.wait_for_selector('#token-count[data-count="5"]')
    assert page.inner_text("#tokens .chip:last-child .id") == str(greedy)
    assert "[1, 5, 50257]" in page.inner_text("#flow")
    assert focused(page) == "append"

    third = page.locator("#bars .bar-row[data-id]").nth(2)  # click a token that is not the greedy one
    clicked = third.get_attribute("data-id")
    third.click()
    assert focused(page) == f"bar-{clicked}"  # the redrawn bar keeps the focus
    with page.expect_response("**/api/append"):
        page.click("#append")
    settled(page)
    page.wait_for_selector('#token-count[data-count="6"]')
    assert page.inner_text("#tokens .chip:last-child .id") == clicked
    assert focused(page) == "append"

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-e2e.png"), full_page=True)

    page.fill("#prompt", "")  # an API error is shown on the page
    page.click("#run")
    page.wait_for_selector("#error:not([hidden])")
    settled(page)
    assert "400" in page.inner_text("#error") and "empty" in page.inner_text("#error")
    assert focused(page) == "run"


def test_append_after_an_edit_appends_to_the_edited_text(open_page):
    page = open_page(1400)
    trace_prompt(page, "Every effort moves you", 4)
    chosen = page.get_attribute("#bars .bar-row.chosen", "data-id")
    page.fill("#prompt", "Hello world")  # typed, not traced
    with page.expect_request("**/api/append") as sent:
        page.click("#append")
    assert sent.value.post_data_json["prompt"] == "Hello world"
    settled(page)
    page.wait_for_selector('#token-count[data-count="3"]')
    chips = page.locator("#tokens .chip .id").all_inner_texts()
    assert chips == ["15496", "995", chosen]  # "Hello", " world", then the chosen token
    assert page.input_value("#prompt").startswith("Hello world")


def test_a_long_prompt_streams_progress_and_hides_the_previous_heatmap(open_page):
    page = open_page(1400)
    trace_prompt(page, "Every effort moves you", 4)
    assert page.is_visible("#heatmap")
    page.fill("#prompt", LONG_PROMPT)
    with page.expect_response("**/api/explain") as answer:
        page.click("#run")
    assert answer.value.headers["content-type"].startswith("application/x-ndjson")  # progress, then the trace
    settled(page)
    page.wait_for_selector('#token-count[data-count="100"]')
    assert not page.is_visible("#heatmap")
    assert "up to 83 tokens" in page.inner_text("#attention-caption")
    assert page.inner_text("#status").startswith("traced 100 tokens")
    assert not page.is_visible("#progress")


def test_the_page_fits_a_360_px_screen(open_page):
    page = open_page(360)
    trace_prompt(page, "Every effort moves you", 4)
    width = page.evaluate("document.documentElement.scrollWidth")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-e2e-360.png"), full_page=True)
    assert width <= 360, f"the page is {width} px wide on a 360 px screen"
    wide = page.evaluate("""[...document.querySelectorAll('body *')]
        .filter(e => e.getBoundingClientRect().right > 361 && !e.closest('.lens, #params, #head'))
        .map(e => e.tagName + '.' + e.className).slice(0, 5)""")
    assert not wide, wide  # nothing sticks out (the lens, head and parameter tables scroll inside their cards)


def test_the_slider_moves_through_the_runs_evaluations(open_page, run_url):
    page = open_page(1400, run_url)
    page.wait_for_selector("#learn-card:not([hidden])")
    assert page.inner_text("#model-info strong") == "verdict-run"  # the run's name, never the server's path
    assert "/tmp" not in page.inner_text("header")
    assert "3 evaluations" in page.inner_text("#learn-run")
    view = page.locator("#snapshot-view")
    assert "step 10" in view.inner_text() and "know" in view.inner_text()  # the last evaluation first
    page.focus("#snapshot")
    page.keyboard.press("Home")  # the slider, moved as a user moves it
    page.wait_for_selector('.snap-losses[data-step="0"]')
    assert page.input_value("#snapshot") == "0" and "1 of 3" in page.inner_text("#snapshot-value")
    assert "the" in view.locator(".snap-bars .bar-row").first.inner_text()
    assert "val loss 9.500" in view.inner_text()
    page.keyboard.press("ArrowRight")
    page.wait_for_selector('.snap-losses[data-step="5"]')
    assert view.locator(".snap-lens tbody tr").count() == 2  # one logit-lens row per block
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-e2e-run.png"), full_page=True)


def test_the_flow_marks_which_parts_the_run_trained_and_which_stayed_frozen(open_page, run_url):
    page = open_page(1400, run_url)
    page.wait_for_selector("#flow li[data-trained]")
    marked = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#flow li[data-trained]')]
                                  .map((li) => [li.dataset.stage, li.dataset.trained]))""")
    assert marked == TRAINED  # block 0 is opened; block 1 is its own group
    assert page.locator('#flow li[data-stage="trf_blocks.1"] .trained-mark').inner_text() == "trained"
    assert "frozen: tok_emb, pos_emb, trf_blocks.0" in page.inner_text("#model-trained")


def test_the_head_card_shows_the_dot_products(open_page, run_url):
    page = open_page(1400, run_url)
    page.wait_for_selector("#head tbody tr")
    assert page.locator("#head tbody tr").count() == 10
    assert "Untied" in page.inner_text("#head-notes") and "cos(tok_emb[id], W[id])" in page.inner_text("#head")
    assert "book's layout" in page.inner_text("#model-layout")


def test_every_text_of_the_svg_lies_inside_it_as_the_browser_draws_it(open_page, run_url):
    """The untied model's label between the weight boxes used to run off the right edge."""
    page = open_page(1400, run_url)
    out = page.evaluate("""async () => {
        const res = await fetch("/api/diagram.svg", {method: "POST", headers: {"Content-Type": "application/json"},
                                                     body: JSON.stringify({prompt: "Every effort moves you"})});
        const holder = document.createElement("div");
        holder.innerHTML = await res.text();
        document.body.append(holder);
        const svg = holder.querySelector("svg");
        const width = svg.width.baseVal.value, height = svg.height.baseVal.value;
        const texts = [...svg.querySelectorAll("text")].map((t) => {
            const b = t.getBBox();
            return {text: t.textContent, left: b.x, right: b.x + b.width, top: b.y, bottom: b.y + b.height};
        });
        holder.remove();
        return {width, height, texts};
    }""")
    labels = [t["text"] for t in out["texts"]]
    assert "two separate tensors (untied)" in labels
    for t in out["texts"]:
        assert t["left"] >= 0 and t["right"] <= out["width"] and t["top"] >= 0 and t["bottom"] <= out["height"], t


@pytest.mark.parametrize("width", [1280, 390])
def test_why_click_a_candidate_then_a_prompt_token(open_page, width):
    page = open_page(width)
    settled(page)
    second = page.locator(".why-candidate").nth(1)
    target = second.get_attribute("data-id")
    with page.expect_response("**/api/why") as answer:
        second.click()
    assert answer.value.ok
    settled(page)
    page.wait_for_selector(f'.why-candidate.chosen[data-id="{target}"]')
    assert page.locator(".why-cell").count() == 12 * 13  # 12 blocks x (12 heads + the feed-forward)
    assert "logit[" in page.inner_text("#why-headline")
    page.locator(".why-source-token").nth(2).click()  # ' moves'
    page.wait_for_selector('.why-source-token.chosen[data-position="2"]')
    said = page.inner_text("#why-source")
    assert "' moves'" in said.replace('"', "'") and "direct share" in said and "removed" in said
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"web-e2e-why-{width}.png"), full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    # every cell of the grid is inside the screen (the grid shrinks, it does not scroll)
    right = page.evaluate("Math.max(...[...document.querySelectorAll('.why-cell')].map(e => e.getBoundingClientRect().right))")
    assert right <= width


def test_the_lens_prediction_column_and_the_params_last_column_are_in_view(open_page):
    page = open_page(390)
    settled(page)
    box = page.locator(".lens tbody tr").first.locator("td.last").bounding_box()
    assert box["x"] + box["width"] <= 390, box  # sticky at the card's right edge, not behind the sideways scroll
    page = open_page(1280)
    settled(page)
    clipped = page.evaluate("""(() => { const box = document.querySelector('#params').getBoundingClientRect();
        return [...document.querySelectorAll('table.params td:last-child')].filter(td => td.getBoundingClientRect().right > box.right + 1).length; })()""")
    assert clipped == 0


def test_the_first_paint_says_it_is_tracing(browser, server_url):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.route("**/api/explain", lambda route: None)  # hold the first trace: the page as it looks before it
    page.goto(server_url + "/")
    assert "tracing" in page.inner_text("#status") and "tracing" in page.inner_text("#tokens")
    context.close()


@pytest.mark.parametrize("width", [1280, 390])
def test_why_shows_top_heads_and_prompt_shares_as_numbers_with_a_legend(open_page, width):
    page = open_page(width)
    settled(page)
    # the prediction is on the first screen of a phone (390 x 844), above the long flow
    box = page.locator("#prediction").bounding_box()
    assert page.inner_text("#prediction").startswith("next token: ") and box["y"] + box["height"] <= 844, box
    assert "null" not in page.inner_text("#random-banner")
    first = page.locator(".why-candidate").first
    with page.expect_response("**/api/why") as answer:
        first.click()
    why = answer.value.json()
    settled(page)
    page.wait_for_selector(".why-top-head")
    terms = sorted((v for row in why["heads"] for v in row), key=abs, reverse=True)[:5]
    shown = [float(t.replace("−", "-")) for t in page.locator(".why-top-head strong").all_inner_texts()]
    assert shown == pytest.approx([round(v, 3) for v in terms], abs=1e-3)
    shares = [float(t.replace("−", "-")) for t in page.locator(".why-source-token .share").all_inner_texts()]
    assert shares == pytest.approx([round(s["direct"], 3) for s in why["sources"]], abs=1e-3)
    legend = page.inner_text("#why-legend")
    assert "blue: raises the logit" in legend and "red: lowers it" in legend and page.is_visible("#why-legend .swatch.neg")
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_why_says_in_one_line_when_the_direct_and_causal_answers_disagree(open_page):
    page = open_page(390)
    said = page.evaluate("""disagreement({sources: [
        {text: " effort", direct: 0.2, causal: {logit_change: -0.5}},
        {text: " you", direct: -0.12, causal: {logit_change: -1.3}}]})""")
    assert said.startswith('" you": the two answers disagree. Its direct share is −0.120 (red), yet removing it '
                           'lowers the logit by 1.300')
    assert "\n" not in said
    assert page.evaluate("""disagreement({sources: [{text: " effort", direct: 0.2, causal: {logit_change: -0.5}}]})""") == ""


@pytest.mark.parametrize("width", [1280, 390])
def test_the_page_shows_the_prompts_training_windows_and_their_overlap(open_page, width):
    page = open_page(width)
    trace_prompt(page, "Every effort moves you forward, one step at a time", 11)
    # the default prompt's windows (4 tokens: max_length 3) come first; wait for this prompt's
    page.wait_for_selector(f'#windows-count:has-text("{len(range(0, 11 - 4, 2))} windows")')
    assert page.inner_text("#windows-overlap") == "max_length 4, stride 2: each window shares 2 input tokens with the next"
    assert page.locator("#windows li").count() == len(range(0, 11 - 4, 2))
    first = page.locator('#windows li[data-window="1"]')
    inputs = first.locator(".in .win-tok").all_inner_texts()
    targets = first.locator(".target .win-tok").all_inner_texts()
    assert len(inputs) == 4 and inputs[1:] == targets[:3]  # the targets are the inputs one token later
    page.fill("#win-stride", "5")
    page.dispatch_event("#win-stride", "change")
    page.wait_for_selector('#windows-overlap:has-text("1 tokens between windows are in no input")')
    page.wait_for_selector(f'#windows-count:has-text("{len(range(0, 11 - 4, 5))} windows")')
    assert page.locator("#windows li").count() == len(range(0, 11 - 4, 5))
    assert page.evaluate("document.documentElement.scrollWidth") <= width


@pytest.fixture(scope="module")
def family_url():
    """The page of a tiny random Qwen3 model (a character tokenizer that covers the default prompt)."""
    from glassgpt.families import FamilyConfig, build_model
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("Every effort moves you abcdefghijklmnopqrstuvwxyz")
    cfg = FamilyConfig(family="qwen3", vocab_size=tok.n_vocab, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                       hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                       tie_embeddings=True)
    torch.manual_seed(0)
    with serving(create_app(build_model(cfg).eval(), tok, About("qwen3-tiny"))) as url:
        yield url


def test_a_qwen3_page_shows_its_answers_groups_heatmaps_lens_and_why(browser, family_url):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    console, requests = [], []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(family_url + "/")
    page.wait_for_selector('#token-count[data-count="22"]')  # one token per character
    settled(page)
    assert "4 query heads sharing 2 key/value groups" in page.inner_text("#model-info")
    answers = page.locator("#family .answers li").all_inner_texts()
    assert answers[0] == "Where does 28 become 32? At tok_emb: a lookup in the [28, 32] weight."
    assert "share their storage (the same data_ptr)" in answers[3]
    family = page.inner_text("#family")
    assert "No pos_emb" in family and "rotated by RoPE, base 1,000,000" in family and "QK-norm" in family
    assert page.locator(".kv-group").all_text_contents() == ["kv0 q0…q1", "kv1 q2…q3"]
    assert page.locator('#flow [data-stage="out_head"] .tied').inner_text() == "= tok_emb.weight"
    # the panels GPT-2's page has, drawn from this model: its heatmaps, labelled with each head's group
    assert page.locator("#heatmap").is_visible() and page.locator("#trace-controls [data-option]").count() == 1
    assert page.locator("#head-thumbs .thumb-box").all_inner_texts() == ["h0 · kv0", "h1 · kv0", "h2 · kv1", "h3 · kv1"]
    assert "reads key/value group 0" in page.inner_text("#attention-caption")
    drawn = page.evaluate("""() => { const c = document.getElementById('heatmap');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && (d[i] < 200 || d[i + 2] < 200)) n++; return n; }""")
    assert drawn > 1000  # cells painted, not an empty canvas
    page.locator("#head-thumbs .thumb-box").nth(3).click()
    page.wait_for_selector('#attention-caption:has-text("head 3 (it reads key/value group 1")')
    assert "(RMSNorm)" in page.inner_text("#head-caption") and page.locator("#head tbody tr").count() == 10
    assert page.locator("#lens tbody tr").count() == 2  # the logit lens after each of the 2 blocks
    with page.expect_response("**/api/why") as answer:
        page.locator(".why-candidate").nth(1).click()
    assert answer.value.ok
    settled(page)
    assert page.locator(".why-cell").count() == 2 * (4 + 1)  # 2 blocks x (4 query heads + the feed-forward)
    assert "logit[" in page.inner_text("#why-headline")
    assert page.locator(".why-col").first.get_attribute("title") == "query head 0 reads key/value group 0"
    page.locator(".why-source-token").nth(2).click()  # the prompt's third token: what it did
    page.wait_for_selector('.why-source-token.chosen[data-position="2"]')
    assert "direct share" in page.inner_text("#why-source")
    with page.expect_response("**/api/append") as answer:
        page.click("#append")
    assert answer.value.ok
    page.wait_for_selector('#token-count[data-count="23"]')
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-e2e-qwen3.png"), full_page=True)
    context.close()
    assert all(url.startswith(family_url) for url in requests if not url.startswith(("data:", "blob:"))), requests
    assert not [m for m in console if m.startswith(("error", "pageerror"))], console
