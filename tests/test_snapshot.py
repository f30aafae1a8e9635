"""explain.snapshot: the top-5 next tokens, the greedy continuation and the logit lens of one prompt,
as training records them at each evaluation (the web page's slider reads this format)."""

from __future__ import annotations

import json

import pytest
import torch

import glassgpt
from glassgpt.training.loop.snapshot import snapshot
from glassgpt.tokenizer import CharTokenizer

TOK = CharTokenizer("abcdefghij ")


@pytest.fixture
def model():
    cfg = glassgpt.GPTConfig(vocab_size=TOK.n_vocab, context_length=16, emb_dim=16, n_heads=2, n_layers=3)
    return glassgpt.load_model("gpt2", config=cfg, seed=0)


@torch.no_grad()
def written_out_lens(model, ids: list[int]) -> list[torch.Tensor]:
    """out_head(final_norm(h)) at the last position after each block, the forward written out by hand."""
    x = model.tok_emb(torch.tensor([ids])) + model.pos_emb(torch.arange(len(ids)))
    out = []
    for block in model.trf_blocks:
        x = block(x)
        out.append(model.out_head(model.final_norm(x))[0, -1].softmax(-1))
    return out


def test_top_is_the_softmax_of_the_last_logits_and_lens_reads_every_block(model):
    ids = TOK.encode("abc ab")
    snap = snapshot(model, TOK, ids, new_tokens=4)
    probs = model(torch.tensor([ids]))[0, -1].softmax(-1)
    top = probs.topk(5)
    assert [e["id"] for e in snap["top"]] == top.indices.tolist()
    assert [e["prob"] for e in snap["top"]] == pytest.approx(top.values.tolist(), rel=1e-6)
    assert [e["text"] for e in snap["top"]] == [TOK.decode([i]) for i in top.indices.tolist()]
    lens = written_out_lens(model, ids)
    assert [e["layer"] for e in snap["lens"]] == [0, 1, 2]
    assert [e["id"] for e in snap["lens"]] == [int(p.argmax()) for p in lens]
    assert [e["prob"] for e in snap["lens"]] == pytest.approx([float(p.max()) for p in lens], rel=1e-5)
    assert snap["lens"][-1]["id"] == snap["top"][0]["id"] and snap["lens"][-1]["prob"] == snap["top"][0]["prob"]


def test_greedy_is_the_continuation_and_the_snapshot_is_plain_json(model):
    ids = TOK.encode("abc")
    snap = snapshot(model, TOK, ids, new_tokens=6)
    assert snap["greedy"] == TOK.decode(glassgpt.generate(model, ids, 6)[0, len(ids):].tolist())
    assert snap["prompt"] == "abc" and snap["prompt_ids"] == ids
    assert json.loads(json.dumps(snap)) == snap
    assert set(snap) == {"prompt", "prompt_ids", "top", "greedy", "lens"}


def test_a_model_whose_answer_is_known_puts_it_first_with_its_probability():
    """Every weight zero but final_norm's shift v and the head's row of "j", 10 v: whatever the prompt and the
    block, final_norm gives v, so "j" wins with logit 10 |v|^2 against 0 for every other token."""
    cfg = glassgpt.GPTConfig(vocab_size=TOK.n_vocab, context_length=8, emb_dim=8, n_heads=2, n_layers=2,
                             tie_embeddings=False)
    model = glassgpt.GPTModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.final_norm.shift.copy_(torch.linspace(-1, 1, 8))
        model.out_head.weight[TOK.encode("j")[0]] = torch.linspace(-1, 1, 8) * 10
    snap = snapshot(model, TOK, TOK.encode("ab"), new_tokens=3)
    assert snap["top"][0]["text"] == "j" and snap["top"][0]["prob"] > 0.99
    assert [e["text"] for e in snap["lens"]] == ["j", "j"] and snap["greedy"] == "jjj"


def test_the_model_keeps_its_mode_and_no_hook_stays(model):
    model.train()
    snapshot(model, TOK, TOK.encode("abc"), new_tokens=2)
    assert model.training
    assert all(not m._forward_hooks for m in model.modules())
