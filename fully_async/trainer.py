"""Trainer loop: pull a batch of groups from the queue, update through the training backend, sync weights every
sync_every steps, checkpoint, log.

Runs in the driver process; the heavy work happens in the backend's Ray workers. Checkpoints are directories
`checkpoints/step_N/` written atomically (built under a temporary name, then renamed; `checkpoints/latest` names the
newest) holding the backend state, the version, and the rollouter's consistent snapshot (dataset cursor, staleness
ledger with in-flight prompts as re-issues, queued groups). A run resumed from step N trains every prompt that was not
trained by step N exactly once: logs past step N are cut back to it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from fully_async.config import FullyAsyncConfig, to_dict
from fully_async.engines.affinity import metrics as routing_metrics
from fully_async.engines.inflight import metrics as in_flight_metrics
from fully_async.handles import resolve
from fully_async.loggers import build_loggers
from fully_async.message_queue import QueueTimeout
from fully_async.metrics import JsonlWriter, plot_run, prefix_cache_metrics, reward_source_metrics, truncate_jsonl
from fully_async.startup import Timeline, write_record
from fully_async.step_helpers import StepHelpers
from fully_async.sync import ParamSync, add_timings
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
        self._last_stats: dict[str, Any] | None = None
        """The rollouter's stats() at the end of the previous step's window (the start of the next one's)."""
        self._plots: threading.Thread | None = None
        self.startup: Timeline | None = None
        """The run's start-up timeline (fully_async/startup.py), closed at this run's first step: its metrics go into
        that step's row, its parts to the trace and RUN_DIR/startup.json; None: not timed (set by the job)."""
        self.helpers = StepHelpers(queue, rollouter, self.run_dir)
        """The next batch's get, the step's counters and the writer, in two kept threads (fully_async/step_helpers.py)."""

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
        deadline = time.monotonic() + self.cfg.advanced.get_timeout_s
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
                        f"no batch within advanced.get_timeout_s={self.cfg.advanced.get_timeout_s:g}s; rollouter: {stats}"
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

        What needs no result of the update runs in the trainer's helper threads (StepHelpers) while the update
        computes: the next batch's get, the trajectory records, and, on a step that writes no checkpoint, the
        counters that close this step's window (so a window runs from one update's start to the next's; on a
        checkpoint step it closes after the checkpoint, whose snapshot takes the filtered groups)."""
        at, tr = self.cfg.async_training, self.tracer
        if self._last_stats is None:
            self._last_stats = resolve(self.rollouter.stats.remote())
        self.helpers.open()
        t0 = time.time()
        groups = self._next_batch(prefetched)
        wait_s = time.time() - t0
        tr.record("trainer", "wait_for_batch", t0, t0 + wait_s)
        self.step += 1
        saves = self._saves_now()
        prefetched, report = self._prefetch(saves, last_step_s)
        self.helpers.write_trajectories(groups, self.step, self.version)
        metrics_of_batch = self.helpers.batch_metrics(groups, self.version)
        m: dict[str, Any] = {"step": self.step, "version": self.version, "timing_s/param_sync": 0.0}
        self._update(groups, m)
        if self.step % at.sync_every == 0:
            self.version += 1
            with tr.span("trainer", "param_sync", version=self.version):
                add_timings(m, self.sync.start(self.version))
        if saves:
            self._checkpoint(m)
        final_validation = self._final_validation(m) if self.step == self.cfg.trainer.total_steps else []
        with tr.span("trainer", "stats"):
            # On a checkpoint step the counters are read after save(), which wrote the filtered groups the snapshot
            # counts (later ones wait for the next step: a resume from here re-runs them).
            report, queue_stats = report.result() if report is not None else self.helpers.step_report(False)
            now = report["stats"]
            self.helpers.write_records(report["filtered"], self.step)
        m.update(metrics_of_batch.result())
        m.update(step_window(self._last_stats, now, queue_stats, wait_s, groups))
        for v in [*report["validation"], *final_validation]:  # a later validation's numbers win
            m.update({("val/version" if k == "version" else k): x for k, x in v.items()})
        self._last_stats = now
        return m, prefetched

    def _final_validation(self, m: dict[str, Any]) -> list[dict[str, Any]]:
        """On the last step (with trainer.val_every set): the validation of the weights the run ends with, which the
        engines hold by now (the last step's checkpoint waited for its sync), and any earlier result not yet logged;
        `timing_s/final_validation` is its wait, bounded by trainer.call_timeout_s (then a TrainerError names it)."""
        if not self.cfg.trainer.val_every:
            return []
        start, bound = time.monotonic(), self.cfg.trainer.call_timeout_s
        with self.tracer.span("trainer", "final_validation"):
            try:
                results = resolve(self.rollouter.final_validation.remote(), timeout=bound)
            except TimeoutError:  # ray's GetTimeoutError and a future's timeout are both TimeoutErrors
                raise TrainerError(f"the final validation did not finish within trainer.call_timeout_s={bound:g} s "
                                   f"(the rollouter's engines answer no held-out request?)") from None  # fmt: skip
        m["timing_s/final_validation"] = time.monotonic() - start
        return results

    def _started(self, first: float) -> dict[str, float]:
        """The start-up ends with this run's first step (which began at `first`): its metrics, line and spans."""
        if self.startup is None:
            return {}
        self.startup.add("first_step", first, time.time())
        metrics = self.startup.finish()
        self.startup.trace(self.tracer)
        write_record(self.run_dir, self.startup)
        return metrics

    def _saves_now(self) -> bool:
        """Whether this step writes a checkpoint (every trainer.save_every steps, and the last step)."""
        tr = self.cfg.trainer
        return bool(tr.save_every and self.step % tr.save_every == 0) or self.step == tr.total_steps

    def _prefetch(self, saves: bool, last_step_s: float) -> tuple[Any, Any]:
        """Ask for the next batch now, so the queue's serialisation and the transfer overlap this update (at scale
        they cost ~10% of a step otherwise), and read this step's counters meanwhile. The next step's version is
        known: one more after a sync. Not before a checkpoint: groups in flight to the trainer would be in no
        snapshot ((None, None) then). Its wait is bounded by about one step, after which _next_batch polls the
        rollouter's health as usual."""
        if saves:
            return None, None
        at = self.cfg.async_training
        next_version = self.version + (self.step % at.sync_every == 0)
        return self.helpers.prefetch((at.groups_per_step, next_version, POLL_S + last_step_s))

    def _update(self, groups: list, m: dict[str, Any]) -> None:
        """The backend's update of this batch, after the weights a background sync still reads were read."""
        tr = self.tracer
        if self.sync.reading:  # the background sync the last step started may still read the weights this changes
            with tr.span("trainer", "param_sync", version=self.version, read=True):
                add_timings(m, self.sync.weights_read())
        t1 = time.time()
        update = self.backend.update(groups, version=self.version)
        t2 = time.time()
        self._trace_update(t1, t2, update)
        m.update({f"actor/{k}" if "/" not in k else k: v for k, v in update.items()})
        m["timing_s/update"] = t2 - t1

    def _checkpoint(self, m: dict[str, Any]) -> None:
        """Write this step's checkpoint. A checkpoint holds the engines' version (the ledger's) and the trainer's:
        with no sync in flight they agree, as in blocking mode, and a resume restarts the engines on the
        checkpoint's weights; so a background sync is waited for first."""
        tr = self.tracer
        if self.sync.mode == "background":
            with tr.span("trainer", "param_sync", version=self.version, wait=True):
                t3 = time.monotonic()
                add_timings(m, self.sync.wait())
                m["timing_s/param_sync"] += time.monotonic() - t3
        with tr.span("trainer", "save_checkpoint"):
            t3 = time.monotonic()
            self.helpers.flush()  # the records handed over so far are in the files the snapshot keeps
            self.save()
            m["timing_s/save_checkpoint"] = time.monotonic() - t3

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
        self.helpers.open()
        self._last_stats = resolve(self.rollouter.stats.remote())
        final: dict[str, Any] = {}
        prefetched = None
        first = time.time()
        try:
            while self.step < cfg.trainer.total_steps:
                final, prefetched = self.train_step(prefetched, final.get("timing_s/step", 0.0))
                if first:
                    final.update(self._started(first))
                    first = 0.0
                self.helpers.write(loggers.log, self.step, final)  # in the writer thread, while the next step computes
            self.helpers.flush()
        finally:
            try:
                self.helpers.close()  # after a failure: what was handed over still reaches the files
            finally:
                loggers.close()
            self.tracer.close()
            # The plot needs nothing but metrics.jsonl, written by now: it is drawn while the job stops the engines
            # and ranks (`wait_plots`), not before (matplotlib's import and the drawing take seconds on a busy box).
            self._plots = threading.Thread(target=plot_run, name="trainer-plots",
                                           args=(self.run_dir / "metrics.jsonl", self.run_dir / "reward_staleness.png"))  # fmt: skip
            self._plots.start()
        return final

    def wait_plots(self) -> None:
        """Wait for the run's plot (RUN_DIR/reward_staleness.png), drawn in a thread once `run` ended."""
        if self._plots is not None:
            self._plots.join()


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
        "fully_async/count/groups_env_infra": now.get("groups_env_infra", 0),
        "fully_async/count/reward_timeouts": now["reward_timeouts"],
        "fully_async/count/filtered_groups": now.get("groups_filtered", 0),
        "fully_async/filtered_groups/ratio": new_filtered / max(1, new_filtered + new_pushed),
        "perf/tokens_per_s": tokens / step_s,
        "perf/generated_tokens_per_s": (now["tokens"] - last["tokens"]) / step_s,
    }
    m.update(reward_source_metrics(now.get("reward", {}), last.get("reward", {})))
    m.update(prefix_cache_metrics(now.get("prefix_cache") or {}, last.get("prefix_cache") or {}))
    m.update(in_flight_metrics(now.get("client") or {}, last.get("client") or {}))
    m.update(routing_metrics(now.get("affinity") or {}, last.get("affinity") or {}))
    if pool:  # the elastic engine pool (fully_async/ctl.py): its size, and who joined or left since the start
        m["fully_async/engines/pool_size"] = pool["size"]
        m["fully_async/engines/pool_down"] = pool["down"]
        for key in ("joins", "leaves", "replacements", "restarts", "moved"):
            m[f"fully_async/count/engine_{key}"] = pool[key]
        joins = pool["join_s"][len(pool_last.get("join_s", [])) :]
        if joins:  # servers that joined during this step: seconds from the add to serving
            m["timing_s/engines/join"] = max(joins)
    return m
