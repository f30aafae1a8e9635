"""why: the attribution of a logit to the model's parts and the prompt's tokens is an exact sum,
equals TransformerLens's direct logit attribution and residual patching, and names the token that
decides the next one on a model built so that one does."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import glassgpt
from glassgpt.config import GPTConfig
from glassgpt.errors import PromptError
from glassgpt.explain.why import why

from conftest import make_hf_model, randomize_

PROMPT, CORRUPTED = "Every effort moves you", "Every effort moves me"
EXACT = 1e-4  # the bound: the parts sum to the true logit within this (float32 model, float64 sums)

# (qkv_bias, tie_embeddings, num_classes): OpenAI's layout, the book's, untied with biases, tied without, a classifier
KINDS = {"openai": (True, True, None), "book": (False, False, None), "untied": (True, False, None),
         "tied_no_bias": (False, True, None), "classifier": (False, False, 2)}


def small(kind: str, seed: int = 0, context_length: int = 32) -> glassgpt.GPTModel:
    qkv_bias, tie, classes = KINDS[kind]
    cfg = GPTConfig(vocab_size=50257, context_length=context_length, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=qkv_bias,
                    tie_embeddings=tie, num_classes=classes)
    model = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=seed, config=cfg)
    return randomize_(model, seed, 0.3).eval()


@pytest.fixture(scope="module")
def tok():
    return glassgpt.get_tokenizer("gpt2")


@pytest.mark.parametrize("kind", list(KINDS))
def test_parts_sum_to_the_true_logit_on_every_model_kind(kind, tok):
    model = small(kind)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(PROMPT)]))[0, -1]
    w = why(model, tok, PROMPT)
    names = [p["name"] for p in w.parts]
    assert names[:2] == ["tok_emb", "pos_emb"] and "trf_blocks.1.att.head.3" in names and "trf_blocks.0.ff" in names
    assert ("out_head.bias" in names) == (kind == "classifier")
    total = sum(p["value"] for p in w.parts)
    a = w.target["id"]
    if kind == "classifier":  # "why spam?": logit[spam] - logit[ham], against the runner-up class
        assert w.versus is not None and w.versus["id"] != a
        assert total == pytest.approx(float(logits[a] - logits[w.versus["id"]]), abs=EXACT)
    else:
        assert w.versus is None and a == int(logits.argmax())
        assert total == pytest.approx(float(logits[a]), abs=EXACT)


@pytest.mark.parametrize("kind", ["book", "nanogpt", "hf"])
def test_parts_sum_to_the_modules_own_logit_on_a_readers_module(kind, tok):
    """why() on the reader's own module, taken through adopt: the parts sum to *its* logit."""
    from readers import NanoGPT, book_model
    module = {"book": book_model, "nanogpt": lambda: randomize_(NanoGPT(), 0, 0.3),
              "hf": lambda: make_hf_model(seed=0, vocab_size=50257)}[kind]().eval()
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        out = module(torch.tensor([ids]))
    logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)[0, -1]
    w = why(module, tok, ids=ids)
    assert w.target["id"] == int(logits.argmax())
    assert sum(p["value"] for p in w.parts) == pytest.approx(float(logits[w.target["id"]]), abs=EXACT)


@pytest.mark.parametrize("kind", ["openai", "book"])
def test_why_a_and_not_b_sums_to_the_logit_difference(kind, tok):
    model = small(kind, seed=1)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(PROMPT)]))[0, -1]
    w = why(model, tok, PROMPT, versus=" me")
    me = tok.encode(" me")[0]
    assert w.versus["id"] == me
    assert sum(p["value"] for p in w.parts) == pytest.approx(float(logits[w.target["id"]] - logits[me]), abs=EXACT)


def test_each_heads_split_over_the_sources_sums_back_to_the_head(tok):
    w = why(small("openai", seed=2), tok, PROMPT)
    by_name = {p["name"]: p["value"] for p in w.parts}
    for i, layer in enumerate(w.by_source):
        for j, shares in enumerate(layer):
            assert len(shares) == 4
            assert sum(shares) == pytest.approx(by_name[f"trf_blocks.{i}.att.head.{j}"], abs=1e-5)
            assert w.heads[i][j] == by_name[f"trf_blocks.{i}.att.head.{j}"]
    direct = [s["direct"] for s in w.sources]
    assert sum(direct) == pytest.approx(sum(map(sum, w.heads)), abs=1e-5)


