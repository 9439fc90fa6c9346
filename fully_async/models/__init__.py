"""Models the project builds itself (no download): the tiny model and tokenizer for CPU runs and tests."""

from fully_async.models.tiny import build_tiny_model, resolve_model_path, resolve_run_model

__all__ = ["build_tiny_model", "resolve_model_path", "resolve_run_model"]
