"""The teacher of a run: its own engine servers (distill.teacher.path) or a server the run does not own
(distill.teacher.url), and the scorer that asks it (scorer.py).

Contract:
- `await start_teacher(cfg, run_dir, device, namespace)`: None with distill off; else a started `Teacher`. With a
  path, the servers are built by the engine machinery the rollout pool uses (`build_engine`: the same kind,
  command line, health checks, log files under RUN_DIR/teacher/, restart of a dead server by `Recovery`), from the
  run's engine section with the teacher's kind, num_servers and KV cache; they are children of the Rollouter on its
  node, listening on loopback. They are never synced: no transport, pause or version change reaches them (they are
  not the Rollouter's pool), so they serve the teacher's weights for the whole run.
- `Teacher.score(rows)`, `stats()`, `aclose()` (stops the servers it started; safe twice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from pathlib import Path
from typing import Any

from fully_async.config import FullyAsyncConfig
from fully_async.distill.checks import api_headers, teacher_dir
from fully_async.distill.scorer import ENGINE_ENDPOINT, TeacherEndpoint, TeacherScorer


class Teacher:
    """A started teacher: `scorer` (TeacherScorer) and, when the run owns them, `servers` (EngineServers)."""

    def __init__(self, scorer: TeacherScorer, servers: Any = None) -> None:
        self.scorer, self.servers = scorer, servers

    async def score(self, rows) -> None:
        await self.scorer.score(rows)

    def stats(self) -> dict[str, float]:
        return self.scorer.stats()

    async def aclose(self) -> None:
        await self.scorer.aclose()
        if self.servers is not None:
            servers, self.servers = self.servers, None
            await asyncio.to_thread(servers.stop)


def teacher_engine(cfg: FullyAsyncConfig) -> Any:
    """The teacher servers' engine section: the run's, with the teacher's kind, server count and KV cache, no
    router, no warm-up, and no elastic bounds."""
    t = cfg.distill.teacher
    return dataclasses.replace(
        cfg.engine, kind=t.kind, num_servers=t.num_servers, min_servers=1, max_servers=0, router="none",
        warmup_requests=0, kv_cache_gib=t.kv_cache_gib or cfg.engine.kv_cache_gib,
    )  # fmt: skip


async def start_teacher(cfg: FullyAsyncConfig, run_dir: str | Path, device: str, namespace: str) -> Teacher | None:
    """The run's teacher, started (module docstring); None when distillation is off."""
    d = cfg.distill
    if not d.enable:
        return None
    if d.teacher.url:
        endpoint = TeacherEndpoint("/completions", d.teacher.model)
        scorer = TeacherScorer(d, [d.teacher.url], endpoint, namespace, headers=api_headers(d.teacher))
        return Teacher(scorer)
    from fully_async.engines import build_engine
    from fully_async.engines.auth import auth_headers
    from fully_async.engines.recovery import Recovery

    model = await asyncio.to_thread(teacher_dir, d.teacher, cfg.model.cache_dir)
    servers = build_engine(teacher_engine(cfg), model, Path(run_dir) / "teacher", device=device)
    try:
        await asyncio.to_thread(servers.start)
    except BaseException:
        await asyncio.to_thread(servers.stop)  # a failed start leaves no teacher process behind
        raise
    recovery = Recovery(servers, servers.cfg.auto_restart, types.SimpleNamespace(restarts=0))
    servers.on_dead = recovery.schedule_restart
    scorer = TeacherScorer(d, servers.addresses, ENGINE_ENDPOINT, namespace, headers=auth_headers(), recovery=recovery)
    return Teacher(scorer, servers)
