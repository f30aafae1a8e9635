"""Hub ids for Qwen3 and Llama 3.2, offline: huggingface_hub's two download functions are replaced by a
fake hub that serves repositories from folders written here and records every file it sends.

What a reader sees: `glassgpt explain --model Qwen/Qwen3-0.6B` fetches config.json first, decides the
model from its `architectures`, checks the memory, and only then fetches the files that model needs
(the safetensors or its shards and index, generation_config.json, the tokenizer), never the rest of
the repository; a second run fetches nothing. An architecture glassgpt does not cover, a gated
repository without a token, and a model too big for this machine are each answered in one line
before a single weight is downloaded. The families' presets (`qwen3-0.6b`, ...) are their shapes
with random weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import glassgpt
from glassgpt import formats, memory
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.families import FAMILY_PRESETS, FamilyConfig, Llama3Model, Qwen3Model, RopeFreq, build_model
from glassgpt.formats import hub
from glassgpt.formats.families import export_family_hf
from glassgpt.formats.family_tokenizers import QWEN_SPECIALS

from conftest import make_hf_model, save_hf_model
from helpers import assert_one_line_error, run

QWEN = FamilyConfig(family="qwen3", vocab_size=320, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                    hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True,
                    tie_embeddings=True)
LLAMA = FamilyConfig(family="llama3", vocab_size=512, context_length=64, emb_dim=16, n_heads=4, n_layers=2,
                     hidden_dim=32, n_kv_groups=2, rope_base=500_000.0, rope_freq=RopeFreq(), norm_eps=1e-5,
                     tie_embeddings=True)
PROMPT = "the quick brown fox"


def hub_error(name: str):
    """huggingface_hub's error `name`, as its download functions raise it (built without an HTTP response)."""
    import huggingface_hub.errors as errors
    cls = getattr(errors, name)
    err = cls.__new__(cls)
    Exception.__init__(err, f"{name} (a fake hub)")
    return err


class FakeHub:
    """hf_hub_download and snapshot_download over `repos` (repo id -> folder): `local_files_only` reads the
    cache this hub filled; otherwise each file sent is recorded in `sent`, and `calls` holds every call."""

    def __init__(self, cache: Path, repos: dict[str, Path], gated: tuple[str, ...] = ()):
        self.cache, self.repos, self.gated = cache, repos, gated
        self.calls: list[tuple] = []
        self.sent: list[str] = []

    def _snapshot(self, repo_id: str) -> Path:
        return self.cache / repo_id.replace("/", "--")

    def _reach(self, repo_id: str) -> Path:
        if repo_id in self.gated:
            raise hub_error("GatedRepoError")
        if repo_id not in self.repos:
            raise hub_error("RepositoryNotFoundError")
        return self.repos[repo_id]

    def _send(self, repo_id: str, name: str) -> None:
        target = self._snapshot(repo_id) / name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.repos[repo_id] / name, target)
            self.sent.append(name)

    def hf_hub_download(self, repo_id: str, filename: str, *, local_files_only: bool = False, **_) -> str:
        self.calls.append(("hf_hub_download", filename, local_files_only))
        if local_files_only:
            if not (self._snapshot(repo_id) / filename).is_file():
                raise hub_error("LocalEntryNotFoundError")
        else:
            if not (self._reach(repo_id) / filename).is_file():
                raise hub_error("EntryNotFoundError")
            self._send(repo_id, filename)
        return str(self._snapshot(repo_id) / filename)

    def snapshot_download(self, repo_id: str, *, allow_patterns=None, local_files_only: bool = False, **_) -> str:
        self.calls.append(("snapshot_download", tuple(allow_patterns), local_files_only))
        if local_files_only:
            if not self._snapshot(repo_id).is_dir():
                raise hub_error("LocalEntryNotFoundError")
            return str(self._snapshot(repo_id))
        root = self._reach(repo_id)
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            name = file.relative_to(root).as_posix()
            if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                self._send(repo_id, name)
        return str(self._snapshot(repo_id))

    def network_calls(self) -> list[tuple]:
        return [c for c in self.calls if not c[-1]]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def serve(repos: dict[str, Path], gated: tuple[str, ...] = ()) -> FakeHub:
        fake = FakeHub(tmp_path / "hf-cache", repos, gated)
        monkeypatch.setattr(hub, "reachable", lambda: True)  # the fake hub answers without a network
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
        return fake
    return serve


