"""SGLang adapter (engine.kind=sglang; sglang 0.5.23): command line, environment, endpoints, request/response shapes.

Generation goes through SGLang's native token-level `/generate` (input_ids in, output_ids and the chosen tokens'
log-probs out, no tokenizer in the server: `--skip-tokenizer-init`); each response carries `weight_versions`, the
spans of output tokens produced under each label set by `/update_weight_version`, so per-token versions come from the
engine itself. Control: `/pause_generation` (mode abort: in-flight requests return their tokens so far with finish
reason abort, which the client continues; mode in_place for pause(keep)), `/continue_generation`,
`/update_weights_from_disk`, `/update_weight_version`, `/flush_cache`; `/ready` answers 503 while paused.

GPU: sglang installed normally (`--tp`, `--mem-fraction-static` from engine.gpu_memory_utilization). CPU-only (these
machines, docs/engines.md): the PyPI wheel runs with SGLANG_USE_CPU_ENGINE=1, the torch-native attention and sampling
backends, and two import shims (sglang_cpu_shims/: torchvision, sgl_kernel) on the server's PYTHONPATH only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp

from fully_async.config.sections.async_training import SGLANG_RECOMPUTE as RECOMPUTE_REFUSED
from fully_async.device import cpu_binding, host_cpus, resolve_dtype
from fully_async.engines.base import REPO_ROOT, EngineKind, engine_interpreter, parse_versions
from fully_async.engines.errors import EngineError
from fully_async.engines.types import HttpCall, PauseMode, Sampling, Segment

logger = logging.getLogger(__name__)

SHIMS = Path(__file__).resolve().parent / "sglang_cpu_shims"
"""Import shims put on the CPU server's PYTHONPATH (never on the project's)."""
SGLANG_VENV = REPO_ROOT / ".venv-sglang"


def sglang_python(configured: str | None) -> str:
    """The SGLang environment's interpreter: engine.python, else .venv-sglang/bin/python at the repository root."""
    return engine_interpreter(
        configured,
        SGLANG_VENV,
        "SGLang installed (engine.kind=sglang)",
        "bash scripts/setup_engine_env.sh --sglang",
    )


