"""The Hugging Face hub (huggingface_hub, an extra): a repository fetched into its cache, config.json first.

    repo, why = try_fetch_config("Qwen/Qwen3-0.6B")   config.json alone (the cache first): its
                                                      `architectures` say which model it is, before
                                                      any weights are asked for
    path, why = try_fetch_files(repo)                 then only the files that model needs (REPO_FILES)
    download("meta-llama/Llama-3.2-1B")               both, or one line: what `glassgpt download` runs

GPT-2 repositories need config.json and model.safetensors; Qwen3 and Llama 3.2 (formats/families.py)
their safetensors (one file, or shards and their index), generation_config.json, and their tokenizer:
Qwen3's tokenizer.json, Llama 3's tokenizer.model (Meta's repositories keep it in original/, beside
a .pth copy of the weights that is never fetched). An architecture glassgpt does not cover is refused
from config.json, so none of its weights are downloaded. A gated repository (Meta's) answers without
a token in one line: accept its license and set HF_TOKEN.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .families import HF_ARCHITECTURES, config_from_hf, hf_architecture
from .family_tokenizers import TOKENIZER_FILES
from .files import read_json

GPT2_ARCHITECTURE = "GPT2LMHeadModel"
_FAMILY_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json")
# What each model needs from its repository (fnmatch patterns: `model*.safetensors` is one file or the shards,
# never another folder's copy).
REPO_FILES: dict[str, tuple[str, ...]] = {
    "gpt2": ("config.json", "model.safetensors"),
    "qwen3": _FAMILY_FILES + TOKENIZER_FILES["qwen3"],
    "llama3": _FAMILY_FILES + TOKENIZER_FILES["llama3"],
}
# The repository of each Qwen3 / Llama 3.2 preset's trained weights (the presets themselves are random).
PRESET_REPOS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-1.7b": "Qwen/Qwen3-1.7B",
                "llama3.2-1b": "meta-llama/Llama-3.2-1B", "llama3.2-3b": "meta-llama/Llama-3.2-3B"}
INSTALL = "fetching needs huggingface_hub: pip install 'glassgpt[hub]'"


@dataclass(frozen=True)
class Repo:
    """A hub repository known by its config.json: `family` "gpt2", "qwen3" or "llama3"."""

    repo_id: str
    family: str
    raw: dict[str, Any]


def is_hub_id(spec: str) -> bool:
    """`owner/name` as the Hugging Face hub spells a repository; never a local-looking path or file name."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None
            and not spec.endswith((".pth", ".pt", ".bin", ".json", ".gguf", ".safetensors")))


def gated_line(repo_id: str) -> str:
    return (f"{repo_id} is gated: accept its license at https://huggingface.co/{repo_id} (logged in), then set "
            "HF_TOKEN to a token of that account or run `hf auth login` (`huggingface-cli login` in older "
            "huggingface_hub), and run this again")


def try_fetch_config(repo_id: str, progress: bool = True) -> tuple[Repo | None, str]:
    """(config.json of `repo_id` fetched alone, the cache first, and which model it describes, "") or (None, why
    it could not be fetched). A gated repository, an architecture glassgpt does not cover or a MoE config is
    refused here in one line (CheckpointError), before any weights are asked for."""
    path, reason = _fetch(repo_id, lambda hub, local: hub.hf_hub_download(repo_id, "config.json",
                                                                          local_files_only=local),
                          lambda p: p.is_file(), "no config.json in the repository", progress)
    if path is None:
        return None, reason
    raw = read_json(path, what=f"{repo_id}'s config", kind="config")
    arch = hf_architecture(raw)
    if arch in (None, GPT2_ARCHITECTURE) and not raw.get("num_experts"):
        return Repo(repo_id, "gpt2", raw), ""  # hf.py checks the rest of a GPT-2 config against its weights
    config_from_hf(raw, f"{repo_id}'s config.json")  # refuses an uncovered architecture or a MoE in its own words
    return Repo(repo_id, HF_ARCHITECTURES[arch], raw), ""


