"""The verl backend: our driver over verl 0.9.1 `TrainingWorker` ranks in a `RayWorkerGroup`.

verl does the heavy lifting (FSDP2 sharding, token-budget micro-batches, AdamW, LR schedule, grad clipping,
checkpoints). This module translates our config into verl's config dataclasses, builds the worker groups (policy and
optional forward-only reference), turns TrajectoryGroups into engine batches and runs the decoupled-PPO step:

  pi_prox = infer_batch(policy)            (recompute_prox=true; else pi_prox = pi_behave, the bypass)
  w       = min(pi_prox / pi_behave, T)    (token or sequence level, verl's rollout-correction helper)
  loss    = verl ppo_loss: clip on pi_theta / pi_prox, weighted by w, + KL to pi_ref, - entropy bonus

Calls go through `execute_all_async` + `ray.get(timeout=...)` rather than the group's bound methods, so a dead or
stuck rank raises `TrainerTimeout` instead of hanging; the split over data-parallel ranks is done here with the rank
mapping verl's own dispatch uses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig
from fully_async.config.sections import NEEDS_CRITIC, NEEDS_PROX
from fully_async.protocol import TrajectoryGroup
from fully_async.training import batch as B
from fully_async.training.base import TrainingBackend

log = logging.getLogger(__name__)

_COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")  # fmt: skip
_STATE_FILE = "fully_async_backend.json"


class TrainerTimeout(RuntimeError):
    """A training rank did not answer within the call timeout."""


_NO_MODULE = "FullyAsyncNoSuchModule"


def _engine_configs(trainer: TrainerConfig, algorithm: AlgorithmConfig, model_path: str, cpu: bool):
    """verl config dataclasses for the policy: (TrainingWorkerConfig, actor config used by the loss).

    fsdp2 runs on CPU (float32, padded sequences, eager attention) and GPUs (bf16); megatron (GPU only) adds TP/PP/CP
    from the trainer config. Loss, dispatch and weight export are the same for both."""
    from verl.workers import config as vc

    megatron = trainer.strategy == "megatron"
    if megatron and cpu:
        raise ConfigError("trainer.strategy=megatron needs GPUs (megatron-core has no CPU path); use fsdp2 on CPU")
    model = vc.HFModelConfig(
        path=str(model_path),
        load_tokenizer=False,
        # eager on CPU: no flash-attn; SDPA's CPU kernels differ from the engine's by more than the 1e-4 we promise.
        override_config={"attn_implementation": "eager"} if cpu else {},
        # Packing sequences (remove-padding) pays off with flash-attn's varlen kernels; on CPU attention runs over the
        # whole packed length (quadratic in the micro-batch, not in each sequence): 3-4x slower on the benchmark.
        use_remove_padding=not cpu,
        enable_gradient_checkpointing=not cpu
        if trainer.gradient_checkpointing is None
        else trainer.gradient_checkpointing,
    )
    budget = {
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": trainer.max_token_len_per_gpu,
        "infer_max_token_len_per_gpu": trainer.max_token_len_per_gpu,
    }
    schedule = {
        "lr": trainer.lr,
        "weight_decay": trainer.weight_decay,
        "clip_grad": trainer.grad_clip,
        "lr_warmup_steps": trainer.lr_warmup_steps,
        "total_training_steps": trainer.total_steps,
    }
    if megatron:
        engine = vc.McoreEngineConfig(
            tensor_model_parallel_size=trainer.tensor_parallel_size,
            pipeline_model_parallel_size=trainer.pipeline_parallel_size,
            context_parallel_size=trainer.context_parallel_size,
            dtype="bfloat16",
            **budget,
        )
        optim = vc.McoreOptimizerConfig(lr_decay_style=trainer.lr_schedule, **schedule)
        actor_cls, placement = vc.McoreActorConfig, {"megatron": engine}
    else:
        precision = "fp32" if cpu else "bf16"
        units = trainer.fsdp_units
        if units == "auto":
            units = "model" if cpu and trainer.nnodes * trainer.n_gpus_per_node == 1 else "layers"
        engine = vc.FSDPEngineConfig(
            # verl's FSDP2 wrapping makes every module whose class is listed (default: the model's _no_split_modules)
            # a unit; a name no module has leaves the model as the one unit (untied embeddings still get their own).
            # `disable` keeps verl's FSDP1 wrap-policy builder, which it runs for FSDP2 too, from rejecting that name.
            wrap_policy={"disable": True, "transformer_layer_cls_to_wrap": [_NO_MODULE]} if units == "model" else {},
            strategy="fsdp2",
            use_torch_compile=not cpu,
            model_dtype="fp32",
            mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            **budget,
        )
        optim = vc.FSDPOptimizerConfig(lr_scheduler_type=trainer.lr_schedule, **schedule)
        actor_cls, placement = vc.FSDPActorConfig, {"strategy": "fsdp2", "fsdp_config": engine}
    actor = actor_cls(
        rollout_n=1,
        **_loss_configs(algorithm),
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=trainer.max_token_len_per_gpu,
        optim=optim,
        clip_ratio_low=algorithm.clip_ratio_low,
        clip_ratio_high=algorithm.clip_ratio_high,
        loss_agg_mode=algorithm.loss_agg_mode,
        entropy_coeff=algorithm.entropy_coeff,
        use_kl_loss=algorithm.use_kl_loss,
        kl_loss_coef=algorithm.kl_loss_coef,
        ppo_epochs=trainer.ppo_epochs,
        **placement,
    )
    twc = vc.TrainingWorkerConfig(
        model_type="language_model",
        model_config=model,
        engine_config=actor.engine,
        optimizer_config=actor.optim,
        checkpoint_config=actor.checkpoint,
    )
    return twc, actor


_ACTOR_LOSS_ARGS = ("tau_pos", "tau_neg", "clip_ratio_c")
"""algorithm.policy_loss_args that are fields of verl's ActorConfig (the rest are PolicyLossConfig fields)."""


