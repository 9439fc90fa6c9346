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
    warn = "UserWarning: the reward function returned numpy.float64 for sample 3"
    for pid in (11, 12):  # two ranks of one role: one kind
        sink.handle(_record("TrainingWorker", pid, warn, "Warning: rank 0 uses 2 threads"))
    for i in range(300):
        port = 8001 + i % 2  # two engines: two kinds
        sink.handle(_record("Rollouter", 5, f"retrying a request after a failure on http://127.0.0.1:{port}: refused"))
    sink.handle(_record("Rollouter", 5, "step 1 done", is_err=False))
    assert err.getvalue().count("returned numpy") == 1 and err.getvalue().count("threads") == 1
    assert err.getvalue().count("retrying a request") == 2  # one per engine, nothing counted yet (no report due)
    assert out.getvalue() == "(Rollouter pid=5) step 1 done\n"
    now[0] = 11.0
    sink.handle(_record("Rollouter", 5, "retrying a request after a failure on http://127.0.0.1:8001: refused"))
    console = err.getvalue().splitlines()
    assert len(console) == 4 + 4  # the first line of each kind + one count line per kind that repeated
    assert sum("[150 more like this, 151 in all" in line for line in console) == 1  # engine 8001 (with the new one)
    assert sum("[149 more like this, 150 in all" in line for line in console) == 1  # engine 8002
    assert sum("[1 more like this, 2 in all" in line and "returned numpy" in line for line in console) == 1
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


# What a default run's ranks and engines printed before (issue 28): none of it is about the run.
CHATTER = [
    "Warning: Failed to set NUMA affinity: libnuma.so: cannot open shared object file: No such file or directory",
    "INFO:2026-11-25 06:29:25,399:Platform override from VERL_PLATFORM: cpu",
    "WARNING:2026-11-25 06:29:25,401:Platform 'cpu' (PlatformCPU) is registered but not available. This may be due to "
    "this ray actor being a CPU-only actor.",
    *(
        f"/x/verl/workers/engine/__init__.py:32: UserWarning: {e} engine is not available: ModuleNotFoundError('{e}')"
        for e in ("torchtitan", "veomni", "automodel", "mindspeed", "megatron")
    ),
    '  warnings.warn(f"megatron engine is not available: {e!r}", stacklevel=1)',
    "[rank0]:W1125 06:30:14.703000 21564 torch/fx/_symbolic_trace.py:56] is_fx_tracing will return true for both",
    "Skipping monkey patch for Qwen2ForCausalLM as use_fused_kernels is False or fused_kernels_backend is None",
    "Monkey patch Qwen2VLForConditionalGeneration model forward",
    "Qwen2ForCausalLM contains 362.37K parameters",
    "Before FSDP, memory allocated (GB): 0.00, memory reserved (GB): 0.00, device memory used/total (GB): 0.00/0.00",
    "Total steps: 6, num_warmup_steps: 0",
    "INFO:2026-11-25 06:30:17,062:[Rank 0] Saved model to /run/checkpoints/.step_6.tmp/backend/model_world_size_1_rank_0.pt",
    "Loading weights: 100%|##########| 27/27 [00:00<00:00, 32035.70it/s]",
    "",
]


def test_library_start_up_chatter_goes_to_the_file_only(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    sink = WorkerLog(tmp_path / "workers.log", out=out, err=err, report_every_s=1e9)
    for pid in (11, 12):
        sink.handle(_record("FullyAsyncTrainingWorker", pid, *CHATTER))
    sink.handle(_record("Rollouter", 5, "retrying a request after a failure on http://127.0.0.1:8001: refused"))
    sink.close()
    assert out.getvalue() == ""
    assert err.getvalue().splitlines() == [
        "(Rollouter pid=5) retrying a request after a failure on http://127.0.0.1:8001: refused"
    ]
    lines = (tmp_path / "workers.log").read_text().splitlines()
    assert len(lines) == 2 * len(CHATTER) + 1
    assert all(f"(FullyAsyncTrainingWorker pid=12) {line}" in lines for line in CHATTER)


def test_the_drivers_own_chatter_waits_for_the_log_file_and_stays_off_the_console(tmp_path):
    import logging

    from fully_async import console

    screen = io.StringIO()  # the console handler a driver's logging has (Ray's, the runner's)
    to_screen = logging.StreamHandler(screen)
    logging.getLogger().addHandler(to_screen)
    console.hold_driver_chatter()
    sink = WorkerLog(tmp_path / "workers.log", out=io.StringIO(), err=io.StringIO())
    try:
        logging.getLogger("torch.fx._symbolic_trace").warning("is_fx_tracing will return true for both")
        console._chatter.attach(sink)  # what install() does once the file is open
        token = logging.getLogger("ray._private.authentication.authentication_token_setup")
        token.warning("Token authentication is on")
        logging.getLogger("fully_async.job").warning("our own line")
    finally:
        console._chatter.attach(None)
        logging.getLogger().removeHandler(to_screen)
        sink.close()
    assert screen.getvalue() == "our own line\n"
    text = (tmp_path / "workers.log").read_text()
    assert "(driver:torch.fx._symbolic_trace pid=" in text and "is_fx_tracing will return true" in text
    assert "Token authentication is on" in text
