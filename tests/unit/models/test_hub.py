"""model.path as a directory or a Hugging Face hub id (fully_async/models/hub.py), on hub caches built here: no
network (HF_HUB_OFFLINE=1, or an endpoint on a closed loopback port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fully_async.config import ConfigError, ModelConfig
from fully_async.models import resolve_model_path, resolve_pretrained

REV = "0123456789abcdef0123456789abcdef01234567"


def make_cache(root: Path, repo: str = "org/name", revision: str = REV) -> Path:
    """A hub cache in huggingface_hub's layout holding one snapshot of `repo` (refs/main -> revision)."""
    storage = root / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_directory_passes_through(tmp_path, hub):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_pretrained(str(tmp_path / "model")) == (tmp_path / "model").resolve()
    assert resolve_model_path(ModelConfig(path=str(tmp_path / "model"))) == (tmp_path / "model").resolve()


def test_a_hub_id_resolves_from_the_local_cache(hub):
    snapshot = make_cache(hub)
    assert resolve_pretrained("org/name") == snapshot.resolve()
    assert resolve_model_path(ModelConfig(path="org/name")) == snapshot.resolve()
    assert resolve_pretrained(f"org/name@{REV}") == snapshot.resolve()  # a pinned revision


def test_a_missing_hub_id_offline_names_the_id_and_how_to_fetch_it(hub):
    make_cache(hub, "org/other")
    with pytest.raises(ConfigError, match=r"model.path 'org/name'.*not in the local Hugging Face cache.*offline.*"
                       r"hf download org/name"):  # fmt: skip
        resolve_pretrained("org/name")


def test_paths_that_are_not_hub_ids_say_not_found(tmp_path, hub):
    for value in (str(tmp_path / "missing"), "./missing", "~/missing/model", "a/b/c"):
        with pytest.raises(ConfigError, match="model.path.*directory or a hub id.*not found"):
            resolve_pretrained(value)
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_pretrained(str(tmp_path))


def test_online_the_cache_is_used_without_the_network_and_a_failed_download_is_a_config_error(tmp_path):
    """A fresh interpreter (huggingface_hub reads HF_ENDPOINT at import) whose hub endpoint is a closed loopback port:
    the cached id resolves (the cache is read first), the uncached one fails with the download's cause."""
    snapshot = make_cache(tmp_path)
    code = (
        "from fully_async.config import ConfigError\n"
        "from fully_async.models import resolve_pretrained\n"
        "print(resolve_pretrained('org/name'))\n"
        "try:\n    resolve_pretrained('org/missing')\nexcept ConfigError as e:\n    print(e)\n"
    )
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0",
           "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().split("\n", 1)
    assert first == str(snapshot.resolve())
    assert "could not download hub id 'org/missing'" in second and "hf download org/missing" in second