def kv_tokens(model_path: Path, gib: float, dtype: str = "float32") -> int:
    """Tokens of KV cache that fit in `gib` GiB for the model's K and V in `dtype` (engine.kv_cache_gib on CPU)."""
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as e:  # a model directory this process cannot read (another node's path)
        logger.warning("no config.json in %s (%s): SGLang's KV cache capped at 65536 tokens", model_path, e)
        return 65536
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)
    return max(1024, int(gib * 2**30) // per_token)


def _success(what: str):
    """A `check` for SGLang control answers {"success": bool, "message": str}."""
    return lambda body: None if (body or {}).get("success") else f"{what} refused: {(body or {}).get('message')}"


def _sglang_finish(reason: Any) -> str:
    """SGLang's finish_reason ({"type": "length" | "stop" | "abort", ...}) as the client's word."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("length", "abort"):
        return kind
    if kind == "stop":
        return "stop"
    raise ValueError(f"unknown finish_reason {reason!r}")


class SGLangKind(EngineKind):
    """One SGLang server: its command line, environment, generate shapes and control calls."""

    name = "sglang"
    liveness_path = "/model_info"  # /health runs a one-token generation, which waits behind a weight reload
    # SGLang 0.5.23's only read-back, /get_weights_by_name, is missing for Qwen2 models ("Get parameter by name
    # failed") and returns the first values of the fused, repacked parameter, not what the loader took.
    unverifiable = "SGLang has no read-back of the tensors it loaded (docs/weight-transports.md)"
    # logprobs_truncated stays False: SGLang's sampler returns log(softmax(logits / temperature)), taken before its
    # top-k / top-p filter (sglang/srt/layers/sampler.py), so the trainer's full-vocabulary log-probs match it.

    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        cfg = self.cfg
        cuda = self.device == "cuda"
        dtype = resolve_dtype(cfg.dtype, self.device)
        cmd = [
            sglang_python(cfg.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            host or self.local_bind,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--context-length",
            str(cfg.max_model_len),
            # Token ids in and out: no tokenizer in the server (the client and trainer own tokenisation).
            "--skip-tokenizer-init",
            "--log-level-http",
            "warning",
        ]
        if cuda:
            cmd += ["--mem-fraction-static", str(cfg.gpu_memory_utilization), "--tp", str(cfg.tensor_parallel_size)]
            if cfg.enforce_eager:
                cmd.append("--disable-cuda-graph")
        else:
            cmd += [
                "--device",
                "cpu",
                # The only backends that run without the CPU sgl-kernel build (not on PyPI).
                "--attention-backend",
                "torch_native",
                "--sampling-backend",
                "pytorch",
                "--disable-overlap-schedule",
                "--max-total-tokens",
                str(kv_tokens(self.model_path, cfg.kv_cache_gib, dtype)),
                # On CPU SGLang sizes the KV pool from free system memory: budget = free now - (1 - fraction) x
                # free before loading. With 0.1 a start failed when other processes took >10 % of the free memory
                # meanwhile ("Loaded weights leave no GPU memory for the KV cache"); --max-total-tokens caps it.
                "--mem-fraction-static",
                "0.9",
                # Without it the idle scheduler spins a core at 100 %, which the trainer beside it would lose.
                "--sleep-on-idle",
            ]
        if cfg.enable_chunked_prefill is False:
            cmd += ["--chunked-prefill-size", "-1"]  # SGLang's word for chunked prefill off
        elif cfg.max_num_batched_tokens:
            cmd += ["--chunked-prefill-size", str(cfg.max_num_batched_tokens)]
        if (lora := self.lora) is not None:  # versioned adapters loaded at run time (engines/adapters.py); GPUs only
            cmd += ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras-per-batch",
                    str(lora.max_loras), "--max-loaded-loras", str(lora.max_cpu_loras),
                    # SGLang's word for PEFT's "all-linear" is "all".
                    "--lora-target-modules", *("all" if m == "all-linear" else m for m in lora.target_modules)]  # fmt: skip
        return cmd + list(cfg.extra_args)

    def environment(self, index: int) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": ""}
        if self.device != "cuda":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # else it imports vllm._custom_ops
            env["PYTHONPATH"] = str(SHIMS)
            # As many compute threads as vLLM's binding gives its server; the affinity comes from the launcher
            # (the Rollouter or the engine host is pinned to the engines' cores and the server inherits it).
            binding = cpu_binding(index, self.cfg.num_servers, host_cpus())
            env["OMP_NUM_THREADS"] = str(len(binding.split(",")))
        # The project venv's VIRTUAL_ENV must not leak into the engine's interpreter.
        env["VIRTUAL_ENV"] = str(Path(sglang_python(self.cfg.python)).parent.parent)
        return {**env, **{str(k): str(v) for k, v in self.cfg.env.items()}}

    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        params: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        body = {
            "input_ids": list(prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
            # Log-probs of the output tokens only: a start at the prompt's end skips the prompt's (a full extra pass).
            "logprob_start_len": len(prompt_ids),
        }
        return "/generate", body

    def parse_generate(self, body: Any) -> Segment:
        try:
            token_ids = [int(t) for t in body["output_ids"] or []]
            meta = body["meta_info"]
            logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
            finish = _sglang_finish(meta["finish_reason"])
            spans = meta.get("weight_versions") or []
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"unexpected generate response ({type(e).__name__}: {e}): {str(body)[:300]}") from e
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs: {str(body)[:300]}")
        return Segment(token_ids, logprobs, finish, parse_versions(spans, len(token_ids)))

    def make_router(self, run_dir: Path) -> Any:
        """engine.router=sglang: an sglang-router (from the SGLang environment) in front of the servers."""
        if self.cfg.router != "sglang":
            return None
        from fully_async.engines.router import SGLangRouter

        return SGLangRouter(sglang_python(self.cfg.python), self.cfg, Path(run_dir) / "engines" / "sglang-router.log")

    # ---- control plane ---------------------------------------------------------------------------------------------
    def pause_call(self, mode: PauseMode) -> HttpCall:
        # in_place: the scheduler stops and the requests keep their KV cache; they finish after continue_generation.
        if mode == "recompute":  # refused before the run too (config/sections/async_training.py on_sync_problems)
            raise EngineError(RECOMPUTE_REFUSED)
        return HttpCall("POST", "/pause_generation", json={"mode": "abort" if mode == "abort" else "in_place"})

    def cache_salt_fields(self, salt: str) -> dict[str, Any]:
        return {"extra_key": salt}  # part of the radix cache's key

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/continue_generation", json={})

    def load_adapter_call(self, name: str, path: Path) -> HttpCall:
        body = {"lora_name": name, "lora_path": str(path)}
        return HttpCall("POST", "/load_lora_adapter", json=body, check=_success(f"loading adapter {name}"))

    def unload_adapter_call(self, name: str) -> HttpCall:
        return HttpCall("POST", "/unload_lora_adapter", json={"lora_name": name},
                        check=_success(f"unloading adapter {name}"))  # fmt: skip

    def adapter_fields(self, name: str) -> dict[str, Any]:
        return {"lora_path": name}  # a loaded adapter's name selects it

    def is_paused_call(self) -> tuple[HttpCall, Any]:
        """Unused: SGLang has no is-paused endpoint; `is_paused` reads /ready's status code instead."""
        raise NotImplementedError("SGLang reports pause through /ready's status code (SGLangKind.is_paused)")

    async def is_paused(self, url: str, control: Any) -> bool:
        """/ready: 200 when serving, 503 while paused (or not healthy: then the next request meets the failure)."""
        from fully_async.engines.auth import auth_headers

        timeout = aiohttp.ClientTimeout(total=self.cfg.control_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session,
                session.get(url + "/ready") as resp,
            ):
                return resp.status == 503
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"{url}/ready: {type(e).__name__}: {e}") from e

    def reload_weights_call(self, weights_dir: Path) -> HttpCall:
        # No flush here: SGLang fails the whole reload when requests are still running (a keep pause's frozen ones).
        # The control plane's reset after the reload flushes what the old weights cached (/flush_cache), and skips it
        # under a keep pause, where each request's cache salt (extra_key) keeps the versions apart (inflight.py).
        body = {"model_path": str(weights_dir), "flush_cache": False}
        return HttpCall(
            "POST",
            "/update_weights_from_disk",
            json=body,
            check=_success("reload"),
        )

    def set_version_call(self, version: int) -> HttpCall:
        return HttpCall(
            "POST",
            "/update_weight_version",
            # SGLang's default aborts every running request; pause(keep) must keep them (and under abort they are gone).
            json={"new_version": str(version), "abort_all_requests": False},
            check=_success("version"),
        )

    def reset_prefix_cache_call(self) -> HttpCall:
        # 400 while requests are running or waiting (pause(keep)); the control plane then logs and goes on.
        return HttpCall("POST", "/flush_cache")

    # ---- NCCL weight path (GPU only: SGLang's weight-update groups are NCCL) -------------------------------------
    def init_weights_group_call(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> HttpCall:
        """Join the trainer's weight-update group: the server's ranks take rank_offset .. rank_offset + tp - 1."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": "nccl",
        }
        return HttpCall("POST", "/init_weights_update_group", json=body, check=_success("joining the weight group"))

    def update_weights_from_distributed_call(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int
    ) -> HttpCall:
        """Receive one bucket of tensors broadcast by rank 0 of the group, in `names` order, labelled `version`."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        return HttpCall("POST", "/update_weights_from_distributed", json=body, check=_success("NCCL weight update"))


# ---- over a pool of SGLang servers (`pool.kind` an SGLangKind) ---------------------------------------------------------
async def init_weights_group(pool: Any, master_address: str, master_port: int, group_name: str) -> None:
    """Every server of `pool` joins one group with the caller as rank 0 (world = 1 + servers x tp); the caller must
    join the same group (torch.distributed, rank 0) at the same time."""
    tp = pool.cfg.tensor_parallel_size
    world = 1 + len(pool.procs) * tp
    call = pool.kind.init_weights_group_call
    await asyncio.gather(
        *(
            pool.control.call_all(
                "join weight group", call(master_address, master_port, 1 + i * tp, world, group_name), [url]
            )
            for i, url in enumerate(pool.addresses)
        )
    )


async def update_weights_from_distributed(
    pool: Any, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int
) -> None:
    """Every server of `pool` receives the bucket the caller broadcasts meanwhile; the servers' version becomes
    `version`."""
    call = pool.kind.update_weights_from_distributed_call(names, dtypes, shapes, group_name, version)
    await pool.control.call_all("NCCL weight update", call)
    pool.state.version = version


async def model_info(pool: Any) -> list[dict]:
    """Per server of `pool`, /model_info: model_path (the weights loaded last), weight_version, model_type, ..."""
    return await pool.control.call_all("model info", HttpCall("GET", "/model_info"))
