"""vLLM worker extension that receives weights over a torch.distributed broadcast (fully_async's collective
transport). Loaded by the engine (`--worker-extension-cls fa_weight_receiver.WeightReceiver`, this directory on the
engine's PYTHONPATH); it imports only the standard library, torch, safetensors and vLLM, never fully_async.

Every method is reached through `POST /collective_rpc {"method": ..., "kwargs": {"spec": "<JSON string>"}}` and runs on
every worker of the server (one per tensor-parallel rank). The sender (the trainer side, rank 0 of the group) sends:
- fa_join(spec): join a group outside vLLM's own (TCPStore client + PrefixStore, ProcessGroupGloo on CPU,
  ProcessGroupNCCL on GPUs); this worker's rank is spec.rank_offset + its tensor-parallel rank. The call must be in
  flight while the sender forms its side (they rendezvous).
- fa_check(spec): names and shapes of the planned tensors against this engine's checkpoint headers; raises
  ValueError naming the first tensors that differ. Nothing is received, nothing changes.
- fa_receive(spec): the bucket layout (names, shapes, offsets of each flat bucket, one dtype); checks it as fa_check
  does, receives EVERY bucket, then loads them through `model_runner.reload_weights(weights_iterator=...)`, which
  shards for tensor parallelism and re-runs the CPU repacking. Receiving everything first costs one extra copy of
  the weights per worker, and buys this: a sender that dies or stalls mid-broadcast fails this call at the group
  timeout and the server keeps its old weights (a failure inside reload_weights would leave a half-loaded model).
- fa_leave(spec): drop the group (before a re-formed one is joined).
No pickle crosses the network: the arguments are JSON, the payload raw tensor bytes.
"""

from __future__ import annotations

import glob
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _process_group(backend: str, store, rank: int, world: int, timeout: timedelta):
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):  # no model-parallel state: a single worker
        return 0


def check_plan(tensors: list, headers: dict[str, list[int]], limit: int = 5) -> list[str]:
    """Problems of a plan ([[name, shape, ...], ...]) against checkpoint `headers` (name -> shape), at most `limit`,
    each naming the tensor; empty when the plan fits."""
    problems = []
    for entry in tensors:
        name, shape = entry[0], [int(d) for d in entry[1]]
        if name not in headers:
            problems.append(f"tensor {name!r} is not in the engine's checkpoint")
        elif headers[name] != shape:
            problems.append(f"tensor {name!r} has shape {shape}, the engine's checkpoint has {headers[name]}")
        if len(problems) >= limit:
            break
    return problems


class WeightReceiver:
    """Mixed into vLLM's worker class (see the module docstring)."""

    def _fa_state(self) -> dict:
        state = getattr(self, "_fa", None)
        if state is None:
            raise RuntimeError("this worker is in no weight group (fa_join first)")
        return state

    def _fa_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def fa_join(self, spec: str) -> dict:
        s = json.loads(spec)
        self._fa = None
        rank = int(s["rank_offset"]) + _tp_rank()
        world, timeout = int(s["world"]), timedelta(seconds=float(s["timeout_s"]))
        start = time.monotonic()
        store = dist.TCPStore(s["host"], int(s["port"]), world, is_master=False, timeout=timeout)
        pg = _process_group(s["backend"], dist.PrefixStore(s["group"], store), rank, world, timeout)
        self._fa = {"group": s["group"], "pg": pg, "store": store, "rank": rank}
        return {"rank": rank, "pid": os.getpid(), "join_s": time.monotonic() - start}

    def fa_leave(self, spec: str = "{}") -> dict:
        had = getattr(self, "_fa", None) is not None
        self._fa = None
        return {"left": had}

    def _fa_headers(self) -> dict[str, list[int]]:
        headers = getattr(self, "_fa_header_cache", None)
        if headers is None:
            from safetensors import safe_open

            root = self.model_config.model
            headers = {}
            for path in sorted(glob.glob(os.path.join(root, "*.safetensors"))):
                with safe_open(path, "pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        headers[key] = [int(d) for d in f.get_slice(key).get_shape()]
            if not headers:
                raise RuntimeError(f"no safetensors under the engine's model directory {root}")
            self._fa_header_cache = headers
        return headers

    def fa_check(self, spec: str) -> dict:
        s = json.loads(spec)
        problems = check_plan(s["tensors"], self._fa_headers())
        if problems:
            raise ValueError("weight plan does not fit this engine: " + "; ".join(problems))
        return {"tensors": len(s["tensors"])}

    def fa_receive(self, spec: str) -> dict:
        s = json.loads(spec)
        state = self._fa_state()
        if s["group"] != state["group"]:
            raise RuntimeError(f"sent for group {s['group']!r}, this worker is in {state['group']!r}")
        flat = [t for bucket in s["buckets"] for t in bucket["tensors"]]
        problems = check_plan(flat, self._fa_headers())
        if problems:
            raise ValueError("weight plan does not fit this engine: " + "; ".join(problems))
        dtype, device, pg = DTYPES[s["dtype"]], self._fa_device(), state["pg"]
        start = time.monotonic()
        buffers = []
        for bucket in s["buckets"]:
            buf = torch.empty(int(bucket["numel"]), dtype=dtype, device=device)
            buffers.append(buf)
            pg.broadcast(buf, 0).wait()
        received = time.monotonic()

        def weights():
            for bucket, buf in zip(s["buckets"], buffers):
                for name, shape, offset, numel in bucket["tensors"]:
                    yield name, buf[int(offset) : int(offset) + int(numel)].view(shape)

        self.model_runner.reload_weights(weights_iterator=weights())
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        return {"tensors": len(flat), "bytes": nbytes, "receive_s": received - start,
                "load_s": time.monotonic() - received}  # fmt: skip
