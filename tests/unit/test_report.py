"""The run report on the recorded files of a real run (tests/data/recorded_run): every PNG, the Chrome trace, the
summary, and the idle ratios recomputed from the trace against metrics.jsonl."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fully_async.report import _pack, chrome_trace, load_run, step_idle_ratios
from fully_async.trace import Span

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "recorded_run"


def test_idle_ratios_from_the_trace_match_metrics_jsonl_and_stay_in_0_1():
    run = load_run(RECORDED)
    assert run.num_engines == 2  # the per-engine average is exercised
    rows = step_idle_ratios(run)
    assert [r["step"] for r in rows] == [m["step"] for m in run.metrics]
    for r in rows:
        for key in ("trainer_trace", "trainer_logged", "rollouter_trace", "rollouter_logged"):
            assert 0.0 <= r[key] <= 1.0, r
        assert r["trainer_trace"] == pytest.approx(r["trainer_logged"], abs=0.01), r
        assert r["rollouter_trace"] == pytest.approx(r["rollouter_logged"], abs=0.01), r
    # the windows tile the run: each step starts where the previous one ended
    windows = run.windows()
    for (_, _, end), (_, start, _) in zip(windows, windows[1:]):
        assert start == pytest.approx(end, abs=1e-3)


def test_report_command_renders_every_png_the_chrome_trace_and_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "fully_async.report", str(run_dir)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    out = run_dir / "report"
    for png in ("timeline.png", "reward_staleness.png", "staleness_hist.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    text = (out / "summary.txt").read_text()
    assert text in proc.stdout
    for lane in ("engine/0", "reward", "trainer", "sync", "wait_for_batch", "log_probs", "export", "idle ratios"):
        assert lane in text
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(1 for p in (RECORDED / "trace").glob("*.jsonl") for line in p.read_text().splitlines() if '"lane"' in line)  # fmt: skip
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine/0", "engine/1", "reward", "rollouter", "trainer", "sync"} <= names


def test_report_of_a_directory_without_run_files_fails_clearly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fully_async.report", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "neither an event trace" in proc.stderr and "Traceback" not in proc.stderr


def test_chrome_trace_rows_never_hold_partly_overlapping_spans():
    spans = [
        Span("engine/0", "generate", 0.0, 5.0, {}),
        Span("engine/0", "generate", 1.0, 5.0, {}),  # overlaps the first: another row
        Span("engine/0", "generate", 5.0, 1.0, {}),  # after the first: back to row 0
        Span("trainer", "update", 0.0, 4.0, {}),
        Span("trainer", "train", 1.0, 2.0, {}),  # nested: same row
    ]
    assert _pack(spans[:3]) == [0, 1, 0]
    assert _pack(spans[3:]) == [0, 0]
    run = load_run(RECORDED)
    events = chrome_trace(run)["traceEvents"]
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in rows.values():
        stack: list[tuple[float, float]] = []
        for s, end in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
            while stack and stack[-1][1] <= s + 2:  # microseconds; spans are stored rounded to 1 us
                stack.pop()
            assert not stack or end <= stack[-1][1] + 2, "partly overlapping spans in one row"
            stack.append((s, end))


def test_report_without_a_trace_still_renders_the_curves_and_summary(tmp_path):
    """logger.trace=false: no timeline or Chrome trace, the rest from metrics.jsonl and trajectories.jsonl."""
    from fully_async.report import write_report

    for name in ("metrics.jsonl", "trajectories.jsonl"):
        shutil.copy(RECORDED / name, tmp_path / name)
    written = write_report(tmp_path)
    assert sorted(written) == ["reward_staleness", "staleness_hist", "summary"]
    text = written["summary"].read_text()
    assert "staleness of trained trajectories" in text and "no trace" in text and "trace vs" not in text


def test_tool_calls_get_their_own_timeline_lane():
    from fully_async.report import _lanes
    from fully_async.trace import Span

    spans = [Span("engine/0", "generate", 0, 1, {}), Span("tools", "tool_call", 0.5, 0.2, {"tool": "search"}),
             Span("trainer", "update", 1, 1, {})]  # fmt: skip
    assert _lanes(spans, 1) == ["engine/0", "tools", "trainer"]


def _long_run(tmp_path, steps: int):
    """A run of `steps` 2-second steps: two engines generating most of the time, the trainer's phases per step."""
    from fully_async.report import Run

    spans, metrics = [], []
    for k in range(steps):
        t = 2.0 * k
        for e in range(2):
            spans += [Span(f"engine/{e}", "generate", t + 0.1 * i, 0.5, {}) for i in range(14)]
        spans += [Span("trainer", "wait_for_batch", t, 0.4, {}), Span("trainer", "update", t + 0.4, 1.4, {}),
                  Span("trainer", "param_sync", t + 1.8, 0.2, {})]  # fmt: skip
        metrics.append({"step": k + 1, "timestamp": t + 2.0, "timing_s/step": 2.0})
    return Run(tmp_path, spans, {"engines": 2}, metrics)


def test_a_long_runs_timeline_adds_a_close_up_of_its_last_steps(tmp_path):
    import matplotlib.pyplot as plt

    from fully_async.report import STEP_LINES_MAX, WINDOW_STEPS, readable_window, render_timeline, timeline_figure

    run = _long_run(tmp_path, 500)
    assert readable_window(run) == (496, 500, 990.0, 1000.0)
    fig = timeline_figure(run)
    whole, close = fig.axes
    assert whole.get_xlim() == (0.0, 1000.0) and close.get_xlim() == (990.0, 1000.0)
    assert "last 5 steps (496-500" in close.get_title()
    # step edges only where they can be read: in the close-up, its steps' ends and the first one's start
    assert len(whole.lines) == 0 and len(close.lines) == WINDOW_STEPS + 1
    plt.close(fig)
    assert render_timeline(run, tmp_path / "timeline.png").stat().st_size > 5000
    short = _long_run(tmp_path, 4 * WINDOW_STEPS - 1)  # short enough to read whole: no close-up
    assert readable_window(short) is None
    fig = timeline_figure(short)
    assert len(fig.axes) == 1
    assert len(fig.axes[0].lines) == 4 * WINDOW_STEPS - 1 <= STEP_LINES_MAX
    plt.close(fig)
