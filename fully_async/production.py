"""Production: one admitted prompt into one TrajectoryGroup on the queue. Which prompt starts when is admission's
(fully_async/admission.py); this module runs it.

A group is rollout.n samples of one prompt, each driven through the agent loop on the engines and scored as soon as it
finishes; then reward.group_fn (if any) sees the whole group, dynamic sampling (algorithm.filter_groups) may leave it
out, and the rest go through the outbox to the MessageQueue, many groups per actor call. Every outcome is reported
to admission (`pushed`, `failed`, `filtered`), which settles it in the staleness ledger: a group that fails or that the
queue refuses is re-issued, never lost. Errors that retrying cannot fix (bad data, reward.on_failure=raise) and a put
the queue refuses go to `fail` and stop the run.

`validate` is the held-out counterpart: one sample per validation prompt, scored, averaged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fully_async.admission import Admission
from fully_async.agents import Sample
from fully_async.config import FullyAsyncConfig
from fully_async.data import DataError, PromptRow
from fully_async.distill import score_sample
from fully_async.engines.affinity import session
from fully_async.envs.failures import InfraExhausted
from fully_async.handles import resolve_async
from fully_async.metrics import trajectory_records
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup
from fully_async.reward import RewardDrop, RewardFatal
from fully_async.reward.shaping import group_values, is_constant, overlong_penalty
from fully_async.trace import Tracer

log = logging.getLogger(__name__)

QUEUE_WAIT_TRACE_S = 0.01
"""A push to the queue that blocks at least this long (backpressure) is recorded as a `queue_wait` span."""
REASON_CHARS = 400
"""Most characters of an exception's text a push failure keeps: Ray's serialisation error carries the repr of the
whole batch (every token array) and its serialisability report, tens of kilobytes per group."""


def short_reason(e: BaseException) -> str:
    """`Type: first line of the message`, clipped to REASON_CHARS, saying how much was left out."""
    text = f"{type(e).__name__}: {e}"
    head = text.splitlines()[0][:REASON_CHARS]  # never empty: the type's name leads
    left = len(text) - len(head)
    return head + (f" ... ({left} more characters)" if left > 0 else "")


COUNTERS = ("groups_pushed", "groups_failed", "groups_dropped_by_reward", "samples", "tokens", "aborted_samples",
            "groups_filtered", "groups_env_infra")  # fmt: skip
"""Production's cumulative counters (Rollouter.stats())."""

# The sample a coroutine works for: asyncio tasks inherit it, so the engine client's per-request callback (the
# Rollouter's trace segment) can name the sample in its trace span without the client knowing about samples, and
# the client keeps the sample's requests on one engine server (sticky routing: it is engines/affinity.py's `session`).
sample_id = session


