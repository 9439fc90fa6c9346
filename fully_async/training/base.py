"""The training-backend boundary: what the trainer loop asks of whatever does the gradient steps.

A backend owns the policy weights (and an optional frozen reference model). The trainer hands it lists of
TrajectoryGroups; the backend assembles them into its own batch layout, recomputes the proximal (and reference)
log-probs, computes advantages, applies the decoupled-PPO update and reports scalar metrics. It exports its current
weights for the inference engines and saves / restores its full state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fully_async.weights.base import SyncPlan, whole_export

if TYPE_CHECKING:
    import numpy as np

    from fully_async.config.sections.model import LoraConfig
    from fully_async.protocol import TrajectoryGroup


class TrainingBackend(ABC):
    """Contract shared by all backends. Calls are blocking and must not be made concurrently."""

    lora: LoraConfig | None = None
    """model.lora when the policy trains a LoRA adapter, None when it trains in full."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Training ranks (data-parallel size)."""

    @abstractmethod
    def compute_log_probs(self, groups: Sequence[TrajectoryGroup], *, reference: bool = False) -> list[np.ndarray]:
        """Log-probs of every response token under the current policy (or the reference model), one float32 array
        per trajectory in `protocol.flatten(groups)` order, each of the trajectory's response length."""

    @abstractmethod
    def update(self, groups: Sequence[TrajectoryGroup], *, version: int | None = None) -> dict[str, float]:
        """One trainer step on these groups (any number, any sizes): advantages, proximal / reference log-probs,
        importance weights, `ppo_epochs x num_mini_batches` optimizer steps, one LR-scheduler step. Returns metrics.
        `version` (the current weight version) adds token-staleness metrics."""

    @abstractmethod
    def export_weights(self, out_dir: str | Path, dtype: str = "float32", *, sync: bool = False) -> list[Path]:
        """Write the current weights as Hugging Face safetensors (plus the model's config and tokenizer files) into
        `out_dir`, cast to `dtype`; returns the weight files written. With LoRA, the merged model (base + adapter,
        Hugging Face names), so every full-weight transport serves it unchanged; `weight_sender()` sends the same.
        `sync`: a weight sync's export, which leaves out the weights that never change (a frozen vision tower: the
        engines keep the one they loaded from model.path); `stage_weights` and `weight_sender()` always do."""

    def sync_export(self, out_dir: Path, dtype: str = "float32") -> SyncPlan:
        """The phases of a weight sync that take the current weights into `out_dir` (the first part of the disk
        transport's plan, fully_async/weights/base.py): by default one `export` phase that reads and writes them
        (`export_weights(sync=True)`). A backend whose `stage_weights` only queues the copy ahead of its later calls
        returns `queued_export(self.stage_weights, ...)`: then the trainer's next update waits for nothing, and a
        `write` phase, ahead of the pause, waits for the copy and the files."""
        return whole_export(self, out_dir, dtype)

    def stage_weights(self, out_dir: str | Path, dtype: str = "float32") -> Callable[[], None]:
        """`export_weights` in two halves: take what it needs of the current weights, or queue the taking ahead of any
        later call on this backend (see `sync_export`): the weights may change as soon as this returns; and return a
        call that finishes writing `out_dir` (waiting for the writing where it runs elsewhere). Default: the whole
        export now, nothing left to finish."""
        self.export_weights(out_dir, dtype)
        return lambda: None

    def export_adapter(self, out_dir: str | Path, dtype: str = "float32") -> str:
        """With LoRA, write the adapter as a PEFT adapter directory (`adapter_model.safetensors` under PEFT's tensor
        names + `adapter_config.json`), loadable by `peft.PeftModel.from_pretrained(base, out_dir)` and by vLLM's
        `/v1/load_lora_adapter`; returns `fa_digest.digest` of the tensors as written (names and dtype of the
        file). Collective on every rank, like export_weights. Raises when the backend trains no adapter."""
        raise NotImplementedError(f"the {type(self).__name__} training backend trains no LoRA adapter")

    def weight_sender(self) -> Any:
        """The sending side of the collective weight transport, run where the full weights are: an object with
        `plan()`, `listen(loopback, timeout_s)`, `form(group, world, backend, timeout_s)`, `send(buckets, dtype)` and
        `close()` (fully_async.weights.collective_sender.CollectiveSender's interface). Backends that cannot send raise."""
        from fully_async.config import ConfigError

        raise ConfigError(
            f"the {type(self).__name__} training backend cannot send weights collectively; use "
            "async_training.weight_transport=disk (or auto)"
        )

    @abstractmethod
    def save_checkpoint(self, path: str | Path, step: int) -> None:
        """Persist everything needed to resume identically (weights, optimizer, LR schedule, RNG, step)."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> int:
        """Restore a `save_checkpoint` directory; returns the step it was saved at."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and resources. Idempotent."""
