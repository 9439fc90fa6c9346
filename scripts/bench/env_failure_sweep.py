"""Environment infrastructure-failure rate x the rule past the retry budget, against the reward curve (issue 40).

    .venv/bin/python scripts/bench/env_failure_sweep.py --out /tmp/envsweep --task lookup --steps 300  # curves
    .venv/bin/python scripts/bench/env_failure_sweep.py --out /tmp/envsweep --report       # the cells under --out
    .venv/bin/python scripts/bench/env_failure_sweep.py --out /tmp/envsweep --sim --steps 20      # the accounting only

Each cell is one job of an OpenEnv example, its reward through the RewardAgent: --task lookup (examples/
openenv_lookup: task=lookup's tool behind the server, a task the tiny model learns on CPU, so the cells give reward
curves) or --task digits (examples/openenv_digits, the default: the accounting), against two OpenEnv server processes
of the task's environment this script starts on 127.0.0.1, reached through a loopback TCP
relay that resets (RST) a fraction --rates of the episodes' WebSocket connections when the client sends its first
step (after the environment answered its reset): that step fails as a reset connection would. Health checks pass
untouched. `env.infra_retries=0`, so each failed episode meets the rule at once:
  reissue      the group is dropped and its prompt re-issued (the project's rule, `env.on_exhausted=reissue`)
  zero_reward  the sample is trained with reward 0 (the naive rule, `env.on_exhausted=zero_reward`)
From trajectories.jsonl and metrics.jsonl: mean reward of the first and last fifth of the steps, samples trained with
a fake 0 (`env_zeroed`), groups re-issued (`fully_async/count/groups_env_infra`), prompts trained twice; and the curve:
the mean reward per --window steps, the step where the --window-step mean first reaches --threshold, the last
window's mean reward and tool-call rate (episodes that stepped a tool answer, `env_turns` > 0). With engine=sim
(--sim) the rewards are 0 (random token ids): only the accounting is meaningful. Markdown tables printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fully_async.engines.process import ServerProcess  # noqa: E402


class ResettingRelay:
    """A TCP relay 127.0.0.1:port -> upstream that resets a fraction `rate` of the WebSocket connections (GET /ws)
    at the client's second message (reset, then the first step)."""

    def __init__(self, upstream_port: int, rate: float, seed: int) -> None:
        self.upstream_port, self.rate, self.rng = upstream_port, rate, random.Random(seed)
        self.port = 0
        self.episodes = self.reset = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            first = await reader.read(65536)
        except OSError:
            writer.transport.abort()
            return
        episode = first.startswith(b"GET /ws")
        doomed = episode and self.rng.random() < self.rate
        self.episodes += episode
        up_writer.write(first)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, client: bool) -> None:
            sent = 0
            while data := await src.read(65536):
                sent += client
                if doomed and sent == 2:  # the client's first step, after its reset was answered
                    self.reset += 1
                    writer.transport.abort()  # RST to the client, as a dying node or proxy would
                    up_writer.transport.abort()
                    return
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)


TASKS = {"digits": ("examples/openenv_digits", "fully_async.envs.digits:app"),
         "lookup": ("examples/openenv_lookup", "fully_async.envs.lookup_env:app")}  # fmt: skip
"""--task: the example a cell runs and the OpenEnv app its servers serve."""


