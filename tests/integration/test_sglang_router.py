"""engine.router=sglang against a REAL sglang-router (0.3.2) in front of two REAL SGLang servers on 127.0.0.1.

The module starts one pool (two servers, ~35-90 s each here, started at once; more on a loaded machine) and runs the
tests in order on it: generation through the router; control calls reaching each server directly (the router answers
404 to them); a pause and weight reload through the pool; a killed router started again; a server removed from the
pool mid-run (it leaves the router, requests go on on the other); the router's process group ending with the pool.
The tests share the pool, so they run in file order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import aiohttp
import pytest

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.engines.sglang import model_info
from fully_async.models import build_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.needs_venv(".venv-sglang"),
]

# Wide enough that a 128-token request takes a moment (a pause or a removal lands mid-generation), small enough to
# start two servers fast; init_std 0.1 gives peaked distributions, so the two weight sets' greedy outputs differ.
TINY = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, init_std=0.1)
CFG = EngineConfig(kind="sglang", router="sglang", num_servers=2, max_model_len=512, kv_cache_gib=1,
                   startup_timeout_s=600, control_timeout_s=30)  # fmt: skip
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [list(b"12+34="), list(b"hello world"), list(b"7*8 is"), list(b"<a>")]
LONG = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)


@pytest.fixture(scope="module")
def pool(models, tmp_path_factory):
    servers = build_engine(CFG, models[0], tmp_path_factory.mktemp("run-router"))
    servers.start()
    yield servers
    servers.stop()


async def _post(url, path, body):
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def _greedy_direct(url, prompts, n):
    """Greedy outputs of one server, asked directly (not through the router)."""
    out = []
    for p in prompts:
        status, body = await _post(url, "/generate", {"input_ids": p, "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                                          "ignore_eos": True}})  # fmt: skip
        assert status == 200, body
        out.append(body["output_ids"])
    return out


async def _greedy(client, prompts, n):
    return [(await client.generate(p, n, GREEDY)).token_ids for p in prompts]


def _router_urls(pool):
    return sorted(w["url"] for w in pool.router.workers())


async def test_generation_goes_through_the_router_with_logprobs_and_versions(pool):
    assert _router_urls(pool) == sorted(pool.addresses)
    client = EngineClient(pool)
    try:
        # ignore_eos: a sampled end token would end a sample early (the lengths below are the budget's).
        sampled = Sampling(temperature=1.0, seed=7, ignore_eos=True)
        results = await asyncio.gather(*(client.generate(p, 16, sampled) for p in PROMPTS))
        for r in results:
            assert r.servers == [pool.router.url]  # the router, not a server, took the request
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == 16
            assert all(lp <= 0.0 for lp in r.logprobs) and r.versions == [0] * 16
        # The router serves what the servers serve: greedy outputs through it equal each server's own.
        routed = await _greedy(client, PROMPTS, 12)
        for url in pool.addresses:
            assert await _greedy_direct(url, PROMPTS, 12) == routed
    finally:
        await client.close()


async def test_pool_pause_reaches_each_server_and_reload_changes_routed_outputs(pool, models):
    status, _ = await _post(pool.router.url, "/pause_generation", {"mode": "abort"})
    assert status == 404  # why control calls go to each server directly
    client = EngineClient(pool)
    try:
        before = await _greedy(client, PROMPTS, 12)
        sent = client.stats.segments
        long = [asyncio.create_task(client.generate(p, LONG, GREEDY)) for p in PROMPTS]
        while client.stats.segments < sent + len(PROMPTS):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        await pool.pause("abort")
        assert [await pool.is_paused(url) for url in pool.addresses] == [True, True]
        await pool.load_weights(models[1], 1)
        assert [info["weight_version"] for info in await model_info(pool)] == ["1", "1"]
        await pool.resume()
        assert [await pool.is_paused(url) for url in pool.addresses] == [False, False]
        results = await asyncio.gather(*long)
        after = await _greedy(client, PROMPTS, 12)
        assert after != before
        for url in pool.addresses:  # each server got the new weights, and the router serves them
            assert await _greedy_direct(url, PROMPTS, 12) == after
        aborted = [r for r in results if r.num_aborts]
        assert aborted, "no request was in flight at the pause"
        for r in results:  # budget kept; per-token versions per segment, old then new
            assert len(r.token_ids) == len(r.versions) == LONG
            assert r.versions == sorted(r.versions) and set(r.versions) <= {0, 1}
        assert any(r.versions[0] == 0 and r.versions[-1] == 1 for r in aborted)
    finally:
        await client.close()


async def test_a_killed_router_is_started_again_by_the_next_request(pool):
    client = EngineClient(pool)
    try:
        old_url, pgid = pool.router.url, pool.router.pid
        os.killpg(pgid, signal.SIGKILL)
        r = await client.generate(PROMPTS[0], 8, GREEDY)
        assert len(r.token_ids) == 8 and r.num_retries == 1
        assert pool.router.is_alive() and pool.router.url != old_url and r.servers == [pool.router.url]
        assert _router_urls(pool) == sorted(pool.addresses)
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    finally:
        await client.close()


async def test_removed_server_leaves_the_router_and_requests_go_on(pool):
    client = EngineClient(pool)
    try:
        tasks = [asyncio.create_task(client.generate(p, LONG, GREEDY)) for p in PROMPTS * 2]
        while client.stats.segments < len(tasks):
            await asyncio.sleep(0.01)
        gone = pool.address(1)
        await client.remove_server(1, drain_timeout_s=60)
        assert _router_urls(pool) == [pool.address(0)]
        assert not pool.is_alive(1)
        results = await asyncio.gather(*tasks)
        assert all(len(r.token_ids) == LONG for r in results)
        more = await asyncio.gather(*(client.generate(p, 8, GREEDY) for p in PROMPTS))
        assert all(len(r.token_ids) == 8 for r in more)
        assert gone not in _router_urls(pool)
    finally:
        await client.close()


def test_router_process_ends_with_the_pool(pool):
    pgid = pool.router.pid
    assert pgid is not None and pool.router.is_alive()
    pool.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the router (and anything it spawned) is gone
    assert not pool.router.is_alive()
