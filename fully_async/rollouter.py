"""Rollouter: admits prompts under the staleness bound, generates rollout.n samples per prompt on the engines, scores
each sample as soon as it finishes, and pushes whole groups to the MessageQueue.

Runs as an async Ray actor (`create_rollouter`); every method runs on one event loop, so the ledger needs no lock.
The actor wires three parts: admission (fully_async/admission.py: which prompt starts when, with the staleness
ledger), production (fully_async/production.py: a prompt's group through the agent loops, the reward and the
constant-group filter onto the queue), and the engine pool with its weight syncs (the methods below).
Contracts:
- A prompt is admitted only through the ledger; a group that fails (engine error after retries) or that the queue
  drops as stale is re-issued, never lost.
- `pause()` stops admission and pauses the engines; async_training.on_sync says what happens to the requests in
  flight (fully_async/engines/inflight.py): abort (they continue after `resume()` from their tokens so far, or with
  partial_rollout=false restart from their prompt), recompute or keep (frozen in the engines, they go on after it). A transport's reload (`engine("load_weights", ...)`, the
  engine port) sits between them.
- Every generate request, reward call, sync pause and validation run is recorded as a span in
  RUN_DIR/trace/rollouter.jsonl (fully_async/trace.py); `stats()` gives the engine occupancy behind the rollouter
  idle ratio; `step_report()` is the trainer's one call per step.
- `snapshot()` is a consistent cut: the ledger, the cursor and the queue's contents are read while no group is
  moving from "running" to "queued" (`_push_lock`), so on restore every prompt is in exactly one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from fully_async.admission import Admission
from fully_async.agents import build_agent_loop
from fully_async.agents.tokens import stop_token_ids
from fully_async.aio import task_stacks
from fully_async.config import FullyAsyncConfig, from_dict
from fully_async.data import EpochCursor, PromptRow, dataset
from fully_async.device import device as run_device
from fully_async.device import pin_all_threads
from fully_async.distill import start_teacher
from fully_async.engines.auth import TOKEN_ENV
from fully_async.engines.service import EngineService
from fully_async.engines.warmup import WarmupPlan
from fully_async.gc_tuning import tune_for_throughput
from fully_async.handles import NAMESPACE, resolve_async
from fully_async.production import COUNTERS, Production
from fully_async.production import sample_id as _sample_id
from fully_async.reward import RewardAgent
from fully_async.staleness import StalenessLedger
from fully_async.trace import Tracer
from fully_async.validation import Validation
from fully_async.weights.lora import adapter_sync_plan

log = logging.getLogger(__name__)

RAY_GET_WARNING_ENV = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"
"""Ray's switch for its "blocking ray.get inside async actor" warning (see Rollouter.__init__)."""

WARMUP_ROWS = 16
"""Dataset rows whose prompts the engines' warm-up picks its longest from."""

FINISH_POLL_S = 0.002
"""While a sync lets the trainer's next batch finish, how often the rollouter looks again (a few ms per sync)."""


