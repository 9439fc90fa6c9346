"""Training backends: verl's engine (FSDP2 / Megatron through `TrainingWorker`) and, later, a simulated one."""

from fully_async.training.base import TrainingBackend, build_backend

__all__ = ["TrainingBackend", "build_backend"]
