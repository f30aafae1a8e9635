"""glassgpt.trace on a model whose positions enter inside the attention (RoPE: Qwen3, Llama 3.2) reads every
option GPT-2's trace reads: about, cancel, progress, block, embedding_check and temperature (issue 47)."""

from __future__ import annotations

import threading

import pytest
import torch

from glassgpt.errors import PromptError, TraceCancelled
from glassgpt.explain.options import TraceOptions
from glassgpt.explain.trace import trace, trace_with_logits
from glassgpt.families import build_model
from glassgpt.formats.source import About
from glassgpt.kinds import describe

from helpers import CHAR_LLAMA as LLAMA, CHAR_QWEN as QWEN, CHAR_TEXT as TEXT, CHAR_TOK as TOK


def model_of(cfg):
    torch.manual_seed(0)
    return build_model(cfg).eval()


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_a_set_cancel_event_stops_the_rotary_trace(cfg):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TraceCancelled):
        trace(model_of(cfg), TOK, TEXT, cancel=cancel)


def test_progress_reports_each_block_the_lens_and_the_embedding_check_in_order():
    model, steps = model_of(QWEN), []
    trace(model, TOK, TEXT, options=TraceOptions(logit_lens=True), progress=lambda *step: steps.append(step))
    n = model.cfg.n_layers
    assert [s[0] for s in steps[:n]] == [f"trf_blocks.{i}" for i in range(n)]
    assert steps[-1] == ("embedding_check", 2 * n + 1, 2 * n + 1)
    assert [s[1] for s in steps] == list(range(1, 2 * n + 2))


def test_the_probabilities_are_the_softmax_of_the_last_logits_over_the_temperature():
    model = model_of(QWEN)
    tr, last = trace_with_logits(model, TOK, TEXT, options=TraceOptions(temperature=0.25, top_k=3))
    expected = torch.softmax(last.float() / 0.25, dim=-1).topk(3)
    assert [t["id"] for t in tr.next_tokens] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor([t["prob"] for t in tr.next_tokens]), expected.values)
    assert tr.temperature == 0.25 and "softmax(last_logits / 0.25)" in tr.to_text()


def test_a_temperature_that_is_not_positive_is_refused_in_one_line():
    with pytest.raises(PromptError, match="temperature must be a positive number"):
        trace(model_of(QWEN), TOK, TEXT, options=TraceOptions(temperature=0.0))


def test_embedding_check_off_skips_the_one_hot_proof_and_says_so():
    tr = trace(model_of(QWEN), TOK, TEXT, options=TraceOptions(embedding_check=False))
    assert tr.answers["one_hot"] is None
    assert "not checked on this prompt (embedding_check is off)" in tr.to_text()
    assert trace(model_of(QWEN), TOK, TEXT).answers["one_hot"]["equal_one_hot_matmul"] is True


def test_the_block_option_reads_the_stages_shapes_in_that_block_and_a_missing_block_is_refused():
    model = model_of(LLAMA)
    tr = trace(model, TOK, TEXT, options=TraceOptions(block=1))
    assert tr.block == 1 and "read in trf_blocks.1 (--block 1)" in tr.to_text()
    with pytest.raises(PromptError, match="block 9 does not exist"):
        trace(model, TOK, TEXT, options=TraceOptions(block=9))


def test_about_names_the_model_and_warns_of_random_weights():
    tr = trace(model_of(QWEN), TOK, TEXT, about=About(name="my-qwen", random_weights=True, notes=("n_heads assumed",)))
    text = tr.to_text()
    assert tr.about["name"] == "my-qwen" and "model my-qwen" in text
    assert "RANDOM WEIGHTS" in text and "n_heads assumed" in text


