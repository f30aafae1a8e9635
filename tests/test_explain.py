"""explain: the traced shapes follow the config, the two transitions are marked, and the
embedding is exactly a one-hot matmul -- all measured on live models."""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import glassgpt
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import GlassError, NonFiniteError, PromptError
from glassgpt.errors import TraceCancelled
from glassgpt.explain import About, TraceOptions, check_embedding_is_linear, trace
from glassgpt.explain.views.diagram import attention_figure, layout, save_attention_png, save_png, to_svg
from glassgpt.explain.views.draw import Text
from glassgpt.formats import random_model

PROMPT = "Every effort moves you"  # 4 GPT-2 tokens
STABLE = ["tokens", "tok_emb", "pos_emb", "embeddings", "final_norm", "out_head", "last_logits", "probs", "next_token"]


@pytest.fixture(scope="module")
def gpt2():
    return glassgpt.load_model("gpt2"), glassgpt.get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def gpt2_trace(gpt2):
    model, tok = gpt2
    return trace(model, tok, PROMPT, options=TraceOptions(logit_lens=True, attention=True), about=About(name="gpt2", random_weights=True))


@pytest.fixture(scope="module")
def small():
    text = "the quick brown fox jumps over the lazy dog"
    tok = glassgpt.get_tokenizer("char", text=text)
    cfg = GPTConfig(vocab_size=tok.n_vocab, context_length=16, emb_dim=24, n_heads=3, n_layers=2)
    return random_model(cfg, torch.device("cpu"), torch.float32, seed=1), tok


def shapes(tr) -> dict[str, list[int]]:
    return {s.name: s.shape for s in tr.stages}


def test_gpt2_trace_has_the_shapes_of_the_book(gpt2_trace):
    s = shapes(gpt2_trace)
    assert s["tokens"] == [1, 4]
    assert s["tok_emb"] == [1, 4, 768]
    assert s["pos_emb"] == [4, 768]
    assert s["embeddings"] == [1, 4, 768]
    for i in range(12):
        assert s[f"trf_blocks.{i}"] == [1, 4, 768]
    assert s["trf_blocks.0.att.heads"] == [1, 12, 4, 64]
    assert s["trf_blocks.0.att.attn_weights"] == [1, 12, 4, 4]
    assert s["trf_blocks.0.ff.layers.0"] == [1, 4, 3072]
    assert s["final_norm"] == [1, 4, 768]
    assert s["out_head"] == [1, 4, 50257]
    assert s["last_logits"] == [1, 50257]
    assert s["probs"] == [1, 50257]
    assert [st.name for st in gpt2_trace.stages if st.parent is None] == (
        STABLE[:4] + [f"trf_blocks.{i}" for i in range(12)] + STABLE[4:])


def test_small_config_trace_follows_the_config_not_constants(small):
    model, tok = small
    tr = trace(model, tok, "the fox")  # 7 characters
    s = shapes(tr)
    V = tok.n_vocab
    assert s["tokens"] == [1, 7]
    assert s["tok_emb"] == [1, 7, 24]
    assert s["trf_blocks.1"] == [1, 7, 24]
    assert s["trf_blocks.0.att.heads"] == [1, 3, 7, 8]
    assert s["trf_blocks.0.att.attn_weights"] == [1, 3, 7, 7]
    assert s["trf_blocks.0.ff.layers.0"] == [1, 7, 96]
    assert s["out_head"] == [1, 7, V]
    assert tr.stage("tok_emb").weight_shape == [V, 24]


def test_the_two_transitions_are_marked_with_their_weights(gpt2_trace):
    emb, head = gpt2_trace.stage("tok_emb"), gpt2_trace.stage("out_head")
    assert emb.transition == "vocab->hidden" and head.transition == "hidden->vocab"
    assert emb.weight_shape == head.weight_shape == [50257, 768]
    assert emb.params == 50257 * 768
    assert head.shared_with == "tok_emb.weight"
    others = [s.name for s in gpt2_trace.stages if s.transition and s.name not in ("tok_emb", "out_head")]
    assert others == []


def test_parameter_totals_tied_and_untied(gpt2_trace):
    assert gpt2_trace.params == {"total": 124_439_808, "total_untied": 163_037_184, "tied": True}
    cfg = dataclasses.replace(glassgpt.PRESETS["gpt2"], tie_embeddings=False, n_layers=1)
    model = random_model(cfg, torch.device("cpu"), torch.float32)
    tr = trace(model, glassgpt.get_tokenizer("gpt2"), PROMPT, options=TraceOptions(embedding_check=False))
    assert tr.params["tied"] is False and tr.stage("out_head").shared_with is None
    assert tr.params["total"] == tr.params["total_untied"] == model.num_parameters()


def test_embedding_equals_one_hot_matmul_exactly(gpt2):
    model, tok = gpt2
    ids = torch.tensor([tok.encode(PROMPT)])
    W = model.tok_emb.weight
    assert torch.equal(model.tok_emb(ids), F.one_hot(ids, 50257).float() @ W)
    check = check_embedding_is_linear(model, ids, repeats=1)
    assert check["equal_one_hot_matmul"] and check["equal_linear"] and check["max_abs_diff"] == 0.0
    assert check["one_hot_bytes"] == 4 * 50257 * 4 and check["lookup_bytes"] == 4 * 768 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_equals_one_hot_matmul_in_each_dtype(small, dtype):
    model, tok = small
    model = random_model(model.cfg, torch.device("cpu"), dtype, seed=3)
    check = check_embedding_is_linear(model, torch.tensor([tok.encode("lazy dog")]), repeats=1)
    assert check["equal_one_hot_matmul"] and check["equal_linear"]


