"""The verl backend: our driver over verl 0.9.1 `TrainingWorker` ranks in a `RayWorkerGroup`.

verl does the heavy lifting (FSDP2 sharding, token-budget micro-batches, AdamW, LR schedule, grad clipping,
checkpoints). This module translates our config into verl's config dataclasses, builds the worker groups (policy and
optional forward-only reference), turns TrajectoryGroups into engine batches and runs the decoupled-PPO step:

  pi_prox = infer_batch(policy)            (decoupled; in bypass mode pi_prox = pi_behave, no forward pass)
  w       = IS weight x rejection mask     (algorithm.rollout_correction through verl's helper: training/correction.py)
  loss    = verl ppo_loss: clip on pi_theta / pi_prox, weighted by w, + KL to pi_ref, - entropy bonus

Calls go through `execute_all_async` + `ray.get(timeout=...)` rather than the group's bound methods, so a dead or
stuck rank raises `TrainerTimeout` instead of hanging; the split over data-parallel ranks is done here with the rank
mapping verl's own dispatch uses.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig
from fully_async.config.sections import NEEDS_CRITIC, NEEDS_PROX
from fully_async.config.sections.distill import DistillConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.multimodal.processor import VisionProcessor, is_vision_model
from fully_async.protocol import TrajectoryGroup
from fully_async.training import batch as B
from fully_async.training import correction, hf_files, hf_names
from fully_async.training.base import TrainingBackend
from fully_async.training.distill_loss import distill_advantages
from fully_async.training.sampling_support import SamplingSupport
from fully_async.training.verl_config import critic_config, engine_configs, reference_config, value_loss_config
from fully_async.training.verl_forward import RankForward
from fully_async.training.verl_ranks import RankGroups, TrainerTimeout, WeightSender
from fully_async.weights.base import SyncPlan, queued_export

__all__ = ["TrainerTimeout", "VerlBackend"]

log = logging.getLogger(__name__)

_STATE_FILE = "fully_async_backend.json"


class VerlBackend(TrainingBackend):
    """verl `TrainingWorker` ranks driven through Ray. See the module docstring for the update it performs."""

    def __init__(
        self,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        model_path: str | Path,
        *,
        temperature: float = 1.0,
        support: SamplingSupport | None = None,
        use_reference: bool | None = None,
        device: str | None = None,
        pad_token_id: int = 0,
        cpu_set: Sequence[int] | None = None,
        placement_groups: list | None = None,
        lora: LoraConfig | None = None,
        freeze_vision_tower: bool = True,
        distill: DistillConfig | None = None,
    ):
        """`placement_groups`: the job's trainer groups (fully_async/placement.py), one per node, each with
        trainer.n_gpus_per_node bundles shared by the policy and the reference ranks; None = create them here.
        `lora` (model.lora) enabled: the policy trains a LoRA adapter over the frozen model (docs/lora.md).
        `freeze_vision_tower` (model.freeze_vision_tower): a vision-language policy's tower does not train and no sync
        sends it (training/vision_tower.py). `support`: the log-probs' top-k / nucleus (training/sampling_support.py).
        `distill` enabled: the advantages mix in the teacher's (`_estimated`)."""
        from fully_async.device import device as run_device

        if not ray.is_initialized():
            raise RuntimeError("VerlBackend needs a running Ray (call ray.init first)")
        device = device or run_device(trainer.device)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.cpu = device == "cpu"
        self.trainer, self.algorithm = trainer, algorithm
        self.model_path = Path(model_path)
        self.pad_token_id = pad_token_id
        self.vision = VisionProcessor(self.model_path) if is_vision_model(self.model_path) else None
        """The vision processor of a vision-language model (the batches' pixel inputs), else None."""
        self.lora = lora if lora is not None and lora.enabled else None
        self.distill = distill if distill is not None and distill.enable else None
        self.step = 0
        if self.cpu:
            from fully_async.training import cpu_platform

            cpu_platform.use_in_this_process()
        use_reference = algorithm.use_kl_loss if use_reference is None else use_reference
        self.use_critic = algorithm.adv_estimator in NEEDS_CRITIC
        if algorithm.use_kl_loss and not use_reference:
            raise ConfigError("algorithm.use_kl_loss=true needs the reference model (use_reference=true)")
        _require_patches(algorithm, bool(use_reference), self.cpu)
        twc, self.actor_config = engine_configs(trainer, algorithm, str(model_path), self.cpu, self.lora)
        roles = 1 + bool(use_reference) + self.use_critic  # worker groups per bundle (placement.trainer_roles)
        self.ranks = RankGroups(trainer, self.cpu, roles, cpu_set, placement_groups)
        self.forward = RankForward(self.ranks, lambda: self.trainer.max_token_len_per_gpu, float(temperature),
                                   pad_token_id, self.vision, support)  # fmt: skip
        self._start_ranks(twc, use_reference, freeze_vision_tower and self.vision is not None)

    def _start_ranks(self, twc, use_reference: bool, freeze_vision_tower: bool) -> None:
        """Start the worker groups (policy, then reference and critic when wanted) and give them the loss."""
        try:
            self.ranks.start("policy", twc, lora_dropout=self.lora.dropout if self.lora else 0.0,
                             freeze_vision_tower=freeze_vision_tower)  # fmt: skip
            if use_reference:
                self.ranks.start("reference", reference_config(twc))
            if self.use_critic:
                self.ranks.start("critic", critic_config(twc, self.trainer))
            self.set_algorithm(self.algorithm)
        except BaseException:
            # Protects the Ray cluster from orphaned ranks when a later group fails to start; the error propagates.
            log.error("training backend failed to start; stopping the ranks already started")
            self.shutdown()
            raise

    def set_algorithm(self, algorithm: AlgorithmConfig) -> None:
        """Use `algorithm` (estimator, policy loss and their settings) from the next update on: the ranks get the
        loss function built from it. Model and optimizer are untouched (the estimator runs here, in the driver)."""
        from verl.workers.utils.losses import ppo_loss, value_loss

        if algorithm.adv_estimator in NEEDS_CRITIC and "critic" not in self.ranks:
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} needs the critic, which this backend was built "
                "without (build the backend with that estimator)"
            )
        _require_patches(algorithm, False, self.cpu)
        _, self.actor_config = engine_configs(self.trainer, algorithm, str(self.model_path), self.cpu, self.lora)
        self.algorithm = algorithm
        self.ranks.call_all("policy", "set_loss_fn", partial(ppo_loss, config=self.actor_config))
        if "critic" in self.ranks:
            self.ranks.call_all(
                "critic", "set_loss_fn", partial(value_loss, config=value_loss_config(self.trainer, algorithm))
            )

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def dp_size(self) -> int:
        return self.ranks.dp_size

    def compute_values(self, groups: Sequence[TrajectoryGroup]) -> list[np.ndarray]:
        """The critic's value per response token, one float32 array per trajectory in `flatten(groups)` order."""
        if "critic" not in self.ranks:
            raise RuntimeError("this backend was built without a critic")
        return self.forward.per_trajectory(groups, self.forward.values)

    def compute_log_probs(self, groups: Sequence[TrajectoryGroup], *, reference: bool = False) -> list[np.ndarray]:
        role = "reference" if reference else "policy"
        if role not in self.ranks:
            raise RuntimeError("this backend was built without a reference model")
        return self.forward.per_trajectory(groups, partial(self.forward.log_probs, role))

    # ----------------------------------------------------------------- update
    def update(self, groups: Sequence[TrajectoryGroup], *, version: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        full = B.assemble(groups, self.pad_token_id, self.vision)
        metrics: dict[str, float] = {"batch/trajectories": float(full.size), "batch/groups": float(len(groups))}
        if version is not None:
            metrics.update(B.version_metrics(full, version))
        tokens = int(full.response_mask.sum())
        metrics["batch/loss_tokens"] = float(tokens)
        if tokens == 0:  # nothing to learn from; verl would divide by zero
            self.step += 1
            metrics["trainer/skipped"] = 1.0
            return metrics
        rows, num_mini = B.dp_layout(full.size, self.dp_size, self.trainer.num_mini_batches)
        laid = full.select(rows)
        t1 = time.perf_counter()
        extra, by_prox = self._proximal(laid, full.size, version, metrics)
        critic_td = self._advantages(groups, full, laid, rows, extra, by_prox, metrics, version)
        if "reference" in self.ranks and self.algorithm.use_kl_loss:
            extra["ref_log_prob"] = self.forward.log_probs("reference", laid)
        t2 = time.perf_counter()
        actor, critic_s = self._train(laid, extra, critic_td, full.size / num_mini, num_mini, metrics)
        metrics.update({"timing_s/prepare": t1 - t0, "timing_s/log_probs": t2 - t1})
        metrics["timing_s/train"] = time.perf_counter() - t2
        if critic_td is not None:
            metrics["timing_s/critic_train"] = critic_s  # part of timing_s/train
        metrics.update(actor)
        self.step += 1
        metrics["trainer/step"] = float(self.step)
        return metrics

    def _proximal(self, laid: B.PaddedBatch, size: int, version: int | None, metrics: dict) -> tuple[dict, dict]:
        """The loss's inputs from pi_prox: (`extra`: old_log_probs and the rollout-correction weights, laid out;
        `by_prox`: the estimator's inputs from the same pass, in `flatten` order). In bypass mode pi_prox is the
        behaviour policy (verl's bypass_mode loss weighs and rejects per micro-batch) and no pass runs."""
        algo = self.algorithm
        extra: dict[str, torch.Tensor] = {}
        by_prox: dict[str, torch.Tensor] = {}
        if algo.bypass:
            extra["old_log_probs"] = laid.behaviour_logprobs
            return extra, by_prox
        mask = laid.response_mask.bool()
        otb = algo.adv_estimator in NEEDS_PROX
        prox = self.forward.log_probs("policy", laid, sum_pi_squared=otb)
        if otb:
            prox, spsq = prox
            by_prox["sum_pi_squared"] = _unlay(spsq, laid.source, size)
        weights, corr = correction.correct(
            prox, laid.behaviour_logprobs, mask, algo.rollout_correction, laid.group_index
        )
        metrics.update(corr)
        metrics.update(correction.diagnostics(prox, laid.behaviour_logprobs, mask, laid.token_versions, version,
                                              laid.cache_versions))  # fmt: skip
        if weights is not None:
            extra["rollout_is_weights"] = weights * laid.response_mask
            by_prox["rollout_is_weights"] = _unlay(extra["rollout_is_weights"], laid.source, size)
        by_prox["old_log_probs"] = _unlay(prox, laid.source, size)
        extra["old_log_probs"] = prox
        return extra, by_prox

    def _advantages(self, groups, full, laid, rows, extra, by_prox, metrics, version=None):
        """Advantages over the real rows in `flatten` order (batch-level estimators must not see the padding rows),
        laid out into `extra`; returns the critic's engine batch (values and returns) when there is a critic."""
        algo = self.algorithm
        critic_td = None
        if "critic" in self.ranks:
            # GAE with the critic as it is now (before this step's update) on these trajectories, whichever policy
            # sampled them (docs/algorithms.md, "PPO with a critic under staleness").
            laid_values = self.forward.values(laid) * laid.response_mask
            values = _unlay(laid_values, laid.source, full.size)
            advantages, returns = B.gae(full, values, algo.gamma, algo.lam)
            metrics.update(B.value_metrics(values, returns, full.response_mask))
            laid_returns = returns[torch.from_numpy(np.where(rows < 0, 0, rows))] * laid.response_mask
            critic_td = self.forward.engine_td(laid, values=laid_values, returns=laid_returns)
        else:
            advantages = _estimated(groups, full, algo, by_prox, self.distill, version, metrics)
        extra["advantages"] = (advantages[torch.from_numpy(np.where(rows < 0, 0, rows))] * laid.response_mask).float()
        return critic_td

    def _train(self, laid, extra, critic_td, mini_size: float, num_mini: int, metrics: dict[str, float]):
        """The policy's optimizer steps on `laid` with the loss inputs `extra`, then the critic's on the same
        mini-batches (with `critic_td`; its metrics into `metrics`); returns (the policy's metrics, the critic's
        seconds)."""
        from verl.utils import tensordict_utils as tu

        td = self.forward.engine_td(laid, **extra)
        schedule = dict(
            # Used by the seq-mean loss modes only: sequences per global mini-batch (exact when the batch divides
            # evenly into mini-batches; dp_layout spreads the rows so they differ by at most the DP size).
            global_batch_size=mini_size,
            num_mini_batch=num_mini,
            epochs=self.trainer.ppo_epochs,
            seed=self.step,
            compute_loss=True,
        )
        tu.assign_non_tensor(td, calculate_entropy=self.algorithm.entropy_coeff > 0, **schedule)
        outs, _ = self.ranks.data_call("policy", "train_mini_batch", td)
        t0 = time.perf_counter()
        if critic_td is not None:  # the critic's step on the same mini-batches, towards this batch's returns
            tu.assign_non_tensor(critic_td, **schedule)
            critic_outs, _ = self.ranks.data_call("critic", "train_mini_batch", critic_td)
            for key, value in tu.get(critic_outs[0], "metrics").items():
                metrics[key if key.startswith("critic/") else f"critic/{key}"] = _mean(value)
        critic_s = time.perf_counter() - t0
        actor = {
            key if "/" in key else f"actor/{key}": _mean(value) for key, value in tu.get(outs[0], "metrics").items()
        }
        return actor, critic_s

    # ----------------------------------------------------------------- weights and state
    def export_weights(self, out_dir: str | Path, dtype: str = "float32", *, sync: bool = False) -> list[Path]:
        out = Path(out_dir)
        bucket = self.trainer.weight_bucket_mb << 20
        # The HF export writes the checkpoint's names (training/hf_names.py); a sync keeps the module's.
        names = None if sync else hf_names.model_type([self.model_path])
        answers = self.ranks.call_all("policy", "export_weights", str(out), dtype, bucket, sync, names)
        files = next(f for f in answers if f is not None)
        hf_files.copy_model_files([self.model_path], out)
        return [out / f for f in files]

    def sync_export(self, out_dir: Path, dtype: str = "float32") -> SyncPlan:  # the ranks' copy queued, then written
        return queued_export(self.stage_weights, out_dir, dtype)

    def stage_weights(self, out_dir: str | Path, dtype: str = "float32") -> Callable[[], None]:
        """Sends the policy's ranks the copy of the weights into host memory and returns at once: each rank runs it
        before any call sent after it (the next update's), so the copy holds the weights as they are now; rank 0 then
        writes `out_dir` from the copy in a thread of its own while the next update runs. The returned call waits
        for the copy and the directory (each at most trainer.call_timeout_s, raising rank 0's reason when the write
        failed) and adds the model's files."""
        out = Path(out_dir)
        refs = self.ranks.send_all("policy", "stage_export", str(out), dtype, self.trainer.weight_bucket_mb << 20)

        def finish() -> None:
            self.ranks.wait_all(refs, "policy.stage_export")
            hf_files.wait_for_staged(out, self.ranks.timeout)
            hf_files.copy_model_files([self.model_path], out)

        return finish

    def export_adapter(self, out_dir: str | Path, dtype: str = "float32") -> str:
        if self.lora is None:
            raise RuntimeError("export_adapter needs LoRA training (model.lora.rank > 0); this backend trains in full")
        answers = self.ranks.call_all("policy", "export_adapter", str(out_dir), dtype, str(self.model_path))
        return next(d for d in answers if d is not None)

    def weight_sender(self) -> WeightSender:
        """The policy's rank 0 sends (the collective transport); every rank takes part in gathering each tensor."""
        return WeightSender(self.ranks)

    def save_checkpoint(self, path: str | Path, step: int | None = None) -> None:
        path = Path(path)
        step = self.step if step is None else step
        self.ranks.call_all("policy", "save_checkpoint", str(path), None, step, None)
        if "critic" in self.ranks:
            self.ranks.call_all("critic", "save_checkpoint", str(path / "critic"), None, step, None)
        state = {"step": step, "world_size": self.world_size, "critic": "critic" in self.ranks}
        (path / _STATE_FILE).write_text(json.dumps(state))

    def load_checkpoint(self, path: str | Path) -> int:
        path = Path(path)
        state_file = path / _STATE_FILE
        if not state_file.exists():
            raise FileNotFoundError(f"{path} is not a training-backend checkpoint (no {_STATE_FILE})")
        state = json.loads(state_file.read_text())
        if state.get("critic", False) != ("critic" in self.ranks):
            raise ValueError(
                f"checkpoint {path} was written {'with' if state.get('critic') else 'without'} a critic; this backend "
                f"has {'one' if 'critic' in self.ranks else 'none'} (algorithm.adv_estimator must match the run's)"
            )
        if state["world_size"] == self.world_size:
            load = ("load_checkpoint", None, False)
        else:  # every rank reads all the old shards and keeps its new one (fully_async/training/hf_files.py)
            log.info("checkpoint %s was written by %d ranks; resharding it to %d", path, state["world_size"],
                     self.world_size)  # fmt: skip
            load = ("load_checkpoint_resharded",)
        self.ranks.call_all("policy", load[0], str(path), *load[1:])
        if "critic" in self.ranks:
            self.ranks.call_all("critic", load[0], str(path / "critic"), *load[1:])
        self.step = int(state["step"])
        return self.step

    def where(self) -> list[dict]:
        """Per policy rank: node id, pid and CUDA_VISIBLE_DEVICES (what the placement plan promised)."""
        return self.ranks.call_all("policy", "where")

    def shutdown(self) -> None:
        self.ranks.shutdown()


def _require_patches(algorithm: AlgorithmConfig, use_reference: bool, cpu: bool) -> None:
    """The verl patches this configuration depends on: 0002 for a reference model on CPU; 0008 where rejection
    meets an entropy bonus or a KL loss (unpatched, both would still count the rejected tokens)."""
    if use_reference and cpu:
        _require_patch("0002-forward-only-engine-on-cpu", "verl.workers.engine.fsdp.transformer_impl", "offload_wanted")
    if algorithm.rollout_correction.rejects() and (algorithm.entropy_coeff > 0 or algorithm.use_kl_loss):
        _require_patch(
            "0008-entropy-and-kl-over-kept-tokens", "verl.workers.utils.losses", "_kept_by_rollout_correction"
        )


def _require_patch(name: str, module: str, marker: str) -> None:
    """Fail early, with the fix, when a verl patch this configuration depends on is not installed."""
    import importlib
    import inspect

    if marker not in inspect.getsource(importlib.import_module(module)):
        raise RuntimeError(
            f"verl patch patches/{name}.patch is not applied to the installed verl (needed here); "
            "run scripts/apply_verl_patches.sh"
        )


def _estimated(groups, full: B.PaddedBatch, algo: AlgorithmConfig, by_prox: dict, distill: DistillConfig | None,
               version: int | None, metrics: dict) -> torch.Tensor:  # fmt: skip
    """The estimator's advantages of the task reward over `full` (rows split off one sample share their sample's),
    with the teacher's per-token signal mixed in by distill.coef when distillation is on (training/distill_loss.py,
    taken against pi_prox from `by_prox`; its metrics into `metrics`)."""
    components = B.reward_components(groups, algo.gdpo_reward_keys) if algo.adv_estimator == "gdpo" else None
    owners = B.sample_owners(groups)
    advantages = B.compute_advantages(full, algo, components=components, owners=owners, **by_prox)
    if distill is None:
        return advantages
    centre = (full.group_index, owners) if distill.baseline == "group" else None
    advantages, distilled = distill_advantages(advantages, full.teacher_logprobs, full.behaviour_logprobs,
                                               full.response_mask, full.token_versions, distill.coef,
                                               distill.discount, version, student=by_prox.get("old_log_probs"),
                                               groups=centre)  # fmt: skip
    metrics.update(distilled)
    return advantages


def _unlay(laid: torch.Tensor, source: np.ndarray, size: int) -> torch.Tensor:
    """Rows of a DP-laid-out (B, R) tensor back in `flatten` order (padding rows left out)."""
    out = torch.zeros((size, laid.shape[1]), dtype=laid.dtype)
    real = torch.from_numpy(source >= 0)
    out[torch.from_numpy(source[source >= 0])] = laid[real]
    return out


def _mean(value) -> float:
    if isinstance(value, list | tuple):
        vals = [_mean(v) for v in value]
        return float(sum(vals) / len(vals)) if vals else float("nan")
    if hasattr(value, "item"):
        return float(value.item())
    return float(value)
