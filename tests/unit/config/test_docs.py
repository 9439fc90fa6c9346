"""docs/configuration.md is generated from the config docstrings; a stale copy fails here with the command to fix it."""

from __future__ import annotations

from pathlib import Path

from fully_async.config import describe
from fully_async.config.docs import render

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m fully_async.config.docs > docs/configuration.md`"
    )


def test_configuration_reference_lists_every_key_with_its_docstring():
    text = render()
    for key, _, _, doc in describe():
        assert f"| `{key}` |" in text, key
        assert doc.replace("|", "\\|") in text, key
