"""The engine boundary: what an engine kind (vLLM, SGLang, sim) must say about itself, and nothing else.

`EngineKind` holds only what differs between kinds: the command line and environment of one server, the shape of a
token-level generate request and its response, the control-call shapes (pause, resume, reload, version, prefix
cache, rpc), the router in front of the servers if the kind has one. Everything the kinds share lives beside it, one
room per idea: `pool.py` (`EngineServers`: the servers' lifecycle and membership, one state per slot in `slots.py`),
`control.py` (`ControlPlane`: a control call fanned out to the serving servers within a deadline), `client.py`
(`EngineClient`: generation with abort/continue), `service.py` (what the Rollouter actor answers about its pool).
A kind is an adapter the pool holds (`EngineServers(kind, run_dir)`, `pool.kind`), never a subclass of the pool: it
knows one server of its kind and nothing of the pool's servers, states or locks (vllm.py, sglang.py, sim.py).

The small shared types (`Sampling`, `Segment`, `GenerationResult`, `HttpCall`, `EngineState`) are in types.py and
re-exported here, with `EngineError` (errors.py).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

from fully_async.config import ConfigError
from fully_async.engines.errors import EngineError
from fully_async.engines.types import EngineState, GenerationResult, HttpCall, PauseMode, Sampling, Segment

__all__ = [
    "REPO_ROOT",
    "EngineError",
    "EngineKind",
    "EngineState",
    "GenerationResult",
    "HttpCall",
    "PauseMode",
    "Sampling",
    "Segment",
    "engine_interpreter",
    "parse_versions",
]

REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_interpreter(configured: str | None, venv: Path, what: str, setup: str) -> str:
    """The interpreter of an engine's own environment: engine.python, else `venv`/bin/python.
    `what` names the engine in the error ("vLLM"); `setup` is the command that creates the default environment."""
    path = Path(configured).expanduser() if configured else venv / "bin" / "python"
    if not path.exists():
        hint = "" if configured else f"; create it with: {setup}"
        raise ConfigError(f"engine.python must be an existing interpreter with {what}, got {str(path)!r}{hint}")
    return str(path)


def parse_versions(spans: list[dict[str, Any]], length: int) -> list[int | None]:
    """Per-token weight versions of `length` output tokens from the engine's `weight_versions` spans
    ({"start", "end", "version"}, the label set by /update_weight_version); None where no span (or no integer label:
    "default" before the first version, or a foreign label) covers a token, which the client then labels itself."""
    versions: list[int | None] = [None] * length
    for span in spans:
        try:
            v: int | None = int(span.get("version"))
        except (TypeError, ValueError):
            v = None
        for i in range(max(0, int(span["start"])), min(length, int(span["end"]))):
            versions[i] = v
    return versions


class EngineKind(abc.ABC):
    """How to launch, address and control one server of a kind; `EngineServers` (pool.py) holds one and drives every
    server through it."""

    name: str = "?"
    """The kind's word (engine.kind): server names, logs and errors say it."""
    in_process = False
    """True for emulated engines that answer generate requests through `send_direct` instead of HTTP; their pool
    launches, stops and restarts no process (`restart_in_process`)."""
    health_path = "/health"
    liveness_path = "/health"
    """Answered by the server's HTTP front while it is busy (a weight reload): the control plane's probe that a server
    under a slow call still lives (control.py)."""
    unverifiable: str = "this engine kind reports no digest of the weights it loaded"
    """Why a weight sync into this kind's servers cannot be proven (fully_async/weights/verify.py); "" = it can:
    every server answers the worker extension's `fa_loaded_digest` (vLLM)."""
    logprobs_truncated = False
    """True when the behaviour log-probs the servers return are of the truncated distribution they sampled from
    (top-k / nucleus applied, renormalised): the trainer then takes its log-probs under the same truncation
    (training/sampling_support.py). False: of the full softmax at the temperature."""
    takes_images = False
    """True when the servers take image prompts (`image_fields`): a vision-language model on a kind without it is
    refused before Ray (preflight.check_engine_takes_images), not at its first generate call."""
    control_class: Any = None
    """The control plane class the pool delivers calls through (None: control.py's `ControlPlane`, over HTTP)."""

    def __init__(self, cfg: Any, model_path: str | Path, device: str | None = None, lora: Any = None) -> None:
        """device: 'cuda' or 'cpu' (the job's fully_async.device.device; None = this machine's). lora (a LoraServing):
        the servers serve versioned LoRA adapters (engines/adapters.py), so they start with LoRA enabled."""
        from fully_async.device import device as run_device

        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = device or run_device("auto")
        self.lora = lora

    @property
    def local_bind(self) -> str:
        """Bind address of servers started as children of this process ("auto" = loopback)."""
        return "127.0.0.1" if self.cfg.host == "auto" else self.cfg.host

    # ---- one server's process ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        """Command line of server `index` listening on `host` (None: the local bind address) and `port`."""

    @abc.abstractmethod
    def environment(self, index: int) -> dict[str, str]:
        """Environment variables added for server `index`."""

    cpu_tensor_parallel = False
    """True when the kind's CPU servers split the model over engine.tensor_parallel_size ranks as its GPU servers do
    (vLLM-CPU: gloo between the ranks, one core range each); False: one rank on CPU, and TP > 1 there is refused
    before Ray (preflight.check_cpu_tensor_parallel)."""

    @property
    def workers_per_server(self) -> int:
        """Worker processes per server: its tensor-parallel ranks (one on CPU for a kind without CPU TP)."""
        return self.cfg.tensor_parallel_size if self.device == "cuda" or self.cpu_tensor_parallel else 1

    def make_router(self, run_dir: Path) -> Any:
        """The router put in front of the servers (engine.router; its log under `run_dir`), or None: the client
        balances itself."""
        return None

    # ---- generation --------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        """(path, JSON body) of a token-level generate call returning log-probs of the chosen tokens."""

    def image_fields(self, images: list[bytes]) -> dict[str, Any]:
        """Fields added to a generate body whose prompt has images (PNG bytes, one per image token in the prompt,
        which the engine expands itself: multimodal/processor.py). Kinds that cannot take images say so."""
        from fully_async.engines.errors import EngineError

        raise EngineError(f"engine.kind={self.name} cannot take images yet; use engine.kind=vllm (docs/vlm.md)")

    def cache_salt_fields(self, salt: str) -> dict[str, Any]:
        """Fields that keep a generate request off prefixes cached under another salt (async_training.on_sync=keep
        salts by weight version: engines/inflight.py). A kind without a salt refuses keep."""
        from fully_async.engines.errors import EngineError

        raise EngineError(f"engine.kind={self.name} has no prefix-cache salt; async_training.on_sync=keep needs one")

    @abc.abstractmethod
    def parse_generate(self, body: Any) -> Segment:
        """Parse a generate response; raise ValueError when it is malformed."""

    async def send_direct(self, idx: int, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> Segment:
        """Generate on server `idx` without HTTP (only where `in_process`)."""
        raise NotImplementedError(f"{self.name} servers are reached over HTTP")

    def restart_in_process(self, idx: int, version: int) -> None:
        """Start emulated server `idx` afresh at `version` (only where `in_process`)."""
        raise NotImplementedError(f"{self.name} servers are processes")

    # ---- control-call shapes (run on every server by control.py) -----------------------------------------------------
    @abc.abstractmethod
    def pause_call(self, mode: PauseMode) -> HttpCall:
        """Pause generation; `mode` is what happens to the requests in flight (engines/inflight.py)."""

    @abc.abstractmethod
    def resume_call(self) -> HttpCall: ...

    @abc.abstractmethod
    def is_paused_call(self) -> tuple[HttpCall, Any]:
        """The call and a function(response_json) -> bool."""

    async def is_paused(self, url: str, control: Any) -> bool:
        """Whether the server at `url` is paused, asked through the pool's `control` plane (a kind without an
        is-paused endpoint answers otherwise)."""
        call, read = self.is_paused_call()
        (body,) = await control.call_all("is paused", call, [url])
        return bool(read(body))

    @abc.abstractmethod
    def reload_weights_call(self, weights_dir: Path) -> HttpCall: ...

    @abc.abstractmethod
    def set_version_call(self, version: int) -> HttpCall: ...

    @abc.abstractmethod
    def reset_prefix_cache_call(self) -> HttpCall: ...

    def encoder_cache_reset_call(self) -> HttpCall | None:
        """After new weights: drop the images' encoder outputs cached under the old ones (None: nothing cached)."""
        return None

    def rpc_call(self, method: str, spec: str) -> HttpCall:
        """A call of `method(spec=<JSON string>)` on every worker of a server (the weight receiver's methods)."""
        raise NotImplementedError(f"{self.name} servers have no weight receiver")

    # ---- LoRA adapters (engines/adapters.py; only kinds that serve them) ---------------------------------------------
    def load_adapter_call(self, name: str, path: Path) -> HttpCall:
        """Load the PEFT adapter directory `path` under `name` (again, in place, when the name exists)."""
        raise NotImplementedError(f"{self.name} servers cannot serve LoRA adapters")

    def unload_adapter_call(self, name: str) -> HttpCall:
        raise NotImplementedError(f"{self.name} servers cannot serve LoRA adapters")

    def adapter_fields(self, name: str) -> dict[str, Any]:
        """What a generate request's body gets so that adapter `name` serves it."""
        raise NotImplementedError(f"{self.name} servers cannot serve LoRA adapters")
