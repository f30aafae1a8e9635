"""Tokenizers: GPT-2's BPE gives exactly tiktoken's `gpt2` ids, and OpenAI's original algorithm agrees.

Two references, both offline:
- tiktoken's own `gpt2` encoding, built by `tiktoken.get_encoding("gpt2")` from a
  cache directory that holds glassgpt's shipped vocabulary files under the names
  tiktoken would have downloaded them to (sha1 of the URL);
- a pure-Python copy of OpenAI's `encoder.py` (gpt-2/src/encoder.py): bytes_to_unicode,
  the merge loop by rank from vocab.bpe, and the original split pattern run by
  the `regex` package. glassgpt runs on tiktoken's engine, so this second check is
  what makes the parity non-tautological.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from functools import lru_cache
from importlib import resources
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glassgpt
from glassgpt import get_tokenizer
from glassgpt.tokenizer import (
    ENDOFTEXT, VOCAB_SHA256, CharTokenizer, TokenizerError, gpt2_byte_to_unicode, tokenizer_from_dict,
)

from conftest import shared_data
from helpers import assert_one_line_error, run

DATA = resources.files("glassgpt").joinpath("vocab")
GPT2_URLS = {  # the URLs in tiktoken_ext/openai_public.py gpt2()
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


# --- the references -------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiktoken_gpt2(tmp_path_factory):
    """tiktoken's real `gpt2` encoding, built from the shipped files; no network possible."""
    import tiktoken
    import tiktoken.load

    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name, url in GPT2_URLS.items():
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(DATA.joinpath(name).read_bytes())

    def no_network(blobpath):
        raise AssertionError(f"the test tried to download {blobpath}")

    saved_env, saved_read = os.environ.get("TIKTOKEN_CACHE_DIR"), tiktoken.load.read_file
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    tiktoken.load.read_file = no_network
    try:
        enc = tiktoken.get_encoding("gpt2")
        enc.encode_ordinary("warm up")  # the ranks load lazily in some versions
    finally:
        tiktoken.load.read_file = saved_read
        if saved_env is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved_env
    return enc


def openai_bytes_to_unicode() -> dict[int, str]:
    """Verbatim from OpenAI's gpt-2/src/encoder.py."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


class OpenAIEncoder:
    """OpenAI's original GPT-2 encoder (gpt-2/src/encoder.py), minus its decoder."""

    PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]]):
        self.encoder = encoder
        self.byte_encoder = openai_bytes_to_unicode()
        self.bpe_ranks = dict(zip(merges, range(len(merges))))
        self.cache: dict[str, str] = {}

    def bpe(self, token: str) -> str:
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = set(zip(word, word[1:]))
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word: list[str] = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = set(zip(word, word[1:]))
        self.cache[token] = " ".join(word)
        return self.cache[token]

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in regex.findall(self.PATTERN, text):
            piece = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(piece).split(" "))
        return ids


