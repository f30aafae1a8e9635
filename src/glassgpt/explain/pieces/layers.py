"""Chapter 4's parts, as the reader wrote them, against model.py's: LayerNorm, GELU, FeedForward and
TransformerBlock (GPTModel goes to verify.py, stage by stage).

Each runs on the book's inputs (LayerNorm(5) on torch.randn(2, 5) and on numbers a thousand times
smaller, where eps decides; GELU on torch.linspace(-3, 3, 100); FeedForward on torch.rand(2, 3, d);
the block on torch.rand(2, 4, d)), against model.py's module holding the reader's weights in
float64. A block is checked part by part first (norm1, att, norm2, ff on the inputs they were
given), so a mistake inside a part is named at that part, then as a whole (the shortcuts, the
order of norm and shortcut).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import GPTConfig
from ...model import GELU, FeedForward, LayerNorm, TransformerBlock
from .attention import check_attention
from . import properties
from .report import (PieceResult, as_double, first_row_that_differs, found, largest_diff, reproducing, run_reader,
                     same)

MISTAKES = {
    "no_eps": "the LayerNorm leaves out eps, so a row of (nearly) equal numbers divides by (nearly) 0: "
              "torch.sqrt(var + self.eps), eps = 1e-5",
    "unbiased_var": "the LayerNorm divides the variance by n - 1 (unbiased): x.var(dim=-1, keepdim=True, "
                    "unbiased=False), as GPT-2 does",
    "exact_gelu": "this is the exact GELU (erf, nn.GELU()), where the book and GPT-2 use the tanh approximation: "
                  "0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))",
    "relu": "this is ReLU where GPT-2 uses GELU (the book's tanh form)",
    "ff_2x": "the feed forward widens to 2 * emb_dim; the book's FeedForward widens to 4 * emb_dim: "
             "nn.Linear(cfg['emb_dim'], 4 * cfg['emb_dim'])",
    "no_shortcut": "the shortcuts are missing: add each part's input back, x = x + shortcut",
    "no_shortcut1": "the first shortcut (around the attention) is missing: x = x + shortcut after self.att",
    "no_shortcut2": "the second shortcut (around the feed forward) is missing: x = x + shortcut after self.ff",
    "post_norm": "the block normalizes after adding the shortcut (post-norm, the 2017 Transformer); GPT-2 "
                 "normalizes first: x = x + att(norm1(x)), then x = x + ff(norm2(x))",
}


def book_cfg(module: nn.Module, emb_dim: int) -> GPTConfig:
    """A GPTConfig holding what a block's formula needs (the rest is unused by a single block)."""
    att = getattr(module, "att", None)
    heads = int(getattr(att, "num_heads", getattr(att, "n_heads", 1))) if att is not None else 1
    qkv_bias = bool(att is not None and getattr(att, "W_query", None) is not None and att.W_query.bias is not None)
    return GPTConfig(vocab_size=2, context_length=1024, emb_dim=emb_dim, n_heads=heads, n_layers=1,
                     drop_rate=0.0, qkv_bias=qkv_bias)


