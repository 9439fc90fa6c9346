"""Trainer loop: pull a batch of groups from the queue, update through the training backend, sync weights every
sync_every steps, checkpoint, log.

Runs in the driver process; the heavy work happens in the backend's Ray workers. Checkpoints are directories
`checkpoints/step_N/` written atomically (built under a temporary name, then renamed; `checkpoints/latest` names the
newest) holding the backend state, the version, and the rollouter's consistent snapshot (dataset cursor, staleness
ledger with in-flight prompts as re-issues, queued groups). A run resumed from step N trains every prompt that was not
trained by step N exactly once: logs past step N are cut back to it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fully_async.config import FullyAsyncConfig, to_dict
from fully_async.handles import CallThread, one_line, resolve, settle
from fully_async.loggers import build_loggers
from fully_async.message_queue import QueueTimeout
from fully_async.metrics import (
    JsonlWriter,
    batch_metrics,
    plot_run,
    reward_source_metrics,
    trajectory_records,
    truncate_jsonl,
)
from fully_async.param_sync import ParamSync, add_timings
from fully_async.trace import Tracer

log = logging.getLogger(__name__)

POLL_S = 5.0
"""How often a waiting trainer checks that the rollouter is still healthy."""


class TrainerError(RuntimeError):
    """The run cannot continue (the rollouter failed, no batch arrived in time); the message says why."""


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `ckpt_root/latest` names (RUN_DIR/checkpoints), None when none was written."""
    latest = Path(ckpt_root) / "latest"
    return Path(ckpt_root) / latest.read_text().strip() if latest.is_file() else None


# The backend's update timings, in the order its phases run (reconstructed into trace spans inside the update).
UPDATE_PHASES = ("prepare", "log_probs", "train")


