"""StepHelpers: what the trainer's step hands to two kept threads so that its own thread only waits for the training
ranks while the update computes.

- `ahead`: sends the next step's get and resolves it (the batch's transfer and deserialisation happen there), and
  reads the rollouter's and queue's counters that close the step's window (`prefetch`: one hand-over for both, since
  each wakes a thread, which costs the trainer on shared cores).
- `writes`: trajectories.jsonl, the batch's metrics and the loggers' lines, in the order the steps hand them over.
  A write that failed (a full disk) is raised by the trainer's next hand-over (`write`) or by `flush`, which the
  trainer calls before a checkpoint (the records so far are then in the files its snapshot keeps) and at the end.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async.handles import one_line, resolve
from fully_async.metrics import JsonlWriter, batch_metrics, trajectory_records
from fully_async.threads import CallThread, settle

log = logging.getLogger(__name__)


class StepHelpers:
    def __init__(self, queue: Any, rollouter: Any, run_dir: Path) -> None:
        self.queue, self.rollouter = queue, rollouter
        self.run_dir = Path(run_dir)
        self._ahead = CallThread("trainer-ahead")
        self._writes = CallThread("trainer-writes")
        self._written: list[concurrent.futures.Future] = []
        """The writes handed over and not yet seen done."""
        self._trajectories: JsonlWriter | None = None

    def open(self) -> None:
        """Open trajectories.jsonl for appending (after a resume cut it back to the checkpoint's step)."""
        if self._trajectories is None:
            self._trajectories = JsonlWriter(self.run_dir / "trajectories.jsonl")

    # -- ahead of the update -------------------------------------------------------------------------------------
    def prefetch(self, get: tuple) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
        """In the `ahead` thread: send the next step's get (`get`: the queue's get arguments), read this step's
        counters (`step_report(True)`), then resolve the batch. Returns (batch, report) futures."""
        batch: concurrent.futures.Future = concurrent.futures.Future()
        report: concurrent.futures.Future = concurrent.futures.Future()
        self._ahead.submit(self._prefetch, get, batch, report)
        return batch, report

    def _prefetch(self, get: tuple, batch: concurrent.futures.Future, report: concurrent.futures.Future) -> None:
        try:
            ref = self.queue.get.remote(*get)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread through both futures
            batch.set_exception(e)
            settle(report, self.step_report, True)
            return
        settle(report, self.step_report, True)
        settle(batch, resolve, ref)

    def step_report(self, take_filtered: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The rollouter's step_report and the queue's stats, both sent before either is awaited."""
        report = self.rollouter.step_report.remote(take_filtered=take_filtered)
        queue_stats = self.queue.stats.remote()
        return resolve(report), resolve(queue_stats)

    # -- the writer ----------------------------------------------------------------------------------------------
    def write(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand a write to the writer thread; a write that failed is raised here at the next one."""
        done, pending = [], []
        for f in self._written:  # one look at each: a write that ends meanwhile is seen next time
            (done if f.done() else pending).append(f)
        self._written = [*pending, self._writes.submit(fn, *args)]
        for f in done:
            f.result()  # raises the failed write's exception (the writes handed over still run)

    def write_trajectories(self, groups: list, step: int, trained_at: int) -> None:
        """The batch's trajectory records, in the writer thread."""
        self.write(lambda: self._trajectories.write(trajectory_records(groups, step, trained_at)))

    def write_records(self, records: list[dict[str, Any]], step: int) -> None:
        """Records the rollouter filtered out (they belong to `step`'s log), in the writer thread."""
        self.write(self._trajectories.write, [{**r, "step": step} for r in records])

    def batch_metrics(self, groups: list, version: int) -> concurrent.futures.Future:
        """The batch's metrics, computed in the writer thread while the update runs."""
        return self._writes.submit(batch_metrics, groups, version)

    def flush(self, quiet: bool = False) -> None:
        """Wait for the writes handed over so far; raise the first that failed (`quiet`: log it instead, when another
        failure is on its way out)."""
        written, self._written = self._written, []
        for f in written:
            if not quiet:
                f.result()
            elif f.exception() is not None:
                log.error("trainer: a write failed: %s", one_line(f.exception()))

    def close(self) -> None:
        """Flush quietly (after a failure, what was handed over still reaches the files), close the file, stop both
        threads."""
        try:
            self.flush(quiet=True)
        finally:
            if self._trajectories is not None:
                self._trajectories.close()
            self._ahead.close()
            self._writes.close()