class Rollouter:
    def __init__(
        self,
        cfg: dict[str, Any],
        model_path: str,
        run_dir: str,
        queue: Any,
        cpu_set: list[int] | None = None,
        tune_gc: bool = False,
        engine_token: str | None = None,
    ) -> None:
        """`tune_gc`: set this process's garbage collector for throughput once started (fully_async/gc_tuning.py);
        create_rollouter sets it, as the actor owns its process. `engine_token`: the run's token, sent with every
        engine request (engines/auth.py)."""
        self.cfg = from_dict(FullyAsyncConfig, cfg).validate()
        self._tune_gc = tune_gc
        self.model_path, self.run_dir, self.queue = model_path, run_dir, queue
        if engine_token:
            os.environ[TOKEN_ENV] = engine_token
        # Ray warns at this process's first ray.get, from whatever thread: in a run they are all engine-host calls in
        # worker threads (asyncio.to_thread: start, restart, stop), which block no event loop. Set it to 1 to see it.
        os.environ.setdefault(RAY_GET_WARNING_ENV, "0")
        pin_all_threads(cpu_set)
        at, ro = self.cfg.async_training, self.cfg.rollout
        self._push_lock = asyncio.Lock()
        self.admission = Admission(StalenessLedger(at.max_staleness, at.groups_per_version), queue, self._push_lock,
                                   ro.n, ro.max_concurrent, ro.effective_start_concurrent(), at.groups_per_step)  # fmt: skip
        self._admitting, self._wake = self.admission.admitting, self.admission.wake
        self.rows: list[PromptRow] = []
        self.reward: RewardAgent | None = None
        """Set by prepare(); the engines, agent loops and production by start()."""
        self.servers: Any = None
        self.client: Any = None
        self.agent: Any = None
        self.production: Production | None = None
        self._error: str | None = None
        self._main: asyncio.Task | None = None
        self.tracer = Tracer(run_dir, "rollouter", self.cfg.logger.trace)
        self.validation = Validation(self.cfg, self.tracer, self._fail)
        self._paused_at: float | None = None
        self._held_at = time.monotonic()
        """When the last pause began to hold requests (after letting the trainer's next batch finish)."""
        self._last_hold_s = 0.0
        """How long the last sync held requests, pause to resume: what aborting one costs it (`pause`)."""
        self.engine_service: EngineService | None = None
        """The engine port (engines/service.py, `engine`), once `start` has started the pool and its client."""

    @property
    def ledger(self) -> StalenessLedger:
        return self.admission.ledger

    @property
    def cursor(self) -> EpochCursor | None:
        return self.admission.cursor

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(
        self,
        cursor_state: dict | None = None,
        ledger_state: dict | None = None,
        weights: tuple[str, int] | None = None,
        hosts: list[Any] | None = None,
        host_factory: Any = None,
    ) -> dict[str, Any]:
        """Load data, check reward sources, start the engines (blocks until healthy) and begin generating.

        Resuming: `cursor_state` / `ledger_state` from a checkpoint, and `weights` = (directory, version) the engines
        load before the first request. `hosts`: one EngineHost actor per engine server, placed by the job (each
        server then runs on its host's node); None: the servers are child processes of this actor. `host_factory`
        (engines/host.py): places the hosts of servers added or replaced while the run goes on."""
        from fully_async.engines import EngineClient, build_engine

        if self.cursor is None:
            await self.prepare()
        if cursor_state:
            self.cursor.load_state_dict(cursor_state)
        if ledger_state:
            at = self.cfg.async_training
            self.admission.ledger = StalenessLedger.from_state(ledger_state, at.max_staleness, at.groups_per_version)
        device = run_device(self.cfg.trainer.device)  # the job has decided it; "auto" only outside a job
        lora, _ = adapter_sync_plan(self.cfg, device)  # the job says once why a LoRA run syncs merged weights
        self.servers = build_engine(self.cfg.engine, self.model_path, self.run_dir, hosts=hosts, device=device,
                                    lora=lora)  # fmt: skip
        self.servers.host_factory = host_factory if hosts else None
        self.servers.state.on_sync = self.cfg.async_training.on_sync  # what a sync does to requests in flight
        # The servers' launch is the start-up's critical path: it begins before the tokenizer's import and load and
        # the agent loops, which the servers do not need (only the warm-up below does).
        launching = asyncio.create_task(asyncio.to_thread(self.servers.launch))
        try:
            from transformers import AutoTokenizer  # a heavy import: after the launch began

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            sampling, self.agent, val_agent = agent_loops(self.cfg, tokenizer)
            self.agent.tracer = val_agent.tracer = self.tracer
            self.servers.warmup = warmup_plan(self.cfg, self.rows, tokenizer, sampling)
        finally:
            await launching  # a failure above still leaves launched servers for shutdown() to stop
        await asyncio.gather(asyncio.to_thread(self.servers.start), self.reward.teacher_ready())  # distill's teacher
        if weights is not None:
            await self.servers.load_weights(weights[0], weights[1])
        else:
            await self.servers.set_version(self.ledger.version)
        self.client = EngineClient(self.servers)
        self.client.on_segment = self._trace_segment
        self.engine_service = EngineService(self.servers, self.client, self.tracer, synced=self._synced)
        self.tracer.meta(engines=len(self.servers.addresses))
        self.production = Production(self.cfg, self.rows, self.agent, self.client, self.reward, self.tracer,
                                     self.queue, self.admission, self._push_lock, self._fail)  # fmt: skip
        if self._tune_gc:
            tune_for_throughput()  # start-up is done: what is alive now (tokenizer, modules, rows) stays
        self._admitting.set()
        self._main = asyncio.get_running_loop().create_task(self.admission.run(self.production, self._fail))
        self.validation.bind(val_agent, self.client, self.reward, self.ledger.version)
        return {"engines": self.servers.addresses, "train_rows": len(self.rows), "val_rows": len(self.validation.rows),
                "startup": dict(self.servers.started_at)}  # fmt: skip

    async def prepare(self) -> dict[str, int]:
        """Load and check the datasets and their reward sources: bad input fails here, before anything heavy starts."""
        self.rows = dataset(self.cfg, "train")
        self.validation.rows = val_rows = dataset(self.cfg, "val") if self.cfg.trainer.val_every else []
        self.reward = RewardAgent(self.cfg.reward, tokenizer_path=self.model_path)
        await self.reward.check_sources(self.rows + val_rows)
        self.reward.start_teacher(start_teacher(self.cfg, self.run_dir, run_device(self.cfg.trainer.device),
                                                self.cfg.reward.limiter_namespace))  # fmt: skip
        seed = self.cfg.mixed_seed(self.cfg.data.seed)
        self.admission.cursor = EpochCursor(len(self.rows), seed, self.cfg.data.shuffle)
        return {"train_rows": len(self.rows), "val_rows": len(val_rows)}

    async def shutdown(self) -> None:
        """Stop generating, stop the engines and reward workers. Safe to call twice or after a failed start."""
        self.admission.stop()
        self.validation.cancel()
        if self._main is not None:
            self._main.cancel()
        if self.production is not None:
            await self.production.stop()
        if self.client is not None:
            await self.client.close()
        if self.servers is not None:
            await asyncio.to_thread(self.servers.stop)
        if self.reward is not None:
            await self.reward.aclose()
        self.tracer.close()

    def error(self) -> str | None:
        """Why generation stopped, if it failed (the trainer polls this while it waits for batches)."""
        return self._error

    def _fail(self, message: str) -> None:
        self._error = message

    def _trace_segment(self, server: int, start: float, end: float, tokens: int, finish: str) -> None:
        sample = _sample_id.get()
        self.tracer.record(f"engine/{server}", "generate", start, end, tokens=tokens, finish=finish, sample=sample)

    # -- weight sync -------------------------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop admitting and pause the engines; validation at the current version finishes first. With
        async_training.drain_on_sync the groups already generating finish first too (nothing is aborted); without,
        requests of the trainer's next batch may still finish (`_let_next_batch_finish`). The servers themselves are
        paused only when a request is still in flight (engines/control.py `pause`); otherwise only the client holds
        new requests until the resume."""
        self._admitting.clear()
        self._paused_at = time.time()
        await self.validation.settle()
        while self.cfg.async_training.drain_on_sync and self.ledger.running and self._error is None:
            await asyncio.sleep(0.005)
        await self._let_next_batch_finish()
        self._held_at = time.monotonic()
        await self.servers.pause(self.cfg.async_training.on_sync, idle=self.client.idle)

    async def _let_next_batch_finish(self) -> None:
        """A request aborted by a sync waits for the whole hold (from the pause to the resume) and then prefills its
        tokens again; the trainer, which waits for its next batch, would wait for it the longer. So while requests
        are in flight and the finished groups do not hold the trainer's next batch yet, they get up to the last
        sync's hold to finish (the first sync aborts at once: no hold measured yet)."""
        deadline = time.monotonic() + self._last_hold_s
        while (
            not self.client.idle()
            and not self.admission.next_batch_ready()
            and self._error is None
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(FINISH_POLL_S)

    # -- the engine port (engines/service.py) ----------------------------------------------------------------------
    async def engine(self, call: str, *args: Any) -> Any:
        """The engine port: `call` (a method of fully_async/weights/port.py's `EnginePort`, the asking side that
        sends it, and the port's one list of calls) on the pool's `EngineService`, for the weight transports and
        `fully_async.ctl engines`. Calls run in the order they are sent (one actor): a transport's `load_weights`
        between this actor's `pause` and `resume`. Before `start`: no rows, any other call fails."""
        if self.engine_service is None:
            if call == "rows":
                return []
            raise RuntimeError(f"engine port call {call!r} before the Rollouter started its engines")
        return await self.engine_service.call(call, *args)

    async def diagnose(self) -> str:
        """What this actor is waiting for, for the error of a sync that passed advanced.sync_timeout_s: its event
        loop's pending tasks with their await chains, the pool's membership lock and each server's last control
        calls (fully_async/aio.py `task_stacks`, engines/control.py `recent_calls`)."""
        parts = [f"Rollouter (pid {os.getpid()}): {task_stacks()}"]
        if self.servers is not None:
            parts.append(f"{self.servers.membership.name}: {self.servers.membership.held_by()}")
            parts.append("last control calls per engine server:\n" + self.servers.control.recent_calls())
        return "\n".join(parts)

    def _synced(self, version: int, serving: bool) -> None:
        """The engines hold `version` (the port's `synced`): the ledger moves; an adapter serves at once, so admission
        wakes and validation runs now, where a reload waits for `resume`."""
        self.ledger.on_sync(version)
        if serving:
            self._wake.set()
            self.validation.after_sync(version)

    async def resume(self) -> None:
        await self.servers.resume()
        self._last_hold_s = time.monotonic() - self._held_at
        self._admitting.set()
        if self._paused_at is not None:
            self.tracer.record("rollouter", "paused", self._paused_at, time.time(), version=self.ledger.version)
            self._paused_at = None
        self._wake.set()
        self.validation.after_sync(self.ledger.version)

    def _pool_stats(self) -> dict[str, Any]:
        return self.engine_service.stats() if self.engine_service is not None else {}

    # -- validation (fully_async/validation.py) ----------------------------------------------------------------
    async def final_validation(self) -> list[dict[str, Any]]:
        """The run's last validation (the trainer's last step, after its sync), at the engines' current version, with
        every result not yet popped. Admission stops first: no step trains what would be generated meanwhile, and
        the validation gets the engines to itself."""
        self._admitting.clear()
        return await self.validation.final(self.ledger.version)

    def pop_validation(self) -> list[dict[str, Any]]:
        return self.validation.pop()

    def pop_filtered(self) -> list[dict[str, Any]]:
        """trajectories.jsonl records (filtered=true) of the groups dynamic sampling left out since the last call."""
        return self.production.pop_filtered() if self.production is not None else []

    # -- state and stats ---------------------------------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        """Cursor, ledger and queue contents at one instant (see the module docstring)."""
        async with self._push_lock:
            await self.admission.take_stale_drops()
            queue_snap = await resolve_async(self.queue.snapshot.remote())
            # The filtered groups' records go with the ledger that counts them as done: logged at the checkpoint's
            # step, they are neither lost nor logged twice by a run resumed from it.
            return {"cursor": self.cursor.state_dict(), "ledger": self.ledger.state_dict(), "queue": queue_snap,
                    "filtered": self.pop_filtered()}  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Counters at one instant. `time` (wall clock) and `engine_busy_s` (per engine server: seconds with a
        generate request in flight, cumulative) give the rollouter idle ratio over the interval between two calls."""
        production, client, reward = self.production, self.client, self.reward
        return {
            **(production.counters if production is not None else dict.fromkeys(COUNTERS, 0)),
            **{f"ledger/{k}": v for k, v in self.ledger.stats().items()},
            "inflight_samples": production.inflight_samples if production is not None else 0,
            "time": time.time(),
            "engine_busy_s": client.busy_seconds() if client is not None else [],
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "client": vars(client.stats) if client is not None else {},
            "prefix_cache": client.prefix_cache.counts() if client is not None else {},
            "affinity": client.affinity.counts() if client is not None else {},
            "reward_timeouts": reward.timeouts if reward is not None else 0,
            "reward_failures": reward.failures if reward is not None else 0,
            "reward": reward.stats() if reward is not None else {},
            "pool": self._pool_stats(),
        }

    def step_report(self, take_filtered: bool = True) -> dict[str, Any]:
        """What the trainer reads after each step, in one call: `stats` (as stats()), `filtered` (pop_filtered(),
        or nothing when `take_filtered` is false: on a checkpoint step the snapshot already took them) and
        `validation` (pop_validation())."""
        return {"stats": self.stats(), "filtered": self.pop_filtered() if take_filtered else [],
                "validation": self.pop_validation()}  # fmt: skip


def agent_loops(cfg: FullyAsyncConfig, tokenizer: Any) -> tuple[Any, Any, Any]:
    """(sampling, the agent loop, the validation agent loop) of the run: rollout.* sampling with the tokenizer's stop
    tokens (none under advanced.ignore_eos), and validation's own sampling."""
    from fully_async.engines import Sampling

    ro = cfg.rollout
    ignore_eos = cfg.advanced.ignore_eos
    sampling = Sampling.from_rollout(ro, stop_token_ids=() if ignore_eos else stop_token_ids(tokenizer),
                                     ignore_eos=ignore_eos)  # fmt: skip
    fn = {"rollout_fn": ro.rollout_fn} if ro.rollout_fn else {}
    agent = build_agent_loop(cfg.agent_loop_path(), tokenizer, sampling, ro.response_length,
                             continue_on_abort=cfg.async_training.partial_rollout, multi_turn=ro.multi_turn, **fn)  # fmt: skip
    stops = {"stop_token_ids": sampling.stop_token_ids, "ignore_eos": ignore_eos}
    val_agent = build_agent_loop(cfg.agent_loop_path(), tokenizer, Sampling.for_validation(ro, **stops),
                                 ro.response_length, multi_turn=ro.multi_turn, **fn)  # fmt: skip
    return sampling, agent, val_agent


def warmup_plan(cfg: FullyAsyncConfig, rows: list[PromptRow], tokenizer: Any, sampling: Any) -> WarmupPlan | None:
    """The engines' warm-up (engines/warmup.py): the run's first prompts through the chat template, as the agent
    loops send them, to rollout.response_length tokens, as many at once as the first batch puts on a server."""
    requests = cfg.engine.warmup_requests
    if requests < 0:
        requests = -(-cfg.rollout.effective_start_concurrent() // cfg.engine.num_servers)
    prompts = []
    for row in rows[:WARMUP_ROWS]:
        ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids))
    return WarmupPlan.of_run(prompts, cfg.rollout.response_length, sampling, requests, cfg.engine.startup_timeout_s)


def create_rollouter(
    cfg: FullyAsyncConfig,
    model_path: str,
    run_dir: str,
    queue: Any,
    runtime_env: dict | None = None,
    cpu_set: list[int] | None = None,
    node_id: str | None = None,
    engine_token: str | None = None,
    name: str | None = None,
):
    """Start the Rollouter as an async Ray actor (its reward workers, and engines not given hosts, are child
    processes of it). `cpu_set`: cores for the actor and everything it starts (on a CPU host: the engines' cores),
    None = any; `node_id`: the node it must run on (the job keeps it on the driver's node); `name`: a Ray actor name in
    the NAMESPACE namespace, by which `python -m fully_async.ctl` finds the running job."""
    import dataclasses

    import ray

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 10000}
    if runtime_env:
        opts["runtime_env"] = runtime_env
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if name:
        opts.update(name=name, namespace=NAMESPACE)
    return (
        ray.remote(Rollouter)
        .options(**opts)
        .remote(dataclasses.asdict(cfg), model_path, run_dir, queue, cpu_set, tune_gc=True, engine_token=engine_token)
    )
