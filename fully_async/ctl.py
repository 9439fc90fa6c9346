"""Operator commands for a running job: grow, shrink and list its engine pool while training goes on.

    python -m fully_async.ctl engines --list
    python -m fully_async.ctl engines --add 2
    python -m fully_async.ctl engines --remove http://10.0.0.7:8101
    python -m fully_async.ctl jobs

The command joins the job's Ray cluster (--address, else RAY_ADDRESS, else the cluster started on this machine) and
finds the job through its Rollouter, a named actor (`rollouter:<run dir>` in the `fully_async` namespace). With one
job on the cluster it is found alone; with several, --run RUN_DIR names it. The same from Python:

    pool = EnginePool.connect()          # or EnginePool.connect(run_dir=..., address=...)
    pool.add(2); pool.remove(url); pool.list()

A server added starts on free resources (a new placement group, as the job placed the first ones), loads the
current weights and version, and only then takes requests. A server removed takes no new requests; what it runs is
aborted and continued on the others; then it is stopped and its resources freed. engine.min_servers and
engine.max_servers bound the pool. Exit status: 0 done, 1 refused or failed (the reason printed), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from fully_async.handles import NAMESPACE, resolve
from fully_async.handles import ROLLOUTER_PREFIX as PREFIX
from fully_async.weights.port import EnginePort


class CtlError(RuntimeError):
    """The job could not be found or refused the command; the message says why."""


def running_jobs() -> list[str]:
    """Run directories of the jobs running on the connected cluster (those with a named Rollouter)."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"][len(PREFIX) :] for a in actors if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX)
    )


def connect(address: str | None = None) -> None:
    """Join the cluster: `address`, else RAY_ADDRESS, else the one started on this machine ("auto")."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 logging_level=logging.WARNING)  # fmt: skip


class EnginePool:
    """The engine pool of one running job (see the module docstring), asked through its Rollouter's engine port
    (fully_async/weights/port.py)."""

    def __init__(self, rollouter: Any, run_dir: str):
        self.rollouter, self.run_dir = rollouter, run_dir
        self.engines = EnginePort(rollouter)

    @classmethod
    def connect(cls, run_dir: str | None = None, address: str | None = None) -> EnginePool:
        import ray

        connect(address)
        jobs = running_jobs()
        if run_dir is not None:
            wanted = os.path.realpath(run_dir)
            if wanted not in jobs:
                raise CtlError(f"no running job with run dir {wanted}; running: {jobs or 'none'}")
        elif len(jobs) == 1:
            wanted = jobs[0]
        else:
            raise CtlError(
                "no fully_async job is running on this cluster"
                if not jobs
                else f"{len(jobs)} jobs are running; name one with --run: {jobs}"
            )
        return cls(ray.get_actor(PREFIX + wanted, namespace=NAMESPACE), wanted)

    def _ask(self, call: Callable[..., Any], *args: Any, timeout: float = 3600) -> Any:
        """The value of the engine port's `call(*args)`; CtlError saying why the job refused it or is gone."""
        import ray

        try:
            return resolve(call(*args), timeout)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            raise CtlError(f"{type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayActorError as e:
            raise CtlError(f"the job's Rollouter is gone ({type(e).__name__}); the job has ended") from None

    def list(self) -> list[dict[str, Any]]:
        return self._ask(self.engines.rows, timeout=60)

    def add(self, count: int = 1) -> dict[str, Any]:
        return self._ask(self.engines.add, count)

    def remove(self, url: str) -> dict[str, Any]:
        return self._ask(self.engines.remove, url)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'index':>5}  {'state':<8} {'in flight':>9} {'busy s':>9}  {'node':<10} url"]
    lines += [
        f"{r['index']:>5}  {r['state']:<8} {r['in_flight']:>9} {r['busy_s']:>9.1f}  {(r['node_id'] or 'local')[:8]:<10} "
        f"{r['url']}"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fully_async.ctl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else this machine's)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("jobs", help="list the running jobs (their run directories)")
    eng = sub.add_parser("engines", help="list, add or remove engine servers of a running job")
    eng.add_argument("--run", help="the job's run directory (needed when several jobs run)")
    what = eng.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="the pool: index, state, requests in flight, node, url")
    eng.add_argument("--json", action="store_true", help="with --list: one JSON object per server")
    what.add_argument("--add", type=int, metavar="N", help="start N more servers")
    what.add_argument("--remove", metavar="URL", help="take the server at URL out of the pool")
    args = parser.parse_args(argv)
    try:
        if args.command == "jobs":
            connect(args.address)
            print("\n".join(running_jobs()) or "no running job")
            return 0
        pool = EnginePool.connect(args.run, args.address)
        if args.list:
            rows = pool.list()
            print("\n".join(json.dumps(r) for r in rows) if args.json else _table(rows))
        elif args.add is not None:
            out = pool.add(args.add)
            print(f"joined in {out['seconds']:.1f} s: {' '.join(out['joined'])} (pool: {out['live']} servers)")
        else:
            out = pool.remove(args.remove)
            print(f"removed {out['removed']}: {out['moved']} request(s) continued elsewhere (pool: {out['live']})")
        return 0
    except CtlError as e:
        print(f"fully_async.ctl: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
