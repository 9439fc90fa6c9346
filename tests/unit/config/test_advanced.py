"""The advanced section: internal bounds, buffer sizes and test knobs, and the keys they moved from (still read, each
with one note)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from fully_async.config import AdvancedConfig, ConfigError, build_config, compose
from fully_async.config import base as config_base
from fully_async.config.sections.advanced import MOVED


@pytest.fixture
def fresh_notes(monkeypatch):
    """Notes are said once per process: start from none said."""
    monkeypatch.setattr(config_base, "_NOTED", set())


SET = (5.0, 7.0, "pinned", 64, True)
"""The values both tests below set, in MOVED's order."""


def values(adv: AdvancedConfig) -> tuple:
    """The moved keys' values (the section also holds keys of its own)."""
    return tuple(getattr(adv, key) for _, key in MOVED)


def test_new_keys_are_read():
    adv = compose(["advanced.get_timeout_s=5", "advanced.sync_timeout_s=7", "advanced.staging=pinned",
                   "advanced.bucket_mb=64", "advanced.ignore_eos=true"]).advanced  # fmt: skip
    assert values(adv) == SET


def test_old_keys_map_to_advanced_with_one_note_each(fresh_notes, caplog):
    old = ["async_training.get_timeout_s=5", "async_training.sync_timeout_s=7", "async_training.staging=pinned",
           "async_training.bucket_mb=64", "rollout.ignore_eos=true"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fully_async.config"):
        cfg = compose(old)
        compose(old)  # a second composition in the same process says nothing more
    assert values(cfg.advanced) == SET
    # The old places are cleared, so that no reader can take the stale value.
    assert (cfg.async_training.get_timeout_s, cfg.async_training.bucket_mb, cfg.rollout.ignore_eos) == (None,) * 3
    notes = [r.getMessage() for r in caplog.records if "is an alias" in r.getMessage()]
    assert sorted(notes) == sorted(
        [
            "async_training.get_timeout_s is an alias: read as advanced.get_timeout_s=5.0",
            "async_training.sync_timeout_s is an alias: read as advanced.sync_timeout_s=7.0",
            "async_training.staging is an alias: read as advanced.staging=pinned",
            "async_training.bucket_mb is an alias: read as advanced.bucket_mb=64",
            "rollout.ignore_eos is an alias: read as advanced.ignore_eos=True",
        ]
    )


def test_an_old_key_in_a_config_file_maps_too():
    cfg = build_config({"async_training": {"bucket_mb": 32}, "rollout": {"ignore_eos": True}})
    assert (cfg.advanced.bucket_mb, cfg.advanced.ignore_eos) == (32, True)


def test_an_old_key_is_validated_under_its_new_name():
    with pytest.raises(ConfigError, match=r"advanced\.bucket_mb.*>= 1"):
        compose(["async_training.bucket_mb=0"])


def test_an_unknown_advanced_key_gets_the_nearest():
    with pytest.raises(ConfigError, match=r"advanced\.bucket_md.*bucket_mb"):
        compose(["advanced.bucket_md=3"])


def test_every_moved_key_has_both_places():
    new = {f.name: f.default for f in dataclasses.fields(AdvancedConfig)}
    cfg = build_config({})
    for section, key in MOVED:
        assert key in new, key
        assert getattr(getattr(cfg, section), key) is None, f"{section}.{key} must default to null (unset)"