def test_attention_weights_match_transformers(hf_tiny):
    """The recomputed attention weights equal HF's eager `output_attentions` (tolerance 1e-5)."""
    from transformers import GPT2LMHeadModel

    _, path = hf_tiny
    hf = GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager").eval()
    model = glassgpt.load_model(path)
    tok = glassgpt.get_tokenizer("gpt2")
    ids = [i % model.cfg.vocab_size for i in tok.encode("It had always been his fate")]
    tr = trace(model, tok, ids=ids, options=TraceOptions(attention=True, embedding_check=False))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_attentions=True).attentions
    for layer, expected in enumerate(ref):
        torch.testing.assert_close(torch.tensor(tr.attention["layers"][layer]), expected[0], atol=1e-5, rtol=1e-5)


def test_attention_rows_are_causal_and_sum_to_one(gpt2_trace):
    weights = torch.tensor(gpt2_trace.attention["layers"][3])  # [h, t, t]
    torch.testing.assert_close(weights.sum(-1), torch.ones(12, 4))
    assert torch.all(weights.triu(diagonal=1) == 0)


def test_logit_lens_last_layer_is_the_prediction(gpt2_trace):
    lens = gpt2_trace.logit_lens["layers"]
    assert len(lens) == 12 and all(len(layer["top"]) == 4 for layer in lens)
    assert lens[-1]["top"][-1]["id"] == gpt2_trace.next_token["id"]