class Production:
    """Drives admitted prompts into groups on the queue. `rows`: the training rows (a prompt's index points into
    them); `agent`: the agent loop; `client`: the EngineClient;
    `reward`: the RewardAgent; `queue`: the MessageQueue handle (Ray actor or LocalActor); `push_lock`: shared with
    admission and the Rollouter's snapshot (see `push_outbox`); `fail`: records why the run must stop."""

    def __init__(
        self,
        cfg: FullyAsyncConfig,
        rows: list[PromptRow],
        agent: Any,
        client: Any,
        reward: Any,
        tracer: Tracer,
        queue: Any,
        admission: Admission,
        push_lock: asyncio.Lock,
        fail: Callable[[str], None],
    ) -> None:
        self.cfg, self.rows, self.agent, self.client, self.reward = cfg, rows, agent, client, reward
        self.tracer, self.queue, self.admission, self.push_lock, self.fail = tracer, queue, admission, push_lock, fail
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.inflight_samples = 0
        """Samples of started groups that have not finished generating (rollout.max_concurrent bounds it)."""
        self.tasks: set[asyncio.Task] = set()
        self._outbox: list[TrajectoryGroup] = []
        self._pusher: asyncio.Task | None = None
        self._filtered: list[dict[str, Any]] = []
        self._failed_in_a_row = 0
        """Groups failed since the last one that finished (pushed or filtered): advanced.failed_groups_in_a_row."""

    @property
    def groups_pushed(self) -> int:
        return self.counters["groups_pushed"]

    def start(self, prompt: PromptRef) -> asyncio.Task:
        """Start generating `prompt`'s group (admitted by the caller). Its samples count as in flight from now, so the
        admission loop sees them before their tasks first run."""
        self.inflight_samples += self.cfg.rollout.n
        return self.spawn(self.run_group(prompt))

    def spawn(self, coro) -> asyncio.Task:
        """A task cancelled by `stop()`."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancel every group and push; returns once they have ended."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # -- one group ---------------------------------------------------------------------------------------------
    async def run_group(self, prompt: PromptRef) -> None:
        row = self.rows[prompt.index]
        loop = asyncio.get_running_loop()
        samples = [loop.create_task(self.run_sample(Sample(prompt, i, row))) for i in range(self.cfg.rollout.n)]
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
                    await self.reward.group.apply(last, texts, row.reward_meta(), prompt.uid)
                    for rows in trajs:
                        for t in rows[:-1]:
                            t.reward = rows[-1].reward
            group = TrajectoryGroup(prompt, [t for rows in trajs for t in rows], meta=row.meta())
            constant = self.constant(group)
        except asyncio.CancelledError:
            raise
        except (DataError, RewardFatal) as e:
            self.fail(str(e))
            return
        # An engine failure after retries, an environment's infrastructure failures past its budget (envs/failures.py)
        # or a reward source's drop: re-issue, keep running.
        except Exception as e:
            log.warning("group %s failed, re-issuing it: %s: %s", prompt.uid, type(e).__name__, e)
            self.counters["groups_failed"] += 1
            self.counters["groups_dropped_by_reward"] += isinstance(e, RewardDrop)
            self.counters["groups_env_infra"] += isinstance(e, InfraExhausted)  # re-issued, never scored
            self.admission.failed(prompt)
            self._count_failure(e)
            return
        self._failed_in_a_row = 0
        if constant:  # dynamic sampling: nothing to learn from it; its slot goes to a new group
            self.admission.filtered(prompt, reissue=self.cfg.algorithm.filter_groups.reissue)
            self.counters["groups_filtered"] += 1
            records = trajectory_records([group], step=0, trainer_version=self.admission.ledger.version)
            self._filtered.extend({**r, "filtered": True} for r in records)
            return
        self._outbox.append(group)
        if self._pusher is None or self._pusher.done():
            self._pusher = self.spawn(self.push_outbox())

    def _count_failure(self, e: Exception) -> None:
        """One more group failed with none finished since the last: past advanced.failed_groups_in_a_row the run
        fails with this error instead of re-issuing the same refusal for ever (its prompt stays on the re-issue list,
        so a resume generates it again)."""
        self._failed_in_a_row += 1
        limit = self.cfg.advanced.failed_groups_in_a_row
        if limit and self._failed_in_a_row >= limit:
            self.fail(
                f"{self._failed_in_a_row} groups failed in a row with none finished in between "
                f"(advanced.failed_groups_in_a_row={limit}); the last: {short_reason(e)}"
            )

    def constant(self, group: TrajectoryGroup) -> bool:
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

    async def push_outbox(self) -> None:
        """Push finished groups to the queue, all that have finished in one actor call. Groups finish at up to
        ~10^3 per second at scale, and a call per group cost more CPU (Ray's submission path here, its receiving
        end in the queue) than everything else the group needs; groups that finish while a put is in flight go
        in the next one. A group stays `running` in the ledger until its put, so a snapshot taken meanwhile saves
        its prompt for re-issue (the Rollouter's consistent cut)."""
        while self._outbox:
            async with self.push_lock:
                batch, self._outbox = self._outbox, []
                start = time.time()
                try:
                    await resolve_async(self.queue.put.remote(batch))
                except Exception as e:  # a dead queue actor, a group Ray cannot serialise: fail the run, lose nothing
                    for group in batch:
                        self.admission.failed(group.prompt)  # not accepted: back on the re-issue list
                    reason = short_reason(e)
                    self.fail(f"pushing {len(batch)} groups to the message queue failed: {reason}")
                    log.error("pushing %d groups to the message queue failed: %s", len(batch), reason)
                    return
                self.admission.pushed(group.prompt for group in batch)
                if time.time() - start >= QUEUE_WAIT_TRACE_S:
                    self.tracer.record("rollouter", "queue_wait", start, time.time(), groups=len(batch))
                self.counters["groups_pushed"] += len(batch)

    # -- one sample --------------------------------------------------------------------------------------------
    async def run_sample(self, sample: Sample) -> list[Trajectory]:
        """The sample's training rows (one, or several when the agent split the episode), scored. It counts in
        `inflight_samples` (reserved by `start`) until its generation ends."""
        sample_id.set(f"{sample.prompt.uid}/{sample.sample_index}")
        try:
            out = await self.agent.run(self.client, sample)
        finally:
            self.inflight_samples -= 1
        rows = out if isinstance(out, list) else [out]
        for t in rows:
            if len(t.prompt_ids) > self.cfg.data.max_prompt_length:
                raise DataError(
                    f"{sample.row.origin}: prompt has {len(t.prompt_ids)} tokens, more than "
                    f"data.max_prompt_length={self.cfg.data.max_prompt_length}"
                )
        traj = rows[-1]
        with self.tracer.span("reward", "score", sample=sample_id.get()):  # and the distillation teacher's, if any
            result = await score_sample(self.reward, rows, self.agent.reward_text(traj),
                                        self.agent.reward_meta(traj, sample.row))  # fmt: skip
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
        self.counters["samples"] += 1
        self.counters["tokens"] += sum(t.response_length for t in rows)
        self.counters["aborted_samples"] += traj.num_aborts > 0
        return rows
