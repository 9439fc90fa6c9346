"""examples/search_agent end to end on 127.0.0.1: the launch script starts the BM25 retrieval server, which answers
/health and /retrieve (batching concurrent requests); ToolAgentLoop's search calls reach it and their documents
become masked tool turns; with the server down, calls fail as counted tool errors and episodes go on; a whole
simulated run with the search tool reaches it (the call is forced: tests/fakes.py:ForcedToolAgentLoop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from examples.search_agent.corpus import write
from fully_async.agents import Sample
from fully_async.agents.tool import ToolAgentLoop
from fully_async.agents.toolkit import load_tools
from fully_async.config import MultiTurnConfig
from fully_async.data import load_rows
from fully_async.engines import Sampling
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef
from tests import fakes

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.needs_extra("envs"), pytest.mark.timeout(300)]  # the retrieval server: bm25s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write(tmp_path_factory.mktemp("search"), entities=40)


@pytest.fixture
def server(data, monkeypatch):
    port = free_port()
    out = subprocess.run(
        ["bash", str(REPO / "examples/search_agent/launch_retrieval.sh"), "--corpus", str(data["corpus"]),
         "--port", str(port)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RETRIEVAL_LOG": str(data["corpus"].parent / f"r{port}.log")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip())
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("FA_RETRIEVAL_URL", url)
    yield url, pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


async def _post(url, body):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url + "/retrieve", json=body) as r:
        return r.status, await r.json()


async def _health(url):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return await r.json()


def test_the_retrieval_server_answers_and_batches(server, data):
    url, _ = server
    rows = load_rows([str(data["val"])])
    question, doc = rows[0].messages[-1]["content"], rows[0].extra_info["doc"]

    async def go():
        status, one = await _post(url, {"queries": [question], "topk": 2, "return_scores": True})
        many = await asyncio.gather(*(_post(url, {"queries": [r.messages[-1]["content"]]}) for r in rows[:16]))
        bad = await _post(url, {"topk": 2})
        return status, one, many, bad, await _health(url)

    status, one, many, bad, health = asyncio.run(go())
    assert status == 200 and len(one["result"][0]) == 2
    top = one["result"][0][0]
    assert top["document"]["id"] == doc and top["score"] > one["result"][0][1]["score"]
    assert all(s == 200 and len(r["result"][0]) == 3 and "contents" in r["result"][0][0] for s, r in many)
    assert bad[0] == 400 and "queries" in bad[1]["error"]
    assert health["status"] == "ok" and health["documents"] == 40 and health["requests"] == 17
    assert health["batches"] < 17  # the 16 concurrent requests were scored in fewer passes


def _episode(tok, row, turns):
    tools = load_tools(["examples.search_agent.tools:search"])
    loop = ToolAgentLoop(tok, Sampling(), 600, multi_turn=MultiTurnConfig(max_tool_response_tokens=400), tools=tools)
    client = fakes.ScriptedClient(tok, turns, end=tok.convert_tokens_to_ids("<|im_end|>"))
    return asyncio.run(loop.run(client, Sample(PromptRef(0, 0), 0, row)))


def test_search_calls_reach_the_server_and_a_server_down_is_a_counted_tool_error(server, data, tmp_path):
    from transformers import AutoTokenizer

    from examples.search_agent.reward import compute_score

    url, pid = server
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    row = load_rows([str(data["val"])])[0]
    name = re.findall(r"\b[A-Z][a-z]+\b", row.messages[-1]["content"])[-1]  # the town the question asks about
    call = json.dumps({"name": "search", "arguments": {"query": name}})
    call = f"<tool_call>{call}</tool_call>"
    answer = f"<answer>{row.ground_truth}</answer>"
    t = _episode(tok, row, [call, answer])
    text = tok.decode(t.response_ids.tolist())
    assert "<|im_start|>tool\nDoc 1: " + name in text and t.reward_info["tool_errors"] == 0
    inserted = tok.decode(t.response_ids[t.loss_mask == 0].tolist())  # the tool turn, masked
    assert inserted.startswith("\n<|im_start|>tool\nDoc 1: " + name) and inserted.endswith("<|im_start|>assistant\n")
    assert compute_score("search_agent", tok.decode(t.response_ids.tolist(), skip_special_tokens=True),
                         row.ground_truth)["score"] == 1.0  # fmt: skip
    assert asyncio.run(_health(url))["requests"] == 1
    os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    t = _episode(tok, row, [call, answer])
    text = tok.decode(t.response_ids.tolist())
    assert "Error: search failed: " in text and t.reward_info["tool_errors/tool_error"] == 1
    assert t.reward_info["turns"] == 2 and text.endswith(answer + "<|im_end|>")  # the episode went on


class ForcedSearchLoop(fakes.ForcedToolAgentLoop):
    script = ['<tool_call>{"name": "search", "arguments": {"query": "town"}}</tool_call>']


@pytest.mark.slow
def test_a_run_with_the_search_tool_reaches_the_server(ray_local, server, data, tmp_path):
    from examples.search_agent.tools import search
    from fully_async.config import compose
    from fully_async.models import resolve_model_path
    from fully_async.simulation import run_schedule

    url, _ = server
    # The rollouter's process does not see this test's FA_RETRIEVAL_URL: the server's address goes in the tool config.
    tools_yaml = tmp_path / "tools.yaml"
    entry = {
        "class_name": "examples.search_agent.tools.SearchTool",
        "config": {"url": url},
        "tool_schema": search.tool_schema,
    }
    tools_yaml.write_text(json.dumps({"tools": [entry]}))
    cfg = compose(
        [
            "engine=sim",
            "trainer=sim",
            "rollout.agent_loop=tests.integration.test_search_agent:ForcedSearchLoop",
            f"rollout.multi_turn.tool_config_path={tools_yaml}",
            "rollout.multi_turn.max_tokens_per_turn=8",
            "rollout.multi_turn.max_tool_response_tokens=64",
            "reward.sources=[{kind: 'examples.search_agent.reward:compute_score'}]",
            f"data.train_files=[{data['train']}]",
            "data.max_prompt_length=800",
            "rollout.n=2",
            "rollout.response_length=160",
            "engine.max_model_len=1024",
            "engine.num_servers=1",
            "engine.sim.decode_step_s=0.001",
            "async_training.groups_per_step=2",
            "trainer.total_steps=2",
            "trainer.sim.optimizer_step_s=0.05",
        ]
    )
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2
    health = asyncio.run(_health(url))
    assert health["requests"] >= len(trajs)  # every trained sample's forced search reached the server
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(s["agent/tool_error_ratio"] == 0 for s in steps if "agent/tool_error_ratio" in s)
