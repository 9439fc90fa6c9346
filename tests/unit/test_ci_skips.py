"""tests/conftest.py's `needs_venv` mark: a test that needs an engine venv that is missing is skipped on a developer's
machine and FAILS in CI (CI set), so that a CI machine that never installed an engine cannot pass green on skips."""

from __future__ import annotations

import pytest

from tests.conftest import pytest_runtest_setup


class Item:
    """The one thing the hook reads of a pytest item: its needs_venv marks."""

    def __init__(self, venv: str) -> None:
        self.marks = [pytest.mark.needs_venv(venv).mark]

    def iter_markers(self, name: str):
        return [m for m in self.marks if m.name == name]


def test_a_missing_venv_fails_in_ci_and_is_skipped_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"engine venv \.venv-nowhere missing.*CI must install it"):
        pytest_runtest_setup(Item(".venv-nowhere"))
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"engine venv \.venv-nowhere missing"):
        pytest_runtest_setup(Item(".venv-nowhere"))
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        pytest_runtest_setup(Item(".venv-nowhere"))


def test_a_present_venv_neither_fails_nor_skips(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr("tests.conftest.REPO_ROOT", tmp_path)
    (tmp_path / ".venv-here" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-here" / "bin" / "python").touch()
    assert pytest_runtest_setup(Item(".venv-here")) is None