def deciding_model() -> glassgpt.GPTModel:
    """Uniform attention (zero queries and keys), values and out_proj the identity, no feed-forward:
    only token 5's embedding points along e0, and only out_head's row 3 reads e0. So the token that
    makes 3 the next token is 5, wherever it sits in the prompt."""
    cfg = GPTConfig(vocab_size=10, context_length=8, emb_dim=32, n_heads=4, n_layers=1, qkv_bias=False,
                    tie_embeddings=False)
    model = glassgpt.GPTModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.tok_emb.weight.copy_(torch.randn(10, 32, generator=gen) * 0.1)
        model.tok_emb.weight[5] = 0
        model.tok_emb.weight[5, 0] = 3.0
        for norm in (model.trf_blocks[0].norm1, model.trf_blocks[0].norm2, model.final_norm):
            norm.scale.fill_(1.0)
        model.trf_blocks[0].att.W_value.weight.copy_(torch.eye(32))
        model.trf_blocks[0].att.out_proj.weight.copy_(torch.eye(32))
        model.out_head.weight.copy_(torch.randn(10, 32, generator=gen) * 0.1)
        model.out_head.weight[3, 0] = 4.0
    return model


def test_the_token_that_decides_the_next_ranks_first():
    model = deciding_model()
    tok = glassgpt.get_tokenizer("char", text="abcdefghij")  # ids 0..9 are the letters a..j
    w = why(model, tok, ids=[1, 5, 2, 7])
    assert w.target["id"] == 3
    assert max(w.sources, key=lambda s: s["direct"])["position"] == 1
    assert min(w.sources, key=lambda s: s["causal"]["logit_change"])["position"] == 1
    assert min(w.sources, key=lambda s: s["causal"]["prob_change"])["position"] == 1


LONG = "Every effort moves you, and every step forward is a step closer to the end"  # 16 tokens


def removals_rerun(model, ids):
    """The causal answer the plain way: each shortened prompt run again from its first token."""
    t = len(ids)
    return model(torch.tensor([ids[:j] + ids[j + 1:] for j in range(t)]), last_only=True)[:, -1].float()  # [t, V]


@pytest.mark.parametrize("kind", ["openai", "book", "classifier"])
@pytest.mark.parametrize("context_length", [32, 128])  # 120 tokens to run: five packs, or one
def test_removals_from_the_clean_runs_keys_and_values_equal_the_plain_rerun(kind, context_length, tok):
    from glassgpt.explain.why import record_run, remove_each
    model, ids = small(kind, seed=5, context_length=context_length), tok.encode(LONG)
    with torch.inference_mode():
        seen, logits = record_run(model, ids, None)
        last = logits[0, -1].float()
        a = int(last.argmax())
        got = remove_each(model, seen, ids, last, a)
        ref = removals_rerun(model, ids)
    # float32 throughout: the same sums in another order (a pack, a batch of another shape), within 1e-5
    assert [g["logit_change"] for g in got] == pytest.approx((ref[:, a] - last[a]).tolist(), abs=1e-5)
    assert [g["prob_change"] for g in got] == pytest.approx((ref.softmax(-1)[:, a] - last.softmax(-1)[a]).tolist(),
                                                            abs=1e-5)


@pytest.mark.parametrize("context_length, passes", [(32, 5), (128, 1)])
def test_removals_feed_only_the_tokens_after_each_removed_one(context_length, passes, tok, monkeypatch):
    """16 tokens: the plain re-run feeds 16 prompts of 15 tokens (240); with the clean run's keys and values
    for the tokens before the removed one, 15 + 14 + ... + 1 = 120, packed into passes of at most
    context_length tokens (without the last token, the clean run's position 14 is the answer)."""
    why_module = importlib.import_module("glassgpt.explain.why")  # the module: glassgpt.explain.why is the function
    model, ids = small("openai", context_length=context_length), tok.encode(LONG)
    fed, twin_of = [], why_module.fused

    def counted_twin(m):  # the removals run on the fused twin: count what its tok_emb is fed
        twin = twin_of(m)
        twin.tok_emb.register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
        return twin
    monkeypatch.setattr(why_module, "fused", counted_twin)
    with torch.inference_mode():
        seen, logits = why_module.record_run(model, ids, None)
        why_module.remove_each(model, seen, ids, logits[0, -1].float(), 0)
    assert len(ids) == 16 and sum(fed) == 16 * 15 // 2 and len(fed) == passes
    assert max(fed) <= context_length


def test_patching_grid_fractions_and_their_ends(tok):
    model = small("openai", seed=3)
    w = why(model, tok, PROMPT, patch=CORRUPTED)
    grid = w.patch["grid"]
    assert w.patch["blocks"] == ["trf_blocks.0", "trf_blocks.1", "final_norm"] and len(grid[0]) == 4
    # block 0's input at the one differing position is the whole difference; final_norm reads the last position only
    assert grid[0][3] == pytest.approx(1.0, abs=1e-4) and grid[0][:3] == pytest.approx([0, 0, 0], abs=1e-5)
    assert grid[-1] == pytest.approx([0, 0, 0, 1], abs=1e-4)
    assert len(w.patch["heads"]["grid"]) == 2 and len(w.patch["heads"]["grid"][0]) == 4


