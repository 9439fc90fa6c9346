"""Event trace: buffered spans on disk, the interval arithmetic and the idle-ratio definitions."""

from __future__ import annotations

import json
import time

import pytest

from fully_async import trace
from fully_async.trace import Span, Tracer, busy_seconds, engine_idle_ratio, load, trainer_idle_ratio, union


def test_a_span_recorded_while_a_flush_writes_is_kept_for_the_next(tmp_path, monkeypatch):
    # ParamSync's background thread records sync spans into the trainer's tracer; one may land while the trainer's
    # thread is writing the buffer out.
    monkeypatch.setattr(trace, "FLUSH_S", 3600.0)
    tr = Tracer(tmp_path, "trainer")
    tr.record("trainer", "update", 1.0, 2.0)
    real_open = type(tr.path).open

    class Recording:  # the file, with "another thread" recording a span just as the write returns
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text)
            tr.record("sync", "reload", 1.5, 1.6)

    def open_and_record(path, *args, **kwargs):
        return Recording(real_open(path, *args, **kwargs))

    monkeypatch.setattr(type(tr.path), "open", open_and_record)
    tr.flush()
    monkeypatch.setattr(type(tr.path), "open", real_open)
    tr.close()
    spans, _ = load(tmp_path)
    assert sorted(s.name for s in spans) == ["reload", "update"]


def test_spans_are_buffered_then_written_and_read_back_in_start_order(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "FLUSH_EVERY", 3)
    monkeypatch.setattr(trace, "FLUSH_S", 3600.0)
    tr = Tracer(tmp_path, "rollouter")
    tr.record("engine/0", "generate", 10.0, 12.0, tokens=4)
    tr.record("reward", "score", 9.0, 9.5)
    assert not tr.path.exists() or tr.path.read_text() == "", "written before the buffer filled"
    with tr.span("trainer", "update", step=1) as extra:
        extra["groups"] = 2
    assert len(tr.path.read_text().splitlines()) == 3  # the third span filled the buffer
    tr.meta(engines=2)
    tr.close()
    spans, meta = load(tmp_path)
    assert meta == {"engines": 2}
    assert [s.name for s in spans] == ["score", "generate", "update"]
    assert spans[1].dur == pytest.approx(2.0) and spans[1].args == {"tokens": 4} and spans[1].source == "rollouter"
    assert spans[2].args == {"step": 1, "groups": 2} and spans[2].start == pytest.approx(time.time(), abs=60)


def test_a_disabled_tracer_writes_nothing(tmp_path):
    tr = Tracer(tmp_path, "trainer", enabled=False)
    tr.record("trainer", "update", 0.0, 1.0)
    tr.meta(engines=1)
    tr.close()
    assert not (tmp_path / "trace").exists()


def test_a_line_cut_by_a_kill_is_skipped(tmp_path):
    (tmp_path / "trace").mkdir()
    good = json.dumps({"lane": "sync", "name": "pause", "ts": 1.0, "dur": 0.5})
    (tmp_path / "trace" / "trainer.jsonl").write_text(good + "\n" + good[:20])
    spans, _ = load(tmp_path)
    assert [(s.lane, s.name) for s in spans] == [("sync", "pause")]


def test_union_and_busy_seconds():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4)], 1.5, 3.5) == pytest.approx(0.5 + 0.5)
    assert busy_seconds([], 0, 10) == 0


def _span(lane, name, start, end):
    return Span(lane, name, start, end - start, {})


def test_engine_idle_ratio_counts_each_engine_and_overlapping_requests_once():
    spans = [
        _span("engine/0", "generate", 0, 6),
        _span("engine/0", "generate", 2, 8),  # overlaps the first: engine 0 is busy 0-8
        _span("engine/1", "generate", 5, 10),  # engine 1 busy 5-10
        _span("reward", "score", 0, 10),  # not an engine
    ]
    # window 0-10, two engines: busy 8 + 5 of 20 engine-seconds
    assert engine_idle_ratio(spans, 2, 0, 10) == pytest.approx(1 - 13 / 20)
    # a third engine that served nothing is idle the whole time
    assert engine_idle_ratio(spans, 3, 0, 10) == pytest.approx(1 - 13 / 30)
    # only the part of a span inside the window counts
    assert engine_idle_ratio(spans, 2, 6, 10) == pytest.approx(1 - (2 + 4) / 8)
    assert engine_idle_ratio([], 1, 0, 10) == 1.0


def test_trainer_idle_ratio_is_the_share_of_the_window_spent_waiting_for_a_batch():
    spans = [
        _span("trainer", "wait_for_batch", 0, 3),
        _span("trainer", "update", 3, 9),
        _span("trainer", "wait_for_batch", 9, 10),
        _span("engine/0", "wait_for_batch", 0, 10),  # another lane's span of that name does not count
    ]
    assert trainer_idle_ratio(spans, 0, 10) == pytest.approx(0.4)
    assert trainer_idle_ratio(spans, 2, 4) == pytest.approx(0.5)
    assert trainer_idle_ratio(spans, 5, 5) == 0.0
