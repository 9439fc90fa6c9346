"""async_training: the staleness bound, the weight-sync cadence and transport, the step's size in groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fully_async.config.base import require

SYNC_MODES = ("blocking", "background")
"""Values of async_training.sync_mode."""
ON_SYNC = ("abort", "recompute", "keep")
"""Values of async_training.on_sync (fully_async/engines/inflight.py says what each does)."""
SGLANG_RECOMPUTE = (
    "async_training.on_sync=recompute is refused with engine.kind=sglang: SGLang's pause that frees a request's KV "
    "(mode retract) leaves its prefix in the radix cache, which cannot be flushed while the request waits, so the "
    "request could go on over KV of the old weights without anyone knowing; use keep (frozen with its KV, cache "
    "versions recorded) or abort"
)
WEIGHT_TRANSPORTS = ("disk", "collective", "auto")
"""The built-in values of weight_transport (fully_async/weights/factory.py builds them)."""


@dataclass
class AsyncTrainingConfig:
    max_staleness: int = 1
    """Staleness bound eta in versions: no trajectory with trainer_version - min_token_version > eta is trained; 0 = synchronous on-policy."""
    sync_every: int = 1
    """Trainer steps per weight sync; every sync bumps the version by one."""
    partial_rollout: bool = True
    """At a weight sync keep the tokens generated so far and continue under the new weights (false: restart the sample)."""
    groups_per_step: int = 8
    """Prompt groups (rollout.n samples each) consumed by one trainer step."""
    queue_capacity: int = 0
    """MessageQueue capacity in groups; 0 = (max_staleness + 1) * groups_per_step * sync_every, what the bound can fill."""
    get_timeout_s: float | None = None
    """Alias (older key) of advanced.get_timeout_s; null = unset."""
    sync_timeout_s: float | None = None
    """Alias (older key) of advanced.sync_timeout_s; null = unset."""
    on_sync: Literal["abort", "recompute", "keep"] = "abort"
    """What a weight sync does to the requests in flight (fully_async/engines/inflight.py; docs/algorithms.md, "Requests in flight at a sync"): abort = they return their tokens so far and the client sends prompt + tokens again after the resume (the engine prefills them again); recompute = frozen in the engine, their KV dropped and recomputed under the new weights at the resume (exact, no client round trip; vLLM); keep = frozen with their KV as it was, no prefill at all (the tokens after the sync come from new weights over a cache written by old ones; each token's cache version is recorded: offpolicy/cache_staleness_*). Needs partial_rollout=true unless abort."""
    drain_on_sync: bool = False
    """At a weight sync let every in-flight sample finish instead of aborting it (one-step-off and synchronous schedules). Without it a sync still lets requests of the trainer's next batch finish for up to the last sync's hold, and pauses the servers only if a request is still in flight (docs/architecture.md, "The pause")."""
    weight_transport: str = "auto"
    """How weights reach the engines: disk (safetensors under /dev/shm that every engine reloads), collective (a gloo/nccl broadcast from the trainer into every vLLM worker), auto (= disk for now; see docs/weight-transports.md), or `pkg.module:Class`, a WeightTransport subclass written outside fully_async (docs/weight-transports.md, "A transport of your own")."""
    sync_mode: Literal["blocking", "background"] = "background"
    """blocking: the trainer waits for the whole weight sync (pause, transfer, reload, resume); background: ParamSync's thread reads the weights (disk: export; collective: a copy into a staging buffer) while the trainer ends its step, the trainer's next update waits only until they were read, and the engines' phases run in that thread while the next step computes (docs/architecture.md)."""
    verify_sync: bool = True
    """Prove every full-weight sync landed: each engine server's digest of the tensors it loaded must equal the trainer's of what it wrote or sent, else the sync fails naming the server (vLLM; engine=sim and SGLang skip it, saying so once). Measured: 7-42 ms per sync in the default job; at 101 M parameters into 2 servers ~2 % of a collective sync, ~7-10 % of a disk one (docs/weight-transports.md, "The proof that a sync landed")."""
    staging: Literal["device", "pinned"] | None = None
    """Alias (older key) of advanced.staging; null = unset."""
    bucket_mb: int | None = None
    """Alias (older key) of advanced.bucket_mb; null = unset."""

    @property
    def groups_per_version(self) -> int:
        """Groups consumed between two weight syncs."""
        return self.groups_per_step * self.sync_every

    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or (self.max_staleness + 1) * self.groups_per_version

    def validate_section(self, p: str) -> None:
        require(self.max_staleness >= 0, p + "max_staleness", self.max_staleness, ">= 0")
        require(self.sync_every >= 1, p + "sync_every", self.sync_every, ">= 1")
        require(self.groups_per_step >= 1, p + "groups_per_step", self.groups_per_step, ">= 1")
        bound = (self.max_staleness + 1) * self.groups_per_version
        require(
            self.queue_capacity == 0 or self.queue_capacity >= bound,
            p + "queue_capacity",
            self.queue_capacity,
            f"0 (derived) or >= (max_staleness + 1) * groups_per_step * sync_every = {bound}, what admission can fill "
            "(a smaller queue would stall producers that the staleness rule already admitted)",
        )
        require(self.sync_mode in SYNC_MODES, p + "sync_mode", self.sync_mode, f"one of {list(SYNC_MODES)}")
        require(self.on_sync in ON_SYNC, p + "on_sync", self.on_sync, f"one of {list(ON_SYNC)}")
        require(
            self.on_sync == "abort" or self.partial_rollout,
            p + "on_sync",
            self.on_sync,
            "abort when partial_rollout=false (a frozen request goes on under the new weights; partial_rollout=false "
            "asks every sample of one version, which only abort and restart can give)",
        )
        require(
            self.weight_transport in WEIGHT_TRANSPORTS or ":" in self.weight_transport,
            p + "weight_transport",
            self.weight_transport,
            f"one of {list(WEIGHT_TRANSPORTS)} or a dotted path 'pkg.module:Class'",
        )


def on_sync_problems(at: AsyncTrainingConfig, engine_kind: str) -> list[str]:
    """Cross-section: an on_sync mode the engine kind cannot give (checked before Ray)."""
    if at.on_sync == "recompute" and engine_kind == "sglang":
        return [SGLANG_RECOMPUTE]
    return []