def qwen_tokenizer_json(path: Path) -> Path:
    """A small byte-level BPE with Qwen3's special tokens, trained here (the `tokenizers` library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(QWEN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 10], trainer)
    tok.save(str(path))
    return path


def llama_tokenizer_model(path: Path) -> Path:
    """A tiktoken file (base64 token and rank per line) of the 256 bytes: 512 ids with Meta's specials."""
    import base64
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return path


def qwen_repo(path: Path, cfg: FamilyConfig = QWEN) -> Path:
    """A Qwen3 repository as the hub holds one, with files glassgpt must not fetch beside those it needs."""
    torch.manual_seed(0)
    export_family_hf(build_model(cfg).eval(), path)
    qwen_tokenizer_json(path / "tokenizer.json")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    for extra in ("README.md", "merges.txt", "vocab.json", "tokenizer_config.json", "onnx/model.safetensors"):
        (path / extra).parent.mkdir(parents=True, exist_ok=True)
        (path / extra).write_text("not needed")
    return path


def llama_repo(path: Path) -> Path:
    """A Llama 3.2 repository as Meta's: two safetensors shards and their index, the tokenizer and a .pth of
    the weights in original/, and transformers' tokenizer.json."""
    torch.manual_seed(0)
    export_family_hf(build_model(LLAMA).eval(), path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llama_tokenizer_model(path / "original" / "tokenizer.model")
    (path / "original" / "consolidated.00.pth").write_bytes(b"the weights again, never fetched")
    (path / "original" / "params.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 128001}))
    (path / "tokenizer.json").write_text("transformers' copy, not read")
    return path


QWEN_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def test_a_qwen3_hub_id_fetches_config_json_first_then_only_the_files_its_model_needs(tmp_path, fake_hub, capsys):
    fake = fake_hub({"Qwen/Qwen3-tiny": qwen_repo(tmp_path / "repo")})
    code, out, err = run(["explain", PROMPT, "--model", "Qwen/Qwen3-tiny"], capsys)
    assert code == 0, err
    assert "Qwen3: 2 blocks" in out and "16 query heads" not in out
    assert fake.network_calls() == [("hf_hub_download", "config.json", False),
                                    ("snapshot_download", hub.REPO_FILES["qwen3"], False)]
    assert sorted(fake.sent) == QWEN_FILES  # not the README, merges.txt, vocab.json or onnx/'s copy
    # the model and tokenizer are those of the repository's own folder
    ids = torch.tensor([glassgpt.load_tokenizer(tmp_path / "repo").encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(glassgpt.load_model("Qwen/Qwen3-tiny")(ids), glassgpt.load_model(tmp_path / "repo")(ids))
    # a second run reads the cache: nothing more from the network
    before = len(fake.network_calls())
    assert run(["explain", PROMPT, "--model", "Qwen/Qwen3-tiny"], capsys)[0] == 0
    assert len(fake.network_calls()) == before


def test_a_llama_hub_id_fetches_its_shards_and_originals_tokenizer_not_the_pth(tmp_path, fake_hub, capsys):
    fake = fake_hub({"meta-llama/Llama-tiny": llama_repo(tmp_path / "repo")})
    code, out, err = run(["generate", "hi", "--model", "meta-llama/Llama-tiny", "--max-new-tokens", "3",
                          "--temperature", "0", "--json"], capsys)
    assert code == 0, err
    assert sorted(fake.sent) == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                 "original/tokenizer.model"]
    model = glassgpt.load_model("meta-llama/Llama-tiny")
    assert isinstance(model, Llama3Model) and model.cfg == LLAMA
    assert json.loads(out)["prompt_ids"] == glassgpt.load_tokenizer("meta-llama/Llama-tiny").encode("hi")


def test_a_gated_repository_without_a_token_says_to_accept_the_license_and_set_hf_token(fake_hub, capsys):
    fake = fake_hub({}, gated=("meta-llama/Llama-3.2-1B",))
    code, _, err = run(["explain", PROMPT, "--model", "meta-llama/Llama-3.2-1B"], capsys)
    assert_one_line_error(code, err, "meta-llama/Llama-3.2-1B is gated", "accept its license",
                          "https://huggingface.co/meta-llama/Llama-3.2-1B", "HF_TOKEN", "hf auth login")
    assert [c[0] for c in fake.network_calls()] == ["hf_hub_download"] and fake.sent == []


def test_an_uncovered_architecture_is_refused_from_config_json_before_any_weights(tmp_path, fake_hub, capsys):
    repo = tmp_path / "gemma"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    (repo / "model.safetensors").write_bytes(b"weights that must not be fetched")
    fake = fake_hub({"google/gemma-2-2b": repo})
    code, _, err = run(["explain", PROMPT, "--model", "google/gemma-2-2b"], capsys)
    assert_one_line_error(code, err, "google/gemma-2-2b's config.json is a Gemma2ForCausalLM (gemma2)",
                          "glassgpt covers Qwen3ForCausalLM (qwen3), Qwen3MoeForCausalLM (qwen3), LlamaForCausalLM (llama3)")
    assert fake.network_calls() == [("hf_hub_download", "config.json", False)] and fake.sent == ["config.json"]


def test_a_quantized_repository_is_refused_from_config_json_before_any_weights(tmp_path, fake_hub, capsys):
    repo = qwen_repo(tmp_path / "repo")
    raw = json.loads((repo / "config.json").read_text())
    (repo / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "fp8"}}))
    fake = fake_hub({"Qwen/Qwen3-tiny-FP8": repo})
    code, _, err = run(["explain", PROMPT, "--model", "Qwen/Qwen3-tiny-FP8"], capsys)
    assert_one_line_error(code, err, "describes fp8 weights (quantization_config)", "unquantized repository")
    assert fake.sent == ["config.json"]


