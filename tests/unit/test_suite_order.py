"""The suite hands its slowest files out first (tests/durations.py): files by recorded seconds, longest first, each
file's tests in their own order; a file without a record counts as DEFAULT_S."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import durations


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_longest_first_and_keep_their_tests_in_order():
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2", "new.py::t1")
    durations.longest_first(items, {"a.py": 5.0, "b.py": 300.0, "c.py": 40.0})
    assert [i.nodeid for i in items] == ["b.py::t1", "b.py::t2", "c.py::t1", "new.py::t1", "a.py::t1", "a.py::t2"]


def test_a_missing_or_broken_record_keeps_the_collected_order(tmp_path):
    assert durations.load(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("[1, 2")
    assert durations.load(tmp_path / "bad.json") == {}
    items = _items("x.py::t", "y.py::t")
    durations.longest_first(items, {})
    assert [i.nodeid for i in items] == ["x.py::t", "y.py::t"]


def test_the_recorder_sums_each_files_phases(tmp_path):
    rec = durations.Recorder(str(tmp_path / "d.json"))
    for nodeid, seconds in [("a.py::t1", 1.0), ("a.py::t1", 2.5), ("b.py::t", 0.5)]:
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    rec.pytest_sessionfinish(None)
    assert json.loads((tmp_path / "d.json").read_text()) == {"a.py": 3.5, "b.py": 0.5}