def _scale_shift(norm: nn.Module, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = getattr(norm, "scale", getattr(norm, "weight", None))
    shift = getattr(norm, "shift", getattr(norm, "bias", None))
    return (as_double(scale) if scale is not None else torch.ones(d, dtype=torch.float64),
            as_double(shift) if shift is not None else torch.zeros(d, dtype=torch.float64))


def norm_formula(norm: nn.Module, x: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    d = x.shape[-1]
    scale, shift = _scale_shift(norm, d)
    h = as_double(x)
    if mistake is None:
        ref = LayerNorm(d).double()
        with torch.no_grad():
            ref.scale.copy_(scale)
            ref.shift.copy_(shift)
        return ref(h).detach()
    var = h.var(dim=-1, keepdim=True, unbiased=mistake == "unbiased_var")
    eps = 0.0 if mistake == "no_eps" else 1e-5
    return scale * (h - h.mean(dim=-1, keepdim=True)) / torch.sqrt(var + eps) + shift


def layer_norm_input(d: int) -> torch.Tensor:
    """The book's torch.randn(2, d) (seed 123), and the same a thousand times smaller, where eps decides."""
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(123))
    return torch.cat([x, x * 1e-3])


def check_layer_norm(norm: nn.Module, x: torch.Tensor | None = None, kind: str = "LayerNorm") -> PieceResult:
    d = _norm_dim(norm)
    x = layer_norm_input(d) if x is None else x
    result = PieceResult(kind, f"[{', '.join(map(str, x.shape))}] inputs (torch.randn, seed 123, and the same "
                               f"1e-3 smaller)" if x.dim() == 2 else "the inputs it was given")
    got = run_reader(f"{type(norm).__name__}.forward", lambda: _no_grad(norm, x))
    want = norm_formula(norm, x)

    def normalized():  # the reader's output with its own scale and shift taken off: what the formula fixes
        scale, shift = _scale_shift(norm, d)
        return _scale_shift_swapped(x, got, scale, shift, float(getattr(norm, "eps", 1e-5))) or \
            properties.norm_rows(x, (as_double(got) - shift) / scale, False, float(getattr(norm, "eps", 1e-5)))
    return _compare(result, got, want, {m: (lambda m=m: norm_formula(norm, x, m)) for m in ("no_eps", "unbiased_var")},
                    "row", normalized)


def _scale_shift_swapped(x: torch.Tensor, got: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float):
    """The affine step: scale times the normalized rows, plus shift; named when the two trade places."""
    h = as_double(x)
    z = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + eps)
    if torch.equal(scale, shift) or not same(got, shift * z + scale):
        return None
    return properties.Broken("scale_shift", "output", "row 0", "the normalized rows are multiplied by shift and "
                             "then scale is added (scale starts at ones and shift at zeros, so a fresh LayerNorm "
                             "gives all ones): self.scale * norm_x + self.shift")


