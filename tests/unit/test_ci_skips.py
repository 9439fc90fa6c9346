"""tests/conftest.py's `needs_venv` and `needs_extra` marks: a test that needs an engine venv, or an optional extra's
packages, that is missing is skipped on a developer's machine and FAILS in CI (CI set), so that a CI machine that never
installed an engine or the envs extra cannot pass green on skips."""

from __future__ import annotations

import pytest

from tests import conftest
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


class ExtraItem(Item):
    """An item marked needs_extra(name)."""

    def __init__(self, extra: str) -> None:
        self.marks = [pytest.mark.needs_extra(extra).mark]


def outcome(item) -> tuple[type, str] | None:
    """What the hook made of `item`: (pytest's fail or skip exception type, its message), or None (it runs)."""
    try:
        pytest_runtest_setup(item)
    except (pytest.fail.Exception, pytest.skip.Exception) as e:
        return type(e), str(e)
    return None


def test_a_missing_extra_fails_in_ci_and_is_skipped_elsewhere_with_the_command_that_installs_it(monkeypatch):
    monkeypatch.setitem(conftest.EXTRAS, "nowhere", ("json", "fully_async_no_such.module"))
    monkeypatch.setenv("CI", "true")
    message = (
        "the nowhere extra is missing (fully_async_no_such.module): FULLY_ASYNC_EXTRAS=nowhere bash scripts/setup.sh"
    )
    assert outcome(ExtraItem("nowhere")) == (pytest.fail.Exception, message + " (CI must install it)")
    monkeypatch.delenv("CI")
    assert outcome(ExtraItem("nowhere")) == (pytest.skip.Exception, message)
    monkeypatch.setitem(conftest.EXTRAS, "here", ("json", "importlib.util"))
    monkeypatch.setenv("CI", "true")
    assert outcome(ExtraItem("here")) is None
