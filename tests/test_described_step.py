"""The described step (engine/described_step.py, kernels/described_step.cpp): one C++ call per new token for every
model its description lays out as RoPE attention blocks, on any CPU with AVX2 and FMA.

Tolerances: float32 logits within 1e-5 of the row's largest logit of the glass model's own cached forward (the
order of the sums differs); bfloat16 against the same glass model in float32 holding the bfloat16 weights, within
2e-2 of the row's largest logit (the step keeps the stream in float32 and rounds only the cache's keys and values
to bfloat16, where the glass model rounds every operation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glassgpt.engine import decode
from glassgpt.engine import step as plans
from glassgpt.engine.decode import twin_steps
from glassgpt.engine import described_step as ds
from glassgpt.engine.described_step import DescribedStep
from glassgpt.engine.hybrid_cache import cache_for
from glassgpt.families import build_model
from glassgpt.generate import generate
from glassgpt.kinds import describe

from conftest import needs_gemv
from helpers import TINY, randomize_, tiny_described

pytestmark = pytest.mark.usefixtures("gemv")


@pytest.fixture(scope="module")
def gemv():
    return needs_gemv()


def model_of(name: str, dtype=torch.float32) -> torch.nn.Module:
    """A tiny random model: DESCRIBED's bonus models by name, or TINY's Qwen3 and Llama 3."""
    model = tiny_described(name) if name not in TINY else randomize_(build_model(TINY[name]))
    return model.to(dtype).eval()


def ids_of(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


MODELS = ["gemma3", "olmo3", "qwen3-moe", "tiny-aya", "qwen3.5", "qwen3", "llama3"]


@pytest.mark.parametrize("name", MODELS)
def test_each_step_equals_the_glass_models_cached_forward_past_the_window(name):
    """17 tokens after a 3-token prompt: the sliding layers' window (4) wraps its ring several times."""
    model = model_of(name)
    ids = ids_of(20, model.cfg.vocab_size)
    ours, theirs = cache_for(model.cfg, 1, 24), cache_for(model.cfg, 1, 24)
    with torch.inference_mode():
        model(ids[:, :3], ours), model(ids[:, :3], theirs)
        # (made directly: on an AVX-512 CPU, Qwen3's and Llama 3's plan is RopeStep's)
        anatomy = describe(model)
        assert ds.differs(anatomy) is None and DescribedStep.why_not(model, anatomy, ours) is None
        step = DescribedStep(model, ours, anatomy)
        for i in range(3, 20):
            got = step(ids[:, i])
            want = model(ids[:, i:i + 1], theirs, last_only=True)[:, -1]
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, f"token {i}"
            best, value = step.greedy(got)
            assert best.item() == int(got.argmax()) and value == [got.max().item()]
    assert ours.pos == theirs.pos == 20


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "tiny-aya", "qwen3.5"])
def test_a_bfloat16_step_equals_the_float32_model_of_its_weights(name):
    model = model_of(name, torch.bfloat16)
    wide = model_of(name).float()
    wide.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids = ids_of(12, model.cfg.vocab_size)
    ours, theirs = cache_for(model.cfg, 1, 16, dtype=torch.bfloat16), cache_for(model.cfg, 1, 16)
    with torch.inference_mode():
        model(ids[:, :3], ours), wide(ids[:, :3], theirs)
        # the prompt's keys and values as the bfloat16 model rounded them
        for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
            b.copy_(a.float())
        step = plans.native_step(model, ours)
        assert type(step) is DescribedStep
        for i in range(3, 12):
            got = step(ids[:, i])
            want = wide(ids[:, i:i + 1], theirs, last_only=True)[:, -1]
            for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
                b.copy_(a.float())
            assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2, f"token {i}"


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "olmo3", "tiny-aya", "qwen3.5"])
def test_greedy_generation_through_the_step_equals_the_glass_models_tokens(name, monkeypatch):
    model = model_of(name)
    prompt = ids_of(5, model.cfg.vocab_size)
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
    out = generate(model, prompt, max_new_tokens=12)
    assert isinstance(twin_steps(model).step, DescribedStep)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_the_plan_holds_each_part_where_the_description_finds_it():
    """Gemma 3's plan: the scaled embedding, the (1 + w) norms on both sides, the window's ring and the
    scores' scale per layer, each layer's own RoPE tables, GeGLU; the cache's tensors last."""
    model = model_of("gemma3")
    cache = cache_for(model.cfg, 1, 16)
    step = plans.native_step(model, cache)
    header = dict(zip(ds.HEADER_FIELDS, step.plan.tolist()))
    assert header["tok_emb"] == header["head"] == model.tok_emb.weight.data_ptr()
    assert torch.tensor([header["emb_scale"]]).view(torch.float64).item() == model.cfg.emb_dim ** 0.5
    for i, block in enumerate(model.blocks):
        start = ds.HEADER + i * ds.LAYER_FIELDS
        fields = dict(zip(ds.LAYER_FIELD_NAMES,
                          step.plan[start:start + ds.LAYER_FIELDS].tolist()))
        sliding = model.cfg.layer_types[i] == "sliding_attention"
        assert (fields["ring"], fields["slots"]) == ((1, 4) if sliding else (0, 16))
        assert fields["rope_cos"] == model.rope_of(i).cos.data_ptr()
        assert fields["norm_kinds"] == 0b010101010101 and fields["act"] == 1  # every norm (1 + w); tanh GELU
        assert (fields["neighbours"], fields["parallel"]) == (0, 0)
        assert fields["attn_out"] == block.post_attention_layernorm.scale.data_ptr()
        assert torch.tensor([fields["scale"]]).view(torch.float64).item() == model.cfg.scaling
        assert (fields["kcache"], fields["vcache"]) == (cache.k[i].data_ptr(), cache.v[i].data_ptr())


