"""Generation: greedy equals transformers', the cache changes nothing, sampling is seeded, windows slide.

Greedy parity: the same random GPT-2 (tiny, and 124M under `slow`) continues the
same prompt for 50 tokens with glassgpt's `generate(temperature=0)` and with
transformers' `generate(do_sample=False)`; every id must be identical.
"""

from __future__ import annotations

import math

import pytest
import torch

import glassgpt
from glassgpt import generate, get_tokenizer, load_model, stream
from glassgpt.errors import GlassError, PromptError
from glassgpt.generate import decode_stream, pick_next

PROMPT = torch.tensor([[5, 17, 42, 3, 99, 0, 64, 23], [1, 2, 3, 4, 5, 6, 7, 8]])


def hf_greedy(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)


def manual_greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The definition: full forward of the last context_length tokens, argmax, append."""
    seq = prompt
    ctx = model.cfg.context_length
    with torch.no_grad():
        for _ in range(n):
            next_id = model(seq[:, -ctx:])[:, -1].argmax(dim=-1, keepdim=True)
            seq = torch.cat([seq, next_id], dim=1)
    return seq


# --- greedy parity with transformers -----------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_50_tokens_equal_transformers(hf_tiny, use_cache):
    hf, path = hf_tiny
    model = load_model(path)
    ours = generate(model, PROMPT, max_new_tokens=50, use_cache=use_cache)
    theirs = hf_greedy(hf, PROMPT, 50)
    assert ours.shape == (2, 58)
    assert ours.tolist() == theirs.tolist()


def test_greedy_of_the_untied_model_equals_transformers(hf_tiny_untied):
    hf, path = hf_tiny_untied
    ours = generate(load_model(path), PROMPT[:1], max_new_tokens=50)
    assert ours.tolist() == hf_greedy(hf, PROMPT[:1], 50).tolist()


@pytest.mark.slow
def test_gpt2_124m_greedy_50_tokens_equal_transformers(tmp_path):
    from conftest import make_hf_model, save_hf_model

    hf = make_hf_model(seed=0, std=0.02, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    model = load_model(save_hf_model(hf, tmp_path / "hf"))
    prompt = torch.tensor([get_tokenizer("gpt2").encode("Every effort moves you")])
    ours = generate(model, prompt, max_new_tokens=50)
    assert ours.tolist() == hf_greedy(hf, prompt, 50).tolist()
    assert generate(model, prompt, max_new_tokens=50, use_cache=False).tolist() == ours.tolist()


# --- the cache and the sliding window ------------------------------------------------------

def test_greedy_with_and_without_cache_is_identical_and_equals_the_definition(tiny_model):
    prompt = PROMPT % 97
    with_cache = generate(tiny_model, prompt, max_new_tokens=20)
    assert with_cache.tolist() == generate(tiny_model, prompt, max_new_tokens=20, use_cache=False).tolist()
    assert with_cache.tolist() == manual_greedy(tiny_model, prompt, 20).tolist()


def test_seeded_sampling_with_and_without_cache_is_identical(tiny_model):
    prompt = PROMPT % 97
    kwargs = dict(max_new_tokens=30, temperature=1.3, top_k=20, top_p=0.95, seed=11)
    assert (generate(tiny_model, prompt, **kwargs).tolist()
            == generate(tiny_model, prompt, use_cache=False, **kwargs).tolist())


def test_generation_past_context_length_slides_the_window(tiny_model):
    ctx = tiny_model.cfg.context_length  # 32
    prompt = PROMPT[:, :5] % 97
    n = 2 * ctx  # well past the end of the context
    expected = manual_greedy(tiny_model, prompt, n)
    assert generate(tiny_model, prompt, max_new_tokens=n).tolist() == expected.tolist()
    assert generate(tiny_model, prompt, max_new_tokens=n, use_cache=False).tolist() == expected.tolist()


def test_prompt_longer_than_context_is_windowed_and_kept_whole(tiny_model):
    ctx = tiny_model.cfg.context_length
    prompt = torch.randint(0, 97, (2, ctx + 13), generator=torch.Generator().manual_seed(0))
    expected = manual_greedy(tiny_model, prompt, 10)
    for use_cache in (True, False):
        out = generate(tiny_model, prompt, max_new_tokens=10, use_cache=use_cache)
        assert out.shape == (2, ctx + 23)
        assert out.tolist() == expected.tolist()


def test_prompt_of_exactly_context_length_works(tiny_model):
    ctx = tiny_model.cfg.context_length
    prompt = torch.randint(0, 97, (1, ctx), generator=torch.Generator().manual_seed(1))
    assert generate(tiny_model, prompt, max_new_tokens=4).tolist() == manual_greedy(tiny_model, prompt, 4).tolist()


def test_batched_greedy_equals_each_row_alone(tiny_model):
    prompt = PROMPT % 97
    both = generate(tiny_model, prompt, max_new_tokens=15)
    for i in range(2):
        assert both[i].tolist() == generate(tiny_model, prompt[i], max_new_tokens=15)[0].tolist()


# --- sampling --------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(tiny_model):
    prompt = PROMPT % 97
    a = generate(tiny_model, prompt, max_new_tokens=25, temperature=1.0, seed=123)
    b = generate(tiny_model, prompt, max_new_tokens=25, temperature=1.0, seed=123)
    c = generate(tiny_model, prompt, max_new_tokens=25, temperature=1.0, seed=124)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_sampling_does_not_depend_on_the_global_rng(tiny_model):
    prompt = PROMPT % 97
    torch.manual_seed(0)
    a = generate(tiny_model, prompt, max_new_tokens=10, temperature=1.0, seed=5)
    torch.manual_seed(1)
    b = generate(tiny_model, prompt, max_new_tokens=10, temperature=1.0, seed=5)
    assert a.tolist() == b.tolist()


def test_top_k_1_equals_greedy(tiny_model):
    prompt = PROMPT % 97
    greedy = generate(tiny_model, prompt, max_new_tokens=20)
    assert generate(tiny_model, prompt, max_new_tokens=20, temperature=5.0, top_k=1, seed=0).tolist() == greedy.tolist()


def test_tiny_top_p_equals_greedy(tiny_model):
    prompt = PROMPT % 97
    greedy = generate(tiny_model, prompt, max_new_tokens=20)
    assert generate(tiny_model, prompt, max_new_tokens=20, temperature=5.0, top_p=1e-6, seed=0).tolist() == greedy.tolist()


def test_top_k_samples_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    picked = set(pick_next(logits, temperature=1.0, top_k=3, generator=gen).tolist())
    assert picked == {1, 3, 5}


@pytest.mark.parametrize("top_p, allowed", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_that_reaches_p(top_p, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[torch.tensor([0, 1, 2, 3])].unsqueeze(0).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(pick_next(logits, temperature=1.0, top_p=top_p, generator=gen).tolist()) == allowed


def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 0.7, 0.2], [3.0, -1.0, 2.0]])
    assert pick_next(logits, temperature=0.0).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_first_largest_logit_as_argmax(dtype):
    logits = torch.randn(4, 1000).to(dtype)
    logits[:, [5, 17, 900]] = logits.max() + 1  # three-way ties (common in bfloat16)
    assert pick_next(logits).tolist() == [5] * 4 == logits.argmax(dim=-1).tolist()


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]]).repeat(20000, 1)
    counts = torch.bincount(pick_next(logits, 1.0, generator=torch.Generator().manual_seed(0)), minlength=3)
    freqs = (counts / counts.sum()).tolist()
    assert freqs == pytest.approx([0.6, 0.3, 0.1], abs=0.02)


# --- stopping, shapes, streaming -------------------------------------------------------------

def test_generation_stops_at_eos_and_includes_it(tiny_model):
    prompt = PROMPT[:1] % 97
    greedy = generate(tiny_model, prompt, max_new_tokens=10)[0, 8:].tolist()
    eos = greedy[3]
    first = greedy.index(eos)
    out = generate(tiny_model, prompt, max_new_tokens=10, eos_id=eos)
    assert out[0, 8:].tolist() == greedy[: first + 1]


def test_rows_that_reached_eos_keep_emitting_it_until_all_are_done(tiny_model):
    prompt = PROMPT % 97
    greedy = generate(tiny_model, prompt, max_new_tokens=12)[:, 8:].tolist()
    eos = greedy[0][2]
    out = generate(tiny_model, prompt, max_new_tokens=12, eos_id=eos)[:, 8:].tolist()
    for row, full in zip(out, greedy):
        if eos in full:
            k = full.index(eos)
            assert row[: k + 1] == full[: k + 1]
            assert all(i == eos for i in row[k:])
        else:
            assert row == full[: len(row)]


def test_generate_returns_prompt_plus_new_ids_as_int64(tiny_model):
    out = generate(tiny_model, [1, 2, 3], max_new_tokens=4)
    assert out.shape == (1, 7) and out.dtype == torch.int64
    assert out[0, :3].tolist() == [1, 2, 3]
    assert generate(tiny_model, [1, 2, 3], max_new_tokens=0).tolist() == [[1, 2, 3]]


def test_zero_new_tokens_runs_no_forward(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr(tiny_model, "forward", lambda *a, **k: calls.append(1))
    assert list(stream(tiny_model, [1, 2, 3], 0)) == [] and not calls


def test_stream_yields_the_same_ids_as_generate(tiny_model):
    prompt = PROMPT % 97
    steps = list(stream(tiny_model, prompt, 6))
    assert all(s.shape == (2,) for s in steps)
    assert torch.stack(steps, dim=1).tolist() == generate(tiny_model, prompt, 6)[:, 8:].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_generate_valid_ids(tiny_config, dtype):
    model = glassgpt.load_model("gpt2", config=tiny_config, dtype=dtype, seed=0)
    for kwargs in (dict(), dict(temperature=0.8, top_k=10, top_p=0.9, seed=0)):
        out = generate(model, [1, 2, 3], max_new_tokens=40, **kwargs)  # past context_length: window slides
        assert out.shape == (1, 43)
        assert 0 <= out.min() and out.max() < tiny_config.vocab_size


def test_generation_leaves_the_model_unchanged(tiny_model):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    generate(tiny_model, PROMPT % 97, max_new_tokens=5, temperature=1.0, seed=0)
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    assert not tiny_model.training


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=-1), dict(max_new_tokens=1.5), dict(temperature=-0.5), dict(temperature=float("nan")),
    dict(top_k=0), dict(top_k=-3), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1),
    dict(top_p=float("nan")),
])
def test_bad_arguments_raise_glass_error_naming_the_value(tiny_model, kwargs):
    args = dict(max_new_tokens=3)
    args.update(kwargs)
    name, value = next(iter(kwargs.items()))
    with pytest.raises(GlassError, match=name):
        generate(tiny_model, [1, 2], **args)


@pytest.mark.parametrize("prompt", [[], torch.zeros(1, 0, dtype=torch.long)])
def test_empty_prompt_is_a_prompt_error(tiny_model, prompt):
    with pytest.raises(PromptError, match="empty"):
        generate(tiny_model, prompt, max_new_tokens=3)


def test_decode_stream_never_emits_a_replacement_character():
    tok = get_tokenizer("gpt2")
    text = "Hi 😀👍🏽 👩‍👩‍👧‍👦 🇺🇳 中文字符 e\u0301 Ω ≈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens do split characters
    pieces = list(decode_stream(tok, ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 5  # it streams, it does not wait for the end


def test_decode_stream_flushes_an_unfinished_character_at_the_end():
    tok = get_tokenizer("gpt2")
    ids = tok.encode("ok😀")
    pieces = list(decode_stream(tok, ids[:-1]))
    assert pieces[0] == "ok" and pieces[-1] == "\ufffd"


def test_public_api_exports_generate():
    assert glassgpt.generate is generate and glassgpt.stream is stream


# --- generate --show-choices and --check-against ------------------------------------------------

BOOK_SMALL = {"vocab_size": 50257, "context_length": 24, "emb_dim": 64, "n_heads": 1, "n_layers": 2,
              "drop_rate": 0.1, "qkv_bias": False}


@pytest.fixture(scope="module")
def book_model_pth(tmp_path_factory):
    """The book's own GPTModel (random, seeded), saved as the model.pth of chapter 5, and the model."""
    from llms_from_scratch.ch04 import GPTModel as BookGPTModel

    torch.manual_seed(5)
    book = BookGPTModel(BOOK_SMALL).eval()
    path = tmp_path_factory.mktemp("book") / "model.pth"
    torch.save(book.state_dict(), path)
    (path.parent / "model.json").write_text('{"n_heads": 1}')
    return book, str(path)


