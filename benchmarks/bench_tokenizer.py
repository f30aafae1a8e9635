"""GPT-2 tokenizer speed: glassgpt vs tiktoken (and Hugging Face's fast tokenizer), MB/s on 1 MB of text.

glassgpt's GPT-2 tokenizer runs on tiktoken's engine, so the goal is no loss: no
Python work added per call. The reference tiktoken Encoding is built here straight
from the vocabulary files with tiktoken's own loader (no glassgpt code), since
`tiktoken.get_encoding("gpt2")` would download them. Text: the first 1 MB of
tinyshakespeare (or a generated text when ../shared/data is absent).

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_tokenizer.py
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import tiktoken
import tiktoken.load
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DATA, machine_info, print_table, time_rows  # noqa: E402

from glassgpt.tokenizer import get_tokenizer  # noqa: E402

VOCAB_DIRS = [DATA / "gpt2", Path(__file__).resolve().parents[1] / "src" / "glassgpt" / "vocab"]


def reference_tiktoken() -> tiktoken.Encoding:
    from tiktoken_ext.openai_public import r50k_pat_str

    folder = next(d for d in VOCAB_DIRS if (d / "vocab.bpe").is_file())
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(folder / "vocab.bpe"), encoder_json_file=str(folder / "encoder.json"))
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def sample_text(n_bytes: int) -> str:
    path = DATA / "tinyshakespeare.txt"
    if path.is_file():
        return path.read_bytes()[:n_bytes].decode("utf-8", errors="ignore")
    rng = random.Random(0)
    words = ["the", "model", "reads", "every", "token", "once", "and", "attends", "to", "all", "before", "it"]
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:n_bytes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megabytes", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(machine_info(torch.device("cpu")))
    text = sample_text(int(args.megabytes * 1_000_000))
    mb = len(text.encode("utf-8")) / 1e6
    lines = text.splitlines(keepends=True)
    per = -(-len(lines) // 64)
    docs = ["".join(lines[i:i + per]) for i in range(0, len(lines), per)]  # 64 documents of ~16 KB
    ref = reference_tiktoken()
    ours = get_tokenizer("gpt2")
    ids = ref.encode_ordinary(text)
    assert ours.encode(text) == ids, "glassgpt's ids differ from tiktoken's"
    print(f"text: {mb:.2f} MB, {len(docs)} documents of {len(lines):,} lines, {len(ids):,} GPT-2 tokens; median of {args.repeats}")

    encode = {"tiktoken encode_ordinary": lambda: ref.encode_ordinary(text),
              "glassgpt encode": lambda: ours.encode(text)}
    batch = {"tiktoken encode_ordinary_batch": lambda: ref.encode_ordinary_batch(docs),
             "glassgpt encode_batch": lambda: ours.encode_batch(docs)}
    decode = {"tiktoken decode": lambda: ref.decode(ids), "glassgpt decode": lambda: ours.decode(ids)}
    try:
        from transformers import GPT2TokenizerFast
        folder = next(d for d in VOCAB_DIRS if (d / "vocab.bpe").is_file())
        hf = GPT2TokenizerFast(vocab_file=str(folder / "encoder.json"), merges_file=str(folder / "vocab.bpe"))
        hf.model_max_length = 10 ** 9
        if hf(text)["input_ids"] != ids:
            print("(HF's fast tokenizer splits some whitespace runs differently: its ids are not tiktoken's)")
        encode["HF GPT2TokenizerFast"] = lambda: hf(text)["input_ids"]
        decode["HF GPT2TokenizerFast decode"] = lambda: hf.decode(ids)
    except ImportError:
        pass
    cpu = torch.device("cpu")
    for title, fns, ref_name in (("encode, one 1 MB string", encode, "tiktoken encode_ordinary"),
                                 ("encode, a batch of 64 documents (tiktoken's thread pool)", batch,
                                  "tiktoken encode_ordinary_batch"),
                                 ("decode", decode, "tiktoken decode")):
        seconds = time_rows(fns, cpu, args.repeats)
        print_table(title, "MB/s", [(name, mb / s) for name, s in seconds.items()], ref_name)


if __name__ == "__main__":
    main()
