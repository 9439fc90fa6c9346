"""The LLM judge end to end through the real openai client against an OpenAI-compatible server on 127.0.0.1:
parsing, weights, retries with Retry-After, what is never retried, failure policies, timeouts, and the API key."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from fully_async.config import ConfigError, JudgeConfig, RewardConfig, RewardLimitsConfig, RewardSourceConfig
from fully_async.reward import RewardAgent, RewardDrop, RewardFatal
from tests.reward_server import JudgeServer, ModelLimits

SECRET = "sk-test-0123456789abcdef"
META = {"data_source": "judge_test", "ground_truth": "7", "extra_info": {}, "question": "What is 3+4?"}


@pytest.fixture
async def server(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", SECRET)
    srv = await JudgeServer(api_key=SECRET).start()
    yield srv
    await srv.stop()


@pytest.fixture
async def make_agent(server):
    agents = []

    def make(*sources: RewardSourceConfig) -> RewardAgent:
        agent = RewardAgent(RewardConfig(list(sources), num_workers=1))
        agents.append(agent)
        return agent

    yield make
    for a in agents:
        await a.aclose()


def judge(server: JudgeServer, **kw) -> RewardSourceConfig:
    judge_kw = {"base_url": server.url, "model": "judge-model", "api_key_env": "JUDGE_TEST_KEY"}
    judge_kw.update(kw.pop("judge", {}))
    return RewardSourceConfig(
        **{"kind": "judge", "timeout_s": 10.0, "retries": 3, "backoff_s": 0.05, "backoff_max_s": 5.0,
           "judge": JudgeConfig(**judge_kw), **kw}
    )  # fmt: skip


async def test_judge_scores_through_the_openai_client_and_combines_with_a_rule(server, make_agent):
    agent = make_agent(RewardSourceConfig(kind="rule", weight=0.5), judge(server, weight=2.0))
    r = await agent.score("7 [[score=0.25]]", {**META, "data_source": "fully_async/synthetic"})
    assert r.score == pytest.approx(0.5 * 1.0 + 2.0 * 0.25)
    j = r.info["sources"]["judge"]
    assert j["score"] == 0.25 and j["attempts"] == 1 and j["usage_tokens"] > 0 and "reward_failed" not in r.info
    assert r.info["sources"]["rule"]["score"] == 1.0
    assert server.count(status=200)[0].tokens == j["usage_tokens"]
    # The prompt carried the question and the reference (the server saw them: the usage counts their bytes).
    assert j["usage_tokens"] > len("What is 3+4?") + len("7 [[score=0.25]]")


async def test_5xx_and_429_are_retried_honouring_retry_after(server, make_agent):
    agent = make_agent(judge(server))
    r = await agent.score("[[score=1]] [[fail_first=2]]", META)
    assert r.score == 1.0 and r.info["sources"]["judge"]["attempts"] == 3
    assert agent.stats()["judge"]["retries"] == 2
    server.limits["judge-model"] = ModelLimits(rpm=60, window_s=1.0)  # one request per second
    start = time.monotonic()
    first, second = await asyncio.gather(agent.score("[[score=1]] a", META), agent.score("[[score=1]] b", META))
    assert first.score == second.score == 1.0
    assert len(server.count(status=429)) >= 1
    # The refused request waited for the server's Retry-After (about 1 s), not a fast exponential backoff.
    assert time.monotonic() - start >= 0.9
    impatient = make_agent(judge(server, backoff_max_s=0.5, fallback_score=-1.0))  # asked to wait ~1 s: gives up
    await asyncio.sleep(1.1)  # the server's window is empty again
    first, second = await asyncio.gather(impatient.score("[[score=1]] c", META), impatient.score("[[score=1]] d", META))
    assert sorted([first.score, second.score]) == [-1.0, 1.0]
    refused = first if first.score == -1.0 else second
    assert "HTTP 429" in refused.info["reward_error"] and refused.info["sources"]["judge"]["attempts"] == 1


async def test_4xx_other_than_408_429_is_not_retried_and_falls_back_with_a_flag(server, make_agent):
    agent = make_agent(judge(server, fallback_score=-1.0))
    r = await agent.score("[[status=400]]", META)
    assert r.score == -1.0 and r.info["reward_failed"] and "HTTP 400" in r.info["reward_error"]
    assert r.info["sources"]["judge"]["attempts"] == 1 and len(server.count(status=400)) == 1
    r = await agent.score("[[status=408]]", META)  # a timeout status is worth retrying
    assert r.info["sources"]["judge"]["attempts"] == 4 and len(server.count(status=408)) == 4


async def test_malformed_bodies_are_retried_and_unparseable_replies_are_flagged(server, make_agent):
    agent = make_agent(judge(server, retries=1))
    r = await agent.score("[[malformed]]", META)
    assert r.info["reward_failed"] and "malformed" in r.info["reward_error"]
    assert r.info["sources"]["judge"]["attempts"] == 2
    r = await agent.score("[[noscore]]", META)
    j = r.info["sources"]["judge"]
    assert j["parse_failed"] and j["attempts"] == 1 and "no score" in j["error"]
    assert agent.stats()["judge"]["parse_failures"] == 1


async def test_a_slow_judge_is_cut_at_the_timeout(server, make_agent):
    agent = make_agent(judge(server, timeout_s=0.3, retries=1))
    start = time.monotonic()
    r = await agent.score("[[sleep=2]]", META)
    assert time.monotonic() - start < 2.0
    assert r.info["reward_failed"] and "timeout" in r.info["reward_error"]
    assert agent.stats()["judge"]["timeouts"] == 2


async def test_failure_policies_drop_and_raise(server, make_agent):
    with pytest.raises(RewardDrop, match="judge"):
        await make_agent(judge(server, on_failure="drop", retries=0)).score("[[status=500]]", META)
    with pytest.raises(RewardFatal, match=r"reward.sources\[0\].on_failure=raise"):
        await make_agent(judge(server, on_failure="raise", retries=0)).score("[[status=500]]", META)


async def test_the_api_key_never_reaches_logs_errors_or_reward_info(server, make_agent, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("JUDGE_WRONG_KEY", "sk-wrong-" + SECRET)  # the server echoes the key it got in its 401
    agent = make_agent(judge(server, judge={"api_key_env": "JUDGE_WRONG_KEY"}))
    r = await agent.score("[[score=1]]", META)
    assert r.info["reward_failed"] and "HTTP 401" in r.info["reward_error"]
    assert SECRET not in str(r.info) and SECRET not in caplog.text
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].judge.api_key_env names .*JUDGE_TEST_KEY"):
        make_agent(judge(server))


async def test_limits_above_the_server_s_429s_are_retried_and_nothing_is_lost(server, make_agent):
    server.limits["judge-model"] = ModelLimits(rpm=600, tpm=180000, max_concurrent=4, window_s=1.0)
    # Every refused request comes back after the server's Retry-After; 30 requests contend for 10 per second.
    src = judge(server, retries=100, limits=RewardLimitsConfig(rpm=6000, max_concurrent=8, scope="process"))
    agent = make_agent(src)
    start = time.monotonic()
    results = await asyncio.gather(*(agent.score(f"[[score=1]] [[sleep=0.05]] {i}", META) for i in range(30)))
    assert [r.score for r in results] == [1.0] * 30 and not any(r.info.get("reward_failed") for r in results)
    assert len(server.count(status=429)) > 0 and len(server.count(status=200)) == 30
    assert time.monotonic() - start < 10
    assert server.max_in_flight["judge-model"] <= 4
    assert agent.stats()["judge"]["retries"] == len(server.count(status=429))
