"""Training backends: verl's engine (FSDP2 / Megatron through `TrainingWorker`) and a simulated one (trainer=sim)."""

from fully_async.training.base import TrainingBackend
from fully_async.training.factory import build_backend

__all__ = ["TrainingBackend", "build_backend"]
