"""Simulated training backend (`trainer=sim`): the TrainingBackend contract with latencies instead of gradients.

Cost model (simulated seconds; wall seconds = simulated / trainer.sim.time_scale):
- update: optimizer_step_s x num_mini_batches x ppo_epochs (fixed per step: optimizer, gradient all-reduce, FSDP
  gathers that do not grow with tokens) + ppo_epochs x tokens / (train_tokens_per_s_per_gpu x gpus), plus a forward
  pass tokens / (logprob_tokens_per_s_per_gpu x gpus) for the proximal log-probs when the run is not in bypass mode (algorithm.rollout_correction) and one
  more for the reference model when it is used. Tokens are every prompt and response token of the batch.
- export_weights: model_gb / export_gb_per_s; it writes a small marker file, not weights.
Log-probs returned are the behaviour log-probs (the policy never changes). Checkpoints hold the step only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fully_async.protocol import flatten
from fully_async.training.base import TrainingBackend

if TYPE_CHECKING:
    from fully_async.config import AlgorithmConfig, TrainerConfig
    from fully_async.protocol import TrajectoryGroup


class SimBackend(TrainingBackend):
    def __init__(self, trainer: TrainerConfig, algorithm: AlgorithmConfig, use_reference: bool | None = None) -> None:
        self.cfg, self.sim, self.algorithm = trainer, trainer.sim, algorithm
        self.use_reference = algorithm.use_kl_loss if use_reference is None else use_reference
        self.step = 0
        self.busy_s = 0.0
        """Simulated seconds spent computing (updates, log-prob passes, exports)."""

    @property
    def world_size(self) -> int:
        return self.sim.gpus

    def _spend(self, sim_s: float) -> None:
        self.busy_s += sim_s
        time.sleep(sim_s / self.sim.time_scale)

    def _forward_s(self, tokens: int) -> float:
        return tokens / (self.sim.logprob_tokens_per_s_per_gpu * self.sim.gpus)

    def compute_log_probs(self, groups: Sequence[TrajectoryGroup], *, reference: bool = False) -> list[np.ndarray]:
        trajs = flatten(groups)
        self._spend(self._forward_s(sum(t.prompt_ids.size + t.response_ids.size for t in trajs)))
        return [t.behaviour_logprobs.copy() for t in trajs]

    def update(self, groups: Sequence[TrajectoryGroup], *, version: int | None = None) -> dict[str, float]:
        sim, cfg = self.sim, self.cfg
        tokens = sum(t.prompt_ids.size + t.response_ids.size for t in flatten(groups))
        train_s = cfg.ppo_epochs * (
            sim.optimizer_step_s * cfg.num_mini_batches + tokens / (sim.train_tokens_per_s_per_gpu * sim.gpus)
        )
        passes = int(not self.algorithm.bypass) + int(self.use_reference)
        logprob_s = passes * self._forward_s(tokens)
        self._spend(train_s + logprob_s)
        self.step += 1
        return {"sim/train_s": train_s, "sim/logprob_s": logprob_s, "sim/tokens": float(tokens)}

    def export_weights(self, out_dir: str | Path, dtype: str = "float32", *, sync: bool = False) -> list[Path]:
        self._spend(self.sim.model_gb / self.sim.export_gb_per_s)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        marker = out / "sim_weights.json"
        marker.write_text(json.dumps({"step": self.step, "dtype": dtype}))
        return [marker]

    def save_checkpoint(self, path: str | Path, step: int) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sim_backend.json").write_text(json.dumps({"step": step}))

    def load_checkpoint(self, path: str | Path) -> int:
        self.step = int(json.loads((Path(path) / "sim_backend.json").read_text())["step"])
        return self.step

    def shutdown(self) -> None:
        pass
