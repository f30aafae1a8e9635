"""The Hugging Face hub: fetch a GPT-2 checkpoint once into its cache (huggingface_hub, an extra)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


def download(repo_id: str, progress: bool = True) -> Path:
    """Fetch a GPT-2 checkpoint (config.json + weights) from the Hugging Face hub into its cache."""
    path, reason = try_download(repo_id, progress)
    if path is None:
        raise CheckpointError(f"could not fetch {repo_id!r} from the Hugging Face hub ({reason}): put config.json "
                              f"and model.safetensors of {repo_id} in a directory and pass that directory as --model")
    return path


def try_download(repo_id: str, progress: bool = True) -> tuple[Path | None, str]:
    """(the checkpoint's directory in the cache, "") or (None, why it could not be fetched)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None, "fetching needs huggingface_hub: pip install 'glassgpt[hub]'"
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    patterns = ["config.json", "model.safetensors"]
    last_error: Exception | None = None
    for local_only in (True, False):  # the cache first: no network needed for what is already here
        try:
            path = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_only))
        except Exception as e:  # offline, unknown repo, auth: all end in the same one-line advice
            last_error = e
            continue
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path, ""
    return None, (f"{type(last_error).__name__}; no network?" if last_error
                  else "no model.safetensors in the repository")
