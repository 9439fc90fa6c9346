"""The model of a run: a directory or Hugging Face hub id (model.path; hub.py), a GGUF file converted once into a cached
directory (gguf.py; model=smollm2), or the tiny model and tokenizer the project builds itself for CPU runs and tests
(no download; tiny.py; its vision-language twin: tiny_vlm.py)."""

from fully_async.models import tiny
from fully_async.models.hub import resolve_pretrained
from fully_async.models.tiny import build_tiny_model, resolve_model_path, resolve_run_model
from fully_async.models.tiny_vlm import write_vlm

tiny.WRITERS["qwen2_vl"] = write_vlm

__all__ = ["build_tiny_model", "resolve_model_path", "resolve_pretrained", "resolve_run_model"]