@lru_cache(maxsize=1)
def openai_encoder() -> OpenAIEncoder:
    encoder = json.loads(DATA.joinpath("encoder.json").read_text(encoding="utf-8"))
    lines = DATA.joinpath("vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
    return OpenAIEncoder(encoder, [tuple(line.split()) for line in lines])


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


# --- the shipped files ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["encoder.json", "vocab.bpe"])
def test_shipped_vocab_files_have_openais_sha256(name):
    import tiktoken_ext.openai_public as openai_public
    import inspect

    digest = hashlib.sha256(DATA.joinpath(name).read_bytes()).hexdigest()
    assert digest == VOCAB_SHA256[name]
    # The same hashes tiktoken checks its downloads against.
    assert digest in inspect.getsource(openai_public.gpt2)


def test_damaged_vocab_file_is_refused(monkeypatch):
    from glassgpt import tokenizer as tokenizer_module

    monkeypatch.setitem(tokenizer_module.VOCAB_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(TokenizerError, match="reinstall"):
        tokenizer_module._read_vocab_file("vocab.bpe")


def test_byte_to_unicode_map_is_openais():
    assert gpt2_byte_to_unicode() == openai_bytes_to_unicode()


def test_encoder_ranks_follow_the_merge_order_of_vocab_bpe():
    # tiktoken merges by rank, so the packaged encoder.json must number each merge's result in
    # vocab.bpe's order; the tokenizer no longer re-checks this pinned fact at every start.
    from glassgpt.tokenizer import _gpt2_ranks

    ranks = _gpt2_ranks()
    to_bytes = {c: b for b, c in openai_bytes_to_unicode().items()}
    merges = DATA.joinpath("vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
    assert len(merges) == 50000
    assert all(ranks[bytes(to_bytes[c] for c in first + second)] == rank
               for rank, (first, second) in enumerate((line.split() for line in merges), start=256))


# --- GPT-2 BPE: basic facts -----------------------------------------------------------

def test_gpt2_tokenizer_has_50257_tokens_and_eot_50256(tok):
    assert tok.n_vocab == 50257
    assert tok.eot_id == 50256
    assert tok.decode([50256]) == ENDOFTEXT
    assert get_tokenizer("gpt2") is tok  # built once


def test_every_token_id_decodes_to_its_bytes_in_encoder_json(tok):
    encoder = json.loads(DATA.joinpath("encoder.json").read_text(encoding="utf-8"))
    byte_decoder = {c: b for b, c in openai_bytes_to_unicode().items()}
    for token, token_id in encoder.items():
        if token != ENDOFTEXT:
            assert tok.token_bytes(token_id) == bytes(byte_decoder[c] for c in token), token


def test_known_ids_of_a_famous_prompt(tok):
    # From the book (chapter 2/4): "Every effort moves you" -> [6109, 3626, 6100, 345].
    assert tok.encode("Every effort moves you") == [6109, 3626, 6100, 345]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]


def test_to_dict_round_trips_to_the_same_tokenizer(tok):
    assert tokenizer_from_dict(tok.to_dict()) is tok


# --- parity with tiktoken -------------------------------------------------------------

EDGE_CASES = [
    "",
    "a",
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "many     spaces   between",
    "\t\ttabs\tand\nnewlines\n\n\nand\r\nCRLF",
    " \n \t \n",
    "\n",
    "   ",
    "he's she'll we've they're I'm you'd don't",
    "HE'S SHE'LL WE'VE THEY'RE I'M YOU'D DON'T",
    "I'VE 'VE 'Ve 's 'll",
    "rock 'n' roll '' ''' ' '",
    "12345678901234567890 3.14159 1,000,000 -42 0x1F 2024-01-01",
    "१२३ ٤٥٦ ⅫⅢ ½ ²³",
    "😀 👍🏽 🇺🇳 🏳️‍🌈",
    "👩‍👩‍👧‍👦 family, 👨‍💻 coder, 🧑🏿‍🚀 astronaut",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트",
    "Привет, мир! Ελληνικά",
    "مرحبا بالعالم",
    "e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311a\u0308",
    "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "\u00a0non-breaking\u00a0spaces\u2009thin\u3000ideographic",
    "zero\u200bwidth\u200cjoiners\u200d\ufeffbom",
    "\x00\x01\x7f control \x1b[31m",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|endoftext|> <|endoftext|><|endoftext|>",
    "!!!???...,,,;;;:::",
    "def f(x):\n    return x ** 2  # comment\n",
    "https://example.com/a_b-c?d=e&f=g#h",
    "\U0010ffff \U0001f600\U0001f600\U0001f600",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_match_tiktoken_and_round_trip(tok, tiktoken_gpt2, text):
    ids = tok.encode(text)
    assert ids == tiktoken_gpt2.encode_ordinary(text)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_match_openais_original_encoder(tok, text):
    assert tok.encode(text) == openai_encoder().encode(text)


def test_endoftext_in_user_text_is_plain_text_unless_allowed(tok, tiktoken_gpt2):
    text = "a<|endoftext|>b"
    as_text = tok.encode(text)
    assert 50256 not in as_text
    assert as_text == tiktoken_gpt2.encode_ordinary(text)
    allowed = tok.encode(text, allowed_special={ENDOFTEXT})
    assert allowed == tiktoken_gpt2.encode(text, allowed_special={ENDOFTEXT})
    assert allowed.count(50256) == 1
    assert tok.decode(allowed) == text


def test_the_verdict_matches_tiktoken(tok, tiktoken_gpt2):
    text = shared_data("the-verdict.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert ids == tiktoken_gpt2.encode_ordinary(text)
    assert tok.decode(ids) == text


def test_tinyshakespeare_matches_tiktoken(tok, tiktoken_gpt2):
    text = shared_data("tinyshakespeare.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert ids == tiktoken_gpt2.encode_ordinary(text)
    assert tok.decode(ids) == text


def words_for_the_independent_check() -> list[str]:
    """A few thousand words: this file's own text, the-verdict (or its stand-in), and made-up ones."""
    text = Path(__file__).read_text(encoding="utf-8") + shared_data("the-verdict.txt").read_text(encoding="utf-8")
    words = text.split()
    words += [" " + w for w in words] + [w.upper() for w in words] + [w[::-1] for w in words]
    return list(dict.fromkeys(words))


def test_thousands_of_words_match_openais_original_encoder(tok):
    words = words_for_the_independent_check()
    assert len(words) > 2000
    reference = openai_encoder()
    for word in words:
        assert tok.encode(word) == reference.encode(word), word


# Text that mixes the classes the split pattern cares about, so that hypothesis
# explores the boundaries: letters, digits, spaces of several kinds, apostrophes, emoji.
pieces = st.sampled_from(list(string.ascii_letters + string.digits + string.punctuation) + [
    " ", "  ", "\t", "\n", "\r\n", "\u00a0", "'s", "'ll", "'VE", "é", "e\u0301", "中", "😀", "👩‍💻",
    "\u200d", ENDOFTEXT])
mixed_text = st.lists(pieces, max_size=30).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=60), mixed_text))
def test_random_strings_match_tiktoken_and_round_trip(tok, tiktoken_gpt2, text):
    ids = tok.encode(text)
    assert ids == tiktoken_gpt2.encode_ordinary(text)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=40), mixed_text))
