"""Run report: python -m fully_async.report RUN_DIR [--out DIR]

Reads the run dir's event trace (trace/*.jsonl), metrics.jsonl and trajectories.jsonl, and writes to RUN_DIR/report/
(or --out):
- timeline.png: one lane per engine server, reward scoring, tool calls, rollouter (pauses, validation), trainer and weight sync,
  over wall time: the whole run, and under it a close-up of the last WINDOW_STEPS steps (with their ends marked), where
  a long run's whole view is a solid block;
- reward_staleness.png: reward and staleness per step; staleness_hist.png: staleness of every trained trajectory;
- summary.txt (also printed): where the time went per lane, and the idle ratios recomputed from the trace next to
  the ones metrics.jsonl logged;
- trace.json: Chrome trace format, for https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fully_async.metrics import plot_run
from fully_async.trace import Span, busy_seconds, engine_idle_ratio, load, trainer_idle_ratio, union

LANES = ("reward", "tools", "rollouter", "trainer", "sync")
"""The lanes after the engines', in timeline order (`tools`: the tool calls of multi-turn agent loops)."""
TRAINER_TOP = ("wait_for_batch", "update", "param_sync", "save_checkpoint", "stats")
"""Trainer spans that tile a step; the others on the trainer lane (prepare, log_probs, train) are inside `update`."""


class ReportError(RuntimeError):
    """The directory holds nothing to report on; the message says what is missing."""


@dataclass
class Run:
    run_dir: Path
    spans: list[Span]
    meta: dict[str, Any]
    metrics: list[dict[str, Any]]
    trajectories: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_engines(self) -> int:
        return int(self.meta.get("engines") or len({s.lane for s in self.spans if s.lane.startswith("engine/")}) or 1)

    def windows(self) -> list[tuple[int, float, float]]:
        """(step, start, end) wall-clock window of every logged step that carries its timestamp."""
        return [
            (m["step"], m["timestamp"] - m["timing_s/step"], m["timestamp"])
            for m in self.metrics
            if "timestamp" in m and "timing_s/step" in m
        ]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a run's jsonl log ([] when it does not exist), skipping a last line cut by a kill."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill mid-write
    return rows


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    spans, meta = load(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not spans and not metrics:
        raise ReportError(f"{run_dir} has neither an event trace (trace/*.jsonl) nor metrics.jsonl")
    # Groups dynamic sampling filtered are logged beside the trained ones; the report is about what was trained.
    trained = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if not t.get("filtered")]
    return Run(run_dir, spans, meta, metrics, trained)


# -- idle ratios from the trace -------------------------------------------------------------------------------------
def step_idle_ratios(run: Run) -> list[dict[str, float]]:
    """Per logged step: the trainer and rollouter idle ratios recomputed from the trace over the step's window, next
    to the logged values."""
    out = []
    logged = {m["step"]: m for m in run.metrics}
    for step, t0, t1 in run.windows():
        m = logged[step]
        out.append(
            {
                "step": step,
                "trainer_trace": trainer_idle_ratio(run.spans, t0, t1),
                "trainer_logged": m.get("fully_async/trainer/idle_ratio", math.nan),
                "rollouter_trace": engine_idle_ratio(run.spans, run.num_engines, t0, t1),
                "rollouter_logged": m.get("fully_async/rollouter/idle_ratio", math.nan),
                "seconds": t1 - t0,
            }
        )
    return out


def _weighted(rows: Sequence[dict[str, float]], key: str) -> float:
    total = sum(r["seconds"] for r in rows)
    return sum(r[key] * r["seconds"] for r in rows) / total if total else math.nan


# -- summary --------------------------------------------------------------------------------------------------------
def summary(run: Run) -> str:
    lines = [f"run {run.run_dir}"]
    if run.spans:
        lines += _time_spent(run)
    lines += _idle_ratios(run)
    if run.trajectories:
        stale = Counter(t["trained_version"] - t["min_version"] for t in run.trajectories)
        lines += ["", "staleness of trained trajectories: " + ", ".join(f"{k}: {v}" for k, v in sorted(stale.items()))]
    if run.metrics:
        last = run.metrics[-1]
        lines.append(
            f"last step {last.get('step')}: version {last.get('version')}, reward/mean "
            f"{last.get('reward/mean', math.nan):.3f}"
        )
    return "\n".join(lines) + "\n"


