"""build_backend: the training backend named by the config. Kept apart from base.py, which every backend imports, so
that no module imports one that imports it back; only verl's backend is imported on demand (it pulls torch, Ray
and verl, which the simulated backend and config tools do not need)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fully_async.config import AlgorithmConfig, ConfigError, TrainerConfig
from fully_async.config.sections.distill import DistillConfig
from fully_async.config.sections.model import LoraConfig, lora_on_sim
from fully_async.training.base import TrainingBackend
from fully_async.training.sampling_support import SamplingSupport
from fully_async.training.sim_backend import SimBackend


def build_backend(
    trainer: TrainerConfig,
    algorithm: AlgorithmConfig,
    model_path: str | Path,
    *,
    temperature: float = 1.0,
    support: SamplingSupport | None = None,
    use_reference: bool | None = None,
    device: str | None = None,
    cpu_set: Sequence[int] | None = None,
    placement_groups: list | None = None,
    lora: LoraConfig | None = None,
    freeze_vision_tower: bool = True,
    distill: DistillConfig | None = None,
) -> TrainingBackend:
    """Build the backend named by `trainer.backend` for the Hugging Face model at `model_path`.

    `temperature` is the rollout sampling temperature (log-probs are taken at the same one), `support` its top-k /
    nucleus truncation when the engine's log-probs are truncated (training/sampling_support.py). `use_reference`
    defaults to `algorithm.use_kl_loss`. `device` ("cpu" / "cuda") overrides `trainer.device`. `cpu_set`: on CPU,
    the cores the ranks are pinned to (the ones the engines do not use), None for all. `placement_groups`: the
    job's trainer groups (fully_async/placement.py); None = the backend reserves its own. `lora`: model.lora
    (rank 0 or None = full fine-tuning). `freeze_vision_tower`: model.freeze_vision_tower (vision-language models).
    `distill`: the distill section (enabled: the teacher's advantage is mixed in; verl backend only).
    Ray must already be initialised by the caller.
    """
    if trainer.backend == "verl":
        from fully_async.training.verl_backend import VerlBackend

        return VerlBackend(
            trainer,
            algorithm,
            model_path,
            temperature=temperature,
            support=support,
            use_reference=use_reference,
            device=device,
            cpu_set=cpu_set,
            placement_groups=placement_groups,
            lora=lora,
            freeze_vision_tower=freeze_vision_tower,
            distill=distill,
        )
    if trainer.backend == "sim":
        if lora is not None and lora.enabled:
            raise ConfigError(lora_on_sim(lora.rank))
        return SimBackend(trainer, algorithm, use_reference=use_reference)
    raise ConfigError(f"trainer.backend must be one of ['verl', 'sim'], got {trainer.backend!r}")