def cli_json(argv, capsys) -> dict:
    import json

    from glassgpt.cli import main

    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_show_choices_follows_the_books_temperature_1_4_top_k_25_sample_token_by_token(book_model_pth, capsys):
    """The book's chapter-5 sampling (torch.manual_seed(123); generate(..., temperature=1.4, top_k=25)):
    --show-choices draws the very same tokens, and at each step lists the book's own candidates: the
    25 largest logits of the book's model, divided by 1.4, softmaxed (tolerance 1e-5)."""
    from llms_from_scratch.ch05 import generate as book_generate

    book, path = book_model_pth
    tok = get_tokenizer("gpt2")
    prompt = "Every effort moves you"
    argv = ["generate", prompt, "--model", path, "--max-new-tokens", "15", "--temperature", "1.4", "--top-k", "25",
            "--seed", "123", "--json"]
    plain = cli_json(argv, capsys)
    shown = cli_json(argv + ["--show-choices", "25"], capsys)
    assert shown["new_ids"] == plain["new_ids"]  # watching the choices changes none of them
    ids = torch.tensor([tok.encode(prompt)])
    torch.manual_seed(123)
    expected = book_generate(book, ids, max_new_tokens=15, context_size=24, temperature=1.4, top_k=25)
    assert shown["new_ids"] == expected[0, ids.shape[1]:].tolist()
    seq = expected[0].tolist()
    for step, choice in enumerate(shown["choices"]):
        t = ids.shape[1] + step
        with torch.no_grad():
            logits = book(torch.tensor([seq[max(0, t - 24):t]]))[0, -1]
        top = logits.topk(25)
        probs = (top.values / 1.4).softmax(-1)
        assert [c["id"] for c in choice["top"]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([c["prob"] for c in choice["top"]]), probs, atol=1e-5, rtol=0)
        assert choice["id"] == seq[t] and choice["id"] in top.indices.tolist() and choice["step"] == step + 1
        assert choice["prob"] == pytest.approx(float(probs[top.indices.tolist().index(seq[t])]), abs=1e-5)


