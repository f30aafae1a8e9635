"""glassgpt vs llama.cpp at each precision: batch-1 generation and a 512-token prefill, same weights.

Optional: it runs when `llama-cpp-python` (built from source with native flags, e.g.
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python`)
and `gguf` (llama.cpp's own Python package for the file format) are installed, and says
so and exits otherwise.

The same random GPT-2 is written to GGUF files here, one per precision (f32, bf16, q8_0,
q4_0), in llama.cpp's GPT-2 layout: `token_embd`, `position_embd`, `blk.N.attn_norm`,
`blk.N.attn_qkv` (W_query, W_key, W_value stacked), `attn_output`, `ffn_norm`, `ffn_up`,
`ffn_down`, `output_norm`, with GPT-2's vocabulary and merges. Both sides then decode the
same 16-token prompt greedily for 64 tokens (new tokens/s) and prefill 512 tokens
(tokens/s), with the same number of threads; llama.cpp with and without flash attention.
Pairs: float32 / f32, bfloat16 / bf16, int8 / q8_0 (glassgpt's int8 is per-row int8, q8_0
per-32-weight blocks), int4 / q4_0 (glassgpt's groups of 32 weights with a scale and a
minimum each, 5 bits per weight; q4_0's groups of 32 with one scale, 4.5 bits). Each
glassgpt row runs the kernels that engine/autotune.py chose (printed before the tables) and
the memory-bandwidth view of every batch-1 row: bytes of weights read per token x tokens/s,
against a 256 MB copy timed right before and after each run (harness.CopyMeter). The greedy tokens of each llama.cpp file are compared with
glassgpt float32's.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_llamacpp.py [--compile]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (CopyMeter, Row, common_args, models_at_each_precision, print_views, setup,  # noqa: E402
                     time_rows, weight_bytes_per_token)

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import KVCache, as_engine, autotune, compile_for_generation, pages  # noqa: E402
from glassgpt.generate import generate  # noqa: E402
from glassgpt.tokenizer import _read_vocab_file  # noqa: E402

GGUF_TYPES = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
PRECISION = {"f32": "float32", "bf16": "bfloat16", "q8_0": "int8", "q4_0": "int4"}
GGUF_BITS = {"f32": 32, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5}  # bits per weight in the file's matrices


def write_gguf(model, path: Path, kind: str) -> Path:
    """`model`'s weights as a llama.cpp GPT-2 GGUF file, the matrices stored as `kind`: glassgpt's own
    writer (`glassgpt export --format gguf`), so the benchmark runs the file a reader would export."""
    from glassgpt.formats.gguf import write_gguf as export_gguf

    return export_gguf(model, path, dtype=kind, name=f"glassgpt-random-{kind}")


class LlamaRunner:
    """One llama.cpp context: greedy decoding and prefill through llama-cpp-python's low-level eval."""

    def __init__(self, path: Path, threads: int, flash_attn: bool, n_ctx: int):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, flash_attn=flash_attn, verbose=False)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(n):
            # The last position's logits, read from the context (llama-cpp-python keeps its
            # `scores` only with logits_all, which would copy every position's logits).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
            nxt = int(np.argmax(logits))
            out.append(nxt)
            llm.eval([nxt])
        return out

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)