def _loss_configs(algorithm: AlgorithmConfig) -> dict:
    """ActorConfig keyword arguments selecting verl's policy loss `algorithm.policy_loss` with its settings.
    bypass_mode reads its importance-weight settings from policy_loss.rollout_correction: ours."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    args = algorithm.policy_loss_args
    correction = RolloutCorrectionConfig(
        rollout_is=algorithm.rollout_is, rollout_is_threshold=algorithm.rollout_is_threshold
    )
    policy_loss = PolicyLossConfig(
        loss_mode=algorithm.policy_loss,
        rollout_correction=correction,
        **{k: v for k, v in args.items() if k not in _ACTOR_LOSS_ARGS},
    )
    return {"policy_loss": policy_loss, **{k: v for k, v in args.items() if k in _ACTOR_LOSS_ARGS}}


def _critic_config(twc, trainer: TrainerConfig):
    """Engine config for the critic: the policy's model loaded as a value model (verl's `load_valuehead_model`: the
    LM head replaced by a one-output score head), the same engine and precision, its own AdamW at trainer.critic_lr (default: trainer.lr)."""
    from verl.workers.config import TrainingWorkerConfig

    optim = dataclasses.replace(twc.optimizer_config, lr=trainer.lr if trainer.critic_lr is None else trainer.critic_lr)
    return TrainingWorkerConfig(
        model_type="value_model",
        model_config=dataclasses.replace(twc.model_config),
        engine_config=dataclasses.replace(twc.engine_config),
        optimizer_config=optim,
        checkpoint_config=twc.checkpoint_config,
    )


def _value_loss_config(trainer: TrainerConfig, algorithm: AlgorithmConfig):
    """verl's critic config as its `value_loss` reads it: the value clip and the loss aggregation."""
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(
        strategy="fsdp2",
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=trainer.max_token_len_per_gpu,
        cliprange_value=algorithm.value_clip,
        loss_agg_mode=algorithm.loss_agg_mode,
        ppo_epochs=trainer.ppo_epochs,
    )


def _reference_config(twc):
    """Forward-only engine config for the reference model: same model and precision, no optimizer."""
    from verl.workers.config import TrainingWorkerConfig

    return TrainingWorkerConfig(
        model_type=twc.model_type,
        model_config=twc.model_config,
        engine_config=dataclasses.replace(twc.engine_config, forward_only=True),
        optimizer_config=None,
        checkpoint_config=twc.checkpoint_config,
    )