def test_random_strings_match_openais_original_encoder(tok, text):
    assert tok.encode(text) == openai_encoder().encode(text)


# --- decoding errors ------------------------------------------------------------------

@pytest.mark.parametrize("bad", [50257, 10**9, -1])
def test_out_of_range_ids_raise_tokenizer_error_naming_the_id(tok, bad):
    with pytest.raises(TokenizerError) as err:
        tok.decode([5, bad])
    assert str(bad) in str(err.value) and "50256" in str(err.value)
    with pytest.raises(TokenizerError):
        tok.token_bytes(bad)


def test_decode_of_a_split_character_shows_replacement_not_an_error(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # an emoji is several byte-level tokens
    assert "\ufffd" in tok.decode(ids[:1])
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode("utf-8")


def test_unknown_tokenizer_spec_lists_choices(tmp_path, capsys):
    with pytest.raises(TokenizerError, match="gpt2, char"):
        get_tokenizer("gpt5")
    # and on the command line, the same words in one line, exit code 2
    data = tmp_path / "text.txt"
    data.write_text("hello world\n" * 20, encoding="utf-8")
    code, _, err = run(["train", "--data", str(data), "--tokenizer", "gpt5", "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "unknown tokenizer 'gpt5'", "gpt2, char")
    assert not (tmp_path / "run" / "latest").exists()


# --- char tokenizer -------------------------------------------------------------------

def test_char_tokenizer_round_trips_and_uses_sorted_ids():
    text = "hello, world!\nÀ😀"
    tok = get_tokenizer("char", text=text)
    assert isinstance(tok, CharTokenizer)
    assert tok.n_vocab == len(set(text))
    assert tok.eot_id is None
    assert tok.chars == sorted(set(text))
    assert tok.encode("hello") == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode_bytes(tok.encode("😀")) == "😀".encode("utf-8")


def test_char_tokenizer_save_and_load(tmp_path):
    tok = get_tokenizer("char", text="To be, or not to be")
    tok.save(tmp_path / "tok.json")
    loaded = get_tokenizer(str(tmp_path / "tok.json"))
    assert loaded.chars == tok.chars
    assert loaded.encode("not to be") == tok.encode("not to be")


def test_char_tokenizer_errors_name_the_problem():
    tok = get_tokenizer("char", text="abc")
    with pytest.raises(TokenizerError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(TokenizerError, match="3"):
        tok.decode([0, 3])
    with pytest.raises(TokenizerError, match="text"):
        get_tokenizer("char")
    with pytest.raises(TokenizerError, match="non-empty"):
        get_tokenizer("char", text="")


def test_unreadable_tokenizer_file_is_a_tokenizer_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(TokenizerError, match="bad.json"):
        get_tokenizer(str(bad))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"type": "wordpiece"}))
    with pytest.raises(TokenizerError, match="wordpiece"):
        get_tokenizer(str(odd))


def test_public_api_exports_the_tokenizer():
    assert glassgpt.get_tokenizer is get_tokenizer


def test_allowed_special_accepts_tiktokens_spellings():
    tok = glassgpt.get_tokenizer("gpt2")
    text = "a<|endoftext|>"
    assert tok.encode(text, allowed_special="all") == [64, 50256]
    assert tok.encode(text, allowed_special="<|endoftext|>") == [64, 50256]
    assert tok.encode(text, allowed_special={"<|endoftext|>"}) == [64, 50256]
    assert 50256 not in tok.encode(text)


# --- <|endoftext|> written in text: plain text by default, the one token with --allow-special --------

TEXT_WITH_EOT = "The end.<|endoftext|>A new text"


def _hf_gpt2_tokenizer():
    """transformers' GPT-2 tokenizer built offline from the vocabulary glassgpt ships (no hub): its
    files are `vocab` and `merges` since transformers 5, `vocab_file` and `merges_file` before."""
    import inspect
    from transformers import GPT2TokenizerFast
    vocab = resources.files("glassgpt").joinpath("vocab")
    files = (str(vocab.joinpath("encoder.json")), str(vocab.joinpath("vocab.bpe")))
    if "vocab_file" in inspect.signature(GPT2TokenizerFast.__init__).parameters:
        return GPT2TokenizerFast(vocab_file=files[0], merges_file=files[1])
    return GPT2TokenizerFast(vocab=files[0], merges=files[1])


def test_endoftext_reads_as_tiktoken_and_transformers_read_it_by_choice(offline_tiktoken):
    import tiktoken
    enc, hf, tok = tiktoken.get_encoding("gpt2"), _hf_gpt2_tokenizer(), get_tokenizer("gpt2")
    special = enc.encode(TEXT_WITH_EOT, allowed_special={"<|endoftext|>"})
    plain = enc.encode_ordinary(TEXT_WITH_EOT)
    assert special.count(50256) == 1 and 50256 not in plain
    assert enc.decode(special) == enc.decode(plain) == TEXT_WITH_EOT  # the same text, read two ways
    # glassgpt's default is tiktoken's ordinary reading (its encode refuses the text instead) ...
    assert tok.encode(TEXT_WITH_EOT) == plain
    with pytest.raises(ValueError, match="disallowed special token"):
        enc.encode(TEXT_WITH_EOT)
    # ... and allowed_special (--allow-special) is tiktoken's allowed and transformers' own reading.
    assert tok.encode(TEXT_WITH_EOT, allowed_special={"<|endoftext|>"}) == special
    assert len(hf) == 50257
    assert hf(TEXT_WITH_EOT)["input_ids"] == special
    assert hf(TEXT_WITH_EOT, split_special_tokens=True)["input_ids"] == plain  # transformers' plain reading


def _cli(argv, capsys):
    from glassgpt.cli import main
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return (code, *capsys.readouterr())


@pytest.fixture
def small_model(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"vocab_size": 50257, "context_length": 32, "emb_dim": 16, "n_heads": 2,
                                "n_layers": 1}))
    return str(path)


