"""Rollouter: admits prompts under the staleness bound, generates rollout.n samples per prompt on the engines, scores
each sample as soon as it finishes, and pushes whole groups to the MessageQueue.

Runs as an async Ray actor (`create_rollouter`); every method runs on one event loop, so the ledger needs no lock.
Contracts:
- A prompt is admitted only through the ledger; a group that fails (engine error after retries) or that the queue
  drops as stale is re-issued, never lost.
- `pause()` stops admission and pauses the engines (in-flight requests abort and continue after `resume()`; with
  partial_rollout=false they restart from their prompt). `load_weights()` sits between them.
- Every generate request, reward call, sync pause and validation run is recorded as a span in
  RUN_DIR/trace/rollouter.jsonl (fully_async/trace.py); `stats()` gives the engine occupancy behind the rollouter
  idle ratio.
- `snapshot()` is a consistent cut: the ledger, the cursor and the queue's contents are read while no group is
  moving from "running" to "queued" (`_push_lock`), so on restore every prompt is in exactly one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections import deque
from typing import Any

from fully_async.agents import Sample, build_agent_loop
from fully_async.config import FullyAsyncConfig, from_dict
from fully_async.data import DataError, EpochCursor, PromptRow, load_rows, synthetic_rows
from fully_async.engines.auth import TOKEN_ENV
from fully_async.engines.service import EngineService
from fully_async.gc_tuning import tune_for_throughput
from fully_async.handles import NAMESPACE
from fully_async.host import device as run_device
from fully_async.host import pin_all_threads
from fully_async.metrics import trajectory_records
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup
from fully_async.reward import RewardAgent, RewardDrop, RewardFatal
from fully_async.reward.shaping import group_values, is_constant, overlong_penalty
from fully_async.staleness import StalenessLedger
from fully_async.trace import Tracer
from fully_async.weights.base import resolve_kind

log = logging.getLogger(__name__)


QUEUE_WAIT_TRACE_S = 0.01
"""A push to the queue that blocks at least this long (backpressure) is recorded as a `queue_wait` span."""

ADMIT_CHUNK_GROUPS = 64
"""The admission loop yields to the event loop after this many groups. A sync opens a whole version at once (2,048
groups, 32,768 samples at 256 engines); started in one go, their tasks filled the loop for seconds of wall time and
the trainer's per-step stats() call, and so the trainer itself, waited behind them (1.8-4.6 s at each version's first
step, at time scale 2). In chunks, calls interleave, and max_concurrent sees the samples already started."""

STALE_POLL_S = 0.1
"""The admission loop asks the queue for groups it dropped as stale at most this often."""

# The sample a coroutine works for: asyncio tasks inherit it, so the engine client's per-request callback can name
# the sample in its trace span without the client knowing about samples.
_sample_id: contextvars.ContextVar[str] = contextvars.ContextVar("sample_id", default="")


def dataset(cfg: FullyAsyncConfig, split: str) -> list[PromptRow]:
    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    if files:
        return load_rows(files, cfg.data.prompt_key)
    size = cfg.data.synthetic_size if split == "train" else max(32, cfg.data.synthetic_size // 16)
    return synthetic_rows(
        size, cfg.data.seed, split, cfg.data.synthetic_task, env_delay_s=cfg.data.synthetic_env_delay_s
    )


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
        pin_all_threads(cpu_set)
        at = self.cfg.async_training
        self.ledger = StalenessLedger(at.max_staleness, at.groups_per_version)
        self.rows: list[PromptRow] = []
        self.val_rows: list[PromptRow] = []
        self.cursor: EpochCursor | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inflight_samples = 0
        self._admitting = asyncio.Event()
        self._wake = asyncio.Event()
        self._push_lock = asyncio.Lock()
        self._outbox: list[TrajectoryGroup] = []
        self._pusher: asyncio.Task | None = None
        self._stale_polled = float("-inf")
        self._stopping = False
        self._error: str | None = None
        self._main: asyncio.Task | None = None
        self._validation: asyncio.Task | None = None
        self._val_results: deque[dict[str, Any]] = deque()
        self.tracer = Tracer(run_dir, "rollouter", self.cfg.logger.trace)
        self._paused_at: float | None = None
        self._filtered: list[dict[str, Any]] = []
        self.engine_service: EngineService | None = None
        """The engine pool's calls (engines/service.py), once `start` has started the pool and its client."""
        self._c = {"groups_pushed": 0, "groups_failed": 0, "groups_dropped_by_reward": 0, "samples": 0, "tokens": 0,
                   "aborted_samples": 0, "groups_filtered": 0}  # fmt: skip

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
        from transformers import AutoTokenizer

        from fully_async.engines import EngineClient, Sampling, build_engine

        if self.cursor is None:
            await self.prepare()
        if cursor_state:
            self.cursor.load_state_dict(cursor_state)
        if ledger_state:
            at = self.cfg.async_training
            self.ledger = StalenessLedger.from_state(ledger_state, at.max_staleness, at.groups_per_version)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        ignore_eos = self.cfg.rollout.ignore_eos
        sampling = Sampling.from_rollout(
            self.cfg.rollout, stop_token_ids=() if ignore_eos else _stop_ids(tokenizer), ignore_eos=ignore_eos
        )
        ro = self.cfg.rollout
        fn = {"rollout_fn": ro.rollout_fn} if ro.rollout_fn else {}
        self.agent = build_agent_loop(
            self.cfg.agent_loop_path(),
            tokenizer,
            sampling,
            ro.response_length,
            continue_on_abort=self.cfg.async_training.partial_rollout,
            multi_turn=ro.multi_turn,
            **fn,
        )
        self.val_agent = build_agent_loop(
            self.cfg.agent_loop_path(), tokenizer, sampling, ro.response_length, multi_turn=ro.multi_turn, **fn
        )
        self.agent.tracer = self.val_agent.tracer = self.tracer
        device = run_device(self.cfg.trainer.device)  # the job has decided it; "auto" only outside a job
        collective = resolve_kind(self.cfg.async_training.weight_transport) == "collective"
        self.servers = build_engine(self.cfg.engine, self.model_path, self.run_dir, hosts=hosts, device=device,
                                    weight_receiver=collective)  # fmt: skip
        self.servers.host_factory = host_factory if hosts else None
        await asyncio.to_thread(self.servers.start)
        if weights is not None:
            await self.servers.load_weights(weights[0], weights[1])
        else:
            await self.servers.set_version(self.ledger.version)
        self.client = EngineClient(self.servers)
        self.client.on_segment = self._trace_segment
        self.engine_service = EngineService(self.servers, self.client, self.tracer)
        self.tracer.meta(engines=len(self.servers.addresses))
        if self._tune_gc:
            tune_for_throughput()  # start-up is done: what is alive now (tokenizer, modules, rows) stays
        self._admitting.set()
        self._main = asyncio.get_running_loop().create_task(self._admission_loop())
        return {"engines": self.servers.addresses, "train_rows": len(self.rows), "val_rows": len(self.val_rows)}

    async def prepare(self) -> dict[str, int]:
        """Load and check the datasets and their reward sources: bad input fails here, before anything heavy starts."""
        self.rows = dataset(self.cfg, "train")
        self.val_rows = dataset(self.cfg, "val") if self.cfg.trainer.val_every else []
        self.reward = RewardAgent(self.cfg.reward, tokenizer_path=self.model_path)
        await self.reward.check_sources(self.rows + self.val_rows)
        self.cursor = EpochCursor(len(self.rows), self.cfg.mixed_seed(self.cfg.data.seed), self.cfg.data.shuffle)
        return {"train_rows": len(self.rows), "val_rows": len(self.val_rows)}

    async def shutdown(self) -> None:
        """Stop generating, stop the engines and reward workers. Safe to call twice or after a failed start."""
        self._stopping = True
        self._wake.set()
        for t in [*self._tasks, *(x for x in (self._main, self._validation) if x)]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if getattr(self, "client", None) is not None:
            await self.client.close()
        if getattr(self, "servers", None) is not None:
            await asyncio.to_thread(self.servers.stop)
        if getattr(self, "reward", None) is not None:
            await self.reward.aclose()
        self.tracer.close()

    def error(self) -> str | None:
        """Why generation stopped, if it failed (the trainer polls this while it waits for batches)."""
        return self._error

    # -- admission ---------------------------------------------------------------------------------------------
    async def _admission_loop(self) -> None:
        n, limit = self.cfg.rollout.n, self.cfg.rollout.max_concurrent
        try:
            while not self._stopping:
                await self._admitting.wait()
                self._wake.clear()  # before the checks: a wake-up arriving during them is not lost
                await self._pull_stale_drops()
                admitted = 0
                while (
                    self._admitting.is_set()
                    and self.ledger.can_admit()
                    and self._inflight_samples + n <= max(limit, n)
                    and self._start_window_open()
                ):
                    prompt = self.ledger.next_reissue() or self.cursor.next()
                    self.ledger.admit(prompt)
                    self._spawn(self._run_group(prompt))
                    admitted += 1
                    if admitted % ADMIT_CHUNK_GROUPS == 0:
                        await asyncio.sleep(0)  # let calls queued behind the burst (stats, pause) run; see below
                # Periodic even without wake-ups: stale drops are collected from the queue by polling.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.2)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the trainer sees this through error() and fails the run with it
            self._error = f"admission loop failed: {type(e).__name__}: {e}"
            log.exception("admission loop failed")

    def _start_window_open(self) -> bool:
        """Until the first trainer step's worth of groups has been pushed since start(), at most
        rollout.start_concurrent samples' worth of groups may be generating. The staleness bound admits (eta + 1)
        versions at once at start; spread over the engines they would all decode at a large batch, and the first
        groups to finish (the trainer's first batch) would wait behind them. Counted in whole groups, not samples:
        a group's finished samples must not let a new group in while its last sample (the one the batch waits for)
        is still decoding. Later versions open while the queue already holds the next batches, so only the start
        (and a resume, which calls start() again) needs this."""
        if self._c["groups_pushed"] >= self.cfg.async_training.groups_per_step:
            return True
        n = self.cfg.rollout.n
        return (len(self.ledger.running) + 1) * n <= max(self.cfg.rollout.effective_start_concurrent(), n)

    async def _pull_stale_drops(self) -> None:
        # At most every STALE_POLL_S: the loop wakes at every pushed batch, and a queue call per wake-up cost as much
        # as the push itself; drops only happen when the trainer moves to a new version.
        now = time.monotonic()
        if now - self._stale_polled < STALE_POLL_S:
            return
        self._stale_polled = now
        async with self._push_lock:
            await self._take_stale_drops()

    async def _take_stale_drops(self) -> None:
        """Move the prompts the queue dropped as stale into the ledger's re-issue list (caller holds _push_lock)."""
        dropped = await self.queue.take_reissue.remote()
        if dropped:
            self.ledger.drop_stale(dropped)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run_group(self, prompt: PromptRef) -> None:
        row = self.rows[prompt.index]
        loop = asyncio.get_running_loop()
        samples = [loop.create_task(self._run_sample(Sample(prompt, i, row))) for i in range(self.cfg.rollout.n)]
        try:
            try:
                trajs = await asyncio.gather(*samples)
            except BaseException:
                # One sample failed (or we are cancelled): its siblings stop too, so a re-issued group never overlaps
                # leftovers of its previous attempt.
                for t in samples:
                    t.cancel()
                await asyncio.gather(*samples, return_exceptions=True)
                raise
            if self.reward.group is not None:  # reward.group_fn: the whole group, before it is queued
                with self.tracer.span("reward", "group_fn", group=prompt.uid):
                    last = [rows[-1] for rows in trajs]  # a sample's own row (earlier ones are split off)
                    texts = [self.agent.reward_text(t) for t in last]
                    await self.reward.group.apply(last, texts, reward_meta(row), prompt.uid)
                    for rows in trajs:
                        for t in rows[:-1]:
                            t.reward = rows[-1].reward
            group = TrajectoryGroup(prompt, [t for rows in trajs for t in rows], meta=row.meta())
            constant = self._constant(group)
        except asyncio.CancelledError:
            raise
        except (DataError, RewardFatal) as e:
            self._error = str(e)
            return
        except Exception as e:  # engine failure after retries, or a reward source's drop: re-issue, keep running
            log.warning("group %s failed, re-issuing it: %s: %s", prompt.uid, type(e).__name__, e)
            self._c["groups_failed"] += 1
            self._c["groups_dropped_by_reward"] += isinstance(e, RewardDrop)
            self.ledger.finish(prompt, ok=False)
            self._wake.set()
            return
        if constant:  # dynamic sampling: nothing to learn from it; its slot goes to a new group
            self.ledger.filter(prompt, reissue=self.cfg.algorithm.filter_groups.reissue)
            self._c["groups_filtered"] += 1
            records = trajectory_records([group], step=0, trainer_version=self.ledger.version)
            self._filtered.extend({**r, "filtered": True} for r in records)
            self._wake.set()
            return
        self._outbox.append(group)
        if self._pusher is None or self._pusher.done():
            self._pusher = self._spawn(self._push_outbox())

    def _constant(self, group: TrajectoryGroup) -> bool:
        """Whether algorithm.filter_groups leaves this group out (its rewards, or its metric, do not vary)."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return False
        values = group_values(group.trajectories, fg.metric)
        if values is None:
            raise DataError(
                f"algorithm.filter_groups.metric={fg.metric!r} is not a number in the reward info of group "
                f"{group.prompt.uid} (use 'reward' or a numeric key the reward function returns)"
            )
        return is_constant(values)

    def pop_filtered(self) -> list[dict[str, Any]]:
        """trajectories.jsonl records (filtered=true) of the groups dynamic sampling left out since the last call;
        the trainer writes them with its current step."""
        out, self._filtered = self._filtered, []
        return out

    async def _push_outbox(self) -> None:
        """Push finished groups to the queue, all that have finished in one actor call. Groups finish at up to
        ~10^3 per second at scale, and a call per group cost more CPU (Ray's submission path here, its receiving
        end in the queue) than everything else the group needs; groups that finish while a put is in flight go
        in the next one. A group stays `running` in the ledger until its put, so a snapshot taken meanwhile saves
        its prompt for re-issue (the module docstring's consistent cut)."""
        while self._outbox:
            async with self._push_lock:
                batch, self._outbox = self._outbox, []
                start = time.time()
                try:
                    await self.queue.put.remote(batch)
                except Exception as e:  # a dead queue actor, a group Ray cannot serialise: fail the run, lose nothing
                    for group in batch:
                        self.ledger.finish(group.prompt, ok=False)  # not accepted: back on the re-issue list
                    self._error = f"pushing {len(batch)} groups to the message queue failed: {type(e).__name__}: {e}"
                    log.error("%s", self._error)
                    return
                for group in batch:
                    self.ledger.finish(group.prompt, ok=True)
                if time.time() - start >= QUEUE_WAIT_TRACE_S:
                    self.tracer.record("rollouter", "queue_wait", start, time.time(), groups=len(batch))
                self._c["groups_pushed"] += len(batch)
            self._wake.set()

    async def _run_sample(self, sample: Sample) -> list[Trajectory]:
        """The sample's training rows (one, or several when the agent split the episode), scored."""
        _sample_id.set(f"{sample.prompt.uid}/{sample.sample_index}")
        self._inflight_samples += 1
        try:
            out = await self.agent.run(self.client, sample)
        finally:
            self._inflight_samples -= 1
        rows = out if isinstance(out, list) else [out]
        for t in rows:
            if len(t.prompt_ids) > self.cfg.data.max_prompt_length:
                raise DataError(
                    f"{sample.row.origin}: prompt has {len(t.prompt_ids)} tokens, more than "
                    f"data.max_prompt_length={self.cfg.data.max_prompt_length}"
                )
        traj = rows[-1]
        with self.tracer.span("reward", "score", sample=_sample_id.get()):
            result = await self.reward.score(self.agent.reward_text(traj), reward_meta(sample.row))
        reward_s = result.info.pop("reward_s", 0.0)
        # The agent's own info (turns, tool errors) stays beside the reward's.
        traj.reward, traj.reward_info = result.score, {**traj.reward_info, **result.info}
        shaping = self.cfg.reward
        if shaping.overlong_buffer:  # DAPO's soft overlong punishment, on top of the sources' score
            penalty = overlong_penalty(traj.response_length, self.cfg.rollout.response_length,
                                       shaping.overlong_buffer, shaping.overlong_penalty)  # fmt: skip
            traj.reward += penalty
            traj.reward_info["overlong_penalty"] = penalty
        traj.timings["reward_s"] = reward_s
        for t in rows[:-1]:  # split-off rows share the sample's reward (and, in training, its advantage)
            t.reward, t.reward_info = traj.reward, {**t.reward_info, **result.info}
        self._c["samples"] += 1
        self._c["tokens"] += sum(t.response_length for t in rows)
        self._c["aborted_samples"] += traj.num_aborts > 0
        return rows

    def _trace_segment(self, server: int, start: float, end: float, tokens: int, finish: str) -> None:
        sample = _sample_id.get()
        self.tracer.record(f"engine/{server}", "generate", start, end, tokens=tokens, finish=finish, sample=sample)

    # -- weight sync -------------------------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop admitting and pause the engines; validation at the current version finishes first. With
        async_training.drain_on_sync the groups already generating finish first too (nothing is aborted)."""
        self._admitting.clear()
        self._paused_at = time.time()
        if self._validation is not None:
            await self._validation
            self._validation = None
        while self.cfg.async_training.drain_on_sync and self.ledger.running and self._error is None:
            await asyncio.sleep(0.005)
        await self.servers.pause("abort")

    async def load_weights(self, weights_dir: str, version: int, node_dirs: dict[str, str] | None = None) -> None:
        """Every engine reloads `weights_dir` (servers on a node in `node_dirs`: that node's copy) as `version`."""
        await self.servers.load_weights(weights_dir, version, node_dirs)
        self.ledger.on_sync(version)

    def engine_nodes(self) -> list[dict[str, Any]]:
        """Per engine server that a weight copy must reach: its node (the disk transport; `EngineService.nodes`)."""
        return self.engine_service.nodes()

    def engine_layout(self) -> dict[str, Any]:
        """The pool's epoch and the servers a weight group spans now (the collective transport)."""
        return self.engine_service.layout()

    async def engine_rpc(self, index: int, method: str, spec: str, timeout_s: float) -> list[Any]:
        """The weight receiver's `method(spec)` on every worker of server `index` (collective transport)."""
        return await self.servers.rpc(index, method, spec, timeout_s)

    async def weights_received(self, version: int, epoch: int) -> None:
        """Every server holds `version` (sent through a weight group formed at `epoch`): label it, no reload."""
        await self.servers.weights_received(version, epoch)
        self.ledger.on_sync(version)

    async def resume(self) -> None:
        await self.servers.resume()
        self._admitting.set()
        if self._paused_at is not None:
            self.tracer.record("rollouter", "paused", self._paused_at, time.time(), version=self.ledger.version)
            self._paused_at = None
        self._wake.set()
        val_every = self.cfg.trainer.val_every
        if val_every and self.ledger.version % val_every == 0 and self.val_rows:
            self._validation = asyncio.get_running_loop().create_task(self._validate(self.ledger.version))

    # -- elastic engine pool (fully_async.ctl engines; engines/service.py) ---------------------------------------------
    async def engines(self) -> list[dict[str, Any]]:
        """One row per server slot: index, url, state, requests in flight, seconds busy, Ray node ([] before start)."""
        return await self.engine_service.rows() if self.engine_service is not None else []

    async def add_engines(self, count: int = 1) -> dict[str, Any]:
        """Start `count` more engine servers (serving once current); refused past engine.max_servers."""
        return await self.engine_service.add(count, self.cfg.engine.max_servers)

    async def remove_engine(self, url: str) -> dict[str, Any]:
        """Take the server at `url` out of the pool, its requests continued elsewhere; refused below min_servers."""
        return await self.engine_service.remove(url, self.cfg.engine.min_servers, self.cfg.engine.control_timeout_s)

    def _pool_stats(self) -> dict[str, Any]:
        return self.engine_service.stats() if self.engine_service is not None else {}

    # -- validation --------------------------------------------------------------------------------------------
    async def _validate(self, version: int) -> None:
        """One sample per held-out prompt, all under weights `version` (the next pause waits for this)."""
        limit = asyncio.Semaphore(self.cfg.rollout.val_max_concurrent)
        start, wall_start = time.monotonic(), time.time()

        async def one(i: int, row: PromptRow) -> float:
            _sample_id.set(f"val:{version}:{i}")
            async with limit:
                out = await self.val_agent.run(self.client, Sample(PromptRef(-1, i), 0, row))
                text = self.val_agent.reward_text(out[-1] if isinstance(out, list) else out)
                try:
                    return (await self.reward.score(text, reward_meta(row))).score
                except RewardDrop:  # a sample a training run would re-issue: left out of the validation mean
                    return None

        try:
            scores = [
                s for s in await asyncio.gather(*(one(i, r) for i, r in enumerate(self.val_rows))) if s is not None
            ]
            self._val_results.append(
                {"version": version, "val/reward_mean": sum(scores) / len(scores) if scores else float("nan"),
                 "val/n": len(scores), "timing_s/validation": time.monotonic() - start}
            )  # fmt: skip
            self.tracer.record("rollouter", "validation", wall_start, time.time(), version=version)
        except RewardFatal as e:  # on_failure=raise holds for validation too
            self._error = str(e)
        except Exception as e:  # validation must not stop training; its failure is logged
            log.warning("validation at version %d failed: %s", version, e)

    def pop_validation(self) -> list[dict[str, Any]]:
        out = list(self._val_results)
        self._val_results.clear()
        return out

    # -- state and stats ---------------------------------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        """Cursor, ledger and queue contents at one instant (see the module docstring)."""
        async with self._push_lock:
            await self._take_stale_drops()
            queue_snap = await self.queue.snapshot.remote()
            # The filtered groups' records go with the ledger that counts them as done: logged at the checkpoint's
            # step, they are neither lost nor logged twice by a run resumed from it.
            return {"cursor": self.cursor.state_dict(), "ledger": self.ledger.state_dict(), "queue": queue_snap,
                    "filtered": self.pop_filtered()}  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Counters at one instant. `time` (wall clock) and `engine_busy_s` (per engine server: seconds with a
        generate request in flight, cumulative) give the rollouter idle ratio over the interval between two calls."""
        client = getattr(self, "client", None)
        return {
            **self._c,
            **{f"ledger/{k}": v for k, v in self.ledger.stats().items()},
            "inflight_samples": self._inflight_samples,
            "time": time.time(),
            "engine_busy_s": client.busy_seconds() if client is not None else [],
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "client": vars(self.client.stats) if getattr(self, "client", None) else {},
            "reward_timeouts": getattr(getattr(self, "reward", None), "timeouts", 0),
            "reward_failures": getattr(getattr(self, "reward", None), "failures", 0),
            "reward": self.reward.stats() if getattr(self, "reward", None) is not None else {},
            "pool": self._pool_stats(),
        }


def reward_meta(row: PromptRow) -> dict[str, Any]:
    """What a reward source sees besides the response: the row's meta and the question (last user message)."""
    question = next((m.get("content", "") for m in reversed(row.messages) if m.get("role") == "user"), "")
    return {**row.meta(), "question": question}


def _stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """End-of-turn tokens: eos and, for chat templates with one, <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None))


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
