"""model.path as a directory, a Hugging Face hub id ("Qwen/Qwen2.5-7B-Instruct") or a GGUF file (models/gguf.py).

Contract of `resolve_pretrained(value)`: an existing directory is returned as it is (resolved; it must hold a
config.json). Anything else that has the shape of a hub id ("name" or "org/name", optionally "@revision") is looked
up in the local Hugging Face cache first (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) without any
network access, and only when it is not there and the hub is not offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) is
it downloaded (the files a model needs: configs, tokenizer, safetensors weights). Every failure is a ConfigError
naming model.path and the id and saying how to get the model. A cluster run reads the returned path on every node:
keep the cache on a shared file system (HF_HOME) or fill it on each node (docs/cluster.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fully_async.config import ConfigError
from fully_async.models.gguf import is_gguf, resolve_gguf

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?)(@(?P<revision>[\w./-]+))?$")
"""A hub id as model.path takes it: "name" or "org/name", optionally "@revision" (branch, tag or commit)."""

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
"""What a download fetches: configs, tokenizer files, chat template, remote code and safetensors weights (not the
.bin / .pth / .gguf duplicates some repositories also ship)."""

_TRUE = {"1", "true", "yes", "on"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment sets it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """Whether downloads are off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _checked_dir(path: Path, value: str) -> Path:
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path {value!r} ({path}) has no config.json; is it a Hugging Face model directory?")
    return path.resolve()


def resolve_pretrained(value: str, cache_dir: str | Path | None = None) -> Path:
    """The model directory that model.path names: the directory itself, the cached / downloaded snapshot of a hub id
    (module docstring), or a GGUF file's converted directory under `cache_dir` (models/gguf.py; None = the default
    cache)."""
    if is_gguf(value):
        return resolve_gguf(value, cache_dir)
    path = Path(value).expanduser()
    if path.is_dir():
        return _checked_dir(path, value)
    match = HUB_ID.match(value)
    if match is None or value.startswith((".", "~")):
        raise ConfigError(
            f"model.path must be an existing Hugging Face model directory or a hub id such as "
            f"'Qwen/Qwen2.5-7B-Instruct' (or a .gguf file), got {value!r} (not found)"
        )
    repo, revision = match["repo"], match["revision"]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    try:
        local = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
        return _checked_dir(Path(local), value)
    except LocalEntryNotFoundError:
        pass  # not cached: download below unless offline
    if hub_offline():
        raise ConfigError(
            f"model.path {value!r}: hub id {repo!r} is not in the local Hugging Face cache ({cache}) and the hub is "
            f"offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE); fetch it on a machine with network access "
            f"(`{fetch}`, with the same HF_HOME / HF_HUB_CACHE), or set model.path to a model directory"
        )
    try:
        local = snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        # The cause (no such repo, gated without HF_TOKEN, no network) goes into the one message the user sees.
        cause = " ".join(str(e).split())
        raise ConfigError(
            f"model.path {value!r}: could not download hub id {repo!r} into {cache} ({type(e).__name__}: {cause}); "
            f"check the id, HF_TOKEN for gated models, and the network, or fetch it with `{fetch}`"
        ) from e
    return _checked_dir(Path(local), value)