class Trainer:
    def __init__(
        self,
        cfg: FullyAsyncConfig,
        backend: Any,
        queue: Any,
        rollouter: Any,
        sync: ParamSync,
        run_dir: Path,
        tracer: Tracer | None = None,
    ):
        self.cfg, self.backend, self.queue, self.rollouter, self.sync = cfg, backend, queue, rollouter, sync
        self.run_dir = Path(run_dir)
        self.tracer = tracer or Tracer(run_dir, "trainer", enabled=False)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.step = 0
        self.version = 0
        self._trajs_out: JsonlWriter | None = None
        self._last_stats: dict[str, Any] | None = None
        """The rollouter's stats() at the end of the previous step's window (the start of the next one's)."""
        self._ahead = CallThread("trainer-ahead")
        """While the update computes: reads the counters that close the step's window, and sends and resolves the
        next step's get (the batch's transfer and deserialisation happen there)."""
        self._writes = CallThread("trainer-writes")
        """Writes trajectories.jsonl and the loggers' lines in the order the steps hand them over (and computes the
        batch's metrics)."""
        self._written: list = []
        """The writes handed to `_writes` and not yet seen done."""

    # -- resume ------------------------------------------------------------------------------------------------
    def find_checkpoint(self) -> Path | None:
        resume = self.cfg.trainer.resume
        if resume == "none":
            return None
        if resume == "auto":
            return latest_checkpoint(self.ckpt_root)
        path = Path(resume).expanduser()
        if not (path / "state.json").is_file():
            raise TrainerError(f"trainer.resume={resume}: no checkpoint there (missing state.json)")
        return path

    def restore(self, path: Path) -> dict[str, Any]:
        """Load the backend and queue from a checkpoint; returns what the rollouter needs to start from it."""
        state = json.loads((path / "state.json").read_text())
        self.step = self.backend.load_checkpoint(path / "backend")
        self.version = int(state["version"])
        snap = {"groups": (path / "queue.bin").read_bytes(), "meta": state["queue_meta"]}
        restored = resolve(self.queue.restore.remote(snap))
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            truncate_jsonl(self.run_dir / name, self.step)
        print(f"fully_async: resumed from {path} at step {self.step}, version {self.version}, {restored} queued groups")
        return {"cursor_state": state["cursor"], "ledger_state": state["ledger"]}

    def save(self) -> Path:
        """Write checkpoints/step_N atomically: everything goes into a hidden temporary directory that is renamed into
        place only when complete, then `latest` is replaced (write + rename) to name it. A failure at any point leaves
        the previous checkpoint and `latest` as they were."""
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        final = self.ckpt_root / f"step_{self.step}"
        tmp = self.ckpt_root / f".step_{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self.backend.save_checkpoint(tmp / "backend", self.step)
        if self.backend.lora is not None:  # the adapter in PEFT format, loadable onto the base model (docs/lora.md)
            self.backend.export_adapter(tmp / "adapter")
        if self.cfg.trainer.save_hf and self.step == self.cfg.trainer.total_steps:
            dtype = self.cfg.engine.dtype if self.cfg.engine.dtype != "auto" else "float32"
            self.backend.export_weights(tmp / "hf", dtype=dtype)  # the trained model out (python -m fully_async.export)
        snap = resolve(self.rollouter.snapshot.remote())
        if snap.get("filtered"):  # before the checkpoint exists: a resume from it keeps these records (step <= N)
            out = JsonlWriter(self.run_dir / "trajectories.jsonl")
            out.write([{**r, "step": self.step} for r in snap["filtered"]])
            out.close()
        (tmp / "queue.bin").write_bytes(snap["queue"]["groups"])
        state = {
            "step": self.step,
            "version": self.version,
            "cursor": snap["cursor"],
            "ledger": snap["ledger"],
            "queue_meta": snap["queue"]["meta"],
            "config": to_dict(self.cfg),
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = self.ckpt_root / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.ckpt_root / "latest")
        return final

    # -- the loop ----------------------------------------------------------------------------------------------
    def _next_batch(self, prefetched: Any = None) -> list:
        """groups_per_step groups fresh enough for the current version; fails clearly instead of waiting forever.

        `prefetched`: a get already sent for this step (with this step's version), awaited first."""
        at = self.cfg.async_training
        deadline = time.monotonic() + at.get_timeout_s
        while True:
            try:
                if prefetched is not None:
                    ref, prefetched = prefetched, None
                    return resolve(ref)
                return resolve(self.queue.get.remote(at.groups_per_step, self.version, POLL_S))
            except QueueTimeout:
                self.sync.check()  # a background sync that failed left the engines paused: no batch would come
                error = resolve(self.rollouter.error.remote())
                if error:
                    raise TrainerError(f"the rollouter stopped: {error}") from None
                if time.monotonic() > deadline:
                    stats = resolve(self.rollouter.stats.remote())
                    raise TrainerError(
                        f"no batch within async_training.get_timeout_s={at.get_timeout_s:g}s; rollouter: {stats}"
                    ) from None

    def _trace_update(self, start: float, end: float, update: dict[str, Any]) -> None:
        """The update span and, inside it, the backend's phases laid end to end from their durations."""
        self.tracer.record("trainer", "update", start, end, step=self.step)
        t = start
        for phase in UPDATE_PHASES:
            dur = update.get(f"timing_s/{phase}")
            if dur is not None:
                self.tracer.record("trainer", phase, t, min(t + dur, end))
                t = min(t + dur, end)

    def train_step(self, prefetched: Any = None, last_step_s: float = 0.0) -> tuple[dict[str, Any], Any]:
        """One step: wait for a batch, update, sync the weights every sync_every steps (async_training.sync_mode=
        background: start the sync, which reads the weights (or queues their copy ahead of the next update on the
        training ranks) while this step ends and finishes while the next one computes; the next update waits only
        until the weights were read), checkpoint when due (with no sync in flight), read the rollouter's and queue's
        counters. Returns (this step's metrics, including its window's from `step_window`; the next step's
        prefetched get or None). `prefetched` is the previous call's; `last_step_s` the previous step's window,
        which bounds how long the prefetched get waits before the health-polling path takes over. The first call's
        window starts at the call (or at run()'s start).

        What needs no result of the update runs in the trainer's helper threads while the update computes (the
        trainer's own thread then only waits for the training ranks): the next batch's get, the trajectory records,
        and, on a step that writes no checkpoint, the counters that close this step's window (so a window runs from
        one update's start to the next's; on a checkpoint step it closes after the checkpoint, whose snapshot takes
        the filtered groups)."""
        cfg, at, tr = self.cfg, self.cfg.async_training, self.tracer
        if self._last_stats is None:
            self._last_stats = resolve(self.rollouter.stats.remote())
        if self._trajs_out is None:
            self._trajs_out = JsonlWriter(self.run_dir / "trajectories.jsonl")
        t0 = time.time()
        groups = self._next_batch(prefetched)
        wait_s = time.time() - t0
        tr.record("trainer", "wait_for_batch", t0, t0 + wait_s)
        self.step += 1
        saves = (cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0) or (
            self.step == cfg.trainer.total_steps
        )
        # Ask for the next batch now, so the queue's serialisation and the transfer overlap this update (at scale they
        # cost ~10% of a step otherwise). The next step's version is known: one more after a sync. Not before a
        # checkpoint: groups in flight to the trainer would be in no snapshot. Its wait is bounded by about one step,
        # after which _next_batch polls the rollouter's health as usual.
        next_version = self.version + (self.step % at.sync_every == 0)
        prefetched: concurrent.futures.Future | None = None
        report: concurrent.futures.Future | None = None
        if not saves:  # one hand-over for both (each wakes a thread, which costs the trainer on shared cores)
            prefetched, report = concurrent.futures.Future(), concurrent.futures.Future()
            get = (at.groups_per_step, next_version, POLL_S + last_step_s)
            self._ahead.submit(self._ahead_of_update, get, prefetched, report)
        trained_at = self.version
        self._write(self._write_trajectories, groups, self.step, trained_at)
        metrics_of_batch = self._writes.submit(batch_metrics, groups, self.version)
        m: dict[str, Any] = {"step": self.step, "version": self.version, "timing_s/param_sync": 0.0}
        if self.sync.reading:  # the background sync the last step started may still read the weights this changes
            with tr.span("trainer", "param_sync", version=self.version, read=True):
                add_timings(m, self.sync.weights_read())
        t1 = time.time()
        update = self.backend.update(groups, version=self.version)
        t2 = time.time()
        self._trace_update(t1, t2, update)
        m.update({f"actor/{k}" if "/" not in k else k: v for k, v in update.items()})
        m["timing_s/update"] = t2 - t1
        if self.step % at.sync_every == 0:
            self.version += 1
            with tr.span("trainer", "param_sync", version=self.version):
                add_timings(m, self.sync.start(self.version))
        if saves and self.sync.mode == "background":
            # A checkpoint holds the engines' version (the ledger's) and the trainer's: with no sync in flight they
            # agree, as in blocking mode, and a resume restarts the engines on the checkpoint's weights.
            with tr.span("trainer", "param_sync", version=self.version, wait=True):
                t3 = time.monotonic()
                add_timings(m, self.sync.wait())
                m["timing_s/param_sync"] += time.monotonic() - t3
        if saves:
            with tr.span("trainer", "save_checkpoint"):
                t3 = time.monotonic()
                self._flush_writes()  # the records handed over so far are in the files the snapshot keeps
                self.save()
                m["timing_s/save_checkpoint"] = time.monotonic() - t3
        with tr.span("trainer", "stats"):
            # On a checkpoint step the counters are read after save(), which wrote the filtered groups the snapshot
            # counts (later ones wait for the next step: a resume from here re-runs them).
            report, queue_stats = report.result() if report is not None else self._step_report(take_filtered=False)
            now = report["stats"]
            self._write(self._trajs_out.write, [{**r, "step": self.step} for r in report["filtered"]])
        m.update(metrics_of_batch.result())
        m.update(step_window(self._last_stats, now, queue_stats, wait_s, groups))
        for v in report["validation"]:
            m.update({k: x for k, x in v.items() if k != "version"})
        self._last_stats = now
        return m, prefetched

    def _ahead_of_update(self, get: tuple, batch: concurrent.futures.Future, report: concurrent.futures.Future) -> None:
        """In the helper thread `_ahead`, while the update computes: send the next step's get (`get`: its
        arguments), read this step's counters into `report` (`_step_report`), then wait for the batch into
        `batch`."""
        try:
            ref = self.queue.get.remote(*get)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread through both futures
            batch.set_exception(e)
            settle(report, self._step_report, True)
            return
        settle(report, self._step_report, True)
        settle(batch, resolve, ref)

    def _write(self, fn, *args) -> None:
        """Hand a write to the writer thread; a write that failed (a full disk) is raised here at the next one."""
        done, pending = [], []
        for f in self._written:  # one look at each: a write that ends meanwhile is seen next time
            (done if f.done() else pending).append(f)
        self._written = [*pending, self._writes.submit(fn, *args)]
        for f in done:
            f.result()  # raises the failed write's exception (the writes handed over still run)

    def _flush_writes(self, quiet: bool = False) -> None:
        """Wait for the writes handed over so far; raise the first that failed (`quiet`: log it instead, when another
        failure is on its way out)."""
        written, self._written = self._written, []
        for f in written:
            if not quiet:
                f.result()
            elif f.exception() is not None:
                log.error("trainer: a write failed: %s", one_line(f.exception()))

    def _write_trajectories(self, groups: list, step: int, trained_at: int) -> None:
        self._trajs_out.write(trajectory_records(groups, step, trained_at))

    def _step_report(self, take_filtered: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The rollouter's step_report and the queue's stats, both sent before either is awaited."""
        report = self.rollouter.step_report.remote(take_filtered=take_filtered)
        queue_stats = self.queue.stats.remote()
        return resolve(report), resolve(queue_stats)

    def run(self) -> dict[str, Any]:
        """Train to trainer.total_steps. Each step's window runs from the previous step's reading of the counters to
        this step's (at its update's start, or after its checkpoint; train_step), both read on the rollouter's clock
        (its stats() call), so windows tile the run and the idle ratios logged per step are exact shares of them
        (definitions in fully_async/metrics.py and docs/metrics.md)."""
        cfg = self.cfg
        if cfg.trainer.total_steps < 1:  # 0 = "from total_epochs", which only the runner's preflight resolves
            raise TrainerError("trainer.total_steps=0 reached the trainer: the runner sets it from trainer.total_epochs "
                               "(preflight.limit_to_epochs); a job started another way must set total_steps")  # fmt: skip
        loggers = build_loggers(cfg.logger, self.run_dir, cfg.trainer.total_steps, self.step, to_dict(cfg))
        self._trajs_out = JsonlWriter(self.run_dir / "trajectories.jsonl")
        self._last_stats = resolve(self.rollouter.stats.remote())
        final: dict[str, Any] = {}
        prefetched = None
        try:
            while self.step < cfg.trainer.total_steps:
                final, prefetched = self.train_step(prefetched, final.get("timing_s/step", 0.0))
                self._write(loggers.log, self.step, final)  # in the writer thread, while the next step computes
            self._flush_writes()
        finally:
            try:
                self._flush_writes(quiet=True)  # after a failure: what was handed over still reaches the files
            finally:
                loggers.close()
                self._trajs_out.close()
                for thread in (self._ahead, self._writes):
                    thread.close()
            self.tracer.close()
            plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "reward_staleness.png")
        return final


def step_window(
    last: dict[str, Any], now: dict[str, Any], queue_stats: dict[str, Any], wait_s: float, groups: list
) -> dict[str, float]:
    """The metrics of one step's window, a pure function of two rollouter stats() readings (`last` at the previous
    step's end, `now` at this one's), the queue's stats, the seconds the trainer waited for its batch and the
    batch. Idle ratios are shares of the window clipped to [0, 1]: trainer = wait / window; rollouter = 1 - engine
    busy seconds / (engines x window), with at least one engine counted (fully_async/metrics.py)."""
    step_s = max(1e-9, now["time"] - last["time"])
    pool, pool_last = now.get("pool") or {}, last.get("pool") or {}
    engines = max(1, pool.get("size", len(now["engine_busy_s"])))
    busy = sum(now["engine_busy_s"]) - sum(last["engine_busy_s"])
    tokens = sum(t.response_length for g in groups for t in g.trajectories)
    new_filtered = now.get("groups_filtered", 0) - last.get("groups_filtered", 0)
    new_pushed = now.get("groups_pushed", 0) - last.get("groups_pushed", 0)
    m = {
        "timestamp": now["time"],
        "timing_s/step": step_s,
        "timing_s/wait_for_batch": wait_s,
        "fully_async/trainer/idle_ratio": min(1.0, max(0.0, wait_s / step_s)),
        "fully_async/rollouter/idle_ratio": min(1.0, max(0.0, 1.0 - busy / (engines * step_s))),
        "fully_async/queue/size": queue_stats["size"],
        "fully_async/count/dropped_stale": queue_stats["dropped_stale"],
        "fully_async/count/groups_failed": now["groups_failed"],
        "fully_async/count/reward_timeouts": now["reward_timeouts"],
        "fully_async/count/filtered_groups": now.get("groups_filtered", 0),
        "fully_async/filtered_groups/ratio": new_filtered / max(1, new_filtered + new_pushed),
        "perf/tokens_per_s": tokens / step_s,
        "perf/generated_tokens_per_s": (now["tokens"] - last["tokens"]) / step_s,
    }
    m.update(reward_source_metrics(now.get("reward", {}), last.get("reward", {})))
    if pool:  # the elastic engine pool (fully_async/ctl.py): its size, and who joined or left since the start
        m["fully_async/engines/pool_size"] = pool["size"]
        m["fully_async/engines/pool_down"] = pool["down"]
        for key in ("joins", "leaves", "replacements", "moved"):
            m[f"fully_async/count/engine_{key}"] = pool[key]
        joins = pool["join_s"][len(pool_last.get("join_s", [])) :]
        if joins:  # servers that joined during this step: seconds from the add to serving
            m["timing_s/engines/join"] = max(joins)
    return m
