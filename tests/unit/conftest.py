"""Fixtures shared by the SGLang adapter's and the router's unit tests (they build command lines, start nothing)."""

from __future__ import annotations

import pytest

from fully_async.config import TinyModelConfig
from fully_async.models import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model directory, built once per test module."""
    return build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("models"))


@pytest.fixture
def python(tmp_path):
    """A stand-in engine interpreter path (an empty file): the adapters check it exists, nothing runs it."""
    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    return str(exe)