def test_next_token_is_the_greedy_choice_of_the_model(gpt2, gpt2_trace):
    model, tok = gpt2
    ids = glassgpt.generate(model, tok.encode(PROMPT), max_new_tokens=1)
    assert int(ids[0, -1]) == gpt2_trace.next_token["id"]
    probs = [c["prob"] for c in gpt2_trace.next_token["top"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1


def test_trace_by_ids_equals_trace_by_text(small):
    model, tok = small
    a = trace(model, tok, "quick", options=TraceOptions(embedding_check=False))
    b = trace(model, tok, ids=tok.encode("quick"), options=TraceOptions(embedding_check=False))
    assert a.prompt == b.prompt and a.next_token == b.next_token


def test_classifier_head_is_hidden_to_classes(small):
    model, tok = small
    cfg = dataclasses.replace(model.cfg, num_classes=3, tie_embeddings=False)
    clf = random_model(cfg, torch.device("cpu"), torch.float32)
    tr = trace(clf, tok, "lazy", options=TraceOptions(embedding_check=False, logit_lens=True), about=About(labels=["neg", "neu", "pos"]))
    head = tr.stage("out_head")
    assert head.transition == "hidden->classes" and head.weight_shape == [3, 24] and head.shape == [1, 4, 3]
    assert tr.stage("label").shape == [1] and tr.next_token["text"] in ("neg", "neu", "pos")
    assert "hidden->classes" in tr.to_text()
    assert {cell["text"] for layer in tr.logit_lens["layers"] for cell in layer["top"]} <= {"neg", "neu", "pos"}


def test_prompt_errors(small):
    model, tok = small
    with pytest.raises(PromptError, match="empty"):
        trace(model, tok, "")
    with pytest.raises(PromptError, match="block 5"):
        trace(model, tok, "fox", options=TraceOptions(block=5))
    with pytest.raises(PromptError, match="token id 99 is out of range"):
        trace(model, tok, ids=[1, 99])


def test_a_prompt_over_the_context_keeps_its_last_tokens_and_says_so(small):
    model, tok = small
    text = "the quick brown fox jumps"  # 25 characters, context_length 16
    tr = trace(model, tok, text, options=TraceOptions(embedding_check=False))
    assert [t["id"] for t in tr.tokens] == tok.encode(text)[-16:] and tr.prompt == text[-16:]
    assert tr.notes == ["the prompt is 25 tokens, more than the 16 the model reads at once (its context_length): "
                        "it saw the last 16 (tokens 9..24)"]
    assert f"note: {tr.notes[0]}" in tr.to_text()
    assert any(tr.notes[0] in t.text for t in layout(tr).keyed("title"))


def test_json_has_the_documented_fields(gpt2_trace):
    d = json.loads(json.dumps(gpt2_trace.to_dict()))
    assert set(d) >= {"model", "tokens", "stages", "params", "next_token"}
    assert d["tokens"][1] == {"id": 3626, "text": " effort"}
    for stage in d["stages"]:
        assert {"name", "module", "shape", "dtype"} <= set(stage)
    tok_emb = next(s for s in d["stages"] if s["name"] == "tok_emb")
    assert tok_emb["weight_shape"] == [50257, 768] and tok_emb["params"] == 38_597_376
    assert {"id", "text", "prob"} == set(d["next_token"]["top"][0])


def test_text_view_answers_the_four_questions(gpt2_trace):
    text = gpt2_trace.to_text()
    for needle in ("vocab->hidden", "hidden->vocab", "[1, 4] -> [1, 4, 768]", "[1, 4, 768] -> logits [1, 4, 50257]",
                   "124,439,808", "163,037,184", "exactly equal", "RANDOM WEIGHTS", "the four questions"):
        assert needle in text


def test_svg_parses_and_shows_the_live_shapes(gpt2_trace):
    svg = to_svg(gpt2_trace)
    root = ET.fromstring(svg)
    texts = " ".join(el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}text"))
    for needle in ("tok_emb.weight", "out_head.weight", "[50257, 768]", "[1, 4, 768]", "[1, 4, 50257]", "tied"):
        assert needle in texts


def test_png_opens_with_its_expected_size(gpt2_trace, tmp_path):
    from PIL import Image

    path = tmp_path / "flow.png"
    w, h = save_png(gpt2_trace, str(path), scale=1.0)
    with Image.open(path) as img:
        assert img.size == (w, h) and w == 1040
    heat = tmp_path / "att.png"
    w, h = save_attention_png(gpt2_trace, 2, str(heat))
    with open(heat, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (w, h)
    with pytest.raises(GlassError, match="layer 12"):
        save_attention_png(gpt2_trace, 12, str(heat))


def test_cli_explain_default_prompt_text(capsys):
    assert main(["explain", "--model", "gpt2", "--color", "never"]) == 0
    out, err = capsys.readouterr()
    assert "vocab->hidden" in out and "hidden->vocab" in out and "random weights" in err


def test_cli_explain_json_and_embedding_section(capsys, tmp_path):
    assert main(["explain", "Hello world", "--format", "json", "--top-k", "3"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [t["text"] for t in d["tokens"]] == ["Hello", " world"] and len(d["next_token"]["top"]) == 3
    assert main(["explain", "Hello world", "--embedding-vs-linear", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["equal_one_hot_matmul"] is True


def test_cli_explain_bad_input_is_one_line(capsys):
    assert main(["explain", "", "--model", "gpt2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "empty" in err[-1]
    assert main(["explain", "hi", "--block", "12"]) == 2
    assert "choose 0..11" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "hi", "--format", "gif"])
    assert exit_info.value.code == 2


# --- traces side by side, cancelled, with progress ------------------------------------------

def test_two_traces_of_one_model_run_side_by_side_and_record_their_own_tensors(small):
    model, tok = small
    prompts = ["the quick brown", "lazy dog"]
    want = [trace(model, tok, p, options=TraceOptions(attention=True, logit_lens=True, embedding_check=False)).to_dict() for p in prompts]
    barrier = threading.Barrier(2, timeout=30)

    def meet(*args) -> None:  # block 0 lets a forward pass on only when the other one is inside it too
        barrier.wait()

    hook = model.trf_blocks[0].register_forward_hook(meet)
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: trace(model, tok, p, options=TraceOptions(attention=True, logit_lens=True, embedding_check=False)).to_dict(), prompts))
    finally:
        hook.remove()
    assert got == want


def test_the_model_is_tapped_once_however_many_traces(small):
    from glassgpt.explain.record import _Tap, _tap_points

    model, tok = small
    untapped = random_model(model.cfg, torch.device("cpu"), torch.float32, seed=1)
    untapped.load_state_dict(model.state_dict())
    for _ in range(3):
        trace(model, tok, "fox", options=TraceOptions(embedding_check=False))
    points = {id(module) for module, _ in _tap_points(model)}
    for module in model.modules():
        taps = sum(isinstance(h, _Tap) for h in module._forward_hooks.values())
        assert taps == (1 if id(module) in points else 0), module
    assert not any(m._forward_hooks for m in untapped.modules())
    with torch.inference_mode():  # outside a trace the taps record nothing and change nothing
        ids = torch.tensor([tok.encode("lazy dog")])
        torch.testing.assert_close(model(ids), untapped(ids), rtol=0, atol=0)


def test_progress_counts_every_block_lens_layer_and_check(small):
    model, tok = small
    reports = []
    trace(model, tok, "fox", progress=lambda *report: reports.append(report), options=TraceOptions(logit_lens=True))
    n = model.cfg.n_layers
    names = [f"trf_blocks.{i}" for i in range(n)] + [f"logit_lens.{i}" for i in range(n)] + ["embedding_check"]
    assert reports == [(name, k + 1, 2 * n + 1) for k, name in enumerate(names)]


def test_a_cancelled_trace_stops_at_the_next_module(small):
    model, tok = small
    cancel = threading.Event()
    reached = []

    def progress(step: str, done: int, total: int) -> None:
        reached.append(step)
        cancel.set()  # as the web server does when the client leaves

    with pytest.raises(TraceCancelled):
        trace(model, tok, "fox", cancel=cancel, progress=progress, options=TraceOptions(logit_lens=True))
    assert reached == ["trf_blocks.0"]  # trf_blocks.1 never ran to its end
    assert trace(model, tok, "fox", options=TraceOptions(embedding_check=False)).stage("tokens").shape == [1, 3]  # the model carries on


def test_logit_lens_probability_is_the_softmax_of_the_top_token(gpt2, gpt2_trace):
    model, tok = gpt2
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        x = model.drop_emb(model.tok_emb(ids) + model.pos_emb(torch.arange(ids.shape[1])))
        for layer, block in zip(gpt2_trace.logit_lens["layers"], model.trf_blocks):
            x = block(x)
            probs = model.out_head(model.final_norm(x))[0].softmax(-1)  # [t, V]
            assert [cell["id"] for cell in layer["top"]] == probs.argmax(-1).tolist()
            torch.testing.assert_close(torch.tensor([cell["prob"] for cell in layer["top"]]), probs.max(-1).values,
                                       rtol=1e-5, atol=0)


# --- temperatures and broken weights ----------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_temperature_whose_division_overflows_is_refused(small, temperature):
    model, tok = small
    with pytest.raises(PromptError, match="temperature .* too small"):
        trace(model, tok, "fox", options=TraceOptions(temperature=temperature))


def test_a_tiny_temperature_that_fits_is_greedy(small):
    model, tok = small
    tr = trace(model, tok, "fox", options=TraceOptions(temperature=1e-20, embedding_check=False))
    assert tr.next_token["prob"] == 1.0  # float32 softmax of scores 1e20 apart


def test_non_finite_weights_are_one_clear_error(small):
    model, tok = small
    broken = random_model(model.cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        broken.final_norm.scale.fill_(float("nan"))  # as a diverged training run would save it
    with pytest.raises(NonFiniteError, match="weights cannot compute: final_norm.scale holds 24 NaN of its 24 values"):
        trace(broken, tok, "fox")


def test_cli_explain_refuses_an_overflowing_temperature_in_one_line(capsys, tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2,
                                           n_layers=1).to_dict()))
    assert main(["explain", "hi", "--model", str(config), "--temperature", "1e-40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: temperature 1e-40 is too small") and "Traceback" not in "".join(err)


# --- the embedding check's cost ---------------------------------------------------------------

def test_embedding_check_without_timing_builds_one_one_hot(small, monkeypatch):
    model, tok = small
    calls = []
    real = F.one_hot
    monkeypatch.setattr(F, "one_hot", lambda *a, **k: calls.append(1) or real(*a, **k))
    check = check_embedding_is_linear(model, torch.tensor([tok.encode("lazy dog")]), timing=False)
    assert calls == [1] and check["equal_one_hot_matmul"] and check["equal_linear"]
    assert "matmul_ms" not in check and "lookup_ms" not in check


def test_a_slow_one_hot_matmul_is_timed_once(small, monkeypatch):
    model, tok = small
    calls = []
    real = F.one_hot
    monkeypatch.setattr(F, "one_hot", lambda *a, **k: calls.append(1) or real(*a, **k))
    check = check_embedding_is_linear(model, torch.tensor([tok.encode("lazy dog")]), repeats=5, budget_ms=0.0)
    assert len(calls) == 2 and check["matmul_ms"] >= 0  # the check itself, then one timed run


# --- a classifier speaks of its class ---------------------------------------------------------

def test_a_classifier_trace_speaks_of_the_class_not_the_next_token(small):
    model, tok = small
    cfg = dataclasses.replace(model.cfg, num_classes=2, tie_embeddings=False)
    clf = random_model(cfg, torch.device("cpu"), torch.float32)
    tr = trace(clf, tok, "lazy", about=About(labels=["ham", "spam"]))
    text = tr.to_text()
    notes = " ".join(s.note for s in tr.stages)
    svg_text = " ".join(t.text for t in layout(tr).items if isinstance(t, Text))
    for words in (text, notes, svg_text):
        assert "next token" not in words and "what comes next" not in words
    assert "class" in tr.stage("last_logits").note
    assert "give the class" in text.split("the four questions")[1]
    assert "argmax(probs)" in svg_text


# --- --attention, --layer, --block ------------------------------------------------------------

def test_cli_attention_text_shows_each_heads_strongest_link(gpt2, capsys, tmp_path):
    heat = tmp_path / "att.png"
    assert main(["explain", PROMPT, "--model", "gpt2", "--attention", "--layer", "3", "--block", "1",
                 "--attention-out", str(heat), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert heat.stat().st_size > 1000 and str(heat) in out
    assert "--layer 3" in out and "--block 1" in out  # says which is which
    model, tok = gpt2  # the same seeded preset the CLI loaded
    tr = trace(model, tok, PROMPT, options=TraceOptions(attention=True, embedding_check=False))
    weights = torch.tensor(tr.attention["layers"][3])  # [h, t, t]
    tokens = [repr(t["text"]) for t in tr.tokens]
    rows = [line for line in out.splitlines() if line.strip().startswith("head ")]
    assert len(rows) == 12
    for h, line in enumerate(rows):
        best = weights[h].max(-1)  # per query token: the weight and the key it goes to
        cells = [f"{tokens[k]} {w:.2f}" for w, k in zip(best.values.tolist(), best.indices.tolist())]
        assert line.split()[:2] == ["head", str(h)] and all(cell in line for cell in cells), (line, cells)


@pytest.mark.parametrize("flags, words", [(["--block", "12"], "--block 12"),
                                          (["--attention", "--layer", "12"], "--layer 12")])
def test_bad_layer_or_block_is_refused_before_the_model_loads(capsys, monkeypatch, flags, words):
    import glassgpt.cli.explain as cli_explain

    def no_load(args):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli_explain, "load", no_load)
    assert main(["explain", "hi", "--model", "gpt2", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "choose 0..11" in err


def test_heatmap_has_a_colour_bar_and_the_random_weights_note(gpt2_trace):
    fig = attention_figure(gpt2_trace, 2)
    assert len(fig.axes) == 12 + 1  # a heatmap per head, and the colour bar
    assert "random weights" in fig._suptitle.get_text()


# --- the picture answers the four questions on its own ----------------------------------------

def texts_of(tr) -> str:
    return " ".join(item.text for item in layout(tr).items if isinstance(item, Text))


def test_picture_shows_the_one_hot_view_tying_and_how_the_id_is_picked(gpt2_trace):
    words = texts_of(gpt2_trace)
    assert "one_hot [1, 4, 50257] @ W [50257, 768] = [1, 4, 768]" in words
    assert "the same numbers as the lookup" in words  # from the trace's own embedding check
    assert "tok_emb.weight" in words and "out_head.weight" in words and "the same tensor (tied)" in words
    assert "argmax(probs)" in words and "sampling" in words
    assert "random weights: these probabilities are noise" in words


def test_picture_bars_are_scaled_to_probability_one(gpt2_trace, small):
    """A bar's length is probability x the length of p = 1 (the dashed scale), never scaled to the largest bar."""
    model, tok = small
    clf = random_model(dataclasses.replace(model.cfg, num_classes=2, tie_embeddings=False), torch.device("cpu"),
                       torch.float32)
    for tr in (gpt2_trace, trace(clf, tok, "lazy", options=TraceOptions(embedding_check=False))):
        d = layout(tr)
        scale = d.keyed("bar_scale")[0].points[0][0]
        bars = d.keyed("bar:")
        assert len(bars) == min(5, len(tr.next_token["top"]))
        for bar, cand in zip(bars, tr.next_token["top"]):
            assert bar.w == pytest.approx(max(2.0, (scale - bar.x) * cand["prob"]), rel=1e-9)
    # Random GPT-2: every top probability is about 2e-4, so no bar grows past its 2-pixel minimum.
    assert all(bar.w == 2.0 for bar in layout(gpt2_trace).keyed("bar:"))


def test_svg_of_every_control_character_parses(small):
    model, tok = small
    text = "".join(chr(c) for c in range(32))
    tok = glassgpt.get_tokenizer("char", text=text + "abc")
    cfg = GPTConfig(vocab_size=tok.n_vocab, context_length=64, emb_dim=8, n_heads=2, n_layers=1)
    tr = trace(random_model(cfg, torch.device("cpu"), torch.float32), tok, "a" + text + "b",
               about=About("name\x01with\x02controls"))
    root = ET.fromstring(to_svg(tr))  # raises ParseError on a character that XML forbids
    shown = " ".join(el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "\\x00" in shown and "\\x1f" in shown


def test_png_takes_dollar_signs_as_text(small):
    """A prompt like "$x$" must be drawn as its three characters, not as an italic x (mathtext)."""
    from matplotlib.figure import Figure

    prompt = "a $x$ b"
    tok = glassgpt.get_tokenizer("char", text=prompt)
    cfg = GPTConfig(vocab_size=tok.n_vocab, context_length=32, emb_dim=8, n_heads=2, n_layers=1)
    tr = trace(random_model(cfg, torch.device("cpu"), torch.float32), tok, prompt,
               options=TraceOptions(attention=True))

    def widths(fig, text: str) -> list[float]:
        renderer = fig.canvas.get_renderer()
        return [t.get_window_extent(renderer).width for t in fig.findobj(matplotlib.text.Text) if t.get_text() == text]

    import matplotlib.text
    from glassgpt.explain.views import draw
    flow = draw.figure(layout(tr), scale=1.0)
    plain = Figure(dpi=100)
    plain.canvas = type(flow.canvas)(plain)
    plain.text(0, 0, "“a $x$ b”", fontsize=14 * 0.72, parse_math=False)
    assert widths(flow, "“a $x$ b”") == pytest.approx(widths(plain, "“a $x$ b”"), rel=1e-6)
    heat = attention_figure(tr, 0)
    heat.canvas.draw()
    ticks = [t for t in heat.axes[0].get_xticklabels() if t.get_text() == "$"]
    assert ticks and all(not t.get_parse_math() for t in ticks)
    assert [t.get_text() for t in heat.axes[0].get_xticklabels()] == ["a", " ", "$", "x", "$", " ", "b"]


# --- the head as a dot product ----------------------------------------------------------------

def book_small(tie: bool = False, seed: int = 0):
    """A small model of the book's layout (no qkv biases, untied), or tied."""
    cfg = GPTConfig(vocab_size=50257, context_length=16, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=False,
                    tie_embeddings=tie)
    return random_model(cfg, torch.device("cpu"), torch.float32, seed=seed)


def last_vector_and_logits(model, ids):
    """h (final_norm's output at the last position) and out_head's logits there, computed by hand."""
    with torch.no_grad():
        x = model.drop_emb(model.tok_emb(ids) + model.pos_emb(torch.arange(ids.shape[1])))
        for block in model.trf_blocks:
            x = block(x)
        h = model.final_norm(x)[0, -1]
        return h, model(ids)[0, -1]


@pytest.mark.parametrize("tie", [True, False])
def test_the_dot_products_equal_out_heads_logits(tie):
    model, tok = book_small(tie), glassgpt.get_tokenizer("gpt2")
    tr = trace(model, tok, PROMPT, options=TraceOptions(top_k=10, embedding_check=False))
    h, logits = last_vector_and_logits(model, torch.tensor([tok.encode(PROMPT)]))
    head = tr.head
    assert head["max_abs_diff"] <= 1e-5
    assert head["h_norm"] == pytest.approx(float(h.norm()), rel=1e-6)
    assert [r["id"] for r in head["rows"]] == [t["id"] for t in tr.next_token["top"]]
    W = model.out_head.weight.detach()
    for row in head["rows"]:
        assert row["dot"] == pytest.approx(float(h @ W[row["id"]]), abs=1e-5)
        assert row["logit"] == pytest.approx(float(logits[row["id"]]), abs=1e-5)
        assert abs(row["dot"] + row["bias"] - row["logit"]) <= 1e-5
        assert row["w_norm"] == pytest.approx(float(W[row["id"]].norm()), rel=1e-6)
        assert row["cos"] == pytest.approx(float(F.cosine_similarity(h, W[row["id"]], dim=0)), abs=1e-6)
    cos = F.cosine_similarity(W, h[None], dim=1)
    assert [t["id"] for t in head["nearest"]] == cos.topk(5).indices.tolist()
    if not tie:
        e = model.tok_emb.weight.detach()[head["rows"][0]["id"]]
        assert head["rows"][0]["cos_emb_head"] == pytest.approx(
            float(F.cosine_similarity(e, W[head["rows"][0]["id"]], dim=0)), abs=1e-6)


def test_tied_rows_share_storage_and_untied_rows_do_not():
    tok = glassgpt.get_tokenizer("gpt2")
    tied, untied = book_small(tie=True), book_small(tie=False)
    assert tied.out_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    for model, shared in ((tied, True), (untied, False)):
        head = trace(model, tok, PROMPT, options=TraceOptions(embedding_check=False)).head
        assert head["tied"] is shared and head["shares_storage"] is shared
        assert ("cos_emb_head" in head["rows"][0]) is not shared
    ranks = trace(tied, tok, PROMPT, options=TraceOptions(embedding_check=False)).head["prompt_ranks"]
    _, logits = last_vector_and_logits(tied, torch.tensor([tok.encode(PROMPT)]))
    for r in ranks:
        assert r["rank"] == int((logits > logits[r["id"]]).sum()) + 1


@pytest.mark.parametrize("tie", [True, False])
def test_a_token_whose_row_is_h_ranks_first_by_both_measures(tie):
    """Build the head so that row j points exactly where h points: j must win the logits and the cosines."""
    model, tok = book_small(tie, seed=3), glassgpt.get_tokenizer("gpt2")
    ids = tok.encode(PROMPT)
    j = 1000  # not in the prompt, so a tied row changes no input embedding
    assert j not in ids
    h, _ = last_vector_and_logits(model, torch.tensor([ids]))
    with torch.no_grad():
        model.out_head.weight[j] = h  # tied: this is tok_emb.weight[j] too
    tr = trace(model, tok, ids=ids, options=TraceOptions(embedding_check=False))
    assert tr.next_token["id"] == j and tr.head["rows"][0]["id"] == j
    assert tr.head["nearest"][0]["id"] == j and tr.head["nearest"][0]["cos"] == pytest.approx(1.0, abs=1e-5)
    assert tr.head["rows"][0]["logit"] == pytest.approx(float(h @ h), rel=1e-5)


def test_every_view_shows_the_dot_products(gpt2_trace):
    text = gpt2_trace.to_text()
    assert "logit[id] = h · W[id]" in text and "nearest to h by cosine" in text and "one storage" in text
    row = gpt2_trace.head["rows"][0]
    assert f"{row['logit']:>9.3f} = {row['dot']:>9.3f}" in text
    d = json.loads(json.dumps(gpt2_trace.to_dict()))
    assert d["head"]["rows"][0]["id"] == gpt2_trace.next_token["id"] and d["head"]["tied"] is True
    picture = texts_of(gpt2_trace)
    assert "logit[id] = h · W[id]" in picture and "tied: W is tok_emb.weight" in picture  # head.tying_note, as in the text
    assert len(layout(gpt2_trace).keyed("dot_row")) == 3


# --- which model, which layout, which initialisation ------------------------------------------

def test_the_picture_and_the_text_say_which_layout():
    tok = glassgpt.get_tokenizer("gpt2")
    book = trace(book_small(tie=False), tok, PROMPT, options=TraceOptions(embedding_check=False))
    openai = trace(random_model(dataclasses.replace(glassgpt.PRESETS["gpt2"], n_layers=1), torch.device("cpu"),
                                torch.float32), tok, PROMPT, options=TraceOptions(embedding_check=False))
    assert "the book's layout" in texts_of(book) and "no qkv biases, its own out_head" in texts_of(book)
    assert "OpenAI's GPT-2 layout: qkv biases" in texts_of(openai)
    assert "OpenAI's GPT-2 layout" in openai.to_text() and "the book's GPT_CONFIG_124M layout" in book.to_text()


@pytest.mark.parametrize("spec, scheme", [("gpt2-book", "pytorch-default"), ("gpt2", "gpt2")])
def test_explain_says_which_initialisation_a_random_model_has(capsys, monkeypatch, spec, scheme):
    from glassgpt.model import INIT_SCHEMES

    small = dataclasses.replace(glassgpt.PRESETS[spec], n_layers=1, context_length=16)
    monkeypatch.setitem(glassgpt.PRESETS, spec, small)
    assert main(["explain", "--model", spec, "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert f"initialisation: {INIT_SCHEMES[scheme]}" in out
    assert sum(line.startswith("initialisation:") for line in out.splitlines()) == 1


def test_a_trained_model_has_no_initialisation_line(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2, n_layers=1)
    path = glassgpt.save_model(random_model(cfg, torch.device("cpu"), torch.float32), tmp_path / "ckpt")
    assert main(["explain", "--model", str(path), "--color", "never"]) == 0
    assert "initialisation:" not in capsys.readouterr().out


def test_explain_of_gpt2_book_seed_123_shows_the_books_chapter_4_logits(capsys):
    """The book's chapter 4: torch.manual_seed(123); model = GPTModel(GPT_CONFIG_124M); model(batch).

    The book prints that tensor with the model in training mode, so its numbers include dropout
    (drop_rate 0.1) drawn from the RNG after the initialisation; explain runs the model in eval
    mode, as inference does. So this compares with the book's own GPTModel, built the book's way
    and then put in eval mode: the last position's logits of "Every effort moves you" for
    explain's top tokens, and their probabilities (tolerance 1e-4 on logits of size ~1).
    """
    from llms_from_scratch.ch04 import GPTModel as BookGPTModel

    assert main(["explain", PROMPT, "--model", "gpt2-book", "--seed", "123", "--format", "json", "--top-k", "5"]) == 0
    got = json.loads(capsys.readouterr().out)
    torch.manual_seed(123)
    book = BookGPTModel({"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12,
                         "drop_rate": 0.1, "qkv_bias": False}).eval()
    with torch.no_grad():
        logits = book(torch.tensor([glassgpt.get_tokenizer("gpt2").encode(PROMPT)]))[0, -1]
    ids = [row["id"] for row in got["head"]["rows"]]
    assert ids == logits.topk(5).indices.tolist()
    torch.testing.assert_close(torch.tensor([row["logit"] for row in got["head"]["rows"]]), logits[ids],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([t["prob"] for t in got["next_token"]["top"]]),
                               logits.softmax(-1)[ids], atol=1e-6, rtol=1e-4)
    assert "the book's initialisation" in got["model"]["init"]


# --- the picture, measured ---------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_no_text_of_the_picture_is_cut_at_the_canvas_edge(tie):
    from glassgpt.explain.views.draw import MARGIN, text_extent

    tok = glassgpt.get_tokenizer("gpt2")
    tr = trace(book_small(tie), tok, PROMPT * 3, about=About("a-rather-long-model-name/best", random_weights=True,
                                                             init="book"))
    d = layout(tr)
    for t in d.items:
        if isinstance(t, Text):
            left, right = text_extent(t)
            assert left >= 0 and right <= d.width - MARGIN / 2, (t.text, left, right, d.width)
    label = next(t for t in d.keyed("tie_label") if "tensor" in t.text)
    assert label.text == ("the same tensor (tied)" if tie else "two separate tensors (untied)")


def test_no_text_of_the_png_leaves_the_canvas():
    """The same check on the PNG's own renderer (Agg), which measures what it draws."""
    import matplotlib.text

    from glassgpt.explain.views import draw

    tr = trace(book_small(tie=False), glassgpt.get_tokenizer("gpt2"), PROMPT)
    fig = draw.figure(layout(tr), scale=1.0)
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
    assert any(t.get_text() == "two separate tensors (untied)" for t in texts)
    for t in texts:
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (t.get_text(), box, width)


# --- a passage: where the model is surprised -----------------------------------------------------

def test_passage_gives_each_true_token_its_probability(small):
    from glassgpt.explain.passage import passage

    model, tok = small
    text = "the lazy dog"
    p = passage(model, tok, text)
    ids = tok.encode(text)
    with torch.inference_mode():
        probs = model(torch.tensor([ids]))[0].softmax(-1)  # [t, V]
    assert p.tokens[0]["prob"] is None and len(p.tokens) == len(ids)
    for i in range(1, len(ids)):
        assert p.tokens[i]["prob"] == pytest.approx(float(probs[i - 1, ids[i]]), rel=1e-5)
        assert p.tokens[i]["expected"]["id"] == int(probs[i - 1].argmax())
    want_loss = float(-torch.log(probs[torch.arange(len(ids) - 1), ids[1:]]).mean())
    assert p.loss == pytest.approx(want_loss, rel=1e-5)
    assert [p.tokens[i]["prob"] for i in p.worst] == sorted(p.tokens[i]["prob"] for i in p.worst)
    assert min(p.tokens[i]["prob"] for i in p.worst) == min(t["prob"] for t in p.tokens[1:])


def test_a_passage_longer_than_the_context_is_scored_in_overlapping_windows(small):
    """43 tokens, context 16: windows [0, 16), [8, 24), [16, 32), [24, 40), [27, 43), each scoring the
    tokens after the last window's end, so every token after the first window has 8 or more before it."""
    from glassgpt.explain.passage import passage

    model, tok = small
    text = "the quick brown fox jumps over the lazy dog"
    p = passage(model, tok, text)
    ids = tok.encode(text)
    assert len(p.tokens) == 43 and "read in 5 windows of 16 overlapping by 8" in p.notes[0]
    with torch.inference_mode():
        for pos, start in ((1, 0), (15, 0), (16, 8), (20, 8), (31, 16), (39, 24), (40, 27), (42, 27)):
            probs = model(torch.tensor([ids[start:start + 16]]))[0].softmax(-1)
            assert p.tokens[pos]["prob"] == pytest.approx(float(probs[pos - start - 1, ids[pos]]), rel=1e-5), pos


def test_a_long_passage_reports_its_progress_block_by_block_and_can_be_cancelled(small):
    """Each window is one recording: n_layers steps each, 5 windows here; a set cancel flag stops it."""
    from glassgpt.explain.passage import passage

    model, tok = small
    text = "the quick brown fox jumps over the lazy dog"
    steps = []
    passage(model, tok, text, progress=lambda step, done, total: steps.append((step, done, total)))
    n = model.cfg.n_layers
    assert [d for _, d, _ in steps] == list(range(1, 5 * n + 1)) and {t for _, _, t in steps} == {5 * n}
    assert steps[0][0] == "trf_blocks.0" and steps[-1][0] == f"trf_blocks.{n - 1}"
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TraceCancelled):
        passage(model, tok, text, cancel=cancel)


def test_the_cli_step_bar_stays_silent_off_a_terminal(capsys):
    from glassgpt.cli.progress import StepBar

    with StepBar("passage") as bar:  # pytest's stderr is no terminal: a file gets no bar lines
        for done in range(1, 11):
            bar("trf_blocks.0", done, 10)
    assert bar.bar is None and capsys.readouterr().err == ""


def test_cli_passage_text_and_picture(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2,
                                           n_layers=1).to_dict()))
    story = tmp_path / "story.txt"
    story.write_text("I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough")
    assert main(["explain", "--model", str(config), "--passage", str(story), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "positions it got most wrong" in out and "read in" in out  # 20 tokens over a context of 16
    assert main(["explain", "Every effort moves you", "--model", str(config), "--passage", "--format", "png",
                 "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


# --- two models compared -----------------------------------------------------------------------

def test_compare_a_model_with_itself_has_no_divergence_and_with_another_the_kl_of_its_distributions():
    from glassgpt.explain.compare import compare

    tok = glassgpt.get_tokenizer("gpt2")
    a, b = book_small(seed=1), book_small(seed=2)
    same = compare(a, a, tok, PROMPT)
    assert same.kl_ab == pytest.approx(0.0, abs=1e-9) and same.kl_ba == pytest.approx(0.0, abs=1e-9)
    c = compare(a, b, tok, PROMPT)
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        pa, pb = (m(ids)[0, -1].double().log_softmax(-1) for m in (a, b))
    assert c.kl_ab == pytest.approx(float((pa.exp() * (pa - pb)).sum()), rel=1e-9)
    assert c.kl_ba == pytest.approx(float((pb.exp() * (pb - pa)).sum()), rel=1e-9)
    top = c.a["top"][0]
    assert top["other_prob"] == pytest.approx(float(pb[top["id"]].exp()), rel=1e-6)
    assert len(c.a["lens_last"]) == 2 and c.b["lens_last"][-1]["id"] == c.b["next_token"]["id"]


def test_compare_runs_each_model_once():
    """The trace's one forward pass gives the next-token distribution too: no second pass for the KL."""
    from glassgpt.explain.compare import compare

    a, b = book_small(seed=1), book_small(seed=2)
    passes = []
    hooks = [m.tok_emb.register_forward_hook(lambda module, args, out, m=m: passes.append(m)) for m in (a, b)]
    try:
        compare(a, b, glassgpt.get_tokenizer("gpt2"), PROMPT)
    finally:
        for hook in hooks:
            hook.remove()
    assert passes == [a, b]


def test_cli_explain_compare_overlays_two_models(tmp_path, capsys):
    paths = []
    for seed in (1, 2):
        paths.append(str(glassgpt.save_model(book_small(seed=seed), tmp_path / f"m{seed}")))
    assert main(["explain", PROMPT, "--model", paths[0], "--compare", paths[1], "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "KL(A || B)" in out and "logit lens at the last position" in out
    assert main(["explain", PROMPT, "--model", paths[0], "--compare", paths[1], "--format", "svg"]) == 0
    root = ET.fromstring(capsys.readouterr().out)
    assert "KL(A || B)" in " ".join(el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}text"))


def test_trace_options_is_a_plain_dataclass_and_its_option_fields_are_the_flags():
    from glassgpt.explain.options import TRACE_OPTIONS, TraceOptions, add_flags
    parser = argparse.ArgumentParser()
    add_flags(parser, TRACE_OPTIONS)
    flags = vars(parser.parse_args([]))
    declared = [f.name for f in dataclasses.fields(TraceOptions) if "option" in f.metadata]
    assert declared == [o.name for o in TRACE_OPTIONS if not o.view_only]
    assert {name: flags[name] for name in declared} == {name: getattr(TraceOptions(), name) for name in declared}
    assert "timing" not in flags and "layer" in flags and not hasattr(TraceOptions(), "layer")
    assert dataclasses.replace(TraceOptions(), top_k=3).top_k == 3  # frozen, and plain: replace works
