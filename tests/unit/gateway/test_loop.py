"""GatewayAgentLoop (fully_async/gateway/loop.py) against a scripted engine client: an unmodified `openai`-SDK agent
program (tests/gateway_agent.py) or a callable trains token-exactly; its answer sources; limits answered as OpenAI
errors; a crashed, hung or SIGKILLed agent is an infrastructure failure (restart, then InfraExhausted), never a
reward, and its processes are gone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from fully_async.agents import Sample
from fully_async.config import ConfigError, MultiTurnConfig, compose
from fully_async.config.sections.gateway import GATEWAY_LOOP, GatewayConfig
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.envs.failures import InfraExhausted
from fully_async.gateway import loop as gateway_loop
from fully_async.gateway.loop import GatewayAgentLoop
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes
from tests.helpers import alive

AGENT = Path(__file__).resolve().parents[2] / "gateway_agent.py"
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def sample():
    return Sample(PromptRef(0, 3), 1, PromptRow("t", [{"role": "user", "content": "go"}], "7"))


def command(mode: str) -> str:
    return f"{sys.executable} {AGENT} {mode}"


def episode(tok, turns, *, versions=None, before_turn=None, continue_on_abort=True, response_length=400,
            mt=None, during=None, **gateway):  # fmt: skip
    """Run one sample through a GatewayAgentLoop; `during(loop)` (a coroutine function) runs beside it. Returns
    (loop, client, result or the exception raised)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    client = fakes.ScriptedClient(tok, turns, end=end, versions=versions, before_turn=before_turn)
    loop = GatewayAgentLoop(tok, Sampling(), response_length, continue_on_abort,
                            MultiTurnConfig(**(mt or {}), gateway=GatewayConfig(**gateway)))  # fmt: skip

    async def main():
        side = asyncio.ensure_future(during()) if during else None
        try:
            return await loop.run(client, sample())
        except Exception as e:
            return e
        finally:
            if side is not None:
                side.cancel()
            for server in list(gateway_loop._SERVERS.values()):
                await server.stop()
            gateway_loop._SERVERS.clear()

    return loop, client, asyncio.run(main())