class VerlBackend(TrainingBackend):
    """verl `TrainingWorker` ranks driven through Ray. See the module docstring for the update it performs."""

    def __init__(
        self,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        model_path: str | Path,
        *,
        temperature: float = 1.0,
        use_reference: bool | None = None,
        device: str | None = None,
        pad_token_id: int = 0,
        cpu_set: Sequence[int] | None = None,
        placement_groups: list | None = None,
    ):
        """`placement_groups`: the job's trainer groups (fully_async/placement.py), one per node, each with
        trainer.n_gpus_per_node bundles shared by the policy and the reference ranks; None = create them here."""
        from fully_async.host import device as run_device

        if not ray.is_initialized():
            raise RuntimeError("VerlBackend needs a running Ray (call ray.init first)")
        device = device or run_device(trainer.device)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.cpu = device == "cpu"
        self.trainer, self.algorithm = trainer, algorithm
        self.model_path = Path(model_path)
        self.temperature = float(temperature)
        self.timeout = trainer.call_timeout_s
        self.pad_token_id = pad_token_id
        self.cpu_set = sorted(int(c) for c in cpu_set) if cpu_set else None
        self.placement_groups = placement_groups
        self.step = 0
        if self.cpu:
            from fully_async.training import cpu_platform

            cpu_platform.use_in_this_process()
        use_reference = algorithm.use_kl_loss if use_reference is None else use_reference
        self.use_critic = algorithm.adv_estimator in NEEDS_CRITIC
        self._roles = 1 + bool(use_reference) + self.use_critic  # worker groups per bundle (placement.trainer_roles)
        if algorithm.use_kl_loss and not use_reference:
            raise ConfigError("algorithm.use_kl_loss=true needs the reference model (use_reference=true)")
        if use_reference and self.cpu:
            _require_patch(
                "0002-forward-only-engine-on-cpu", "verl.workers.engine.fsdp.transformer_impl", "offload_wanted"
            )
        twc, self.actor_config = _engine_configs(trainer, algorithm, str(model_path), self.cpu)
        self._groups = {}
        try:
            self._make_group("policy", twc)
            if use_reference:
                self._make_group("reference", _reference_config(twc))
            if self.use_critic:
                self._make_group("critic", _critic_config(twc, trainer))
            self.set_algorithm(algorithm)
        except BaseException:
            # Protects the Ray cluster from orphaned ranks when a later group fails to start; the error propagates.
            log.error("training backend failed to start; stopping the ranks already started")
            self.shutdown()
            raise

    def set_algorithm(self, algorithm: AlgorithmConfig) -> None:
        """Use `algorithm` (estimator, policy loss and their settings) from the next update on: the ranks get the
        loss function built from it. Model and optimizer are untouched (the estimator runs here, in the driver)."""
        from verl.workers.utils.losses import ppo_loss, value_loss

        if algorithm.adv_estimator in NEEDS_CRITIC and "critic" not in self._groups:
            raise ConfigError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} needs the critic, which this backend was built "
                "without (build the backend with that estimator)"
            )
        _, self.actor_config = _engine_configs(self.trainer, algorithm, str(self.model_path), self.cpu)
        self.algorithm = algorithm
        self._all("policy", "set_loss_fn", partial(ppo_loss, config=self.actor_config))
        if "critic" in self._groups:
            self._all("critic", "set_loss_fn", partial(value_loss, config=_value_loss_config(self.trainer, algorithm)))

    # ----------------------------------------------------------------- plumbing
    def _make_group(self, role: str, twc):
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from fully_async.training.verl_worker import FullyAsyncTrainingWorker

        n = self.trainer.n_gpus_per_node
        prefix = f"fa_{role}_{uuid.uuid4().hex[:6]}_"  # Ray actor names are global: unique per backend
        if self.placement_groups is not None:
            # The job's groups: every role's ranks share their bundles (one rank of each role per GPU, verl's
            # colocation), and the job, not this backend, frees them.
            pool = RayResourcePool(
                process_on_nodes=[n] * len(self.placement_groups), use_gpu=not self.cpu,
                max_colocate_count=self._roles, name_prefix=prefix,
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
        return wg

    def _wait(self, refs, what: str):
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise TrainerTimeout(f"{what}: no answer from the training ranks within {self.timeout:.0f} s") from e

    def _all(self, role: str, method: str, *args, **kwargs):
        return self._wait(self._groups[role].execute_all_async(method, *args, **kwargs), f"{role}.{method}")

    def _data_call(self, role: str, method: str, td) -> tuple[list, list]:
        """Split `td` evenly over data-parallel ranks (its size must be a multiple of the DP size; `dp_layout`
        guarantees it); returns (outputs of the collecting ranks, input chunks), both in data-parallel order."""
        from verl.utils import tensordict_utils as tu

        wg = self._groups[role]
        dp = max(wg.fa_dp_map) + 1
        chunks = tu.chunk_tensordict(td, dp) if dp > 1 else [td]
        outs = self._all(role, method, [chunks[r] for r in wg.fa_dp_map])
        by_dp = {}
        for rank, out in enumerate(outs):
            if wg.fa_collect[rank]:
                by_dp.setdefault(wg.fa_dp_map[rank], out)
        return [by_dp[d] for d in range(dp)], chunks

    @property
    def world_size(self) -> int:
        return self._groups["policy"].world_size

    @property
    def dp_size(self) -> int:
        return max(self._groups["policy"].fa_dp_map) + 1

    def _engine_td(self, batch: B.PaddedBatch, **extra: torch.Tensor):
        """Engine batch with the micro-batch token budget read from `self.trainer` at each call (so the budget can
        be changed between calls without rebuilding the workers)."""
        from verl.utils import tensordict_utils as tu

        budget = self.trainer.max_token_len_per_gpu
        longest = int(batch.attention_mask.sum(-1).max())
        if longest > budget:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds trainer.max_token_len_per_gpu={budget}; raise the budget to "
                "at least data.max_prompt_length + rollout.response_length"
            )
        td = B.to_engine_td(batch, self.temperature, **extra)
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
        return td

    # ----------------------------------------------------------------- log-probs
    def _log_probs(self, role: str, batch: B.PaddedBatch, sum_pi_squared: bool = False):
        """(B, R) log-probs of `batch` (already laid out for DP) under `role`'s weights; with `sum_pi_squared`, the
        pair (log-probs, sum over the vocabulary of pi^2 per token) from the same forward pass."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._engine_td(batch)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, calculate_sum_pi_squared=sum_pi_squared)
        outs, chunks = self._data_call(role, "infer_batch", td)

        def gather(key: str) -> torch.Tensor:
            parts = [no_padding_2_padding(tu.get(o, key), c) for o, c in zip(outs, chunks, strict=True)]
            return torch.cat(parts, dim=0).float()

        return (gather("log_probs"), gather("sum_pi_squared")) if sum_pi_squared else gather("log_probs")

    def _values(self, batch: B.PaddedBatch) -> torch.Tensor:
        """(B, R) critic values of `batch` (laid out for DP): V(state before each response token)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._engine_td(batch)
        tu.assign_non_tensor(td, compute_loss=False)
        outs, chunks = self._data_call("critic", "infer_batch", td)
        parts = [no_padding_2_padding(tu.get(o, "values"), c) for o, c in zip(outs, chunks, strict=True)]
        return torch.cat(parts, dim=0).float()

    def compute_values(self, groups: Sequence[TrajectoryGroup]) -> list[np.ndarray]:
        """The critic's value per response token, one float32 array per trajectory in `flatten(groups)` order."""
        if "critic" not in self._groups:
            raise RuntimeError("this backend was built without a critic")
        full = B.assemble(groups, self.pad_token_id)
        rows, _ = B.dp_layout(full.size, self.dp_size, 1)
        laid = full.select(rows)
        values = self._values(laid)
        out: list[np.ndarray] = [None] * full.size  # type: ignore[list-item]
        for k, src in enumerate(laid.source):
            if src >= 0:
                out[src] = values[k, : int(laid.response_lengths[k])].numpy().copy()
        return out

    def compute_log_probs(self, groups: Sequence[TrajectoryGroup], *, reference: bool = False) -> list[np.ndarray]:
        role = "reference" if reference else "policy"
        if role not in self._groups:
            raise RuntimeError("this backend was built without a reference model")
        full = B.assemble(groups, self.pad_token_id)
        rows, _ = B.dp_layout(full.size, self.dp_size, 1)
        laid = full.select(rows)
        lp = self._log_probs(role, laid)
        out: list[np.ndarray] = [None] * full.size  # type: ignore[list-item]
        lengths = laid.response_lengths
        for k, src in enumerate(laid.source):
            if src >= 0:
                out[src] = lp[k, : int(lengths[k])].numpy().copy()
        return out

    # ----------------------------------------------------------------- update
    def update(self, groups: Sequence[TrajectoryGroup], *, version: int | None = None) -> dict[str, float]:
        from verl.utils import tensordict_utils as tu

        t0 = time.perf_counter()
        full = B.assemble(groups, self.pad_token_id)
        algo = self.algorithm
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
        extra: dict[str, torch.Tensor] = {}
        mask = laid.response_mask.bool()
        t1 = time.perf_counter()
        by_prox: dict[str, torch.Tensor] = {}  # inputs of the estimator that come from the proximal pass, full order
        if algo.recompute_prox:
            otb = algo.adv_estimator in NEEDS_PROX
            prox = self._log_probs("policy", laid, sum_pi_squared=otb)
            if otb:
                prox, spsq = prox
                by_prox["sum_pi_squared"] = _unlay(spsq, laid.source, full.size)
            weights, corr = B.importance_weights(
                prox, laid.behaviour_logprobs, mask, algo.rollout_is, algo.rollout_is_threshold
            )
            extra["rollout_is_weights"] = weights * laid.response_mask
            metrics.update(corr)
            by_prox["old_log_probs"] = _unlay(prox, laid.source, full.size)
            by_prox["rollout_is_weights"] = _unlay(extra["rollout_is_weights"], laid.source, full.size)
        else:  # bypass: pi_prox is the behaviour policy, so the importance weight is 1
            prox = laid.behaviour_logprobs
        extra["old_log_probs"] = prox
        # Advantages over the real rows in `flatten` order (batch-level estimators must not see the padding rows).
        critic_td = None
        if "critic" in self._groups:
            # GAE with the critic as it is now (before this step's update) on these trajectories, whichever policy
            # sampled them (docs/algorithms.md, "PPO with a critic under staleness").
            laid_values = self._values(laid) * laid.response_mask
            values = _unlay(laid_values, laid.source, full.size)
            advantages, returns = B.gae(full, values, algo.gamma, algo.lam)
            metrics.update(B.value_metrics(values, returns, full.response_mask))
            laid_returns = returns[torch.from_numpy(np.where(rows < 0, 0, rows))] * laid.response_mask
            critic_td = self._engine_td(laid, values=laid_values, returns=laid_returns)
        else:
            components = B.reward_components(groups, algo.gdpo_reward_keys) if algo.adv_estimator == "gdpo" else None
            owners = B.sample_owners(groups)  # rows split off one sample share its advantage
            advantages = B.compute_advantages(full, algo, components=components, owners=owners, **by_prox)
        extra["advantages"] = (advantages[torch.from_numpy(np.where(rows < 0, 0, rows))] * laid.response_mask).float()
        if "reference" in self._groups and algo.use_kl_loss:
            extra["ref_log_prob"] = self._log_probs("reference", laid)
        t2 = time.perf_counter()
        td = self._engine_td(laid, **extra)
        schedule = dict(
            # Used by the seq-mean loss modes only: sequences per global mini-batch (exact when the batch divides
            # evenly into mini-batches; dp_layout spreads the rows so they differ by at most the DP size).
            global_batch_size=full.size / num_mini,
            num_mini_batch=num_mini,
            epochs=self.trainer.ppo_epochs,
            seed=self.step,
            compute_loss=True,
        )
        tu.assign_non_tensor(td, calculate_entropy=algo.entropy_coeff > 0, **schedule)
        outs, _ = self._data_call("policy", "train_mini_batch", td)
        t3 = time.perf_counter()
        if critic_td is not None:  # the critic's step on the same mini-batches, towards this batch's returns
            tu.assign_non_tensor(critic_td, **schedule)
            critic_outs, _ = self._data_call("critic", "train_mini_batch", critic_td)
            for key, value in tu.get(critic_outs[0], "metrics").items():
                metrics[key if key.startswith("critic/") else f"critic/{key}"] = _mean(value)
        t4 = time.perf_counter()
        metrics.update({"timing_s/prepare": t1 - t0, "timing_s/log_probs": t2 - t1, "timing_s/train": t4 - t2})
        if critic_td is not None:
            metrics["timing_s/critic_train"] = t4 - t3  # part of timing_s/train
        for key, value in tu.get(outs[0], "metrics").items():
            metrics[key if "/" in key else f"actor/{key}"] = _mean(value)
        self.step += 1
        metrics["trainer/step"] = float(self.step)
        return metrics

    # ----------------------------------------------------------------- weights and state
    def export_weights(self, out_dir: str | Path, dtype: str = "float32") -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for old in list(out.glob("model-*.safetensors")) + list(out.glob("model.safetensors*")):
            old.unlink()
        bucket = self.trainer.weight_bucket_mb << 20
        files = next(f for f in self._all("policy", "export_weights", str(out), dtype, bucket) if f is not None)
        for name in _COPY_FILES:
            src = self.model_path / name
            if src.exists() and not (out / name).exists():
                shutil.copy2(src, out / name)
        return [out / f for f in files]

    def weight_sender(self) -> _VerlSender:
        """The policy's rank 0 sends (the collective transport); every rank takes part in gathering each tensor."""
        return _VerlSender(self)

    def save_checkpoint(self, path: str | Path, step: int | None = None) -> None:
        path = Path(path)
        step = self.step if step is None else step
        self._all("policy", "save_checkpoint", str(path), None, step, None)
        if "critic" in self._groups:
            self._all("critic", "save_checkpoint", str(path / "critic"), None, step, None)
        state = {"step": step, "world_size": self.world_size, "critic": "critic" in self._groups}
        (path / _STATE_FILE).write_text(json.dumps(state))

    def load_checkpoint(self, path: str | Path) -> int:
        path = Path(path)
        state_file = path / _STATE_FILE
        if not state_file.exists():
            raise FileNotFoundError(f"{path} is not a training-backend checkpoint (no {_STATE_FILE})")
        state = json.loads(state_file.read_text())
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by {state['world_size']} ranks; this backend has {self.world_size}"
            )
        if state.get("critic", False) != ("critic" in self._groups):
            raise ValueError(
                f"checkpoint {path} was written {'with' if state.get('critic') else 'without'} a critic; this backend "
                f"has {'one' if 'critic' in self._groups else 'none'} (algorithm.adv_estimator must match the run's)"
            )
        self._all("policy", "load_checkpoint", str(path), None, False)
        if "critic" in self._groups:
            self._all("critic", "load_checkpoint", str(path / "critic"), None, False)
        self.step = int(state["step"])
        return self.step

    def where(self) -> list[dict]:
        """Per policy rank: node id, pid and CUDA_VISIBLE_DEVICES (what the placement plan promised)."""
        return self._all("policy", "where")

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