def test_tiny_ayas_plan_holds_its_parallel_blocks_layernorms_neighbour_pairs_and_logit_scale():
    model = model_of("tiny-aya")
    step = plans.native_step(model, cache_for(model.cfg, 1, 16))
    header = dict(zip(ds.HEADER_FIELDS, step.plan.tolist()))
    assert header["final_kind"] == 2  # a LayerNorm without a shift
    assert torch.tensor([header["logit_scale"]]).view(torch.float64).item() == model.cfg.logit_scale
    for i, kind in enumerate(model.cfg.layer_types):
        start = ds.HEADER + i * ds.LAYER_FIELDS
        fields = dict(zip(ds.LAYER_FIELD_NAMES, step.plan[start:start + ds.LAYER_FIELDS].tolist()))
        assert (fields["parallel"], fields["norm_kinds"] & 3, fields["ff_in"]) == (1, 2, 0)
        sliding = kind == "sliding_attention"
        assert (fields["rope_cos"] != 0, fields["neighbours"], fields["ring"]) == (sliding, int(sliding), int(sliding))


@pytest.mark.parametrize("case, words", [
    ("batch 2", "a batch of 1, not 2"),
    ("a LoRA layer", "not all plain"),
    ("a cache longer than RoPE's tables", "longer than RoPE's tables"),
    ("a float32 cache for bfloat16 weights", "dtype, key/value groups and window"),
    ("norms of different eps", "different eps"),
])
def test_what_the_described_step_cannot_read_is_said_in_one_line(case, words):
    model = model_of("gemma3")
    cfg, batch, length, dtype = model.cfg, 1, 16, torch.float32
    if case == "batch 2":
        batch = 2
    elif case == "a LoRA layer":
        from glassgpt.training.tasks.lora import LoRALinear
        model.blocks[0].ff.fc1 = LoRALinear(model.blocks[0].ff.fc1, rank=2, alpha=4)
    elif case == "a cache longer than RoPE's tables":
        cfg = dataclasses.replace(cfg, context_length=128)
        length = 128
    elif case == "a float32 cache for bfloat16 weights":
        model = model.to(torch.bfloat16)
    else:
        model.blocks[1].input_layernorm.eps = 1e-5
    reason = plans.why_not(model, cache_for(cfg, batch, length, dtype=dtype))
    assert reason is not None and words in reason and "\n" not in reason


