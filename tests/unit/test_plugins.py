"""fully_async/plugins.py: every plug-in path (agent loop, rollout function, tool, reward function) loads through one
`load`, and a path that does not load fails with a ConfigError naming the config key."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest

from fully_async.agents import build_agent_loop
from fully_async.agents.toolkit import load_tools
from fully_async.config import ConfigError
from fully_async.plugins import load
from tests import fakes


def test_load_returns_the_attribute_and_follows_dotted_attributes():
    assert load("json:dumps") is json.dumps
    assert load("collections:OrderedDict.fromkeys") == OrderedDict.fromkeys
    assert load("tests.fakes:echo_tool") is fakes.echo_tool


@pytest.mark.parametrize("path", ["json.dumps", "json:", ":dumps", "", None])
def test_a_malformed_path_names_the_key(path):
    with pytest.raises(ConfigError, match=r"reward\.group_fn must be a dotted path 'package\.module:attribute'"):
        load(path, "reward.group_fn")


def test_a_missing_module_names_the_key_and_the_module():
    with pytest.raises(ConfigError, match=r"rollout\.rollout_fn='no_such_pkg_x\.mod:fn': cannot import module") as e:
        load("no_such_pkg_x.mod:fn", "rollout.rollout_fn")
    assert isinstance(e.value.__cause__, ModuleNotFoundError)


def test_a_module_whose_own_import_fails_keeps_the_cause(tmp_path, monkeypatch):
    (tmp_path / "plugin_with_bad_dep.py").write_text("import no_such_dependency_y\n\ndef fn():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="no_such_dependency_y") as e:
        load("plugin_with_bad_dep:fn", "reward.sources.mine.kind")
    assert "reward.sources.mine.kind=" in str(e.value)
    assert e.value.__cause__.name == "no_such_dependency_y"


def test_a_missing_attribute_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.agent_loop='json:NoSuchLoop': module 'json' has no attribute"):
        load("json:NoSuchLoop", "rollout.agent_loop")


def test_callers_name_their_keys():
    """The agent-loop and tool loaders pass their own keys (a ConfigError is a ValueError, which the reward
    sources' callers already turn into DataError)."""
    with pytest.raises(ConfigError, match=r"^rollout\.agent_loop="):
        build_agent_loop("tests.fakes:NoSuchLoop")
    with pytest.raises(ConfigError, match=r"^rollout\.multi_turn\.tools\[1\]="):
        load_tools(["tests.fakes:echo_tool", "tests.fakes:no_such_tool"])
