"""The training ranks of the verl backend, per role (policy, reference, critic): one verl `RayWorkerGroup` each.

`RankGroups` starts the groups on the job's placement groups (or its own), calls a method on every rank of a role
with a timeout (`call_all`: a dead or stuck rank raises `TrainerTimeout` instead of hanging), splits a batch over the
data-parallel ranks with the rank mapping verl's own dispatch uses (`data_call`) and releases everything
(`shutdown`). `WeightSender` is the collective weight transport's sending side over the policy ranks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import ray

from fully_async.config import TrainerConfig


class TrainerTimeout(RuntimeError):
    """A training rank did not answer within the call timeout."""


class RankGroups:
    """Worker groups by role; `roles` = worker groups sharing each bundle of the job's placement groups."""

    def __init__(
        self,
        trainer: TrainerConfig,
        cpu: bool,
        roles: int,
        cpu_set: Sequence[int] | None = None,
        placement_groups: list | None = None,
    ) -> None:
        self.trainer, self.cpu, self.roles = trainer, cpu, roles
        self.cpu_set = sorted(int(c) for c in cpu_set) if cpu_set else None
        self.placement_groups = placement_groups
        self.timeout = trainer.call_timeout_s
        self._groups: dict = {}

    def __contains__(self, role: str) -> bool:
        return role in self._groups

    @property
    def world_size(self) -> int:
        return self._groups["policy"].world_size

    @property
    def dp_size(self) -> int:
        return max(self._groups["policy"].fa_dp_map) + 1

    def start(self, role: str, twc, **worker_args) -> None:
        """Start `role`'s ranks with engine config `twc` and build their models (verl's `reset`); `worker_args` go to
        FullyAsyncTrainingWorker's constructor."""
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from fully_async.training.verl_worker import FullyAsyncTrainingWorker

        n = self.trainer.n_gpus_per_node
        prefix = f"fa_{role}_{uuid.uuid4().hex[:6]}_"  # Ray actor names are global: unique per backend
        if self.placement_groups is not None:
            # The job's groups: every role's ranks share their bundles (one rank of each role per GPU, verl's
            # colocation), and the job, not this backend, frees them.
            pool = RayResourcePool(
                process_on_nodes=[n] * len(self.placement_groups), use_gpu=not self.cpu,
                max_colocate_count=self.roles, name_prefix=prefix,
            )  # fmt: skip
            pool.pgs = list(self.placement_groups)
            pool.fa_owned = False
        else:
            # One CPU per rank reserved for placement: verl's default (10) cannot be placed on small CPU machines.
            pool = RayResourcePool(
                process_on_nodes=[n] * self.trainer.nnodes, use_gpu=not self.cpu, max_colocate_count=1,
                name_prefix=prefix,
            )  # fmt: skip
            pool.fa_owned = True
        env = {}
        if self.cpu:
            from fully_async.training import cpu_platform

            env = cpu_platform.worker_env()
        cls = RayClassWithInitArgs(
            ray.remote(FullyAsyncTrainingWorker),
            config=twc,
            cpu=self.cpu,
            cpu_threads=self.trainer.cpu_threads_per_rank,
            cpu_set=self.cpu_set if self.cpu else None,
            **worker_args,
        )
        wg = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=cls,
            device_name="cpu" if self.cpu else "cuda",
            worker_env=env,
            name_prefix=prefix,
        )
        wg.fa_pool = pool
        self._groups[role] = wg  # registered before the first call, so shutdown() can release it if that call fails
        self._wait(wg.execute_all_async("reset"), f"{role}.reset")
        wg.fa_dp_map = self._wait(wg.execute_all_async("_query_dispatch_info", "train"), f"{role}.dispatch_info")
        wg.fa_collect = self._wait(wg.execute_all_async("_query_collect_info", "train"), f"{role}.collect_info")

    def _wait(self, refs, what: str):
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise TrainerTimeout(f"{what}: no answer from the training ranks within {self.timeout:.0f} s") from e

    def call_all(self, role: str, method: str, *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank of `role`; the answers in rank order."""
        return self._wait(self.send_all(role, method, *args, **kwargs), f"{role}.{method}")

    def send_all(self, role: str, method: str, *args, **kwargs) -> list:
        """`method(*args, **kwargs)` sent to every rank of `role` without waiting (`wait_all` takes the references).
        Each rank runs its calls one at a time in the order this process sent them (Ray's rule for an actor
        without concurrency), so any call sent after this one runs after it on every rank."""
        return self._groups[role].execute_all_async(method, *args, **kwargs)

    def wait_all(self, refs: list, what: str) -> list:
        """The answers of `send_all`'s references, bounded by trainer.call_timeout_s like every call."""
        return self._wait(refs, what)

    def data_call(self, role: str, method: str, td) -> tuple[list, list]:
        """Split `td` evenly over data-parallel ranks (its size must be a multiple of the DP size; `dp_layout`
        guarantees it); returns (outputs of the collecting ranks, input chunks), both in data-parallel order."""
        from verl.utils import tensordict_utils as tu

        wg = self._groups[role]
        dp = max(wg.fa_dp_map) + 1
        chunks = tu.chunk_tensordict(td, dp) if dp > 1 else [td]
        outs = self.call_all(role, method, [chunks[r] for r in wg.fa_dp_map])
        by_dp = {}
        for rank, out in enumerate(outs):
            if wg.fa_collect[rank]:
                by_dp.setdefault(wg.fa_dp_map[rank], out)
        return [by_dp[d] for d in range(dp)], chunks

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for wg in self._groups.values():
            for worker in wg.workers:
                ray.kill(worker)
            # The pool's placement groups outlive the actors: without this every backend built in a process keeps
            # its CPUs/GPUs reserved and the next one waits for placement forever.
            for pg in (wg.fa_pool.pgs or []) if wg.fa_pool.fa_owned else []:
                remove_placement_group(pg)
        self._groups.clear()


class WeightSender:
    """CollectiveSender's interface over the policy ranks (verl_worker.FullyAsyncTrainingWorker.weights_*)."""

    def __init__(self, ranks: RankGroups) -> None:
        self.ranks = ranks

    def _rank0(self, method: str, *args):
        return self.ranks.call_all("policy", method, *args)[0]

    def plan(self) -> list:
        return self._rank0("weights_plan")

    def listen(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        host, port = self._rank0("weights_listen", loopback, timeout_s)
        return host, int(port)

    def form(self, group: str, world: int, backend: str, timeout_s: float) -> None:
        self._rank0("weights_form", group, world, backend, timeout_s)

    def send(self, buckets: list, dtype: str) -> dict:
        return self._rank0("weights_send", json.dumps(buckets), dtype)

    def stage(self, buckets: list, dtype: str, staging: str = "device") -> dict:
        return self._rank0("weights_stage", json.dumps(buckets), dtype, staging)

    def send_staged(self) -> None:
        self._rank0("weights_send_staged")

    def close(self) -> None:
        if "policy" in self.ranks:
            self.ranks.call_all("policy", "weights_close")