def test_a_moe_step_reads_only_the_experts_its_router_chose():
    """Every expert the router did not choose for this token is NaN: the step's logits are still the glass model's."""
    model = model_of("qwen3-moe")
    ids = ids_of(6, model.cfg.vocab_size)
    ours, theirs = cache_for(model.cfg, 1, 8), cache_for(model.cfg, 1, 8)
    chosen = {}
    with torch.inference_mode():
        model(ids[:, :5], ours), model(ids[:, :5], theirs)
        for i, block in enumerate(model.trf_blocks):
            route = block.ff.route
            block.ff.route = lambda x, i=i, route=route: chosen.setdefault(i, route(x)) if x.shape[1] == 1 else route(x)
        want = model(ids[:, 5:], theirs, last_only=True)[:, -1]
        for i, block in enumerate(model.trf_blocks):
            del block.ff.route
            for e in set(range(model.cfg.num_experts)) - set(chosen[i][0].flatten().tolist()):
                for lst in (block.ff.fc1, block.ff.fc2, block.ff.fc3):
                    lst[e].weight.fill_(float("nan"))
        got = plans.native_step(model, ours)(ids[:, 5])
    assert len(chosen) == len(model.trf_blocks)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_attention_over_a_long_cache_runs_a_head_a_thread_and_equals_the_glass_model():
    """Past 2^16 scores x head widths a position, the step splits attention's heads over the threads."""
    from glassgpt.families import Gemma3Config
    cfg = Gemma3Config(vocab_size=300, context_length=192, emb_dim=32, n_heads=8, n_layers=2, hidden_dim=48,
                       head_dim=64, n_kv_groups=2, rope_local_base=10_000.0, rope_base=1_000_000.0, sliding_window=160,
                       layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=64)
    model = randomize_(build_model(cfg)).eval()
    ids = ids_of(180, cfg.vocab_size)
    ours, theirs = cache_for(cfg, 1, 192), cache_for(cfg, 1, 192)
    with torch.inference_mode():
        model(ids[:, :170], ours), model(ids[:, :170], theirs)
        step = plans.native_step(model, ours)
        for i in range(170, 180):  # 171..180 positions seen: 171 x 64 x 8 > 2^16
            got = step(ids[:, i])
            want = model(ids[:, i:i + 1], theirs, last_only=True)[:, -1]
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, f"token {i}"


def test_a_short_prompt_runs_the_kernel_in_the_twin_where_autotune_measured_it_faster(monkeypatch):
    """The twin's "linear prompt" decision (autotune.twin_choices): where the kernel won on the widest block layer at
    PROMPT_ROWS rows, each kernel layer takes prompts of up to that many rows, within the kernel's rounding."""
    from glassgpt.engine import autotune
    from glassgpt.engine.linear import GEMV_MAX_ROWS, GemvLinear
    model = model_of("gemma3")
    real = autotune.twin_choices

    def chose(winner):
        def twin_choices(m):
            choices = real(m)
            for shape in {(x.out_features, x.in_features) for x in m.modules() if type(x) is torch.nn.Linear}:
                choices.winners[f"linear {shape[0]}x{shape[1]}"] = "glassgpt"
            choices.winners[autotune.PROMPT] = winner
            return choices
        return twin_choices
    for winner, rows in (("glassgpt", autotune.PROMPT_ROWS["float32"]), ("torch", GEMV_MAX_ROWS)):
        monkeypatch.setattr(autotune, "twin_choices", chose(winner))
        twin, _ = decode.gemv_twin(model)
        layers = [m for m in twin.modules() if isinstance(m, GemvLinear)]
        assert layers and all(m.gemv is not None and m.max_rows == rows for m in layers)
    ids = ids_of(16, model.cfg.vocab_size)
    with torch.inference_mode():
        want = model(ids)[:, -1]
        calls = []
        for m in layers:  # (the last twin: "torch"; give its layers the prompt's rows again)
            m.max_rows = autotune.PROMPT_ROWS["float32"]
            m.gemv = lambda x, w, b, gemv=m.gemv: calls.append(x.shape[0]) or gemv(x, w, b)
        got = twin(ids)[:, -1]
    assert 16 in calls and ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_qwen35s_glass_model_goes_on_from_the_state_and_convolution_the_step_wrote():
    """The step keeps each linear layer's convolution inputs and state in tensors of its own and hands them to the
    HybridCache: the glass model's next token, read from that cache, is the one it makes from its own."""
    model = model_of("qwen3.5")
    ids = ids_of(9, model.cfg.vocab_size)
    ours, theirs = cache_for(model.cfg, 1, 16), cache_for(model.cfg, 1, 16)
    with torch.inference_mode():
        model(ids[:, :4], ours), model(ids[:, :4], theirs)
        step = plans.native_step(model, ours)
        for i in range(4, 8):
            step(ids[:, i]), model(ids[:, i:i + 1], theirs)
        assert all(ours.state[i] is state for i, (_, state) in zip(step.linear_layers, step.own))
        got = model(ids[:, 8:], ours, last_only=True)[:, -1]
        want = model(ids[:, 8:], theirs, last_only=True)[:, -1]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