class _VerlSender:
    """CollectiveSender's interface over the policy ranks (verl_worker.FullyAsyncTrainingWorker.weights_*)."""

    def __init__(self, backend: VerlBackend) -> None:
        self.backend = backend

    def _rank0(self, method: str, *args):
        return self.backend._all("policy", method, *args)[0]

    def plan(self) -> list:
        return self._rank0("weights_plan")

    def listen(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        host, port = self._rank0("weights_listen", loopback, timeout_s)
        return host, int(port)

    def form(self, group: str, world: int, backend: str, timeout_s: float) -> None:
        self._rank0("weights_form", group, world, backend, timeout_s)

    def send(self, buckets: list, dtype: str) -> dict:
        return self._rank0("weights_send", json.dumps(buckets), dtype)

    def close(self) -> None:
        if "policy" in self.backend._groups:
            self.backend._all("policy", "weights_close")


def _require_patch(name: str, module: str, marker: str) -> None:
    """Fail early, with the fix, when a verl patch this configuration depends on is not installed."""
    import importlib
    import inspect

    if marker not in inspect.getsource(importlib.import_module(module)):
        raise RuntimeError(
            f"verl patch patches/{name}.patch is not applied to the installed verl (needed here); "
            "run scripts/apply_verl_patches.sh"
        )


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