def test_bad_input_is_one_line(tok):
    model = small("openai")
    with pytest.raises(PromptError, match=r"the prompt is 4 .* the corrupted prompt 5"):
        why(model, tok, PROMPT, patch="Every effort moves you too")
    with pytest.raises(PromptError, match=r"' knowable' is 2 tokens \(' know' \+ 'able'\)"):
        why(model, tok, PROMPT, versus=" knowable")
    one = why(model, tok, "Every")
    assert one.sources[0]["causal"]["how"] == "the prompt is one token: there is nothing to remove"


# --- TransformerLens, the reference -------------------------------------------------------

def tl_bridge(hf):
    """TransformerLens 4's bridge over a transformers GPT2LMHeadModel, offline. Weight processing:
    fold_ln only, which puts ln_final's scale into W_U (its direct logit attribution reads W_U and
    would otherwise leave the scale out); no centring of the writing weights or of W_U and no folding
    of the value biases into b_O, each of which moves terms between the parts glassgpt names."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    from transformer_lens.model_bridge import TransformerBridge
    import transformer_lens.model_bridge.sources.transformers  # noqa: F401  (attaches boot_transformers)
    vocab = os.path.join(os.path.dirname(glassgpt.__file__), "vocab")
    # bos_token=None: TransformerLens would otherwise rebuild the tokenizer from the hub to add a BOS
    tok = transformers.GPT2TokenizerFast(vocab_file=f"{vocab}/encoder.json", merges_file=f"{vocab}/vocab.bpe",
                                         bos_token=None)
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, tokenizer=tok)
    bridge.enable_compatibility_mode(disable_warnings=True, fold_ln=True, center_writing_weights=False,
                                     center_unembed=False, fold_value_biases=False)
    return bridge


@pytest.fixture(scope="module")
def tl_pair(tmp_path_factory):
    from glassgpt.formats import load_model
    from conftest import save_hf_model
    hf = make_hf_model(seed=4, vocab_size=50257, n_embd=32, n_head=4, n_layer=2, attn_implementation="eager")
    ours = load_model(str(save_hf_model(hf, tmp_path_factory.mktemp("hf_why"))), device="cpu", dtype="float32")
    return ours, tl_bridge(hf)


def test_direct_logit_attribution_equals_transformer_lens(tl_pair, tok):
    ours, bridge = tl_pair
    ids = torch.tensor([tok.encode(PROMPT)])
    w = why(ours, tok, PROMPT, versus=" me")
    _, cache = bridge.run_with_cache(ids)
    tokens = torch.tensor([w.target["id"]]), torch.tensor([w.versus["id"]])
    heads, _ = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True, apply_ln=False)  # [L*h, 1, d]
    # logit_attrs applies ln_final with its cached scale itself (so the stacks above are taken without it)
    theirs = cache.logit_attrs(heads, tokens=tokens[0], incorrect_tokens=tokens[1], pos_slice=-1)[:, 0]
    torch.testing.assert_close(torch.tensor(w.heads, dtype=torch.float32).flatten(), theirs.float(),
                               atol=1e-4, rtol=0)
    layers, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True, apply_ln=False,
                                           mode="mlp")  # embed, pos_embed, then each block's MLP
    mlp = cache.logit_attrs(layers, tokens=tokens[0], incorrect_tokens=tokens[1], pos_slice=-1)[:, 0]
    torch.testing.assert_close(torch.tensor(w.ff, dtype=torch.float32), mlp[2:].float(), atol=1e-4, rtol=0)
    by_name = {p["name"]: p["value"] for p in w.parts}
    assert labels[:2] == ["embed", "pos_embed"]
    assert [by_name["tok_emb"], by_name["pos_emb"]] == pytest.approx(mlp[:2].tolist(), abs=1e-4)


def test_residual_patching_equals_transformer_lens(tl_pair, tok):
    from transformer_lens import patching
    ours, bridge = tl_pair
    w = why(ours, tok, PROMPT, patch=CORRUPTED)
    clean, bad = torch.tensor([tok.encode(PROMPT)]), torch.tensor([tok.encode(CORRUPTED)])
    _, clean_cache = bridge.run_with_cache(clean)
    a, b = w.patch["clean_top"]["id"], w.patch["versus"]["id"]
    m_clean, m_bad = w.patch["m_clean"], w.patch["m_corrupted"]

    def metric(logits):
        return ((logits[0, -1, a] - logits[0, -1, b]) - m_bad) / (m_clean - m_bad)

    theirs = patching.get_act_patch_resid_pre(bridge, bad, clean_cache, metric)  # [n_layers, t]
    torch.testing.assert_close(torch.tensor(w.patch["grid"][:-1], dtype=torch.float32), theirs.float(),
                               atol=1e-4, rtol=0)
    heads = patching.get_act_patch_attn_head_out_all_pos(bridge, bad, clean_cache, metric)  # [n_layers, h]
    torch.testing.assert_close(torch.tensor(w.patch["heads"]["grid"], dtype=torch.float32), heads.float(),
                               atol=1e-4, rtol=0)


def test_explain_why_json_adds_why_to_the_trace(tmp_path, capsys):
    import json
    from glassgpt.cli import main
    path = tmp_path / "book"
    glassgpt.save_model(small("book"), path)
    assert main(["explain", PROMPT, "--model", str(path), "--why", "--patch", CORRUPTED, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    w = data["why"]
    assert data["stages"][0]["name"] == "tokens" and w["target"]["id"] == data["next_token"]["id"]
    assert w["versus"] is None and w["patch"]["blocks"][-1] == "final_norm"
    assert sum(p["value"] for p in w["parts"]) == pytest.approx(w["target"]["logit"], abs=EXACT)
    assert [s["causal"]["how"] for s in w["sources"]] == ["removed"] * 4
    assert main(["explain", PROMPT, "--model", str(path), "--versus", " the"]) == 2
    assert "--versus and --patch belong to --why" in capsys.readouterr().err
    assert main(["explain", PROMPT, "--model", str(path), "--why", "--versus", " the"]) == 0
    out = capsys.readouterr().out
    assert "logit[' the']" in out and "attention weights alone are neither" in out


def test_the_readers_item_6_fixes(tok):
    """The text logit lens shows probabilities; the attention JSON's shape is its data's; a classifier's
    head is counted with its bias (1,538 for GPT-2's width and two classes, as info counts it)."""
    from glassgpt.explain import TraceOptions, trace
    import numpy as np
    model = small("classifier")
    tr = trace(model, tok, PROMPT, options=TraceOptions(logit_lens=True, attention=True, embedding_check=False))
    assert list(np.array(tr.attention["layers"]).shape) == tr.attention["shape"] == [2, 4, 4, 4]
    text = tr.to_text()
    assert "weight [2, 32] = 64 numbers + bias [2] = 66 parameters" in text
    lens = text[text.index("logit lens"):]
    cell = tr.logit_lens["layers"][0]["top"][0]
    assert f"{cell['text'][:10]!r} " in lens and "%" in lens.splitlines()[2]


def test_the_picture_and_the_notebook_view(tok):
    from glassgpt.explain.views.draw import Text, text_extent
    from glassgpt.explain.views.why import why_layout
    w = why(small("openai", seed=5), tok, PROMPT, patch=CORRUPTED)
    d = why_layout(w)
    assert len(d.keyed("head:")) == 2 * 4 and len(d.keyed("ff:")) == 2 and len(d.keyed("source:")) == 4
    assert len(d.keyed("patch:")) == 3 * 4
    assert all(text_extent(t)[1] <= d.width for t in d.items if isinstance(t, Text))  # every label inside the canvas
    html = w._repr_html_()
    assert html.startswith("<div><svg") and "parts that move" in html and "attention weights alone" in html


def test_a_cancelled_why_stops(tok):
    import threading
    from glassgpt.errors import TraceCancelled
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TraceCancelled):
        why(small("openai"), tok, PROMPT, patch=CORRUPTED, cancel=cancel)


@pytest.mark.parametrize("stage", ["removals", "patching"])
def test_a_why_cancelled_after_its_recording_stops_in_the_reruns(stage, tok):
    """The removals and the patched runs run on a twin without taps: they check the cancel flag block by block."""
    import threading
    from glassgpt.errors import TraceCancelled
    from glassgpt.explain.why import patch_grid, record_run, remove_each
    model, ids, cancel = small("openai"), tok.encode(PROMPT), threading.Event()
    with torch.inference_mode():
        seen, logits = record_run(model, ids, cancel)
        last = logits[0, -1].float()
        cancel.set()
        with pytest.raises(TraceCancelled):
            if stage == "removals":
                remove_each(model, seen, ids, last, int(last.argmax()), cancel)
            else:
                patch_grid(model, tok, seen, ids, last, CORRUPTED, None, str, cancel)