def _time_spent(run: Run) -> list[str]:
    """Where the traced wall time went: per engine lane, then per lane of LANES with its spans by name."""
    t0, t1 = run.spans[0].start, max(s.end for s in run.spans)
    wall = max(1e-9, t1 - t0)
    lines = [f"traced wall time {wall:.1f} s, {len(run.spans)} spans"]
    by_lane: dict[str, list[Span]] = defaultdict(list)
    for s in run.spans:
        by_lane[s.lane].append(s)
    lines.append("")
    lines.append("where the time went (busy = covered by at least one span; share of the traced wall time)")
    engines = sorted(lane for lane in by_lane if lane.startswith("engine/"))
    for lane in engines:
        spans = by_lane[lane]
        busy = busy_seconds([(s.start, s.end) for s in spans], t0, t1)
        tokens = sum(s.args.get("tokens", 0) for s in spans)
        lines.append(
            f"  {lane:<12} busy {busy:8.1f} s ({busy / wall:6.1%})  {len(spans)} requests, {tokens} tokens, "
            f"peak {_peak_concurrency(spans)} at once"
        )
    idle_engines = run.num_engines - len(engines)
    if idle_engines > 0:
        lines.append(f"  {idle_engines} engine server(s) served no request")
    for lane in LANES:
        if lane not in by_lane:
            continue
        spans = by_lane[lane]
        busy = busy_seconds([(s.start, s.end) for s in spans], t0, t1)
        lines.append(f"  {lane:<12} busy {busy:8.1f} s ({busy / wall:6.1%})")
        per_name: dict[str, list[float]] = defaultdict(list)
        for s in spans:
            per_name[s.name].append(s.dur)
        for name, durs in sorted(per_name.items(), key=lambda kv: -sum(kv[1])):
            if lane == "trainer" and name not in TRAINER_TOP:
                name = f"  {name} (in update)"
            lines.append(
                f"      {name:<26} {sum(durs):8.1f} s ({sum(durs) / wall:6.1%})  n={len(durs)}, "
                f"mean {sum(durs) / len(durs):.3f} s, max {max(durs):.3f} s"
            )
    return lines


def _idle_ratios(run: Run) -> list[str]:
    """The idle ratios over the logged steps: from metrics.jsonl alone, or the trace's beside them."""
    rows = step_idle_ratios(run)
    if rows and not run.spans:
        return [
            "",
            f"idle ratios over steps {rows[0]['step']}-{rows[-1]['step']} (time-weighted, metrics.jsonl; no trace)",
            f"  trainer {_weighted(rows, 'trainer_logged'):.3f}, rollouter {_weighted(rows, 'rollouter_logged'):.3f}",
        ]
    if not rows:
        return []
    trainer_trace, trainer_logged = _weighted(rows, "trainer_trace"), _weighted(rows, "trainer_logged")
    roll_trace, roll_logged = _weighted(rows, "rollouter_trace"), _weighted(rows, "rollouter_logged")
    return [
        "",
        f"idle ratios over steps {rows[0]['step']}-{rows[-1]['step']} (time-weighted; trace vs metrics.jsonl)",
        f"  trainer   (waiting for a batch)          {trainer_trace:.3f} vs {trainer_logged:.3f}",
        f"  rollouter (engine-seconds with no request) {roll_trace:.3f} vs {roll_logged:.3f}",
        f"  largest per-step difference: trainer "
        f"{max(abs(r['trainer_trace'] - r['trainer_logged']) for r in rows):.4f}, rollouter "
        f"{max(abs(r['rollouter_trace'] - r['rollouter_logged']) for r in rows):.4f}",
        "  " + _verdict(trainer_trace, roll_trace),
    ]


def _verdict(trainer_idle: float, engine_idle: float) -> str:
    if trainer_idle > engine_idle:
        return f"generation-bound: the trainer waits {trainer_idle:.0%} of the time for batches"
    return f"trainer-bound: the engines stand idle {engine_idle:.0%} of the time"


