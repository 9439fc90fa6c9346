"""The distillation teacher's scorer (fully_async/distill/scorer.py) against a real aiohttp teacher on 127.0.0.1 in
its own process (tests/teacher_server.py): exact per-token log-probs in both request shapes, and a teacher SIGKILLed
mid-run that loses and fakes nothing: the call fails after its retries, no row gets a value, and in production the
sample's group is re-issued, then trained whole once a teacher serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fully_async.config import DistillConfig
from fully_async.distill import TeacherFailed, TeacherScorer
from fully_async.distill.scorer import ENGINE_ENDPOINT, TeacherEndpoint
from fully_async.engines.process import free_port
from fully_async.protocol import PromptRef, Trajectory
from fully_async.reward import RewardDrop
from tests.teacher_server import logprob
from tests.unit.test_production import producing, settled

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
FAST = DistillConfig(retries=2, backoff_s=0.01, backoff_max_s=0.02, timeout_s=5.0)


class TeacherProcess:
    """tests/teacher_server.py in a process of its own, on a free port."""

    def __init__(self, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.teacher_server", str(self.port), *flags],
                                     cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


@pytest.fixture
def teacher():
    proc = TeacherProcess()
    yield proc
    proc.stop()


def row(prompt, response, loss_mask=None) -> Trajectory:
    n = len(response)
    return Trajectory(prompt=PromptRef(0, 0), sample_index=0, prompt_ids=np.array(prompt),
                      response_ids=np.array(response), behaviour_logprobs=np.zeros(n), token_versions=np.zeros(n),
                      loss_mask=loss_mask)  # fmt: skip


def expected(t: Trajectory) -> list[float]:
    p = len(t.prompt_ids)
    return [pytest.approx(logprob(int(tok), p + k), abs=1e-6) for k, tok in enumerate(t.response_ids)]


@pytest.mark.parametrize("shape", ["engine", "completions"])
async def test_every_response_token_gets_the_teachers_log_prob_of_it(teacher, shape):
    endpoint = ENGINE_ENDPOINT if shape == "engine" else TeacherEndpoint("/completions", "teacher")
    base = teacher.url if shape == "engine" else teacher.url + "/v1"
    scorer = TeacherScorer(FAST, [base], endpoint, "test")
    # Two rows of one multi-turn sample; the tool tokens (mask 0) are scored as context like any other.
    rows = [row([3, 4, 5], [9, 10, 11, 12], loss_mask=[1, 1, 0, 1]), row([3, 4, 5, 9, 10, 11, 12], [13])]
    try:
        await scorer.score(rows)
    finally:
        await scorer.aclose()
    for t in rows:
        assert t.teacher_logprobs.tolist() == expected(t)
    s = scorer.stats()
    assert s["calls"] == 1 and s["requests"] == 2 and s["tokens_scored"] == 5 and s["failures"] == 0


async def test_a_teacher_sigkilled_mid_run_fails_the_call_and_fakes_nothing(teacher):
    scorer = TeacherScorer(FAST, [teacher.url], ENGINE_ENDPOINT, "test")
    first, second = row([3, 4], [5, 6]), row([3, 4], [7, 8])
    try:
        await scorer.score([first])
        teacher.kill()
        with pytest.raises(TeacherFailed) as failed:
            await scorer.score([second])
    finally:
        await scorer.aclose()
    assert isinstance(failed.value, RewardDrop)  # production re-issues the group
    assert first.teacher_logprobs.tolist() == expected(first)
    assert second.teacher_logprobs is None  # nothing made up
    s = scorer.stats()
    assert s["failures"] == 1 and s["drops"] == 1 and s["retries"] == FAST.retries and s["tokens_scored"] == 2


async def test_teacher_calls_are_not_capped_by_the_http_client():
    # aiohttp's default connector holds 100 connections: a slow teacher's calls would queue in the client unseen,
    # capping the pipeline at 100 / latency samples per second. Only distill.limits.max_concurrent may cap them.
    import aiohttp

    proc = TeacherProcess("--delay", "1,1")
    scorer = TeacherScorer(FAST, [proc.url], ENGINE_ENDPOINT, "test")
    try:
        await asyncio.gather(*(scorer.score([row([3, 4], [5])]) for _ in range(150)))
        async with aiohttp.ClientSession() as session, session.get(proc.url + "/stats") as resp:
            peak = (await resp.json())["peak"]
    finally:
        await scorer.aclose()
        proc.stop()
    assert peak > 100, peak


async def test_a_teacher_that_returns_no_prompt_log_probs_is_a_failure_not_a_score():
    proc = TeacherProcess("--no-prompt-logprobs")
    scorer = TeacherScorer(FAST, [proc.url], ENGINE_ENDPOINT, "test")
    t = row([3, 4], [5])
    try:
        with pytest.raises(TeacherFailed, match="no prompt log-probs|entries"):
            await scorer.score([t])
    finally:
        await scorer.aclose()
        proc.stop()
    assert t.teacher_logprobs is None


async def test_production_reissues_the_group_of_a_killed_teacher_and_trains_it_whole_later(tmp_path, teacher):
    port = teacher.port
    async with producing(tmp_path) as (production, admission, queue, failures, handle):
        production.reward.teacher = scorer = TeacherScorer(FAST, [teacher.url], ENGINE_ENDPOINT, "test")
        try:
            teacher.kill()
            lost = admission.admit_next()
            production.start(lost)
            await settled(production)
            assert list(admission.ledger.reissue) == [lost]  # not pushed with a sample unscored: re-issued
            assert (await queue("stats"))["size"] == 0
            back = TeacherProcess(port=port)  # the teacher serves again on the same address
            try:
                again = admission.admit_next()
                production.start(again)
                await settled(production)
                groups = await queue("get", 1, 0, 5)
            finally:
                back.stop()
        finally:
            await scorer.aclose()
    assert again == lost and not failures
    c = production.counters
    assert c["groups_failed"] == 1 and c["groups_dropped_by_reward"] == 1 and c["groups_pushed"] == 1
    (group,) = groups
    assert sorted(t.sample_index for t in group.trajectories) == [0, 1, 2, 3]
    for t in group.trajectories:
        assert t.teacher_logprobs.tolist() == expected(t)


def test_the_teachers_tokens_scored_per_second_over_a_step():
    from fully_async.metrics import reward_source_metrics

    last = {"teacher": {"calls": 2, "tokens_scored": 100, "clock_s": 10.0, "latency_s": 1.0}}
    now = {"teacher": {"calls": 6, "tokens_scored": 500, "clock_s": 14.0, "latency_s": 3.0, "drops": 1}}
    m = reward_source_metrics(now, last)
    assert m["fully_async/reward/teacher/tokens_scored_per_s"] == pytest.approx(100.0)
    assert m["fully_async/reward/teacher/latency_s"] == pytest.approx(0.5)
    assert m["fully_async/reward/teacher/drops"] == 1
    assert "fully_async/reward/teacher/tokens_scored_per_s" not in reward_source_metrics(now, {})  # no window yet
