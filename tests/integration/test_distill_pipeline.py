"""Distillation through a whole simulated run (engine=sim, trainer=sim, the real Rollouter, MessageQueue and Trainer on
local Ray) with a teacher at a url (tests/teacher_server.py on 127.0.0.1): the Rollouter starts the teacher beside
its engines, every sample is scored by it, its calls are the step metrics' reward source `teacher`; a teacher
SIGKILLed mid-run and brought back only re-issues groups: the run ends with every step trained, each prompt once."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fully_async.config import compose
from fully_async.models import resolve_model_path
from fully_async.simulation import run_schedule
from tests.integration.test_sim_pipeline import SMALL, trajectories
from tests.unit.distill.test_scorer import TeacherProcess

pytestmark = pytest.mark.timeout(300)

STEPS = 8


def test_a_url_teacher_scores_every_sample_and_its_death_only_reissues_groups(ray_local, tmp_path):
    teacher = TeacherProcess()
    cfg = compose([*SMALL, f"trainer.total_steps={STEPS}", "distill.enable=true", f"distill.teacher.url={teacher.url}/v1",
                   "distill.teacher.model=teacher", "distill.retries=1", "distill.backoff_s=0.01",
                   "distill.backoff_max_s=0.02", "distill.timeout_s=5"])  # fmt: skip
    back: list[TeacherProcess] = []

    def kill_then_restore() -> None:  # once the first step is logged: dead for a second, then back on its port
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        teacher.kill()
        time.sleep(1.0)
        back.append(TeacherProcess(port=teacher.port))

    chaos = threading.Thread(target=kill_then_restore, daemon=True)
    chaos.start()
    try:
        run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
        chaos.join(timeout=30)
    finally:
        teacher.stop()
        for proc in back:
            proc.stop()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    total = lambda key: sum(r.get(f"fully_async/reward/teacher/{key}", 0.0) for r in rows)  # noqa: E731
    trained = trajectories(tmp_path)
    assert len(trained) == STEPS * 4 * 4
    assert len({(t["epoch"], t["prompt_uid"], t["sample_index"]) for t in trained}) == len(trained)  # each once
    assert total("drops") >= 1  # the dead teacher's groups were re-issued ...
    assert total("calls") >= len(trained) + total("drops")  # ... and every trained sample was scored
    assert max(r.get("fully_async/reward/teacher/tokens_scored_per_s", 0.0) for r in rows) > 0