def _peak_concurrency(spans: Sequence[Span]) -> int:
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


# -- plots ----------------------------------------------------------------------------------------------------------
_COLOURS = {
    "generate": "tab:blue", "score": "tab:orange", "paused": "tab:gray", "validation": "tab:olive",
    "wait_for_batch": "lightgray", "update": "tab:green", "prepare": "tab:cyan", "log_probs": "tab:purple",
    "train": "darkgreen", "param_sync": "tab:red", "save_checkpoint": "tab:brown", "stats": "black",
    "pause": "salmon", "export": "gold", "reload": "darkred", "resume": "pink", "tool_call": "teal",
}  # fmt: skip


def _lanes(spans: Sequence[Span], num_engines: int) -> list[str]:
    engines = [f"engine/{i}" for i in range(num_engines)]
    extra = sorted({s.lane for s in spans if s.lane.startswith("engine/")} - set(engines))
    others = [lane for lane in LANES if any(s.lane == lane for s in spans)]
    return engines + extra + others


WINDOW_STEPS = 5
"""Steps in the timeline's close-up: the run's last ones (the steady state, after the pipeline's fill)."""
STEP_LINES_MAX = 60
"""The whole-run view marks step ends only up to this many steps (past it the marks cover the lanes)."""


def readable_window(run: Run, steps: int = WINDOW_STEPS) -> tuple[int, int, float, float] | None:
    """(first step, last step, start, end) of the run's last `steps` logged steps, wall clock; None when the run
    logged fewer than 4x that many (its whole-run view is readable as it is)."""
    windows = run.windows()
    if len(windows) < 4 * steps:
        return None
    last = windows[-steps:]
    return last[0][0], last[-1][0], last[0][1], last[-1][2]