def try_fetch_files(repo: Repo, progress: bool = True) -> tuple[Path | None, str]:
    """(the folder in the hub's cache holding what `repo`'s model needs (REPO_FILES), the cache first, "") or
    (None, why not)."""
    patterns = list(REPO_FILES[repo.family])
    lacks = "no model.safetensors in the repository" if repo.family == "gpt2" else \
        "the repository lacks its safetensors or its tokenizer (" + ", ".join(patterns[2:]) + ")"
    return _fetch(repo.repo_id, lambda hub, local: hub.snapshot_download(repo.repo_id, allow_patterns=patterns,
                                                                         local_files_only=local),
                  lambda p: has_files(p, repo.family), lacks, progress)


def download(repo_id: str, progress: bool = True) -> Path:
    """config.json, then the files its model needs: the folder in the hub's cache (`glassgpt download`)."""
    repo, reason = try_fetch_config(repo_id, progress)
    path, reason = try_fetch_files(repo, progress) if repo is not None else (None, reason)
    if path is None:
        raise CheckpointError(f"could not fetch {repo_id!r} from the Hugging Face hub ({reason}): put its config.json "
                              "and weights (model.safetensors) in a directory and pass that directory as --model")
    return path


def has_files(path: Path, family: str) -> bool:
    """Whether a folder holds a whole model of `family`: config.json, the weights (every shard its index names)
    and, for Qwen3 and Llama 3, the tokenizer."""
    if not (path / "config.json").is_file():
        return False
    if family == "gpt2":
        return (path / "model.safetensors").is_file()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = read_json(index, kind="index").get("weight_map")
        except CheckpointError:
            return False
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        weights = bool(shards) and all((path / str(s)).is_file() for s in shards)
    else:
        weights = (path / "model.safetensors").is_file()
    return weights and any((path / name).is_file() for name in TOKENIZER_FILES[family])


def _fetch(repo_id: str, get, complete, lacks: str, progress: bool) -> tuple[Path | None, str]:
    """(the path get(huggingface_hub, local_files_only) returns from the cache, else from the network, once
    `complete(path)`, "") or (None, why not); a gated repository: its one line, raised at once."""
    try:
        import huggingface_hub
    except ImportError:
        return None, INSTALL
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    reason = lacks
    for local in (True, False):  # the cache first: no network needed for what is already here
        if not local and not reachable():
            # huggingface_hub would retry for about 20 s, logging each try: no network is said at once
            return None, f"{hub_host()} cannot be reached from here (no network?)"
        try:
            hub_log = logging.getLogger("huggingface_hub")
            level = hub_log.level
            hub_log.setLevel(logging.ERROR)  # its retry warnings: the one line below says what went wrong
            try:
                path = Path(get(huggingface_hub, local))
            finally:
                hub_log.setLevel(level)
        except Exception as e:  # offline, unknown repository, auth: each said in a few words
            if _is(e, "GatedRepoError"):
                raise CheckpointError(gated_line(repo_id)) from None
            if not local:
                reason = _reason(e)
            continue
        if complete(path):
            return path, ""
    return None, reason


def hub_host() -> str:
    """The hub's host name: huggingface.co, or HF_ENDPOINT's (a mirror)."""
    from urllib.parse import urlparse
    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def reachable() -> bool:
    """Whether the hub's host name resolves here (offline mode, HF_HUB_OFFLINE=1, is huggingface_hub's to say)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    try:
        socket.getaddrinfo(hub_host(), 443)
    except OSError:
        return False
    return True


def _is(error: Exception, name: str) -> bool:
    """Whether `error` is huggingface_hub's `name`, told by class name (its errors moved between versions)."""
    return any(cls.__name__ == name for cls in type(error).__mro__)


def _reason(error: Exception) -> str:
    if _is(error, "RepositoryNotFoundError"):
        return "no such repository, or a private one: check the name, or set HF_TOKEN"
    if _is(error, "EntryNotFoundError") and not _is(error, "LocalEntryNotFoundError"):
        return "the repository has no config.json: it is not a transformers model"
    return f"{type(error).__name__}; no network?"
