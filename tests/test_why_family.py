"""why for Qwen3 and Llama 3.2 (explain/why.py, through their descriptions): the logit as an exact sum of parts through RMSNorm, the
prompt tokens' shares per query head, why A and not B, and activation patching, as GPT-2's why (tests/test_why.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import glassgpt
from glassgpt.errors import GlassError
from glassgpt.explain.why import FamilyWhy, attention_rows, record_parts as record_family
from glassgpt.families import build_model
from glassgpt.formats.families import export_family_hf
from glassgpt.prompt import encode
from glassgpt.tokenizer import CharTokenizer
from helpers import TINY, randomize_

TEXT = "every effort moves you"
CORRUPTED = "every effort moves yoa"  # as many tokens, the last one changed
TOK = CharTokenizer.from_text(TEXT + " abcdefghijklmnopqrstuvwxyz")
# Qwen3 tied (and QK-norm), Llama untied (and Llama 3's frequency scaling)
CONFIGS = {"qwen3": dataclasses.replace(TINY["qwen3"], tie_embeddings=True),
           "llama3": dataclasses.replace(TINY["llama3"], tie_embeddings=False)}


def model_of(family: str) -> torch.nn.Module:
    return randomize_(build_model(CONFIGS[family]))


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_parts_sum_to_the_models_logit_one_term_per_query_head(family):
    model = model_of(family)
    assert model.tied == (family == "qwen3") and (model.cfg.rope_freq is not None) == (family == "llama3")
    w = glassgpt.why(model, TOK, TEXT)
    assert isinstance(w, FamilyWhy)
    cfg = model.cfg
    with torch.no_grad():
        logits = model(torch.tensor([encode(TOK, TEXT)]), last_only=True)[0, -1]  # out_head on the last row, as why
    assert w.target["id"] == int(logits.argmax())
    assert abs(w.target["logit"] - float(logits[w.target["id"]])) == 0
    assert abs(w.total - w.target["logit"]) < 1e-5
    assert len(w.heads) == cfg.n_layers and all(len(row) == cfg.n_heads for row in w.heads)
    assert w.groups == [j // (cfg.n_heads // cfg.n_kv_groups) for j in range(cfg.n_heads)] == [0, 0, 1, 1]
    assert len(w.parts) == 1 + cfg.n_layers * (cfg.n_heads + 1)
    # another target's logit splits as exactly
    other = glassgpt.why(model, TOK, TEXT, target=3)
    assert abs(other.total - float(logits[3])) < 1e-5


def test_a_head_term_is_what_zeroing_that_heads_slice_of_out_proj_removes_at_frozen_rms():
    """The head's term is its own: zero its slice of out_proj and the attention's output loses exactly that vector."""
    model = model_of("llama3")
    w = glassgpt.why(model, TOK, TEXT)
    hd = model.cfg.head_dim_value
    seen = {}
    model.trf_blocks[1].att.register_forward_hook(lambda m, i, o: seen.__setitem__("x", o[0, -1].clone()))
    ids = torch.tensor([encode(TOK, TEXT)])
    with torch.no_grad():
        model(ids)
        before = seen["x"]
        model.trf_blocks[1].att.out_proj.weight[:, 2 * hd:3 * hd] = 0
        model(ids)
        removed = before - seen["x"]
        direction = model.out_head.weight[w.target["id"]] * model.final_norm.weight / w.rms
    assert abs(float(removed @ direction) - w.heads[1][2]) < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_logit_the_parts_sum_to_is_transformers_logit(family, tmp_path):
    from transformers import AutoModelForCausalLM
    model = model_of(family)
    export_family_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    w = glassgpt.why(model, TOK, TEXT)
    with torch.no_grad():
        out = hf(torch.tensor([encode(TOK, TEXT)]), output_attentions=True)
    assert abs(w.total - float(out.logits[0, -1, w.target["id"]])) < 1e-4
    # the last query's attention weights that split each head over the prompt (QK-norm, RoPE) are transformers' too
    with torch.inference_mode():
        rows = attention_rows(model, encode(TOK, TEXT))
        for i, block in enumerate(model.trf_blocks):
            ours = rows[i]  # [h, t]
            torch.testing.assert_close(ours.float(), out.attentions[i][0, :, -1], atol=1e-5, rtol=0)


def test_the_text_shows_the_sum_the_top_parts_and_the_heads_grid_with_groups():
    text = glassgpt.why(model_of("qwen3"), TOK, TEXT).to_text()
    assert "= sum of 11 parts" in text and "final_norm's 1/rms frozen" in text
    assert "(read key/value group 1)" in text or "(read key/value group 0)" in text
    assert "h0 g0" in text and "h3 g1" in text and "no pos_emb" in text


def test_a_target_outside_out_head_and_a_versus_of_two_tokens_are_refused_in_one_line():
    with pytest.raises(GlassError, match="target id 97 does not exist: choose 0..96"):
        glassgpt.why(model_of("qwen3"), TOK, TEXT, target=97)
    with pytest.raises(GlassError, match=r"--versus 'ab' is 2 tokens \('a' \+ 'b'\), not one"):
        glassgpt.why(model_of("qwen3"), TOK, TEXT, versus="ab")
    with pytest.raises(GlassError, match=r"--patch needs as many tokens as the prompt: the prompt is 22"):
        glassgpt.why(model_of("qwen3"), TOK, TEXT, patch="every effort")


def test_glassgpt_explain_why_prints_the_attribution_of_a_family_folder(tmp_path, monkeypatch, capsys):
    from glassgpt.cli import main
    from glassgpt.formats import families
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)  # any tokenizer serves the view
    export_family_hf(model_of("llama3"), tmp_path)
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "Llama 3.2: why" in out and "= sum of 11 parts" in out and "h3 g1" in out
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)["why"]
    assert abs(sum(p["value"] for p in data["parts"]) - data["target"]["logit"]) < 1e-5
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--versus", "e", "--patch", CORRUPTED,
                 "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)["why"]
    assert data["versus"]["text"] == "e" and data["groups"] == [0, 0, 1, 1] and data["family"] == "llama3"
    assert abs(sum(p["value"] for p in data["parts"]) - data["metric"]) < 1e-5
    assert data["patch"]["blocks"] == ["trf_blocks.0", "trf_blocks.1", "final_norm"]
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--patch", CORRUPTED, "--versus", "e"]) == 0
    out = capsys.readouterr().out
    assert "logit['e']" in out and "activation patching from 'every effort moves yoa'" in out
    assert "kv group" in out and "attention weights alone are neither" in out
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--format", "svg"]) == 0
    assert capsys.readouterr().out.startswith("<svg")


def test_the_books_own_qwen3model_is_explained_in_place_and_its_logits_are_what_the_parts_sum_to():
    from llms_from_scratch.qwen3 import Qwen3Model
    torch.manual_seed(1)
    book = Qwen3Model(CONFIGS["qwen3"].to_book_dict()).eval()
    w = glassgpt.why(book, TOK, TEXT, versus="e")
    with torch.no_grad():
        logits = book(torch.tensor([encode(TOK, TEXT)]))[0, -1]
    assert isinstance(w, FamilyWhy) and w.family == "qwen3"
    assert abs(sum(p["value"] for p in w.parts) - float(logits[w.target["id"]] - logits[w.versus["id"]])) < 1e-5


# --- which prompt tokens -----------------------------------------------------------------------------

SHARES = 1e-5  # float32 model, float64 sums: each head's split over the prompt sums back to its term within this


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_each_query_heads_shares_of_the_prompt_sum_to_its_term_and_all_to_the_attention_part(family):
    w = glassgpt.why(model_of(family), TOK, TEXT)
    t = len(TEXT)
    for i, layer in enumerate(w.by_source):
        for j, shares in enumerate(layer):
            assert len(shares) == t
            assert abs(sum(shares) - w.heads[i][j]) < SHARES
    attention_part = w.metric - w.parts[0]["value"] - sum(w.ff)  # the logit less tok_emb and the feed-forwards
    assert abs(sum(s["direct"] for s in w.sources) - attention_part) < SHARES
    heads = [p for p in w.parts if ".att.head." in p["name"]]  # each query head's part names the group it read
    assert [p["group"] for p in heads] == w.groups * model_of(family).cfg.n_layers


def deciding_model(family: str) -> torch.nn.Module:
    """Uniform attention (zero queries and keys: RoPE and QK-norm keep zeros zero), no feed-forward, and one path
    into the logits: only token 5's embedding has a first component, only value group 0's first unit reads it,
    only out_proj's first column (query head 0's) writes it back, and out_head's row 3 reads it. So token 5 makes 3
    the next token, wherever it sits in the prompt, through query head 0 (key/value group 0)."""
    cfg = dataclasses.replace(TINY[family], vocab_size=10, n_layers=1, tie_embeddings=False,
                              head_dim=8 if family == "qwen3" else None)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p))
        model.tok_emb.weight.copy_(torch.randn(10, 32, generator=gen) * 0.1)
        model.tok_emb.weight[:, 0] = 0
        model.tok_emb.weight[5] = 0
        model.tok_emb.weight[5, 0] = 3.0
        att = model.trf_blocks[0].att
        att.W_value.weight[0, 0] = 1.0
        att.out_proj.weight[0, 0] = 1.0
        model.out_head.weight.copy_(torch.randn(10, 32, generator=gen) * 0.1)
        model.out_head.weight[3, 0] = 4.0
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_token_that_decides_the_next_gets_the_largest_share_through_the_head_that_reads_it(family):
    tok = CharTokenizer.from_text("abcdefghij")  # ids 0..9 are the letters a..j
    w = glassgpt.why(deciding_model(family), tok, ids=[1, 5, 2, 7])
    assert w.target["id"] == 3
    assert max(w.sources, key=lambda s: s["direct"])["position"] == 1
    assert min(w.sources, key=lambda s: s["causal"]["logit_change"])["position"] == 1
    assert min(w.sources, key=lambda s: s["causal"]["prob_change"])["position"] == 1
    shares = torch.tensor(w.by_source[0])  # [h, t]: the share is query head 0's, at token 5's position
    assert divmod(int(shares.abs().argmax()), 4) == (0, 1) and w.groups[0] == 0
    row = next(line for line in w.to_text().splitlines() if line.startswith("     1  'f'"))  # token 5's row
    assert "b0 h0 (kv group 0)" in row


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_removals_equal_running_each_shortened_prompt_alone(family):
    model, ids = model_of(family), encode(TOK, TEXT)
    w = glassgpt.why(model, TOK, TEXT)
    a = w.target["id"]
    with torch.no_grad():
        last = model(torch.tensor([ids]))[0, -1]
        for j in (0, 7, len(ids) - 1):
            alone = model(torch.tensor([ids[:j] + ids[j + 1:]]))[0, -1]
            cause = w.sources[j]["causal"]
            assert abs(cause["logit_change"] - float(alone[a] - last[a])) < 1e-5
            assert abs(cause["prob_change"] - float(alone.softmax(-1)[a] - last.softmax(-1)[a])) < 1e-5


# --- why A and not B -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_why_a_and_not_b_sums_to_the_logit_difference(family):
    model = model_of(family)
    with torch.no_grad():
        logits = model(torch.tensor([encode(TOK, TEXT)]))[0, -1]
    w = glassgpt.why(model, TOK, TEXT, versus="e")
    a, b = w.target["id"], TOK.encode("e")[0]
    assert w.versus["id"] == b and w.contrast is None
    assert abs(sum(p["value"] for p in w.parts) - float(logits[a] - logits[b])) < 1e-5
    assert abs(w.metric - float(logits[a] - logits[b])) < 1e-6
    plain = glassgpt.why(model, TOK, TEXT)  # without versus: A against the runner-up, the same sum
    r = plain.contrast["versus"]["id"]
    assert r != a and abs(sum(p["value"] for p in plain.contrast["parts"]) - float(logits[a] - logits[r])) < 1e-5


# --- activation patching ---------------------------------------------------------------------------

def hooked_run(model, ids, module, swap) -> torch.Tensor:
    """The last position's logits of `ids`, with `swap(input)` replacing `module`'s input (a forward pre-hook)."""
    handle = module.register_forward_pre_hook(lambda m, args: (swap(args[0]), *args[1:]))
    try:
        with torch.no_grad():
            return model(torch.tensor([ids]))[0, -1]
    finally:
        handle.remove()


def clean_input(model, ids, module) -> torch.Tensor:
    seen = {}
    hooked_run(model, ids, module, lambda x: seen.setdefault("x", x.clone()))
    return seen["x"]


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_patching_gives_the_logits_of_a_rerun_with_that_activation_replaced(family):
    model = model_of(family)
    w = glassgpt.why(model, TOK, TEXT, versus="e", patch=CORRUPTED)
    patch, clean, bad = w.patch, encode(TOK, TEXT), encode(TOK, CORRUPTED)
    a, b, m_clean, m_bad = patch["clean_top"]["id"], patch["versus"]["id"], patch["m_clean"], patch["m_corrupted"]

    def restored(logits):  # what the grid holds, of a run's logits
        return (float(logits[a] - logits[b]) - m_bad) / (m_clean - m_bad)

    blocks = list(model.trf_blocks) + [model.final_norm]  # row i patches block i's input, the last final_norm's
    for i, module in enumerate(blocks):
        x_clean = clean_input(model, clean, module)  # [1, t, d]
        for p in (len(bad) - 1, 3):
            def swap(x, p=p, x_clean=x_clean):
                x = x.clone()
                x[:, p] = x_clean[:, p]
                return x
            assert abs(patch["grid"][i][p] - restored(hooked_run(model, bad, module, swap))) < 1e-5
    hd = model.cfg.head_dim_value
    for i, block in enumerate(model.trf_blocks):
        context = clean_input(model, clean, block.att.out_proj)  # [1, t, h*hd]: every head's context
        for j in range(model.cfg.n_heads):
            def swap(x, j=j, context=context):
                x = x.clone()
                x[..., j * hd:(j + 1) * hd] = context[..., j * hd:(j + 1) * hd]
                return x
            assert abs(patch["heads"]["grid"][i][j] - restored(hooked_run(model, bad, block.att.out_proj, swap))) < 1e-5
    # the ends: block 0's input at the one position that differs is the whole difference, the others nothing
    assert abs(patch["grid"][0][-1] - 1) < 1e-5 and patch["grid"][0][:-1] == [0.0] * (len(bad) - 1)
    assert abs(restored(hooked_run(model, bad, model.final_norm, lambda x: x)) - 0) < 1e-5


def test_the_picture_and_the_notebook_view_of_a_family_models_why():
    from glassgpt.explain.views.why import why_layout
    w = glassgpt.why(model_of("llama3"), TOK, TEXT, versus="e", patch=CORRUPTED)
    d = w.picture()
    assert type(d) is type(why_layout(w)) and len(d.keyed("head:")) == 2 * 4 and len(d.keyed("ff:")) == 2
    assert len(d.keyed("source:")) == len(TEXT) and len(d.keyed("patch:")) == 3 * len(TEXT)
    html = w._repr_html_()
    assert html.startswith("<div><svg") and "kv group" in html and "h3 g1" in html


def test_a_cancelled_family_why_stops_in_its_reruns():
    import threading

    from glassgpt.errors import TraceCancelled
    from glassgpt.explain.why import patch_grid_rerun as patch_grid_family, remove_each_rerun as remove_each_family
    model, ids, cancel = model_of("qwen3"), encode(TOK, TEXT), threading.Event()
    with torch.inference_mode():
        seen, last = record_family(model, ids, cancel)
        cancel.set()
        with pytest.raises(TraceCancelled):
            remove_each_family(model, seen, ids, last, int(last.argmax()), cancel)
        with pytest.raises(TraceCancelled):
            patch_grid_family(model, TOK, seen, ids, last, CORRUPTED, 4, str, cancel)