def test_a_model_too_big_for_this_machine_is_refused_before_its_weights_are_fetched(tmp_path, fake_hub, capsys,
                                                                                     monkeypatch):
    fake = fake_hub({"Qwen/Qwen3-tiny": qwen_repo(tmp_path / "repo")})
    monkeypatch.setattr(memory, "available_memory", lambda device=None: memory.Free(10_000, 0, "a test"))
    code, _, err = run(["explain", PROMPT, "--model", "Qwen/Qwen3-tiny"], capsys)
    assert_one_line_error(code, err, "Qwen/Qwen3-tiny")
    assert fake.sent == ["config.json"]
    # load_model checks the weights alone, in its own words, before fetching them
    with pytest.raises(ConfigError, match="Qwen/Qwen3-tiny: .* parameters"):
        glassgpt.load_model("Qwen/Qwen3-tiny")
    assert fake.sent == ["config.json"]


def test_info_of_a_hub_id_reads_config_json_alone(tmp_path, fake_hub, capsys):
    fake = fake_hub({"Qwen/Qwen3-tiny": qwen_repo(tmp_path / "repo")})
    code, out, err = run(["info", "--model", "Qwen/Qwen3-tiny", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["config"] == QWEN.to_dict() and fake.sent == ["config.json"]


def test_download_fetches_a_family_repository_and_an_unknown_one_is_one_line(tmp_path, fake_hub, capsys):
    fake = fake_hub({"Qwen/Qwen3-tiny": qwen_repo(tmp_path / "repo")})
    code, out, err = run(["download", "Qwen/Qwen3-tiny"], capsys)
    assert code == 0, err
    assert sorted(fake.sent) == QWEN_FILES and Path(out.strip()) == fake.cache / "Qwen--Qwen3-tiny"
    code, _, err = run(["download", "Qwen/No-such-model"], capsys)
    assert_one_line_error(code, err, "Qwen/No-such-model", "no such repository")


def test_a_gpt2_hub_id_still_fetches_config_json_and_model_safetensors_alone(tmp_path, fake_hub):
    repo = save_hf_model(make_hf_model(seed=1), tmp_path / "gpt2")
    (repo / "pytorch_model.bin").write_bytes(b"a pickle, never fetched")
    fake = fake_hub({"openai-community/gpt2-tiny": repo})
    model = glassgpt.load_model("openai-community/gpt2-tiny")
    assert isinstance(model, glassgpt.GPTModel) and model.cfg == glassgpt.load_model(repo).cfg
    assert sorted(fake.sent) == ["config.json", "model.safetensors"]
    assert glassgpt.formats.read_config("openai-community/gpt2-tiny") is None  # a GPT-2's: read with its weights


def test_a_family_preset_is_its_shapes_with_random_weights_and_says_so(monkeypatch, capsys):
    preset = dataclasses.replace(QWEN, vocab_size=50_257)  # read with GPT-2's tokenizer: glassgpt ships no Qwen3's
    monkeypatch.setitem(FAMILY_PRESETS, "qwen3-tiny", preset)
    monkeypatch.setitem(hub.PRESET_REPOS, "qwen3-tiny", "Qwen/Qwen3-tiny")
    source = formats.open("qwen3-tiny")
    assert source.random_weights and source.local_config() == preset
    code, out, err = run(["explain", PROMPT, "--model", "qwen3-tiny", "--seed", "3"], capsys)
    assert code == 0, err
    assert "qwen3-tiny has random weights" in err and "Load Qwen/Qwen3-tiny" in err
    assert "Qwen3: 2 blocks" in out
    a, b = (formats.open("qwen3-tiny").load(seed=3) for _ in range(2))
    assert isinstance(a, Qwen3Model) and torch.equal(a.tok_emb.weight, b.tok_emb.weight)


@pytest.mark.slow
def test_explain_runs_qwen3_0_6b_at_its_full_shape_with_random_weights(capsys):
    code, out, err = run(["explain", "Every effort moves you", "--model", "qwen3-0.6b"], capsys)
    assert code == 0, err
    assert "Where does 151,936 become 1,024?" in out and "596,049,920 parameters" in out
    assert "queries [1, 16, 4, 128], keys and values [1, 8, 4, 128]" in out


def test_a_hub_id_that_is_nothing_offline_still_says_where_to_put_the_files(fake_hub):
    fake_hub({})
    with pytest.raises(CheckpointError, match="no model 'nobody/nothing' here or on the Hugging Face hub .*"
                                              "model.safetensors"):
        glassgpt.load_model("nobody/nothing")


def test_without_a_network_a_hub_id_is_one_line_at_once_not_the_hubs_retries(monkeypatch):
    """huggingface_hub retries an unreachable host for about 20 s and logs each try; glassgpt asks the
    resolver first and says it in one line (what a mistyped local path that looks like owner/name gets)."""
    import socket

    import huggingface_hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(socket.gaierror(-2, "unknown")))
    called = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, local_files_only=False, **k: called.append(local_files_only) or
                        (_ for _ in ()).throw(FileNotFoundError("not in the cache")))
    repo, reason = hub.try_fetch_config("Qwen/Qwen3-0.6B")
    assert repo is None and reason == "huggingface.co cannot be reached from here (no network?)"
    assert called == [True]  # the cache was asked; the network never
