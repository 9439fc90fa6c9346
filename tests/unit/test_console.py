"""WorkerLog: every worker line in the file, each kind once on the console, repeats counted."""

from __future__ import annotations

import io

from fully_async.console import WorkerLog, line_kind


def _record(actor: str, pid: int, *lines: str, is_err: bool = True) -> dict:
    return {"lines": list(lines), "pid": pid, "actor_name": actor, "is_err": is_err}


def test_kind_ignores_pids_and_counts_but_keeps_engine_addresses():
    a = line_kind("Rollouter", "retrying a request after a failure on http://127.0.0.1:8001: timeout after 30 s")
    b = line_kind("Rollouter", "retrying a request after a failure on http://127.0.0.1:8001: timeout after 31 s")
    c = line_kind("Rollouter", "retrying a request after a failure on http://127.0.0.1:8002: timeout after 30 s")
    assert a == b and a != c
    assert line_kind("W", "rank 0 warning") == line_kind("W", "rank 1 warning")
    assert line_kind("W", "x") != line_kind("V", "x")


def test_first_line_of_each_kind_printed_repeats_counted_and_all_lines_in_the_file(tmp_path):
    now = [0.0]
    out, err = io.StringIO(), io.StringIO()
    sink = WorkerLog(tmp_path / "logs" / "workers.log", out=out, err=err, report_every_s=10, clock=lambda: now[0])
    warn = "UserWarning: torchtitan engine is not available: ModuleNotFoundError('torchtitan')"
    for pid in (11, 12):  # two ranks of one role: one kind
        sink.handle(_record("TrainingWorker", pid, warn, "Warning: pynvml not available, skipping NUMA affinity setup"))
    for i in range(300):
        port = 8001 + i % 2  # two engines: two kinds
        sink.handle(_record("Rollouter", 5, f"retrying a request after a failure on http://127.0.0.1:{port}: refused"))
    sink.handle(_record("Rollouter", 5, "step 1 done", is_err=False))
    assert err.getvalue().count("engine is not available") == 1 and err.getvalue().count("NUMA") == 1
    assert err.getvalue().count("retrying a request") == 2  # one per engine, nothing counted yet (no report due)
    assert out.getvalue() == "(Rollouter pid=5) step 1 done\n"
    now[0] = 11.0
    sink.handle(_record("Rollouter", 5, "retrying a request after a failure on http://127.0.0.1:8001: refused"))
    console = err.getvalue().splitlines()
    assert len(console) == 4 + 4  # the first line of each kind + one count line per kind that repeated
    assert sum("[150 more like this, 151 in all" in line for line in console) == 1  # engine 8001 (with the new one)
    assert sum("[149 more like this, 150 in all" in line for line in console) == 1  # engine 8002
    assert sum("[1 more like this, 2 in all" in line and "torchtitan" in line for line in console) == 1
    sink.close()
    lines = (tmp_path / "logs" / "workers.log").read_text().splitlines()
    assert len(lines) == 2 * 2 + 300 + 1 + 1
    assert "(TrainingWorker pid=12) " + warn in lines
    assert sum("retrying a request" in line for line in lines) == 301


def test_close_reports_what_repeated_since_the_last_report(tmp_path):
    err = io.StringIO()
    sink = WorkerLog(tmp_path / "w.log", out=io.StringIO(), err=err, report_every_s=1e9)
    for _ in range(5):
        sink.handle(_record("Rollouter", 1, "retrying"))
    assert err.getvalue().count("retrying") == 1
    sink.close()
    assert "[4 more like this, 5 in all" in err.getvalue()
    assert sink.counts() == {("Rollouter", "retrying"): 5}


def test_the_autoscaler_status_report_is_dropped_its_events_kept(tmp_path):
    out = io.StringIO()
    sink = WorkerLog(tmp_path / "w.log", out=out, err=io.StringIO())
    sink.handle({"lines": ["======== Autoscaler status ========", ":event_summary:Adding 1 node"], "pid": "autoscaler"})
    assert out.getvalue() == "(autoscaler pid=autoscaler) :event_summary:Adding 1 node\n"
    sink.close()