def job(out: Path, task: str, urls: list[str], rule: str, steps: int, sim: bool, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "fully_async.runner", "--config-dir", str(REPO / TASKS[task][0]),
           "--config-name", "config", f"hydra.run.dir={out}", "logger=[jsonl]", f"trainer.total_steps={steps}",
           f"rollout.multi_turn.env.urls=[{','.join(urls)}]", "rollout.multi_turn.env.infra_retries=0",
           f"rollout.multi_turn.env.on_exhausted={rule}", "engine.startup_timeout_s=1200",
           *(["engine=sim", "trainer=sim"] if sim else []), *extra]  # fmt: skip
    for _ in range(3):  # again when Ray's start times out on a loaded machine
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (out / "stdout.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        if proc.returncode == 0:
            return
        if "timed out during startup" not in proc.stderr:
            break
    raise SystemExit(f"job failed ({out}):\n{proc.stderr[-3000:]}")


def curve(trajs: list[dict], steps: int, window: int, threshold: float) -> dict:
    """Mean reward per `window` steps, the first step whose trailing `window`-step mean reaches `threshold`, and
    the last window's reward and tool-call rate; the same three again without the samples trained with a fake 0
    (`_real`): what the policy really earned, where a fake 0 (zero_reward) lowers the logged mean by ~rate x reward."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for t in trajs:
        by_step[t["step"]].append(t)
    last = [t for k in range(steps - window + 1, steps + 1) for t in by_step.get(k, [])]
    logged = _reading(by_step, steps, window, threshold, lambda t: True)
    real = _reading(by_step, steps, window, threshold, lambda t: not t.get("env_zeroed"))
    return {
        **logged,
        **{f"{k}_real": v for k, v in real.items()},
        # A second model turn follows only a tool call (a digit or any other first token ends the episode).
        "tool_rate_last": sum(t.get("turns", 0) > 1 for t in last) / max(1, len(last)),
    }


def _reading(by_step: dict[int, list[dict]], steps: int, window: int, threshold: float, keep) -> dict:
    per_step = {
        k: sum(t["reward"] for t in kept) / len(kept) for k, v in by_step.items() if (kept := list(filter(keep, v)))
    }

    def mean(lo: int, hi: int) -> float:
        xs = [per_step[k] for k in range(lo, hi + 1) if k in per_step]
        return sum(xs) / max(1, len(xs))

    return {
        "windows": [round(mean(lo, min(lo + window - 1, steps)), 3) for lo in range(1, steps + 1, window)],
        "crossed": next((k for k in range(window, steps + 1) if mean(k - window + 1, k) >= threshold), None),
        "last_window": mean(steps - window + 1, steps),
    }


def summarize(out: Path, window: int = 20, threshold: float = 0.5) -> dict:
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines() if x]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = max(t["step"] for t in trajs)
    fifth = max(1, steps // 5)

    def mean(lo: int, hi: int) -> float:
        r = [t["reward"] for t in trajs if lo <= t["step"] <= hi]
        return sum(r) / max(1, len(r))

    steps_of: dict[str, set[int]] = defaultdict(set)
    for t in trajs:
        steps_of[t["prompt_uid"]].add(t["step"])
    return {
        "steps": steps,
        "first": mean(1, fifth),
        "last": mean(steps - fifth + 1, steps),
        "zeroed": sum(bool(t.get("env_zeroed")) for t in trajs),
        "samples": len(trajs),
        "reissued": max((m.get("fully_async/count/groups_env_infra", 0) for m in metrics), default=0),
        "twice": sum(len(s) > 1 for s in steps_of.values()),
        **curve(trajs, steps, window, threshold),
    }


def print_curves(cells: list[tuple[float, str, dict]], window: int, threshold: float) -> None:
    print(f"\n| failure rate | rule | steps | mean reward per {window} steps | {window}-step mean >= {threshold} "
          f"at step | last-{window} reward | without the fake 0s: mean reward per {window} steps | >= {threshold} at "
          f"step | last-{window} reward | last-{window} tool-call rate | fake 0 trained | groups re-issued | seconds |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for rate, rule, s in cells:
        print(f"| {rate:.0%} | {rule} | {s['steps']} | {' '.join(f'{w:.2f}' for w in s['windows'])} | "
              f"{s['crossed'] or 'not reached'} | {s['last_window']:.3f} | "
              f"{' '.join(f'{w:.2f}' for w in s['windows_real'])} | {s['crossed_real'] or 'not reached'} | "
              f"{s['last_window_real']:.3f} | {s['tool_rate_last']:.2f} | "
              f"{s['zeroed'] / max(1, s['samples']):.1%} | {s['reissued']} | {s['seconds']:.0f} |", flush=True)  # fmt: skip


def report(out: Path, window: int, threshold: float) -> None:
    """The curve table of every finished cell under `out` (cells run by separate invocations, one per cell)."""
    cells = []
    for path in sorted(out.glob("**/summary.json")):
        rate, _, rule = path.parent.name.removeprefix("rate").partition("-")
        s = {**json.loads(path.read_text()), **summarize(path.parent, window, threshold)}
        cells.append((float(rate), rule if float(rate) > 0 else "-", s))
    print_curves(sorted(cells, key=lambda c: (c[0], c[1] != "reissue")), window, threshold)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.05, 0.15])
    p.add_argument("--rules", nargs="+", default=["reissue", "zero_reward"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--override", action="append", default=[], help="a runner override for every cell (repeatable)")
    p.add_argument("--sim", action="store_true", help="engine=sim trainer=sim: the accounting only")
    p.add_argument("--task", choices=sorted(TASKS), default="digits", help="lookup: a task that learns (curves)")
    p.add_argument("--window", type=int, default=20, help="steps per point of the reward curve")
    p.add_argument("--threshold", type=float, default=0.5, help="the window mean whose first crossing is reported")
    p.add_argument("--report", action="store_true", help="run nothing: the curve table of the cells under --out")
    args = p.parse_args()
    if args.report:
        return report(args.out, args.window, args.threshold)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FULLY_ASYNC_ENV_MAX_CONCURRENT": "256"}
    servers = [
        ServerProcess(name=f"env {i}", env=env, log_path=args.out / f"env-{i}.log",
                      command=lambda port: [sys.executable, "-m", "fully_async.envs.serve",
                                            TASKS[args.task][1], "--port", str(port)])
        for i in range(2)
    ]  # fmt: skip
    for s in servers:
        s.launch()
    cells: list[tuple[float, str, dict]] = []
    try:
        for s in servers:
            s.wait_healthy(300)
        print("| failure rate | rule | steps | reward first fifth -> last fifth | samples trained with a fake 0 | "
              "groups re-issued | prompts trained twice | episodes reset / relayed |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        for rate in args.rates:
            for rule in args.rules if rate > 0 else args.rules[:1]:
                relays = [ResettingRelay(int(s.url.rsplit(":", 1)[1]), rate, seed=k) for k, s in enumerate(servers)]
                out = args.out / f"rate{rate}-{rule}"
                out.mkdir(exist_ok=True)
                t0 = time.monotonic()
                urls = [f"http://127.0.0.1:{r.port}" for r in relays]
                job(out, args.task, urls, rule, args.steps, args.sim, args.override)
                s = summarize(out, args.window, args.threshold)
                s.update(seconds=time.monotonic() - t0, reset=sum(r.reset for r in relays),
                         episodes=sum(r.episodes for r in relays))  # fmt: skip
                (out / "summary.json").write_text(json.dumps(s))
                print(f"| {rate:.0%} | {rule if rate > 0 else '-'} | {s['steps']} | {s['first']:.3f} -> "
                      f"{s['last']:.3f} | {s['zeroed']} of {s['samples']} | {s['reissued']} | {s['twice']} | "
                      f"{s['reset']} / {s['episodes']} |", flush=True)  # fmt: skip
                cells.append((rate, rule if rate > 0 else "-", s))
        print_curves(cells, args.window, args.threshold)
    finally:
        for s in servers:
            s.stop(5.0)


if __name__ == "__main__":
    main()