def test_glassgpt_explain_of_a_family_folder_reads_block_and_temperature(tmp_path, monkeypatch, capsys):
    import json

    from glassgpt.cli import main
    from glassgpt.formats import families
    from glassgpt.formats.families import export_family_hf
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)
    folder = str(export_family_hf(model_of(QWEN), tmp_path / "qwen"))
    out = tmp_path / "trace.json"
    assert main(["explain", TEXT, "--model", folder, "--block", "1", "--temperature", "0.5", "--format", "json",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["block"] == 1 and data["temperature"] == 0.5
    assert data["answers"]["one_hot"]["equal_one_hot_matmul"] is True  # the third answer, always checked here


# --- every rotary model the house reads, through the same trace (issue 47: main's Gemma 3, Qwen3.5, OLMo 3
# and Tiny Aya carried from explain/family.py into trace.py) -------------------------------------------------

def _rotary_models():
    from glassgpt.families import FamilyConfig, Gemma3Config, Olmo3Config, Qwen3_5Config, TinyAyaConfig
    v, sliding, full = TOK.n_vocab, "sliding_attention", "full_attention"
    small = dict(vocab_size=v, context_length=32, emb_dim=32, n_heads=4, n_layers=4, hidden_dim=48, head_dim=8)
    aya = dict(small, n_kv_heads=2, sliding_window=4, layer_types=(sliding, sliding, full, sliding),
               rope_base=10_000.0)
    return {
        "qwen3_moe": FamilyConfig(family="qwen3", n_kv_groups=2, qk_norm=True, rope_base=1e6, num_experts=4, num_experts_per_tok=2,
                                  moe_hidden_dim=24, **small),
        "gemma3": Gemma3Config(n_kv_groups=2, rope_local_base=10_000.0, rope_base=1e6, sliding_window=4,
                               layer_types=(sliding, full, sliding, full), query_pre_attn_scalar=24, **small),
        "qwen3_5": Qwen3_5Config(family="qwen3_5", n_kv_groups=2, qk_norm=True, rope_base=1e6, linear_conv_kernel_dim=3,
                                 linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                                 linear_num_value_heads=4,
                                 layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
                                 **small),
        "olmo3": Olmo3Config(**aya),
        "tiny_aya": TinyAyaConfig(**aya),
    }


ROTARY = _rotary_models()


@pytest.mark.parametrize("kind", list(ROTARY))
def test_every_rotary_model_reads_block_lens_progress_and_temperature_through_the_one_trace(kind):
    model, steps = model_of(ROTARY[kind]), []
    n, last = model.cfg.n_layers, model.cfg.n_layers - 1  # Qwen3.5's last block is linear attention: no keys
    opt = TraceOptions(block=last, logit_lens=True, temperature=0.5, top_k=3)
    tr, logits = trace_with_logits(model, TOK, TEXT, options=opt, progress=lambda *step: steps.append(step))
    assert [s[0] for s in steps[:n]] == [block.path for block in describe(model).blocks]  # Gemma's: blocks.N
    assert [s[1] for s in steps] == list(range(1, 2 * n + 2))
    assert steps[-1] == ("embedding_check", 2 * n + 1, 2 * n + 1)
    assert tr.block == last and len(tr.logit_lens["layers"]) == n
    expected = torch.softmax(logits.float() / 0.5, dim=-1).topk(3)
    assert [t["id"] for t in tr.next_tokens] == expected.indices.tolist()
    with torch.no_grad():
        assert tr.next_token["id"] == int(model(torch.tensor([TOK.encode(TEXT)]))[0, -1].argmax())
    assert tr.answers["one_hot"]["equal_one_hot_matmul"] is True
    names = [s["name"] for s in tr.stages]
    assert names[:2] == ["ids", "tok_emb"] and names[-2:] == ["final_norm", "out_head"]
    assert ("linear attention" in names) == (kind == "qwen3_5")
    h, hd = model.cfg.n_heads, model.cfg.head_dim
    assert tr.attention["q_shape"] == [1, h, len(tr.tokens), hd]


def test_the_feed_forward_stage_says_what_the_description_says():
    notes = {kind: next(s["note"] for s in trace(model_of(cfg), TOK, TEXT).stages if s["name"] == "ff")
             for kind, cfg in ROTARY.items()}
    assert notes["qwen3_moe"].startswith("router gate: 4 expert scores; each token runs its top 2 SwiGLU experts, "
                                         "32 -> 24 -> 32")
    assert notes["gemma3"] == "GeGLU: fc3(gelu_tanh(fc1(x)) * fc2(x)), 32 -> 48 -> 32"
    assert notes["olmo3"] == "SwiGLU: fc3(silu(fc1(x)) * fc2(x)), 32 -> 48 -> 32"
    gemma_emb = next(s["note"] for s in trace(model_of(ROTARY["gemma3"]), TOK, TEXT).stages if s["name"] == "tok_emb")
    assert "times sqrt(32) = 5.66" in gemma_emb


def test_attention_weights_of_a_model_with_linear_attention_layers_are_refused_in_one_line():
    """Qwen3.5's Gated DeltaNet layers keep a state, no weights over the positions (a KeyError before)."""
    from glassgpt.errors import GlassError
    with pytest.raises(GlassError, match="layers 0, 2, 3 are linear attention .*: trace it without --attention"):
        trace(model_of(ROTARY["qwen3_5"]), TOK, TEXT, options=TraceOptions(attention=True))


@pytest.mark.parametrize("kind", ["gemma3", "olmo3", "tiny_aya"])
def test_every_rotary_models_attention_weights_come_from_its_description_and_match_its_own_attention(kind):
    """Each layer's weights by its description (its QK-norm module, RoPE or none, window, scale): the rows sum to 1,
    a sliding layer's last row sees its window, and (checked inside the trace) times the values they give the
    context the layer's own attention handed its out projection."""
    model = model_of(ROTARY[kind])
    tr = trace(model, TOK, TEXT, options=TraceOptions(attention=True))
    weights = torch.tensor(tr.attention_weights["layers"])  # [n_layers, h, t, t]
    t, windows = weights.shape[-1], [block.attention.window for block in describe(model).blocks]
    assert t > 4 and None in windows and 4 in windows
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)
    assert [int((weights[i, 0, -1] > 0).sum()) for i in range(len(windows))] == [w or t for w in windows]


def test_attention_weights_that_do_not_give_the_layers_own_context_are_refused_in_one_line():
    """A module whose attention scales its scores otherwise than its description says is named, not drawn."""
    from glassgpt.errors import GlassError
    model = model_of(ROTARY["gemma3"])
    model.blocks[1].att.scaling = 1.0  # its description says query_pre_attn_scalar ** -0.5
    with pytest.raises(GlassError, match="layer 1: the attention weights its description gives do not reproduce its "
                                         "own attention .*: trace it without --attention"):
        trace(model, TOK, TEXT, options=TraceOptions(attention=True))


def test_gpt2_and_a_rotary_model_give_one_trace_type_read_alike():
    """One result type for both paths: the same fields hold the same things (the tokens with their ids, Stage
    objects, the next token and its top_k, the one-hot proof), and `rotary` says which flow the stages are."""
    from glassgpt import GPTConfig, GPTModel
    from glassgpt.explain.trace import FamilyTrace, Stage, Trace
    torch.manual_seed(0)
    gpt2 = GPTModel(GPTConfig(vocab_size=TOK.n_vocab, context_length=32, emb_dim=32, n_heads=4, n_layers=2)).eval()
    opt = TraceOptions(top_k=3, attention=True)
    ours, theirs = trace(gpt2, TOK, TEXT, options=opt), trace(model_of(QWEN), TOK, TEXT, options=opt)
    assert FamilyTrace is Trace and type(ours) is type(theirs) is Trace
    assert (ours.rotary, ours.positions, theirs.rotary, theirs.positions) == (False, "learned", True, "rope")
    for tr in (ours, theirs):
        assert [t["id"] for t in tr.tokens] == TOK.encode(TEXT) and "".join(t["text"] for t in tr.tokens) == TEXT
        assert all(isinstance(s, Stage) for s in tr.stages) and tr.stage("tok_emb")["name"] == "tok_emb"
        assert len(tr.next_token["top"]) == 3 and tr.next_token["id"] == tr.next_tokens[0]["id"]
        assert tr.embedding_check["equal_one_hot_matmul"] is True
        assert tr.attention_weights["shape"] == [2, 4, len(TEXT), len(TEXT)]
    assert ours.attention_weights is ours.attention and theirs.attention["groups"] == [[0, 1], [2, 3]]


# --- what the text view says of positions and QK-norm follows each model's description ------------------------

def _text_of(kind, block=0):
    from glassgpt.explain.views.text import render_family_text
    return render_family_text(trace(model_of(ROTARY[kind]), TOK, TEXT, options=TraceOptions(block=block)))


def test_tiny_ayas_positions_are_its_sliding_layers_rope_and_its_full_layers_have_none():
    """Tiny Aya's sliding layers turn by RoPE and its full ones have no positions; it has no linear layers (the
    trace said Qwen3.5's "full attentions ... the linear ones" before)."""
    text = _text_of("tiny_aya")
    assert ("Inside the sliding attentions (layers 0, 1, 3; the full ones, layer 2, have no position signal: no RoPE "
            "turns their queries and keys, and only the causal mask orders what they see) the queries and keys") in text
    assert "linear" not in text and "Inside the full attentions" not in text
    full = _text_of("tiny_aya", block=2)  # the full layer's queries are not rotated
    assert "[1, 22, 32] split into 4 heads, not rotated (this layer has no RoPE)" in full
    assert "RoPE-rotated" not in full.split("the four questions")[0]
    assert "split into 4 heads, RoPE-rotated" in _text_of("tiny_aya", block=1)


def test_qwen3_5s_positions_still_name_its_full_and_linear_layers():
    assert ("Inside the full attentions (layers 1; the linear ones have no position signal: their convolution and "
            "state see the order itself)") in _text_of("qwen3_5", block=1)


def test_olmo3s_qk_norm_spans_the_whole_projection_and_qwen3s_each_head():
    olmo = _text_of("olmo3")
    assert ("QK-norm: the whole query projection (32 wide) and the whole key projection (16 wide) are each RMS-normed "
            "at once, across all heads, before the split into heads and the rotation.") in olmo
    assert "each query and key head is RMS-normed" not in olmo
    assert "QK-norm: each query and key head is RMS-normed before the rotation." in _text_of("qwen3_moe")


def test_the_opened_block_is_said_as_its_own_description_gives_it():
    """--block N said "every block's are the same" even where the blocks differ (Qwen3.5's linear and full layers,
    Tiny Aya's sliding and full)."""
    assert ("the shapes below are read in trf_blocks.2 (--block 2), a full attention, without RoPE; the blocks are "
            "not all alike") in _text_of("tiny_aya", block=2)
    assert ("the shapes below are read in trf_blocks.1 (--block 1), a sliding-window attention (4 positions), with "
            "RoPE; the blocks are not all alike") in _text_of("tiny_aya", block=1)
    linear = _text_of("qwen3_5", block=2)
    assert ("the shapes below are read in trf_blocks.2 (--block 2), a linear-attention block (no keys or values: the "
            "rows of keys and values are trf_blocks.1's); the blocks are not all alike") in linear
    assert "every block's are the same" not in linear
    assert ("the shapes below are read in trf_blocks.1 (--block 1); every block's are the same"
            in _text_of("qwen3_moe", block=1))


def test_a_mixtures_trace_names_each_tokens_experts_and_weights_as_its_router_chose_them():
    """The mixture's table named no experts: now each token's top k, with the weights its own route() gives."""
    model = model_of(ROTARY["qwen3_moe"])
    tr = trace(model, TOK, TEXT)
    ff = model.trf_blocks[0].ff
    captured = {}
    ff.register_forward_hook(lambda mod, args, out: captured.setdefault("x", args[0]))
    with torch.no_grad():
        model(torch.tensor([TOK.encode(TEXT)]))
        ids, weights = ff.route(captured["x"])  # [1, t, k]
    assert [t["experts"] for t in tr.experts["tokens"]] == ids[0].tolist()
    got = torch.tensor([t["weights"] for t in tr.experts["tokens"]])
    assert torch.allclose(got, weights[0], atol=1e-6)  # float32 softmax of the same scores
    text = tr.to_text()
    assert "the experts (trf_blocks.0.ff: each token's top 2 of 4, weighted by the softmax of their router scores)" in text
    first = tr.experts["tokens"][0]
    assert (f"  'e'              {first['weights'][0]:.3f} * expert {first['experts'][0]} + "
            f"{first['weights'][1]:.3f} * expert {first['experts'][1]}") in text
    assert trace(model_of(ROTARY["olmo3"]), TOK, TEXT).experts is None


def test_the_attention_tables_note_says_which_layers_rope_turned():
    """It said "RoPE-rotated (and QK-normed in Qwen3)" for every model, Tiny Aya's unrotated full layer too."""
    from glassgpt.explain.views.text import render_family_text
    tr = trace(model_of(ROTARY["tiny_aya"]), TOK, TEXT, options=TraceOptions(attention=True))
    text = render_family_text(tr, attention_layer=2)
    assert ("its queries and keys were RoPE-rotated before the softmax (not in layer 2, which RoPE does not turn)"
            in text)
    assert "QK-normed in Qwen3" not in text
    olmo = render_family_text(trace(model_of(ROTARY["olmo3"]), TOK, TEXT, options=TraceOptions(attention=True)),
                              attention_layer=0)
    assert "its queries and keys were QK-normed, then RoPE-rotated before the softmax" in olmo
