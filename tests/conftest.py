"""Shared fixtures: tiny random Hugging Face GPT-2 checkpoints (no downloads) and data files.

`hf_checkpoint(...)` builds a `GPT2LMHeadModel` from a `GPT2Config`, gives every
parameter (biases and LayerNorm scales included) random values, so that a mix-up
in the weight mapping cannot hide behind HF's zero/one initialisation, and saves
it with `save_pretrained` to a temporary directory. `shared_data(name)` is the
path of a text file under ../shared/data, or of a small stand-in under tests/data
when ../shared is absent (a bare clone), so that every test still runs.

What a machine may lack (a browser, a C++ compiler or an AVX-512 CPU for the kernels) skips the
tests that need it, through `skip_unless_required`, except where an environment variable says
it must be there (CI sets GLASSGPT_REQUIRE_BROWSER=1 and GLASSGPT_REQUIRE_KERNELS=1): there the
test fails, so that it never passes for nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest
import torch

import glassgpt

# GLASSGPT_TEST_SHARED_DATA (read by the tests only) points elsewhere, e.g. at an empty folder
# to check that the suite runs without ../shared.
SHARED_DATA = Path(os.environ.get("GLASSGPT_TEST_SHARED_DATA")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "data")
# Stand-ins written for these tests (never copies of the shared files): English prose with
# quotes, dashes, contractions and numbers; a few pages of verse dialogue.
STAND_INS = {"the-verdict.txt": "short-story.txt", "tinyshakespeare.txt": "small-play.txt"}

# A small GPT-2 whose sizes are all different from each other, so a transposed
# or swapped tensor changes a shape or at least every value.
TINY_HF = dict(vocab_size=101, n_positions=96, n_embd=48, n_layer=3, n_head=4)


def shared_data(name: str) -> Path:
    """../shared/data/NAME, else its stand-in in tests/data: tests may read the shared files,
    never commit them."""
    path = SHARED_DATA / name
    if path.is_file():
        return path
    if name not in STAND_INS:
        raise FileNotFoundError(f"{path} is absent and tests/data has no stand-in for it: add one to STAND_INS")
    return Path(__file__).parent / "data" / STAND_INS[name]


def skip_unless_required(message: str, variable: str) -> NoReturn:
    """Skip the test because this machine lacks something, unless `variable` is 1: then fail."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{variable}=1 but {message}")
    pytest.skip(message)


def needs_kernels():
    """`torch.ops.glassgpt` with glassgpt's own kernels (and the native step) loaded; where they
    cannot be built here, the test skips, or fails under GLASSGPT_REQUIRE_KERNELS=1."""
    from glassgpt.engine import native
    ops = native.load()
    if ops is None or native.library() is None:
        skip_unless_required(f"glassgpt's kernels are not available here: {native.status()}", "GLASSGPT_REQUIRE_KERNELS")
    return ops


def needs_gemv():
    """`torch.ops.glassgpt` with at least the float `gemv`: the whole kernels, or the AVX2 build (native.gemv_ops);
    where neither can be built here, the test skips, or fails under GLASSGPT_REQUIRE_GEMV=1."""
    from glassgpt.engine import native
    ops = native.gemv_ops()
    if ops is None:
        skip_unless_required(f"glassgpt's gemv is not available here: {native.gemv_status()}", "GLASSGPT_REQUIRE_GEMV")
    return ops


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each tensor once (a tied one is one tensor)."""
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    """Every parameter gets fresh random values (LayerNorm scales around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            if name.endswith(("weight", "scale")) and ("ln_" in name or "norm" in name):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)
    return model


def layer_norm_and_input(width: int = 48, seed: int = 0):
    """A LayerNorm with a scale and shift far from their initial 1 and 0, and an input of mean 1, std 3."""
    from glassgpt.model import LayerNorm
    torch.manual_seed(seed)
    norm = LayerNorm(width)
    with torch.no_grad():
        norm.scale.normal_(1.0, 0.3)
        norm.shift.normal_(0.0, 0.3)
    return norm, torch.randn(2, 5, width) * 3 + 1


def make_hf_model(seed: int = 0, std: float = 0.1, **config):
    """A random GPT2LMHeadModel (fp32, eval, no dropout) from GPT2Config(**config)."""
    import transformers

    values = dict(TINY_HF, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    values.update(config)
    cfg = transformers.GPT2Config(**values)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    if std:
        randomize_(model, seed, std)
    return model.float().eval()


def save_hf_model(model, path: Path, safetensors: bool = True) -> Path:
    """save_pretrained to PATH; with safetensors=False, as an old-style pytorch_model.bin."""
    path.mkdir(parents=True, exist_ok=True)
    if safetensors:
        model.save_pretrained(path)
        assert (path / "model.safetensors").is_file()
    else:
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """(HF model, its save_pretrained directory) for the small tied config."""
    model = make_hf_model(seed=0)
    return model, save_hf_model(model, tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture(scope="session")
def hf_tiny_untied(tmp_path_factory):
    """(HF model, directory) for the small config with tie_word_embeddings=False."""
    model = make_hf_model(seed=1, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    return model, save_hf_model(model, tmp_path_factory.mktemp("hf_tiny_untied"))


@pytest.fixture
def tiny_config() -> glassgpt.GPTConfig:
    return glassgpt.GPTConfig(vocab_size=97, context_length=32, emb_dim=32, n_heads=4, n_layers=2)


@pytest.fixture
def tiny_model(tiny_config) -> glassgpt.GPTModel:
    """A random glassgpt model built from `tiny_config` (fp32, eval), with every parameter
    drawn at std 0.3 so that next-token distributions are peaked, not near-uniform."""
    model = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=tiny_config)
    return randomize_(model, seed=0, std=0.3)


@pytest.fixture
def one_thread():
    """Run a test on one CPU thread: tiny models train faster on one, a busy 2-core machine makes two
    thrash, and the book's numbers need both sides on the same thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(name="shared_data")
def shared_data_fixture():
    return shared_data


GPT2_URLS = {  # where tiktoken's gpt2() reads its two files: the same files are glassgpt's vocab/
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


@pytest.fixture(scope="session")
def offline_tiktoken(tmp_path_factory):
    """The book's code calls tiktoken.get_encoding("gpt2"): built here from the
    files glassgpt ships, once (tiktoken keeps it), with no network."""
    import tiktoken
    import tiktoken.load
    from importlib import resources
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    vocab = resources.files("glassgpt").joinpath("vocab")
    for name, url in GPT2_URLS.items():
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(vocab.joinpath(name).read_bytes())
    saved_env, saved_read = os.environ.get("TIKTOKEN_CACHE_DIR"), tiktoken.load.read_file
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    tiktoken.load.read_file = lambda blobpath: pytest.fail(f"tiktoken tried to download {blobpath}")
    try:
        tiktoken.get_encoding("gpt2").encode_ordinary("warm up")
    finally:
        tiktoken.load.read_file = saved_read
        os.environ.pop("TIKTOKEN_CACHE_DIR") if saved_env is None else os.environ.__setitem__("TIKTOKEN_CACHE_DIR", saved_env)


@pytest.fixture(scope="module")
def openai_dir(tmp_path_factory) -> Path:
    from helpers import write_openai_folder
    return write_openai_folder(tmp_path_factory.mktemp("gpt2") / "124M")


@pytest.fixture
def openai_copy(openai_dir, tmp_path) -> Path:
    """A copy of the folder that a test may damage."""
    return Path(shutil.copytree(openai_dir, tmp_path / "124M"))