def test_an_openai_sdk_program_trains_token_exactly(tok):
    loop, client, t = episode(tok, ["seven", "yes seven"], command=command("two_calls"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1, turn2 = tok.encode("seven") + [im_end], tok.encode("yes seven") + [im_end]
    inserted = tok.encode("\n<|im_start|>user\ncheck: are you sure?<|im_end|>\n<|im_start|>assistant\n")
    assert t.response_ids.tolist() == turn1 + inserted + turn2
    assert t.loss_mask.tolist() == [1] * len(turn1) + [0] * len(inserted) + [1] * len(turn2)
    assert (t.token_versions[t.loss_mask == 0] == NO_VERSION).all()
    # The second call was sent the exact tokens so far: the model's turn was not re-rendered from the agent's message.
    assert client.prompts[1] == t.prompt_ids.tolist() + t.response_ids.tolist()[: -len(turn2)]
    assert t.prompt_ids.tolist() == loop.chat.render_ids([{"role": "user", "content": "go"}], True)
    assert [round(x, 4) for x in t.behaviour_logprobs[t.loss_mask == 1].tolist()[:2]] == [-0.1, -0.2]
    assert loop.reward_text(t) == "yes seven"  # stdout's last line
    info = t.reward_info
    assert info["turns"] == 2 and info["gateway_calls"] == 2 and info["env_retries"] == 0
    assert info["gateway_ignored/temperature"] == 2  # the run's sampling governs


def test_a_streamed_and_a_tool_calling_agent(tok):
    loop, _, t = episode(tok, ["seven", "yes seven"], command=command("stream"))
    assert loop.reward_text(t) == "yes seven" and t.reward_info["turns"] == 2
    # The agent asserts finish_reason tool_calls and parses the call's JSON arguments (OpenAI's shape).
    loop, _, t = episode(tok, [CALL, "answer"], command=command("tools"))
    assert not isinstance(t, Exception), t
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    inserted = tok.encode("\n<|im_start|>tool\nA=a<|im_end|>\n<|im_start|>assistant\n")
    assert t.response_ids.tolist() == tok.encode(CALL) + [im_end] + inserted + tok.encode("answer") + [im_end]
    assert t.reward_info["tool_calls"] == 1 and loop.reward_text(t) == "answer"


RUNS: list[dict] = []
"""What the callable agents below saw, one entry per run."""


def test_answer_sources_and_an_agent_that_never_calls_the_model(tok):
    loop, _, t = episode(tok, ["a", "b"], command=command("file"))
    assert loop.reward_text(t) == "from-file"
    loop, _, t = episode(tok, ["a", "b"], command=command("post"))
    assert loop.reward_text(t) == "posted"
    loop, client, t = episode(tok, ["a"], function=f"{__name__}:no_calls_agent")
    assert client.prompts == [] and t.response_length == 0 and t.reward_info["agent_no_calls"] is True
    assert loop.reward_text(t) == "42" and loop.counts["agent_no_calls"] == 1


def test_a_limit_is_an_openai_error_and_ends_the_episode_not_a_failure(tok):
    loop, client, t = episode(tok, ["a", "b", "c"], command=command("chatty"), mt={"max_turns": 2})
    assert len(client.prompts) == 2 and t.finish_reason == "length" and t.reward_info["turns"] == 2
    assert t.reward_info["env_retries"] == 0  # the agent exited 1 after the limit: no infrastructure failure
    assert loop.reward_text(t) == "max_turns_exceeded"


def test_a_sigkilled_agent_restarts_its_episode_and_nothing_of_it_is_trained(tok, tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("AGENT_MARK", str(tmp_path / "mark"))
    monkeypatch.setenv("AGENT_PID_FILE", str(pid_file))
    killed = []

    async def kill_mid_episode():
        while not pid_file.exists():
            await asyncio.sleep(0.05)
        killed.append(int(pid_file.read_text()))
        os.kill(killed[0], signal.SIGKILL)

    loop, client, t = episode(tok, ["X", "two", "three"], command=command("killed_once"), during=kill_mid_episode)
    assert not isinstance(t, Exception), t
    info = t.reward_info
    assert info["env_retries"] == 1 and info["env_infra/agent_crash"] == 1 and info["env_infra_failures"] == 1
    # The killed attempt's turn ("X") is in no trained token: the episode restarted from its prompt.
    assert t.response_ids.tolist()[: len(tok.encode("two"))] == tok.encode("two")
    assert tok.encode("X")[0] not in t.response_ids.tolist() and loop.reward_text(t) == "three"
    assert len(client.prompts) == 3 and client.prompts[1] == client.prompts[0]
    assert not alive(killed[0])


def test_a_crash_every_time_exhausts_the_retries_and_names_the_agents_stderr(tok):
    loop, client, err = episode(tok, ["a", "b", "c"], command=command("crash"), infra_retries=1)
    assert isinstance(err, InfraExhausted) and err.kind == "agent_crash" and "boom" in str(err)
    assert len(client.prompts) == 2 and loop.counts["env_infra/agent_crash"] == 2 and loop.counts["env_exhausted"] == 1


def test_a_hung_agent_is_killed_at_its_timeout_and_the_episode_restarts(tok, tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("AGENT_MARK", str(tmp_path / "mark"))
    monkeypatch.setenv("AGENT_PID_FILE", str(pid_file))
    loop, _, t = episode(tok, ["one", "two", "three"], command=command("killed_once"), timeout_s=8.0)
    assert not isinstance(t, Exception), t
    assert t.reward_info["env_infra/agent_timeout"] == 1 and loop.reward_text(t) == "three"
    assert not alive(int(pid_file.read_text()))


def sync_agent(base_url, api_key, task):
    """Two calls with the synchronous SDK (run in a thread)."""
    from openai import OpenAI

    RUNS.append({**task, "base_url": base_url})
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages = list(task["messages"])
    for _ in range(2):
        out = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": out}, {"role": "user", "content": "next"}]
    return out


def no_calls_agent(base_url, api_key, task):
    return "42"


async def async_agent(base_url, api_key, task):
    """Two turns of one growing conversation with the async SDK (awaited in the loop)."""
    from openai import AsyncOpenAI

    RUNS.append(task)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    for _ in range(2):
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "next"}]
    return reply.content


def test_time_inside_model_calls_does_not_count_toward_the_timeout(tok):
    async def slow_engine(k):
        await asyncio.sleep(2.0)

    # 4 s inside the two model calls against 3 s of the agent's own time: the agent's own share (an SDK client, two
    # HTTP calls) stays far below 3 s even on a loaded 2-core machine (1.5 s was seen to run out there). The SDK's
    # first import (~1 s on an idle 2-core machine, several under load) would count as the agent's own time if this
    # test were the first in its worker to run an SDK agent: it is paid here, before the clock starts.
    import openai  # noqa: F401

    loop, _, t = episode(tok, ["a", "b"], before_turn=slow_engine, function=f"{__name__}:sync_agent", timeout_s=3.0)
    assert not isinstance(t, Exception), t
    assert t.reward_info["agent_s"] > 4.0 and loop.reward_text(t) == "b"


def test_partial_rollout_off_restarts_the_agent_when_the_weights_change(tok):
    RUNS.clear()
    loop, _, t = episode(tok, ["a", "b", "c", "d"], versions=[0, 1, 1, 1], continue_on_abort=False,
                         function=f"{__name__}:async_agent")  # fmt: skip
    assert not isinstance(t, Exception), t
    assert len(RUNS) == 2 and t.reward_info["restarts"] == 1 and t.reward_info["env_retries"] == 0
    assert set(t.token_versions[t.loss_mask == 1].tolist()) == {1} and loop.reward_text(t) == "d"


def test_the_agent_gets_the_prompts_fields_but_never_the_ground_truth(tok):
    RUNS.clear()
    episode(tok, ["a", "b"], function=f"{__name__}:sync_agent")
    seen = RUNS[0]
    assert seen["messages"] == [{"role": "user", "content": "go"}] and seen["data_source"] == "t"
    assert "7" not in json.dumps({k: v for k, v in seen.items() if k != "base_url"})
    assert seen["base_url"].startswith("http://127.0.0.1:") and seen["base_url"].endswith("/v1")


def test_the_examples_agent_runs_as_a_callable_named_by_its_file(tok):
    # examples/openai_agent/agent.py imports nothing of ours; named by its absolute path it runs in the rollouter's
    # process (no `examples` package on a Ray worker's path), two calls, the second answer is the result.
    agent = Path(__file__).resolve().parents[3] / "examples" / "openai_agent" / "agent.py"
    loop, _, t = episode(tok, ["a", "b"], function=f"{agent}:run")
    assert not isinstance(t, Exception), t
    assert t.reward_info["turns"] == 2 and loop.reward_text(t) == "b"
    cfg = compose([f"rollout.agent_loop={GATEWAY_LOOP}", f"rollout.multi_turn.gateway.function={agent}:run"])
    assert cfg.rollout.multi_turn.gateway.function == f"{agent}:run"
    with pytest.raises(ConfigError, match="gateway.function must be a dotted path"):
        compose(["rollout.multi_turn.gateway.function=examples/openai_agent/agent.py:run"])  # relative: refused


def test_gateway_config():
    cfg = compose([f"rollout.agent_loop={GATEWAY_LOOP}", "rollout.multi_turn.gateway.command=python a.py"])
    assert cfg.rollout.multi_turn.gateway.command == "python a.py"
    with pytest.raises(ConfigError, match="rollout.multi_turn.gateway.command or"):
        compose([f"rollout.agent_loop={GATEWAY_LOOP}"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.gateway.timeout_s must be > 0"):
        compose(["rollout.multi_turn.gateway.timeout_s=0"])
    with pytest.raises(ConfigError, match="both name the agent"):
        compose(["rollout.multi_turn.gateway.command=a", "rollout.multi_turn.gateway.function=m.n:f"])
    with pytest.raises(ConfigError, match="gateway.host must be an IP address"):
        compose(["rollout.multi_turn.gateway.host=localhost"])


def test_the_agent_command_never_sees_the_runs_engine_token(tok, monkeypatch, tmp_path):
    from fully_async.engines.auth import TOKEN_ENV
    from fully_async.gateway.server import Session

    monkeypatch.setenv(TOKEN_ENV, "run-secret")
    gateway = GatewayConfig(command=f"{sys.executable} --x", env={"A": 1})  # a number from YAML
    loop = GatewayAgentLoop(tok, Sampling(), 64, True, MultiTurnConfig(gateway=gateway))

    async def build():
        session = Session("s1", None, "http://127.0.0.1:1")
        import numpy as np

        task = {"messages": [], "extra_info": {"ids": np.array([1, 2])}}  # a parquet row's values
        return session, loop._agent(session, task, tmp_path / "answer.json")

    session, agent = asyncio.run(build())
    assert TOKEN_ENV not in agent.env and "run-secret" not in json.dumps(agent.env) and agent.env["A"] == "1"
    assert agent.env["OPENAI_API_KEY"] == session.key and agent.env["OPENAI_BASE_URL"] == "http://127.0.0.1:1/s/s1/v1"
    assert agent.argv == [sys.executable, "--x"] and "127.0.0.1" in agent.env["NO_PROXY"]
    assert json.loads(agent.stdin) == json.loads(agent.env["FULLY_ASYNC_TASK"]) == {"messages": [],
                                                                                    "extra_info": {"ids": [1, 2]}}  # fmt: skip


ROLLOUTER = """
import asyncio, sys
from pathlib import Path
from transformers import AutoTokenizer
from tests.unit.gateway.test_loop import command, sample
from fully_async.config import MultiTurnConfig
from fully_async.config.sections.gateway import GatewayConfig
from fully_async.engines import Sampling
from fully_async.gateway.loop import GatewayAgentLoop
from tests import fakes

tok = AutoTokenizer.from_pretrained(sys.argv[1])
loop = GatewayAgentLoop(tok, Sampling(), 64, True, MultiTurnConfig(gateway=GatewayConfig(command=command("killed_once"))))
asyncio.run(loop.run(fakes.ScriptedClient(tok, ["a", "b"]), sample()))
"""


def test_an_agent_dies_with_its_rollouter_however_that_dies(tok, tmp_path, monkeypatch):
    """The rollouter's process is SIGKILLed mid-episode (no finally runs): the watchdog takes its agent down."""
    import subprocess
    import time

    pid_file = tmp_path / "pid"
    monkeypatch.setenv("AGENT_MARK", str(tmp_path / "mark"))
    monkeypatch.setenv("AGENT_PID_FILE", str(pid_file))
    repo = AGENT.parents[1]
    rollouter = subprocess.Popen([sys.executable, "-c", ROLLOUTER, tok.name_or_path], cwd=repo,
                                 env={**os.environ, "PYTHONPATH": str(repo)})  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # a hang guard: the rollouter's imports take long on a loaded machine
        while not pid_file.exists() and rollouter.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        agent = int(pid_file.read_text())
        rollouter.kill()
        rollouter.wait()
        deadline = time.monotonic() + 30
        while alive(agent) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(agent)
    finally:
        rollouter.kill()


def test_an_agent_that_is_no_executable_or_a_gateway_off_loopback_without_the_token_is_refused(tok, monkeypatch):
    from fully_async.engines.auth import TOKEN_ENV

    with pytest.raises(ConfigError, match="gateway.command='no-such-agent --x': 'no-such-agent' is no executable"):
        GatewayAgentLoop(tok, Sampling(), 64, True, MultiTurnConfig(gateway=GatewayConfig(command="no-such-agent --x")))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    loop = GatewayAgentLoop(tok, Sampling(), 64, True, MultiTurnConfig(gateway=GatewayConfig(command="true",
                                                                                             host="10.0.0.1")))  # fmt: skip
    with pytest.raises(ConfigError, match="gateway.host='10.0.0.1' leaves loopback: the run needs its token"):
        asyncio.run(loop.server())


def test_an_engine_failure_during_a_call_fails_the_episode_at_once_not_as_the_agents(tok):
    from fully_async.engines.errors import EngineError

    async def engine_fails(k):
        raise EngineError("generate failed 3 times")

    loop, _, err = episode(tok, ["a", "b"], before_turn=engine_fails, function=f"{__name__}:async_agent")
    assert isinstance(err, EngineError) and "generate failed" in str(err)  # the group is re-issued by production
    assert loop.counts["env_infra_failures"] == 0  # never retried as an agent's crash


def test_every_call_of_a_session_goes_to_the_server_of_its_first_call(tok):
    """Sticky routing (fully_async/engines/affinity.py) through the gateway: the agent's calls arrive on the gateway's
    own tasks, yet each episode's calls land on one of the 2 emulated servers (engine=sim), and the episodes split
    over both."""
    from fully_async.config import EngineConfig, SimEngineConfig
    from fully_async.engines import EngineClient, build_engine
    from fully_async.production import sample_id

    sim = SimEngineConfig(decode_step_s=0.0005, decode_step_per_seq_s=0.0, length_sigma=0.0, length_median=4.0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    loop = GatewayAgentLoop(tok, Sampling(stop_token_ids=(end,)), 400, True,
                            MultiTurnConfig(gateway=GatewayConfig(command=command("two_calls"))))  # fmt: skip
    calls: dict[str, list[int]] = {}

    async def main():
        servers = build_engine(EngineConfig(kind="sim", num_servers=2, sim=sim), "/nonexistent", "/tmp")
        servers.start()
        client = EngineClient(servers)
        client.on_segment = lambda idx, *_: calls.setdefault(sample_id.get(), []).append(idx)

        async def one(k: int):
            sample_id.set(f"p{k}/0")  # as production does for each sample
            return await loop.run(
                client, Sample(PromptRef(k, 3), 0, PromptRow("t", [{"role": "user", "content": "go"}], "7"))
            )

        try:
            return await asyncio.gather(*(one(k) for k in range(4)))
        finally:
            for server in list(gateway_loop._SERVERS.values()):
                await server.stop()
            gateway_loop._SERVERS.clear()
            await client.close()

    outs = asyncio.run(main())
    assert all(t.reward_info["gateway_calls"] == 2 for t in outs)
    assert sorted(calls) == [f"p{k}/0" for k in range(4)], calls
    assert all(len(v) == 2 and v[0] == v[1] for v in calls.values()), calls
    assert sorted(v[0] for v in calls.values()) == [0, 0, 1, 1], calls
