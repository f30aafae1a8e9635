"""Weights that cannot compute are named, in one line, before anything runs on them; every dtype works.

Four kinds of model that cannot give a true answer, each through every public function that takes
a model: a NaN in one weight, an inf in one weight, a model on the meta device (shapes without
values), and a vocabulary smaller than the tokenizer's ids. Each kind is planted in a glassgpt
GPTModel and in a transformers GPT2LMHeadModel, which adopt.py reads in place.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import glassgpt
from glassgpt.engine import autotune, decode
from glassgpt.errors import GlassError, KernelWarning, NonFiniteError, PromptError, TokenizerError
from glassgpt.explain.compare import compare
from glassgpt.explain.diff import diff_weights
from glassgpt.explain.passage import passage
from glassgpt.web.service import ExplainRequest, ExplainService

from conftest import make_hf_model

PROMPT = "Every effort moves you"
GPT2_VOCAB = 50257
SMALL = dict(context_length=32, emb_dim=32, n_heads=4, n_layers=2)


def glass_model(vocab_size: int = GPT2_VOCAB) -> glassgpt.GPTModel:
    cfg = glassgpt.GPTConfig(vocab_size=vocab_size, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", glassgpt.RandomWeightsWarning)
        return glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=cfg)


def hf_model(vocab_size: int = GPT2_VOCAB):
    return make_hf_model(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4)


BUILDERS = {"glassgpt": glass_model, "transformers": hf_model}
# The tensor the NaN or inf goes into, in each kind's own names (the message names it so).
PLANTED = {"glassgpt": "trf_blocks.1.ff.layers.0.weight", "transformers": "transformer.h.1.mlp.c_fc.weight"}


def broken(kind: str, family: str) -> torch.nn.Module:
    if kind == "small vocab":
        return BUILDERS[family](vocab_size=100)
    model = BUILDERS[family]()
    if kind == "meta":
        return model.to("meta")
    with torch.no_grad():
        model.get_parameter(PLANTED[family]).view(-1)[7] = float("nan") if kind == "NaN" else float("inf")
    return model


def expected(kind: str, family: str) -> tuple[type, str]:
    """The error and the words of its one line."""
    if kind == "NaN":
        return NonFiniteError, f"the model's weights cannot compute: {PLANTED[family]} holds 1 NaN of its"
    if kind == "inf":
        return NonFiniteError, f"the model's weights cannot compute: {PLANTED[family]} holds 1 inf of its"
    if kind == "meta":
        return GlassError, "weights are on the meta device"
    return TokenizerError, "the tokenizer has 50,257 tokens but the model's vocab_size is 100"


def tok():
    return glassgpt.get_tokenizer("gpt2")


def ids():
    return tok().encode(PROMPT)


# Each public function that takes a model, called as a reader would. adopt, generate and stream take
# ids, not a tokenizer: for them a small vocabulary is a prompt id past the model's rows.
CALLS = {
    "trace": lambda m: glassgpt.trace(m, tok(), PROMPT),
    "why": lambda m: glassgpt.why(m, tok(), PROMPT),
    "why with patching": lambda m: glassgpt.why(m, tok(), PROMPT, patch="Every effort moves him"),
    "generate": lambda m: glassgpt.generate(m, ids(), max_new_tokens=3),
    "generate sampled": lambda m: glassgpt.generate(m, ids(), max_new_tokens=3, temperature=1.0, seed=1),
    "stream": lambda m: list(glassgpt.stream(m, ids(), max_new_tokens=3)),
    "show": lambda m: glassgpt.show(m, PROMPT),
    "check": lambda m: glassgpt.check(m),
    "adopt with a prompt": lambda m: glassgpt.adopt(m, ids()),
    "compare": lambda m: compare(m, glass_model(m.config.vocab_size if hasattr(m, "config") else m.cfg.vocab_size),
                                 tok(), PROMPT),
    "compare, as B": lambda m: compare(glass_model(m.config.vocab_size if hasattr(m, "config") else m.cfg.vocab_size),
                                       m, tok(), PROMPT),
    "diff": lambda m: diff_weights(m, m),
    "passage": lambda m: passage(m, tok(), PROMPT),
    "the page's service": lambda m: ExplainService(m, tok()).explain(ExplainRequest(prompt=PROMPT)),
}
TAKES_NO_TOKENIZER = {"generate", "generate sampled", "stream", "adopt with a prompt"}
# check reads a toy vocabulary's ids modulo its size, and diff compares two models' weights: neither
# runs a tokenizer's ids through the model.
NO_VOCAB_CASE = {"check", "diff"}


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("call, kind", [(call, kind) for call in CALLS for kind in ("NaN", "inf", "meta", "small vocab")
                                        if not (kind == "small vocab" and call in NO_VOCAB_CASE)])
def test_weights_that_cannot_compute_are_named_in_one_line(call, kind, family):
    model = broken(kind, family)
    error, words = expected(kind, family)
    if kind == "small vocab" and call in TAKES_NO_TOKENIZER:
        error, words = PromptError, "token id 6,109 is out of range for this model: its vocab_size is 100"
    with pytest.raises(error) as caught:
        CALLS[call](model)
    message = str(caught.value)
    assert words in message
    assert "\n" not in message


def test_a_nan_weight_is_counted_and_the_others_mentioned():
    model = glass_model()
    with torch.no_grad():
        model.trf_blocks[0].att.W_query.weight[:3, 0] = float("nan")
        model.trf_blocks[0].att.W_query.weight[5, 0] = float("-inf")
        model.final_norm.scale[0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"trf_blocks\.0\.att\.W_query\.weight holds 3 NaN and 1 inf of its "
                                             r"1,024 values \(and 1 more tensor\)"):
        glassgpt.generate(model, ids(), max_new_tokens=1)


def test_a_weight_repaired_in_place_computes_again():
    """The check remembers a model that passed only while its tensors are unchanged."""
    model = glass_model()
    assert glassgpt.generate(model, ids(), max_new_tokens=1).shape == (1, len(ids()) + 1)
    weight = model.trf_blocks[0].norm1.scale
    with torch.no_grad():
        weight[0] = float("nan")
    with pytest.raises(NonFiniteError, match="trf_blocks.0.norm1.scale holds 1 NaN"):
        glassgpt.generate(model, ids(), max_new_tokens=1)
    with torch.no_grad():
        weight[0] = 1.0
    assert glassgpt.generate(model, ids(), max_new_tokens=1).shape == (1, len(ids()) + 1)


def test_huge_finite_weights_are_not_called_broken():
    """A tensor's sum can overflow float32 while every value is finite: it is counted, not blamed."""
    model = glass_model().double()
    with torch.no_grad():
        model.trf_blocks[0].ff.layers[0].weight[:4, :4] = 1e300
    glassgpt.adopt(model, ids())  # no error: the values are finite


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_never_returns_tokens_from_nan_scores(temperature):
    """Finite weights whose scores overflow at run time (an activation past float16's range) stop
    generate with one line, greedy or sampled, instead of picking id 0 from NaN scores."""
    model = glass_model()
    with torch.no_grad():
        model.out_head.weight.mul_(0).add_(1.0)   # every logit is the sum of the last hidden vector
        model.final_norm.scale.fill_(6e4)         # ... times 6e4: past float16's 65,504
    model = model.half()
    with pytest.raises(NonFiniteError, match="next-token scores are NaN or infinite, so no token can be picked"):
        glassgpt.generate(model, ids(), max_new_tokens=2, temperature=temperature, seed=0)