@pytest.mark.parametrize("allow", [False, True])
def test_generate_reads_endoftext_in_the_prompt_as_chosen_and_says_how(small_model, capsys, allow, offline_tiktoken):
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    code, out, err = _cli(["generate", TEXT_WITH_EOT, "--model", small_model, "--max-new-tokens", "1", "--json"]
                          + (["--allow-special"] if allow else []), capsys)
    assert code == 0, err
    expected = enc.encode(TEXT_WITH_EOT, allowed_special={"<|endoftext|>"}) if allow else enc.encode_ordinary(TEXT_WITH_EOT)
    assert json.loads(out)["prompt_ids"] == expected
    notes = [line for line in err.splitlines() if "<|endoftext|> in the prompt" in line]
    assert len(notes) == 1
    assert ("the one token 50256 (--allow-special)" if allow else "plain text (on its own 7 tokens") in notes[0]


@pytest.mark.parametrize("allow", [False, True])
def test_the_trace_says_how_endoftext_in_the_prompt_was_read(small_model, capsys, allow):
    code, out, err = _cli(["explain", TEXT_WITH_EOT, "--model", small_model, "--format", "json", "--no-embedding-check"]
                          + (["--allow-special"] if allow else []), capsys)
    assert code == 0, err
    trace = json.loads(out)
    ids = [t["id"] for t in trace["tokens"]]
    assert (50256 in ids) == allow
    assert sum("<|endoftext|> in the prompt" in note for note in trace["notes"]) == 1


def test_a_prompt_without_endoftext_gets_no_note(small_model, capsys):
    code, out, err = _cli(["explain", "no special token here", "--model", small_model, "--format", "json",
                           "--allow-special"], capsys)
    assert code == 0 and not any("endoftext" in n for n in json.loads(out)["notes"])


@pytest.mark.parametrize("allow", [False, True])
def test_training_text_reads_endoftext_as_chosen_and_between_files_always(tmp_path, capsys, allow):
    from glassgpt.training.tasks.data import tokenize_files
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT_WITH_EOT)
    b.write_text("second file")
    tok = get_tokenizer("gpt2")
    ids = tokenize_files([a, b], tok, tmp_path / "cache", allow_special=allow).ids().tolist()
    first = tok.encode(TEXT_WITH_EOT, {"<|endoftext|>"} if allow else ())
    assert ids == first + [50256] + tok.encode("second file")
    # The reading is part of the cache's key: the other reading never reuses these ids.
    other = tokenize_files([a, b], tok, tmp_path / "cache", allow_special=not allow)
    assert other.ids().tolist() != ids


def test_allow_special_is_refused_for_a_tokenizer_without_the_token(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("abc " * 400)
    code, _, err = _cli(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--tokenizer", "char",
                         "--n-layers", "1", "--emb-dim", "16", "--n-heads", "2", "--context-length", "16",
                         "--allow-special"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --allow-special")