def main() -> None:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e.name} is not installed (see this script's docstring)")
        return
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--no-large-pages", dest="large_pages", action="store_false",
                   help="keep glassgpt's weights on 4 KB pages (by default they are moved onto 2 MB pages, as a "
                        "generation of engine/pages.py's PAYS_AT new tokens or more moves them)")
    args = p.parse_args()
    device = setup(args)
    if device.type != "cpu":
        print("llama.cpp is compared on the CPU: pass --device cpu")
        return
    threads = torch.get_num_threads()
    cfg = PRESETS[args.model]
    n = args.new_tokens
    copy = CopyMeter(device)
    print(f"copy rate now: {copy.rate() / 1e9:.1f} GB/s (256 MB tensor copy, read + write; measured again "
          "before and after every timed decoding run)")
    models, _ = models_at_each_precision(cfg, device, reference=False, int4=True)
    ours = {name: (precision, m) for (name, precision), m in models.items()}
    if args.large_pages:  # what a long run does before its first token (64 tokens alone would not move them)
        moved = sum(pages.move_to_large_pages(m) for _, m in ours.values())
        print(f"glassgpt's weights on 2 MB pages ({moved / 1e9:.2f} GB moved; transparent huge pages: {pages.mode()}), "
              f"as a generation of {pages.PAYS_AT}+ new tokens has them; --no-large-pages keeps 4 KB pages")
    for _, m in ours.values():
        print(autotune.describe(as_engine(m).choices, cfg))
    fp32 = ours["glassgpt float32"][1]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=gen)
    long = torch.randint(0, cfg.vocab_size, (1, args.prefill), generator=gen)
    reference = generate(fp32, prompt, n)[0, args.prompt_len:].tolist()
    int4_tokens = generate(ours["glassgpt int4"][1], prompt, n)[0, args.prompt_len:].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for kind in GGUF_TYPES:
            path = write_gguf(fp32, Path(tmp) / f"gpt2-{kind}.gguf", kind)
            for fa in (False, True):
                runners[f"llama.cpp {kind}{' + flash attention' if fa else ''}"] = (
                    PRECISION[kind], LlamaRunner(path, threads, fa, n_ctx=max(args.prefill, args.prompt_len + n)))
        decode, prefill, meta, notes = {}, {}, {}, {}
        for name, (precision, m) in ours.items():
            # One Engine per model, made once, as a llama.cpp context is: each call then pays for its own tokens
            # only (its cache of the same shape takes the last one's place in the step's plan).
            engine = as_engine(m)
            decode[name] = lambda e=engine: generate(e, prompt, n)
            prefill[name] = lambda e=engine, m=m: e(long, KVCache(cfg, 1, args.prefill, dtype=m.tok_emb.weight.dtype),
                                                   last_only=True)
            meta[name] = (precision, False, False)
            if args.compile and precision != "float32":
                compiled = compile_for_generation(m)
                decode[name + " + compile"] = lambda c=compiled: generate(c, prompt, n)
                prefill[name + " + compile"] = lambda c=compiled, m=m: c(
                    long, KVCache(cfg, 1, args.prefill, dtype=m.tok_emb.weight.dtype), last_only=True)
                meta[name + " + compile"] = (precision, True, False)
        for name, (precision, runner) in runners.items():
            ids = prompt[0].tolist()
            decode[name] = lambda r=runner, ids=ids: r.greedy(ids, n)
            prefill[name] = lambda r=runner: r.prefill(long[0].tolist())
            meta[name] = (precision, False, True)
            theirs = runner.greedy(ids, n)
            same = next((i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b), n)
            notes[name] = f"{same}/{n} tokens = glassgpt float32's"
            if precision == "int4":  # q4_0 (one scale per 32) against glassgpt's int4 (a scale and a minimum per 32)
                same = next((i for i, (a, b) in enumerate(zip(theirs, int4_tokens)) if a != b), n)
                notes[name] += f", {same}/{n} = glassgpt int4's"
        fp32_bytes = weight_bytes_per_token(fp32)
        with torch.inference_mode():
            decode_s = time_rows(decode, device, args.repeats, copy=copy)
            prefill_s = time_rows(prefill, device, args.repeats)
    print(f"\n{args.model}, {threads} threads; llama.cpp rows are compared like for like with the glassgpt row "
          "of the same precision (compile ignored: llama.cpp compiles ahead of time)")
    for name, s in decode_s.items():
        if name in ours or name.removesuffix(" + compile") in ours:
            note = copy.note(name, weight_bytes_per_token(ours[name.removesuffix(" + compile")][1]), n)
        else:  # llama.cpp reads the same matrices at its file's bits per weight
            note = copy.note(name, fp32_bytes * GGUF_BITS[name.split()[1]] / 32, n)
        notes[name] = f"{notes[name]}; {note}" if name in notes else note
    for title, unit, seconds, tokens in (
            (f"batch-1 generation ({args.prompt_len} + {n} tokens, greedy)", "new tokens/s", decode_s, n),
            (f"prefill 1 x {args.prefill}", "tokens/s", prefill_s, args.prefill)):
        rows = [Row(name, tokens / s, meta[name][0], False, meta[name][2],
                    notes.get(name, "") if seconds is decode_s else "") for name, s in seconds.items()]
        print_views(title, unit, rows)


if __name__ == "__main__":
    main()
