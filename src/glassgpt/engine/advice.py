"""What to run on this CPU, in words: the dtype and flags that `glassgpt info` names, and why.

    advise(cfg, precision, flags, measured, missing)  -> lines

`measured` holds autotune's records for this model's shapes on this machine, one per precision
that has run here (autotune.recorded: its decoding step, timed at the first `generate`, or else
its matrix-vector products), and what a compile cost and saved (compiling.py). Where a figure was
measured, the words say so and give it; where nothing was, they say what they assume from the
CPU's instruction sets. Nothing here measures.
"""

from __future__ import annotations

from ..config import GPTConfig
from . import compiling, pages
from .autotune import Choices, linear_shapes

TRADE = {"float32": "the reference's exact tokens", "bfloat16": "logits within ~3% of float32's",
         "int8": "perplexity within 1% of float32's", "int4": "perplexity a few % above float32's"}


def token_ms(choices: Choices, cfg: GPTConfig) -> dict[str, float]:
    """{what was timed: ms a token}: "step", the decoding step that runs here (timed at the first `generate`),
    and "products", the chosen matrix-vector products of a token (timed when the precision was first used)."""
    out = {}
    step = choices.ms.get("step", {}).get(choices.winners.get("step", ""))
    if step:
        out["step"] = step
    total = 0.0
    for (out_f, in_f), count in linear_shapes(cfg).items():
        ms = choices.ms.get(f"linear {out_f}x{in_f}", {})
        winner = choices.winners.get(f"linear {out_f}x{in_f}", "torch")
        if winner not in ms:
            return out
        total += count * ms[winner]
    if total:
        out["products"] = total
    return out


def advise(cfg: GPTConfig, precision: str, flags: frozenset[str], measured: dict[str, Choices | None],
           missing: str | None = None, gemv: bool = False) -> list[str]:
    """Lines naming the dtype to use here and why, then whether --compile pays for `precision`'s generation.
    `missing`: why glassgpt's kernels do not run here (native.status()), None where they do; `gemv`: whether
    their AVX2 build of the float products does (native.gemv_ops)."""
    return [dtype_line(cfg, flags, measured, missing, gemv), compile_line(measured.get(precision)),
            pages_line(pages.mode())]


def pages_line(mode: str | None) -> str:
    """Whether a long generation moves the weights onto 2 MB pages here (pages.py), from the kernel's THP mode."""
    if mode in ("always", "madvise"):
        return (f"pages: a generation of {pages.PAYS_AT:,}+ new tokens moves the weights onto 2 MB pages first "
                f"(transparent huge pages: {mode}; 1.07-1.22x a token measured on an AMD EPYC, for a copy of the "
                "weights)")
    if mode is None:
        return "pages: 4 KB pages only (no transparent huge pages on this system)"
    return (f"pages: 4 KB pages only (transparent huge pages: {mode}); `echo madvise | sudo tee "
            f"{pages.THP}` lets a long generation move its weights onto 2 MB pages, 1.07-1.22x a token")


def dtype_line(cfg: GPTConfig, flags: frozenset[str], measured: dict[str, Choices | None],
               missing: str | None = None, gemv: bool = False) -> str:
    timed = {p: token_ms(c, cfg) for p, c in measured.items() if c is not None}
    # The same kind of figure for every precision compared: whole steps where each has one, else products.
    for kind, what in (("step", "its decoding step"), ("products", "its matrix-vector products")):
        times = {p: t[kind] for p, t in timed.items() if kind in t}
        if len(times) >= 2 and (kind == "products" or len(times) == len(timed)):
            fastest = min(times, key=times.get)
            figures = ", ".join(f"{p} {ms:.2f} ms" for p, ms in sorted(times.items(), key=lambda kv: kv[1]))
            unmeasured = [p for p in TRADE if p not in times]
            rest = f"; not measured yet: {', '.join(unmeasured)}" if unmeasured else ""
            return (f"dtype: --dtype {fastest} for the fastest decoding here ({TRADE[fastest]}): each precision's "
                    f"{what.removeprefix('its ')} a token, measured on this machine: {figures}{rest}")
    assumed = ("assumed from the CPU's flags: no two precisions measured here yet for this model; each "
               "`generate --dtype X` measures its own")
    if missing is not None and gemv:
        return (f"dtype: float32 or --dtype bfloat16: glassgpt's AVX-512 kernels do not run here "
                f"({missing.split(';')[0]}); its AVX2 matrix-vector kernel multiplies both, bfloat16 reading half "
                f"float32's bytes but widening each weight to float32 first, and int8 and int4 have no kernel here "
                f"({assumed}; --dtype auto measures bfloat16 against float32)")
    if missing is not None:
        return (f"dtype: float32: glassgpt's kernels do not run here ({missing.split(';')[0]}), and PyTorch's "
                f"bfloat16 and int8 products are often no faster than float32's ({assumed}; --dtype auto measures "
                f"bfloat16 against float32)")
    if "avx512_bf16" in flags:
        why = ("this CPU has avx512_bf16, so glassgpt's matrix-vector kernel multiplies bfloat16 weights as "
               "they are, streaming half float32's bytes a token")
    else:
        why = ("glassgpt's kernel streams half float32's bytes a token; this CPU lacks avx512_bf16, so it widens "
               "each weight to float32 first, which costs less than the bytes it saves")
    return (f"dtype: --dtype bfloat16 ({TRADE['bfloat16']}): {why}; --dtype int4 for the fastest (an eighth of "
            f"float32's bytes; {TRADE['int4']}), float32 for {TRADE['float32']} ({assumed})")


def compile_line(choices: Choices | None) -> str:
    """Whether `generate --compile` pays here, from the step and compile figures measured for this precision."""
    step = choices.winners.get("step") if choices else None
    record = choices.ms.get(compiling.COMPILE) if choices else None
    if step == "native":
        ms = choices.ms.get("step", {})
        speed = f", measured {ms['engine'] / ms['native']:.2f}x the PyTorch engine's speed" if \
            ms.get("native") and ms.get("engine") else ""
        return (f"--compile: not for generate here: the native step decodes (one C++ call a token{speed}) with or "
                "without it, so generate skips it; compiling would speed only the prompt's one forward")
    if record is not None:
        beyond = compiling.pays_beyond(record, False)
        measured = (f"measured here: compiling took {record['compiling'] / 1e3:.1f} s, a step {record['compiled']:.2f} "
                    f"ms compiled against {record['plain']:.2f} ms plain")
        if beyond is None:
            return f"--compile: never pays here ({measured})"
        return f"--compile: pays only beyond {beyond:,} new tokens ({measured})"
    if step == "engine":
        return ("--compile: nothing measured yet: the PyTorch engine decodes here, so the first `generate --compile` "
                "compiles and measures what it costs and saves; later ones compile only where that pays")
    return ("--compile: nothing measured yet: the first `generate` times the native step against the PyTorch "
            "engine; where the native step wins, --compile is skipped (it cannot speed it), else the first "
            "`generate --compile` measures what compiling costs and saves")
