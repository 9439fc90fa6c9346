"""Inference engines behind one interface: `build_engine` gives an `EngineServers` pool, `EngineClient` talks to it.
Which module holds what: docs/engines.md (the table at the top).

servers = build_engine(cfg.engine, resolve_model_path(cfg.model), run_dir)
servers.start()                                   # blocks until every server is healthy
client = EngineClient(servers)
out = await client.generate(prompt_ids, cfg.rollout.response_length, Sampling.from_rollout(cfg.rollout))
await servers.pause("abort"); await servers.load_weights(weights_dir, version); await servers.resume()
await client.close(); servers.stop()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fully_async.config import ConfigError, EngineConfig
from fully_async.engines.base import EngineKind
from fully_async.engines.client import EngineClient
from fully_async.engines.errors import EngineError
from fully_async.engines.pool import EngineServers
from fully_async.engines.types import GenerationResult, Sampling

__all__ = [
    "EngineClient", "EngineError", "EngineServers", "GenerationResult", "Sampling", "build_engine", "kind_class", "logprobs_truncated",
]  # fmt: skip


def kind_class(kind: str) -> type[EngineKind]:
    """The EngineKind class of engine.kind=`kind` (its class-level capabilities: logprobs_truncated, takes_images),
    imported only for that kind."""
    if kind == "vllm":
        from fully_async.engines.vllm import VLLMKind

        return VLLMKind
    if kind == "sglang":
        from fully_async.engines.sglang import SGLangKind

        return SGLangKind
    if kind == "sim":
        from fully_async.engines.sim import SimKind

        return SimKind
    raise ConfigError(f"engine.kind must be one of ['vllm', 'sglang', 'sim'], got {kind!r}")


def logprobs_truncated(kind: str) -> bool:
    """Whether engine.kind=`kind` returns behaviour log-probs of the top-k / nucleus-truncated distribution
    (EngineKind.logprobs_truncated): the trainer's log-probs then repeat the truncation."""
    return kind_class(kind).logprobs_truncated


def build_engine(
    cfg: EngineConfig,
    model_path: str | Path,
    run_dir: str | Path,
    addresses: list[str] | None = None,
    hosts: list | None = None,
    device: str | None = None,
    lora: Any = None,
) -> EngineServers:
    """An unstarted server pool of kind cfg.kind (call start(); or pass addresses of servers already running).
    `hosts`: EngineHost actors that run the servers on their nodes (engines/host.py); `device`: cuda | cpu;
    `lora` (a LoraServing): the servers serve versioned LoRA adapters (vLLM, SGLang on GPUs). vLLM servers always
    start with the weight receiver (the worker extension every reload goes through, whatever the transport)."""
    if cfg.kind == "sim":
        from fully_async.engines.sim import SimKind

        if addresses is not None:
            raise EngineError("engine=sim emulates its servers in this process; it cannot attach to addresses")
        sim = SimKind(cfg, model_path, device)
        return EngineServers(sim, run_dir, addresses=sim.urls)
    kind: EngineKind
    if cfg.kind == "vllm":
        from fully_async.engines.vllm import VLLMKind

        kind = VLLMKind(cfg, model_path, device, lora)
    elif cfg.kind == "sglang":
        from fully_async.engines.sglang import SGLangKind

        kind = SGLangKind(cfg, model_path, device, lora)
    else:
        raise ConfigError(f"engine.kind must be one of ['vllm', 'sglang', 'sim'], got {cfg.kind!r}")
    return EngineServers(kind, run_dir, addresses=addresses, hosts=hosts)