def test_show_choices_in_the_terminal_lists_each_step(book_model_pth, capsys):
    from glassgpt.cli import main

    _, path = book_model_pth
    assert main(["generate", "Every effort moves you", "--model", path, "--max-new-tokens", "4", "--temperature",
                 "1.4", "--top-k", "25", "--seed", "123", "--show-choices", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Every effort moves you" and "the 3 likeliest after temperature 1.4, top-k 25" in out[1]
    assert [line.split()[0] for line in out[2:6]] == ["1", "2", "3", "4"]
    assert out[6].startswith("Every effort moves you") and len(out) == 7


def test_greedy_show_choices_draws_the_most_likely_candidate(tiny_model):
    from glassgpt.generate import sampling_probs

    seen = []
    ids = list(stream(tiny_model, [1, 2, 3], 5, on_pick=lambda logits, nxt: seen.append((logits.clone(), nxt))))
    for (logits, nxt), got in zip(seen, ids):
        probs = sampling_probs(logits, 1.0)
        assert int(nxt[0]) == int(got[0]) == int(probs[0].argmax())
        torch.testing.assert_close(probs, logits.float().softmax(-1))


def test_check_against_finds_the_recited_spans(tmp_path):
    from glassgpt.recall import copied_spans

    story = "I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it was no"
    pieces = ["I", " HAD", " always", " thought", " Jack", " Gisburn", " rather", " a", " cheap", " genius",
              " and", " a", " good", " fellow", " enough", "--", "so", " it"]
    spans = copied_spans(pieces, story, first_new=4)
    assert [(s.start, s.end) for s in spans] == [(0, 10), (11, 18)]
    assert spans[0].text == "I HAD always thought Jack Gisburn rather a cheap genius" and spans[0].new_tokens == 6
    assert spans[1].new_tokens == 7 and spans[1].offset == story.index(" a good fellow") and spans[1].line == 1
    assert copied_spans(pieces, story, first_new=18) == []  # the prompt alone is no recitation
    assert copied_spans([" the", " cat", " sat"], story, first_new=0) == []


def test_cli_check_against_lists_spans_with_their_line(book_model_pth, capsys, tmp_path):
    _, path = book_model_pth
    tok = get_tokenizer("gpt2")
    got = cli_json(["generate", "Every effort moves you", "--model", path, "--max-new-tokens", "6", "--json"], capsys)
    data = tmp_path / "data.txt"
    data.write_text("first line\n" + got["text"] + " and more\n")
    got = cli_json(["generate", "Every effort moves you", "--model", path, "--max-new-tokens", "6", "--json",
                    "--check-against", str(data)], capsys)
    spans = got["check_against"]["spans"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == len(tok.encode("Every effort moves you")) + 6
    assert spans[0]["line"] == 2 and spans[0]["new_tokens"] == 6
