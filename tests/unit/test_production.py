"""Production alone (fully_async/production.py), without Ray or the admission loop: the test admits prompts itself
and hands them to a Production over emulated engines (engine=sim), the sim agent loop and reward, a real Admission
with its ledger and a real MessageQueue behind a LocalActor. A group comes out whole and is settled in the ledger; its
samples count against max_concurrent from the moment it starts; dynamic sampling filters constant groups; a push the
queue refuses puts the groups back for re-issue and fails the run; a prompt over data.max_prompt_length fails it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from transformers import AutoTokenizer

from fully_async.admission import Admission
from fully_async.agents import build_agent_loop
from fully_async.agents.tokens import stop_token_ids
from fully_async.config import compose
from fully_async.data import EpochCursor, dataset
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.handles import LocalActor, resolve_async
from fully_async.message_queue import MessageQueue
from fully_async.models import resolve_model_path
from fully_async.production import Production
from fully_async.reward import RewardAgent
from fully_async.staleness import StalenessLedger
from fully_async.trace import Tracer
from tests.helpers import SIM_ROLLOUT

pytestmark = pytest.mark.timeout(120)

SIM = [*SIM_ROLLOUT, "async_training.groups_per_step=4", "data.synthetic_size=8", "data.shuffle=false"]


@contextlib.asynccontextmanager
async def producing(tmp_path, overrides: list[str] = ()):
    """(Production, its Admission, a call helper for the queue, the list `fail` appends to, the queue's handle)."""
    cfg = compose([*SIM, *overrides])
    at, ro = cfg.async_training, cfg.rollout
    model = str(resolve_model_path(cfg.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    sampling = Sampling.from_rollout(ro, stop_token_ids=stop_token_ids(tokenizer))
    agent = build_agent_loop(cfg.agent_loop_path(), tokenizer, sampling, ro.response_length)
    servers = build_engine(cfg.engine, model, str(tmp_path))
    servers.start()
    client, reward = EngineClient(servers), RewardAgent(cfg.reward, tokenizer_path=model)
    handle = LocalActor(MessageQueue(at.effective_queue_capacity(), at.max_staleness), "queue")
    lock = asyncio.Lock()
    admission = Admission(StalenessLedger(at.max_staleness, at.groups_per_version), handle, lock, ro.n,
                          ro.max_concurrent, ro.effective_start_concurrent(), at.groups_per_step)  # fmt: skip
    admission.cursor = EpochCursor(cfg.data.synthetic_size, shuffle=False)
    failures: list[str] = []
    tracer = Tracer(str(tmp_path), "rollouter", cfg.logger.trace)
    production = Production(cfg, dataset(cfg, "train"), agent, client, reward, tracer, handle, admission, lock,
                            failures.append)  # fmt: skip

    def queue(method: str, *args):
        return resolve_async(getattr(handle, method).remote(*args))

    try:
        yield production, admission, queue, failures, handle
    finally:
        await production.stop()
        await client.close()
        servers.stop()
        await reward.aclose()
        tracer.close()
        handle.close()


async def settled(production: Production) -> None:
    """Until every started group has ended (pushed, filtered or failed)."""
    while production.tasks:
        await asyncio.wait(set(production.tasks))


async def test_each_started_prompt_comes_out_as_one_whole_scored_group_and_is_settled(tmp_path):
    async with producing(tmp_path) as (production, admission, queue, failures, handle):
        prompts = [admission.admit_next() for _ in range(3)]
        for p in prompts:
            production.start(p)
        assert production.inflight_samples == 3 * 4  # counted before the tasks first run
        await settled(production)
        groups = await queue("get", 3, 0, 5)
    assert not failures and production.inflight_samples == 0
    assert sorted(g.prompt for g in groups) == prompts
    for g in groups:
        assert sorted(t.sample_index for t in g.trajectories) == [0, 1, 2, 3]
        for t in g.trajectories:  # fully_async.reward.sim:score: 1 for an even response length
            assert t.reward == float(t.response_length % 2 == 0) and "reward_s" in t.timings
    assert admission.ledger.accepted == 3 and not admission.ledger.running
    c = production.counters
    assert c["groups_pushed"] == 3 and c["samples"] == 12
    assert c["tokens"] == sum(t.response_length for g in groups for t in g.trajectories)


async def test_constant_groups_are_filtered_recorded_and_their_slots_freed(tmp_path):
    overrides = ["engine.sim.length_sigma=0", "algorithm.filter_groups.enable=true"]  # equal lengths, equal rewards
    async with producing(tmp_path, overrides) as (production, admission, queue, failures, handle):
        prompts = [admission.admit_next() for _ in range(2)]
        for p in prompts:
            production.start(p)
        await settled(production)
        size = (await queue("stats"))["size"]
    assert not failures and size == 0 and production.counters["groups_filtered"] == 2
    assert admission.ledger.filtered == 2 and not admission.ledger.running and admission.ledger.accepted == 0
    records = production.pop_filtered()
    assert len(records) == 8 and all(r["filtered"] for r in records)
    assert {r["prompt_uid"] for r in records} == {p.uid for p in prompts}
    assert production.pop_filtered() == []


async def test_a_push_the_queue_refuses_puts_the_groups_back_and_fails_the_run(tmp_path):
    async with producing(tmp_path) as (production, admission, queue, failures, handle):
        # The queue's close() (LocalActor's own close() stops the handle's thread; __getattr__ reaches the queue's).
        await resolve_async(handle.__getattr__("close").remote("the trainer is gone"))
        prompt = admission.admit_next()
        production.start(prompt)
        await settled(production)
    assert len(failures) == 1 and "pushing 1 groups to the message queue failed" in failures[0], failures
    assert list(admission.ledger.reissue) == [prompt] and admission.ledger.accepted == 0
    assert production.counters["groups_pushed"] == 0


async def test_a_prompt_longer_than_max_prompt_length_fails_the_run(tmp_path):
    async with producing(tmp_path, ["data.max_prompt_length=4"]) as (production, admission, queue, failures, handle):
        production.start(admission.admit_next())
        await settled(production)
        size = (await queue("stats"))["size"]
    assert len(failures) == 1 and "data.max_prompt_length=4" in failures[0] and size == 0


class _InfraOnce:
    """The agent loop, but sample 1 of `prompt`'s first attempt fails as an environment past its retry budget."""

    def __init__(self, agent, prompt):
        self.agent, self.prompt, self.failed = agent, prompt, False

    def __getattr__(self, name):
        return getattr(self.agent, name)

    async def run(self, client, sample):
        from fully_async.envs.failures import InfraExhausted

        if sample.prompt == self.prompt and sample.sample_index == 1 and not self.failed:
            self.failed = True
            raise InfraExhausted("reset", "3 attempts failed; last: reset: connection reset by peer")
        return await self.agent.run(client, sample)


async def test_an_environment_failed_past_its_retries_reissues_the_group_and_trains_each_prompt_once(tmp_path):
    async with producing(tmp_path) as (production, admission, queue, failures, handle):
        prompts = [admission.admit_next() for _ in range(2)]
        production.agent = _InfraOnce(production.agent, prompts[0])
        for p in prompts:
            production.start(p)
        await settled(production)
        assert list(admission.ledger.reissue) == [prompts[0]]  # not trained with a sample missing: re-issued
        again = admission.admit_next()
        production.start(again)
        await settled(production)
        groups = await queue("get", 2, 0, 5)
        size = (await queue("stats"))["size"]
    assert again == prompts[0] and not failures and size == 0
    assert sorted(g.prompt for g in groups) == sorted(prompts)  # each prompt once, whole
    assert all(sorted(t.sample_index for t in g.trajectories) == [0, 1, 2, 3] for g in groups)
    c = production.counters
    assert c["groups_env_infra"] == 1 and c["groups_failed"] == 1 and c["groups_pushed"] == 2
    assert admission.ledger.accepted == 2 and not admission.ledger.running and not admission.ledger.reissue


class _Refused:
    """The agent loop, but every sample of the prompts in `refused` fails as a request every server refuses (a 4xx:
    EngineClient does not retry it), as one naming an adapter no server holds."""

    def __init__(self, agent, refused):
        self.agent, self.refused = agent, refused

    def __getattr__(self, name):
        return getattr(self.agent, name)

    async def run(self, client, sample):
        from fully_async.engines import EngineError

        if sample.prompt in self.refused:
            raise EngineError("HTTP 404 from http://127.0.0.1:1/generate: the model 'policy-v4' does not exist")
        return await self.agent.run(client, sample)


async def test_groups_failing_in_a_row_fail_the_run_and_one_that_finishes_resets_the_count(tmp_path):
    """A refusal re-issued for ever would hang the run: at advanced.failed_groups_in_a_row failures with none
    finished in between the run fails with the last error; a group that finishes starts the count again."""
    async with producing(tmp_path, ["advanced.failed_groups_in_a_row=3"]) as (production, admission, _, failures, _h):
        refused: set = set()
        production.agent = _Refused(production.agent, refused)

        async def run() -> None:
            production.start(admission.admit_next())  # a failed group's prompt is re-issued first
            await settled(production)

        first = admission.admit_next()
        refused.add(first)
        production.start(first)
        await settled(production)  # 1 in a row
        await run()  # 2
        refused.clear()
        await run()  # the prompt now finishes: the count starts again
        assert not failures and production.counters["groups_pushed"] == 1, failures
        second = admission.admit_next()
        refused.add(second)
        production.start(second)
        await settled(production)  # 1
        await run()  # 2
        assert not failures, failures
        await run()  # 3 in a row: the run fails
    assert len(failures) == 1, failures
    assert "3 groups failed in a row" in failures[0] and "advanced.failed_groups_in_a_row=3" in failures[0]
    assert "HTTP 404" in failures[0] and "policy-v4" in failures[0]
    assert production.counters["groups_failed"] == 5 and list(admission.ledger.reissue) == [second]