def _draw_lanes(ax, run: Run, lanes: list[str], t0: float, lo: float, hi: float, step_lines: bool) -> set[str]:
    """The lanes' spans that overlap [lo, hi] (wall clock) on `ax`, x in seconds since t0; returns the names drawn."""
    used: set[str] = set()
    for row, lane in enumerate(reversed(lanes)):
        spans = [s for s in run.spans if s.lane == lane and s.end >= lo and s.start <= hi]
        if lane.startswith("engine/") or lane in ("reward", "tools"):
            # Many concurrent requests per lane: draw when the lane had at least one running.
            name = spans[0].name if spans else "generate"
            bars = [(s - t0, e - s) for s, e in union((s.start, s.end) for s in spans)]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=_COLOURS.get(name, "tab:blue"))
            used.add(name)
            continue
        for s in spans:
            inner = lane == "trainer" and s.name not in TRAINER_TOP
            y, h = (row - 0.15, 0.3) if inner else (row - 0.35, 0.7)
            ax.broken_barh([(s.start - t0, s.dur)], (y, h), color=_COLOURS.get(s.name, "tab:pink"))
            used.add(s.name)
    if step_lines:
        for _, _, end in run.windows():
            if lo <= end <= hi:
                ax.axvline(end - t0, color="black", alpha=0.4, linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_xlim(lo - t0, hi - t0)
    ax.grid(axis="x", alpha=0.3)
    return used


def timeline_figure(run: Run, window_steps: int = WINDOW_STEPS):
    """The timeline: the whole run, and under it (when the run has more than `window_steps` steps) a close-up of
    its last `window_steps` steps, where single requests and trainer phases can be told apart. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not run.spans:
        raise ReportError(f"{run.run_dir} has no event trace (trace/*.jsonl); was logger.trace=false?")
    t0 = run.spans[0].start
    end = max(s.end for s in run.spans)
    lanes = _lanes(run.spans, run.num_engines)
    window = readable_window(run, window_steps)
    panels = 1 + (window is not None)
    fig, axes = plt.subplots(panels, 1, figsize=(14, panels * (1.0 + 0.55 * len(lanes))), squeeze=False)
    whole = axes[0][0]
    step_lines = len(run.windows()) <= STEP_LINES_MAX
    used = _draw_lanes(whole, run, lanes, t0, t0, end, step_lines)
    whole.set_title(f"timeline: {run.run_dir.name}, the whole run ({len(run.windows())} steps)")
    whole.set_xlabel(
        "wall seconds since the first span" + (" (thin lines: end of each trainer step)" if step_lines else "")
    )
    if window is not None:
        first, last, lo, hi = window
        whole.axvspan(lo - t0, hi - t0, color="gold", alpha=0.25, zorder=0)
        close = axes[1][0]
        used |= _draw_lanes(close, run, lanes, t0, lo, hi, True)
        close.set_title(f"the last {last - first + 1} steps ({first}-{last}; shaded above)")
        close.set_xlabel("wall seconds since the first span (thin lines: end of each trainer step)")
    whole.legend(
        handles=[Patch(color=_COLOURS.get(n, "tab:pink"), label=n) for n in sorted(used)],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    return fig


def render_timeline(run: Run, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = timeline_figure(run)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def render_staleness_hist(run: Run, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stale = [t["trained_version"] - t["min_version"] for t in run.trajectories]
    if not stale:
        raise ReportError(f"{run.run_dir}/trajectories.jsonl is missing or empty")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(stale, bins=[b - 0.5 for b in range(max(stale) + 2)], rwidth=0.8)
    ax.set_xticks(range(max(stale) + 1))
    ax.set_xlabel("staleness (trained version - oldest token version)")
    ax.set_ylabel("trajectories")
    ax.set_title(f"staleness of {len(stale)} trained trajectories")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -- Chrome trace ---------------------------------------------------------------------------------------------------
def _pack(spans: Sequence[Span]) -> list[int]:
    """A slot (thread row) per span such that spans in one slot never partly overlap: each either follows the
    previous one or nests inside it, as the Chrome trace format requires."""
    eps = 2e-6  # spans are stored rounded to the microsecond: a phase may end 1 us after the next one starts
    slots: list[list[Span]] = []  # per slot: the stack of open spans
    out = []
    for s in spans:  # sorted by start
        for i, stack in enumerate(slots):
            while stack and stack[-1].end <= s.start + eps:
                stack.pop()
            if not stack or s.end <= stack[-1].end + eps:
                stack.append(s)
                out.append(i)
                break
        else:
            slots.append([s])
            out.append(len(slots) - 1)
    return out


def chrome_trace(run: Run) -> dict[str, Any]:
    """The trace as Chrome trace events (microseconds from the first span); one process per recording actor, one
    thread per lane (split into rows where requests run concurrently)."""
    t0 = run.spans[0].start if run.spans else 0.0
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str, int], int] = {}
    by_lane: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for s in run.spans:
        by_lane[(s.source, s.lane)].append(s)
    for (source, lane), spans in by_lane.items():
        pid = pids.setdefault(source, len(pids) + 1)
        for s, slot in zip(spans, _pack(spans)):
            key = (source, lane, slot)
            if key not in tids:
                tids[key] = len(tids) + 1
                label = lane if slot == 0 else f"{lane} #{slot}"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[key], "args": {"name": label}})
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": lane,
                    "ts": round((s.start - t0) * 1e6, 3),
                    "dur": round(s.dur * 1e6, 3),
                    "pid": pid,
                    "tid": tids[key],
                    "args": s.args,
                }
            )
    for source, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": source}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"wall_clock_origin_s": t0}}


# -- entry point ----------------------------------------------------------------------------------------------------
def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Render everything the run's files allow; returns what was written (name -> path)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if run.spans:
        written["timeline"] = render_timeline(run, out / "timeline.png")
        path = out / "trace.json"
        path.write_text(json.dumps(chrome_trace(run)))
        written["chrome_trace"] = path
    if run.metrics and plot_run(run.run_dir / "metrics.jsonl", out / "reward_staleness.png"):
        written["reward_staleness"] = out / "reward_staleness.png"
    if run.trajectories:
        written["staleness_hist"] = render_staleness_hist(run, out / "staleness_hist.png")
    text = summary(run)
    (out / "summary.txt").write_text(text)
    written["summary"] = out / "summary.txt"
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fully_async.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (hydra.run.dir of a fully_async.runner run)")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.run_dir, args.out)
    except ReportError as e:
        print(f"fully_async.report: {e}", file=sys.stderr)
        return 2
    print(written["summary"].read_text(), end="")
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
