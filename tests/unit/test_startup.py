"""fully_async/startup.py: a run's start-up (and shutdown) as named wall-clock parts: the metrics
`timing_s/startup/<part>` and `/total` (command to first step), one console line that marks the parts that ran beside
the one before, the trace's `startup` lane, and RUN_DIR/startup.json holding both phases."""

from __future__ import annotations

import json
import time

from fully_async.startup import Timeline, process_start, write_record
from fully_async.trace import Tracer, load


def test_parts_give_metrics_and_the_total_runs_from_the_command_to_the_end():
    t = Timeline("startup", t0=100.0)
    t.add("config", 100.5, 101.0)
    t.add("engine_launch", 102.0, 130.0)
    t.add("trainer_ranks", 103.0, 120.0)
    m = t.finish(end=140.0)
    assert m == {"timing_s/startup/config": 0.5, "timing_s/startup/engine_launch": 28.0,
                 "timing_s/startup/trainer_ranks": 17.0, "timing_s/startup/total": 40.0}  # fmt: skip


def test_the_line_marks_parts_that_ran_beside_the_one_before():
    t = Timeline("startup", t0=0.0)
    t.add("ray", 1.0, 6.0)
    t.add("engine_launch", 6.0, 40.0)
    t.add("trainer_ranks", 7.0, 25.0)  # beside the engines' launch
    t.add("first_step", 41.0, 45.0)  # after both
    t.finish(end=45.0)
    assert (
        t.line()
        == "startup 45.0 s to the first step: ray 5.0, engine_launch 34.0 || trainer_ranks 18.0, first_step 4.0 (s)"
    )


def test_a_part_is_recorded_even_when_it_fails_and_a_repeated_name_keeps_the_later():
    t = Timeline("shutdown", t0=time.time())
    try:
        with t.part("engines"):
            raise RuntimeError("stop failed")
    except RuntimeError:
        pass
    assert "engines" in t.parts
    t.add("x", 1.0, 2.0)
    t.add("x", 5.0, 9.0)
    assert t.seconds("x") == 4.0


def test_process_start_is_the_commands_start_before_this_test_ran():
    assert process_start() <= time.time() - 0.01


def test_spans_go_to_the_startup_lane_and_both_phases_to_startup_json(tmp_path):
    up = Timeline("startup", t0=10.0)
    up.add("ray", 10.0, 15.0)
    up.finish(end=20.0)
    tracer = Tracer(tmp_path, "trainer")
    up.trace(tracer)
    tracer.close()
    spans, _ = load(tmp_path)
    assert [(s.lane, s.name, s.dur) for s in spans] == [("startup", "ray", 5.0)]
    write_record(tmp_path, up)
    down = Timeline("shutdown", t0=30.0)
    down.add("rollouter", 30.0, 33.0)
    down.finish(end=34.0)
    write_record(tmp_path, down)  # merged into the start-up's record
    record = json.loads((tmp_path / "startup.json").read_text())
    assert record["startup"]["metrics"]["timing_s/startup/total"] == 10.0
    assert record["shutdown"]["metrics"] == {"timing_s/shutdown/rollouter": 3.0, "timing_s/shutdown/total": 4.0}