def test_a_temperature_that_overflows_finite_scores_is_named_as_the_temperature():
    with pytest.raises(GlassError, match="temperature 1e-45 is so small that the scores divided by it overflow"):
        glassgpt.generate(glass_model(), ids(), max_new_tokens=1, temperature=1e-45, seed=0)


# --- every dtype the API accepts ---------------------------------------------------------

def own_greedy(module, prompt: list[int], n: int) -> list[int]:
    """The module's own greedy loop, by its own forward."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            out = module(torch.tensor([seq]))
            logits = getattr(out, "logits", out)
            seq.append(int(logits[0, -1].float().argmax()))
    return seq


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_dtype_generates_and_traces(family, dtype):
    model = BUILDERS[family]().to(dtype)
    prompt = ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", glassgpt.errors.KernelWarning)
        out = glassgpt.generate(model, prompt, max_new_tokens=4)
        tr = glassgpt.trace(model, tok(), PROMPT)
    assert out.shape == (1, len(prompt) + 4) and out.dtype == torch.long
    assert tr.stage("tok_emb").dtype == str(dtype).replace("torch.", "")
    if dtype in (torch.float32, torch.float64):  # exact enough that the greedy tokens are the module's own
        assert out[0].tolist() == own_greedy(model, prompt, 4)
        assert tr.next_token["top"][0]["id"] == own_greedy(model, prompt, 1)[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_weights_run_pytorchs_matmul_where_the_kernel_was_chosen(monkeypatch, dtype):
    """transformers' Conv1D weights are read as transposed views; glassgpt's gemv kernel reads only
    contiguous matrices, so where autotune chose it, those layers run F.linear, with one note."""
    chosen = autotune.choose

    def kernel_everywhere(cfg, precision, cache=None):
        choices = chosen(cfg, precision, cache)
        winners = {k: ("glassgpt" if k.startswith("linear ") else v) for k, v in choices.winners.items()}
        return autotune.Choices(choices.machine, precision, winners, choices.ms)
    monkeypatch.setattr(autotune, "choose", kernel_everywhere)
    monkeypatch.setattr(decode, "_said", set())  # each note is said once per process
    model = hf_model().to(dtype)
    prompt = ids()
    with pytest.warns(KernelWarning, match="native decoding step does not run here: some of its tensors are not "
                                           "contiguous \\(e.g. transformers' Conv1D weights"):
        out = glassgpt.generate(model, prompt, max_new_tokens=4)
    assert out.shape == (1, len(prompt) + 4)
    if dtype == torch.float32:
        assert out[0].tolist() == own_greedy(model, prompt, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_training_runs_weight_check_finds_one_nan_or_inf_anywhere_and_never_blames_finite_values(dtype):
    """formats.glassgpt.nonfinite_tensor (every evaluation and save of a run checks the weights with it):
    one bad value at the start, in the middle, in the last partial vector or at the end; the dtype's
    largest finite values are not bad."""
    from glassgpt.formats.glassgpt import nonfinite_tensor
    good = torch.randn(1001).to(dtype)
    big = torch.full((33,), torch.finfo(dtype).max, dtype=dtype)
    big[::2] = torch.finfo(dtype).min
    assert nonfinite_tensor([("a", good), ("big", big), ("empty", torch.empty(0, dtype=dtype)),
                             ("ids", torch.arange(5))]) is None
    for where in (0, 517, 995, 1000):
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = good.clone()
            t[where] = bad
            assert nonfinite_tensor([("a", good), ("b", t.view(7, 143))]) == "b"
    assert nonfinite_tensor([("all nan", torch.full((4,), float("nan"), dtype=dtype))]) == "all nan"