def gelu_formula(x: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    h = as_double(x)
    if mistake == "exact_gelu":
        return F.gelu(h)
    if mistake == "relu":
        return F.relu(h)
    return GELU()(h)


def check_gelu(gelu: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    x = torch.linspace(-3, 3, 100) if x is None else x
    result = PieceResult("GELU", "torch.linspace(-3, 3, 100), as the book plots it" if x.dim() == 1 else
                         "the inputs it was given")
    got = run_reader(f"{type(gelu).__name__}.forward", lambda: _no_grad(gelu, x))
    return _compare(result, got, gelu_formula(x), {m: (lambda m=m: gelu_formula(x, m)) for m in ("exact_gelu", "relu")},
                    "input", lambda: properties.activation(x.reshape(-1, 1), got.reshape(-1, 1),
                                                           "GELU (the tanh form)"))


def _linears(ff: nn.Module) -> list[nn.Linear]:
    return [m for m in ff.modules() if isinstance(m, nn.Linear)]


def ff_formula(ff: nn.Module, x: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    first, last = _linears(ff)[0], _linears(ff)[-1]
    h = as_double(x) @ as_double(first.weight).T + as_double(first.bias)
    h = gelu_formula(h, mistake)
    return h @ as_double(last.weight).T + as_double(last.bias)


def check_feed_forward(ff: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    linears = _linears(ff)
    if len(linears) < 2:
        raise AttributeError("fewer than two nn.Linear layers: the book's FeedForward is Linear, GELU, Linear")
    d, hidden = linears[0].in_features, linears[0].out_features
    x = torch.rand(2, 3, d, generator=torch.Generator().manual_seed(123)) if x is None else x
    result = PieceResult("FeedForward", f"torch.rand(2, 3, {d}) (seed 123)" if x.shape[:2] == (2, 3) else
                         "the inputs it was given")
    broken = properties.width(hidden, d, 4 * d, "the book's FeedForward (4 * emb_dim)")
    if broken is not None:
        found(result, broken, "ff_2x" if hidden == 2 * d else None, MISTAKES)
        result.where = f"nn.Linear({d}, {hidden})"
        return result
    seen: dict[str, torch.Tensor] = {}
    def keep(_module, args, out):  # returns None: the reader's numbers flow on unchanged
        if _module is linears[0]:
            seen.setdefault("x", args[0].detach().clone())
        seen.setdefault("h" if _module is linears[0] else "a", (out if _module is linears[0] else args[0]).detach().clone())
    handles = [linears[0].register_forward_hook(keep), linears[-1].register_forward_hook(keep)]
    try:
        got = run_reader(f"{type(ff).__name__}.forward", lambda: _no_grad(ff, x))
    finally:
        for handle in handles:
            handle.remove()
    variants = {m: (lambda m=m: ff_formula(ff, x, m)) for m in ("exact_gelu", "relu")}
    return _compare(result, got, ff_formula(ff, x), variants, "position",
                    lambda: properties.activation(seen["h"], seen["a"], "GELU (the tanh form)") or
                    _ff_flow(linears, x, seen, got) if len(seen) == 3 else None)


def _ff_flow(linears: list[nn.Linear], x: torch.Tensor, seen: dict, got: torch.Tensor):
    """The feed forward's two ends: the first layer reads the module's input, and the module returns the last
    layer's output, nothing added after it."""
    if not same(seen["x"], x):
        pos = first_row_that_differs(seen["x"], x)[-1] if seen["x"].shape == x.shape else 0
        return properties.Broken("ff_input", "output", f"position {pos}",
                                 "the first layer does not read the feed forward's input: "
                                 "self.layers(x), Linear, GELU, Linear")
    last = linears[-1]
    out = as_double(seen["a"]) @ as_double(last.weight).T + (as_double(last.bias) if last.bias is not None else 0)
    if same(got, out):
        return None
    added = same(got, out + as_double(x))
    pos = first_row_that_differs(got, out)[-1] if got.shape == out.shape else 0
    return properties.Broken("ff_output", "output", f"position {pos}", (
        "the feed forward adds its input back, a shortcut inside it (first at position " if added else
        "the output is not the last layer's output (first at position ") + f"{pos}): FeedForward returns "
        "self.layers(x), and the block adds the shortcut, x = x + shortcut")


def block_formula(block: nn.Module, x: torch.Tensor, mistake: str | None = None) -> torch.Tensor:
    """model.py's TransformerBlock holding the reader's weights, in float64 (or with `mistake`)."""
    d = x.shape[-1]
    ref = TransformerBlock(book_cfg(block, d)).double().eval()
    state = {k: v for k, v in block.state_dict().items() if k in ref.state_dict()}
    ref.load_state_dict(state, strict=False)
    h = as_double(x)
    with torch.no_grad():
        if mistake is None:
            return ref(h)
        att, ff, n1, n2 = ref.att, ref.ff, ref.norm1, ref.norm2
        if mistake == "post_norm":
            h = n1(h + att(h))
            return n2(h + ff(h))
        a = att(n1(h))
        h = a if mistake in ("no_shortcut", "no_shortcut1") else h + a
        f = ff(n2(h))
        return f if mistake in ("no_shortcut", "no_shortcut2") else h + f


def check_block(block: nn.Module, x: torch.Tensor | None = None) -> PieceResult:
    d = _norm_dim(block.norm1)
    x = torch.rand(2, 4, d, generator=torch.Generator().manual_seed(123)) if x is None else x
    seen: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    def tap(name):
        def hook(_module, args, out):
            seen.setdefault(name, args[0].detach().clone())  # returns None: the output stays the reader's
            if torch.is_tensor(out):
                outs.setdefault(name, out.detach().clone())
        return hook
    handles = [getattr(block, name).register_forward_hook(tap(name))
               for name in ("norm1", "att", "norm2", "ff") if isinstance(getattr(block, name, None), nn.Module)]
    try:
        got = run_reader(f"{type(block).__name__}.forward", lambda: _no_grad(block, x))
    finally:
        for h in handles:
            h.remove()
    fed = f"torch.rand(2, 4, {d}) (seed 123)"
    for name, check in (("norm1", check_layer_norm), ("att", None), ("norm2", check_layer_norm),
                        ("ff", check_feed_forward)):
        if name not in seen:
            continue
        part = getattr(block, name)
        inner = check_attention(part, "MultiHeadAttention", seen[name]) if name == "att" else check(part, seen[name])
        if not inner.ok:
            inner.kind, inner.fed = "TransformerBlock", fed
            inner.finding = f"{name}: {inner.finding}"
            inner.stage = f"{name} {inner.stage}"
            return inner
    result = PieceResult("TransformerBlock", fed, lines=["norm1, att, norm2, ff each match model.py's on the "
                                                         "inputs they were given"])
    variants = {m: (lambda m=m: block_formula(block, x, m)) for m in ("no_shortcut", "no_shortcut1", "no_shortcut2",
                                                                        "post_norm")}
    return _compare(result, got, block_formula(block, x), variants, "position",
                    lambda: _block_properties(x, seen, outs, got))


def _block_properties(x: torch.Tensor, seen: dict, outs: dict, out: torch.Tensor):
    """A pre-norm block's properties, from what its parts were given and gave: norm1 reads the block's
    input and att reads norm1's output (else the norm is placed after), then both shortcuts."""
    if not {"norm1", "att", "norm2", "ff"} <= set(seen) or not {"norm1", "att", "ff"} <= set(outs):
        return None
    if not same(seen["norm1"], x) or not same(seen["att"], outs["norm1"]):
        reads = "the block's input" if same(seen["att"], x) else "something other than norm1's output"
        return properties.Broken("norm_placement", "output", "position 0",
                                 f"the attention reads {reads}, not norm1(x): GPT-2 normalizes each part's input "
                                 f"before it (pre-norm), x = x + att(norm1(x)), then x = x + ff(norm2(x))")
    return properties.shortcuts(x, outs["att"], seen["norm2"], outs["ff"], out)


def _compare(result: PieceResult, got: torch.Tensor, want: torch.Tensor, variants: dict, unit: str,
             broken_property=None) -> PieceResult:
    shown = f"max |diff| {largest_diff(got, want):.3g}" if tuple(got.shape) == tuple(want.shape) else \
        f"shape {list(got.shape)}, glassgpt's {list(want.shape)}"
    result.lines.append(f"output against model.py's {result.kind} in float64: {shown}")
    result.views = {"reader_out": got, "book_out": want}
    if same(got, want):
        result.finding = f"{result.kind} matches glassgpt's formula (float64, your weights)."
        return result
    flat = (lambda t: t.reshape(-1, 1)) if got.dim() == 1 else (lambda t: t)  # a 1-d output: each number a row
    index = first_row_that_differs(flat(got), flat(want)) if tuple(got.shape) == tuple(want.shape) else ()
    result.stage = "output"
    result.where = f"{unit} {index[-1]}" if index else "its shape"
    result.mistake = reproducing(got, variants)
    broken = broken_property() if broken_property else None
    if broken is not None:  # the property of the formula first, then the catalogue's line
        return found(result, broken, result.mistake, MISTAKES)
    what = f"the output first differs from glassgpt's at {result.where}"
    result.finding = f"{what}: {MISTAKES[result.mistake]}" if result.mistake else \
        f"{what}; it keeps what was checked ({CHECKED.get(result.kind, 'its properties')}), and no known mistake " \
        f"reproduces it: compare your forward line by line with the book's"
    return result


CHECKED = {"LayerNorm": "scale and shift in their places, mean 0, unit biased variance, eps inside the root",
           "GELU": "the activation, fitted", "FeedForward": "4 * emb_dim wide, the activation, the first layer "
           "reading the input, the output the last layer's", "TransformerBlock": "each part alone, each norm before "
           "its part, both shortcuts"}


def _no_grad(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(x).detach()
    finally:
        module.train(was)


def _norm_dim(norm: nn.Module) -> int:
    p = getattr(norm, "scale", getattr(norm, "weight", None))
    if p is None:
        raise AttributeError("no scale (or weight): glassgpt reads the book's LayerNorm names, scale and shift")
    return p.shape[-1]
