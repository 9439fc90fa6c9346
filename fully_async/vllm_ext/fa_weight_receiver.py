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
  does, then streams: a thread receives bucket k+1 while `model_runner.reload_weights(weights_iterator=...)` loads
  bucket k (it shards for tensor parallelism and re-runs the CPU repacking; the iterator yields views into the
  received bucket, no copy). Buckets land in buffers kept across syncs (POOL_KEEP per worker), because touching
  fresh memory is what a receive costs most on these machines (first-touch page faults: a 386 MB receive into fresh
  buffers took 0.6-1.0 s, into warm ones 0.14 s). vLLM's layerwise reload may hold views of a bucket until every
  tensor of that layer arrived (or to the end, for a layer it cannot complete), so a buffer is reused only when
  nothing but the pool refers to its storage; otherwise a fresh one is allocated (slower, never wrong).
  The price of streaming: a sender that dies or stalls mid-broadcast fails this call (at the group timeout at the
  latest) AFTER some layers took the new weights. The iterator then ends early, so vLLM finishes its reload
  cleanly (layers that got nothing keep their old tensors), and the call raises naming how much was loaded: the
  server holds a mix of versions and must not serve before the next sync succeeds (ParamSync's error fails the
  run; a restarted run syncs before it generates).
- fa_leave(spec): drop the group (before a re-formed one is joined).
- fa_reload(spec): the disk transport's reload: vLLM's own loader reads the safetensors directory spec.path (as
  `reload_weights(weights_path=...)` does) and every tensor it yields is digested on its way into
  `reload_weights(weights_iterator=...)`.
- fa_loaded_digest(spec): the checksum (fa_digest.py) of the tensors the last fa_reload or fa_receive handed to the
  loader, with their count and source: the proof that a sync landed, compared by the trainer with the digest of what
  it wrote or sent. It is taken of the tensors the loader got (checkpoint names and layout, before vLLM shards them
  for tensor parallelism and repacks them for the CPU kernels), so every worker of a server reports the same digest;
  what vLLM does with them afterwards is not covered (on CPU the repacked parameters no longer compare with the
  checkpoint, which is why vLLM's own /weight_checker cannot serve here). A server that loaded nothing through these
  methods since it started reports digest None.
After fa_receive and fa_reload, an LM head tied to the token embedding is prepared again (`refresh_tied_heads`): the
load updated the embedding in place, but vLLM prepares again only the layers that got tensors, and on CPU the head's
logits come from a packed copy of its weights.
No pickle crosses the network: the arguments are JSON, the payload raw tensor bytes.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__:  # imported as fully_async.vllm_ext.fa_weight_receiver
    from .fa_digest import Digest
    from .fa_lora import AdapterDigest
else:  # the top-level module fa_weight_receiver (the engine: this directory alone on its path; or loaded by file)
    import importlib.util as _util

    def _sibling(name: str):
        spec = _util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
        module = _util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    Digest = _sibling("fa_digest").Digest
    AdapterDigest = _sibling("fa_lora").AdapterDigest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

POOL_KEEP = 3
"""Bucket buffers a worker keeps between syncs: one being received, one being loaded, one a layer still holds."""


def storage_free(buf: torch.Tensor) -> bool | None:
    """Whether nothing but `buf` itself refers to its storage (no view of it is alive); None when this torch cannot
    tell (then the caller must treat it as taken)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    # `buf` and the temporary storage handle taken here are the two expected references.
    return use_count(buf.untyped_storage()._cdata) <= 2


class BucketPool:
    """Flat receive buffers of one dtype and device, kept across syncs (at most POOL_KEEP, each as large as the
    largest bucket asked for so far). `take(numel)` gives a view of a buffer no live tensor refers to, or of a
    fresh one (kept when there is room, else temporary); `fresh` counts the allocations."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.buffers: list[torch.Tensor] = []
        self.fresh = 0

    def take(self, numel: int) -> torch.Tensor:
        for i, buf in enumerate(self.buffers):
            if storage_free(buf):
                if buf.numel() < numel:  # the bucket size grew: replace it
                    buf = self.buffers[i] = self._alloc(numel)
                return buf[:numel]
        buf = self._alloc(numel)
        if len(self.buffers) < POOL_KEEP:
            self.buffers.append(buf)
        return buf[:numel]

    def _alloc(self, numel: int) -> torch.Tensor:
        self.fresh += 1
        return torch.empty(numel, dtype=self.dtype, device=self.device)


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


def refresh_tied_heads(model) -> int:
    """Prepare again the kernel of every unquantized LM head tied to a token embedding; returns how many there were.
    vLLM's in-place reload copies each tensor it loads into the parameter's storage and prepares again every layer
    it loaded, but a tied head gets no tensor of its own (the checkpoint holds the embedding once, and vLLM skips a
    tied head's name), so its layer is never prepared again: on CPU the logits keep coming from the packed copy of
    the weights the head was prepared with at start, whatever the syncs load (issue 48: offpolicy k3 2e-3 at
    max_staleness=0 on SmolLM2 after the first sync). On GPUs the preparation does nothing for such a head."""
    if model is None:
        return 0
    embeddings = [
        m.weight for name, m in model.named_modules() if name.endswith("embed_tokens") and hasattr(m, "weight")
    ]
    heads = 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        tied = name.endswith("lm_head") and any(getattr(module, "weight", None) is w for w in embeddings)
        if tied and type(method).__name__ == "UnquantizedEmbeddingMethod":
            method.process_weights_after_loading(module)
            heads += 1
    return heads


def _model_of(runner):
    get_model = getattr(runner, "get_model", None)
    return get_model() if get_model is not None else None


class BucketStream:
    """One fa_receive's buckets, streamed: a thread receives bucket k+1 from the group while the loader takes the
    tensors of bucket k from `weights()` (two buckets in flight, so buffers get reused). A failure on the receiving
    side, or a bucket that does not arrive within `patience` seconds, ends the iterator early and is kept in
    `failure` ({"error", "bucket"}); `loaded` counts the tensors the loader took."""

    def __init__(self, buckets: list, pool: BucketPool, pg, device: torch.device, patience: float) -> None:
        self.buckets, self.pool, self.pg, self.device, self.patience = buckets, pool, pg, device, patience
        self.arrived: queue.Queue = queue.Queue()
        self.taken = threading.Semaphore(0)
        self.stop = threading.Event()
        self.stats = {"receive_s": 0.0, "stall_s": 0.0, "digest_s": 0.0}
        self.digest = Digest()
        self.failure: dict = {}
        self.loaded = 0

    def load_into(self, reload_weights) -> None:
        """Run `reload_weights(weights_iterator=...)` over the buckets as they arrive; the receiving thread is
        stopped and joined whatever the loader does."""
        receiver = threading.Thread(target=self.receive, name="fa-weight-receive", daemon=True)
        receiver.start()
        try:
            reload_weights(weights_iterator=self.weights())
        finally:
            self.stop.set()
            receiver.join(timeout=self.patience)

    def receive(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            for k, bucket in enumerate(self.buckets):
                # Receive bucket k once the load took bucket k-1: two in flight, so buffers get reused.
                while k and not self.taken.acquire(timeout=0.5):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                buf = self.pool.take(int(bucket["numel"]))
                t0 = time.monotonic()
                self.pg.broadcast(buf, 0).wait()
                self.stats["receive_s"] += time.monotonic() - t0
                self.arrived.put((k, buf))
                del buf  # this thread must not keep the bucket's storage referenced
        except BaseException as e:  # handed to the loading side, which ends its iterator and reports it
            self.arrived.put((None, e))

    def weights(self):
        for k, bucket in enumerate(self.buckets):
            t0 = time.monotonic()
            try:
                got, buf = self.arrived.get(timeout=self.patience)
            except queue.Empty:
                self.failure["error"] = TimeoutError(f"bucket {k} did not arrive within {self.patience:g} s")
                return
            self.stats["stall_s"] += time.monotonic() - t0
            self.taken.release()
            if got is None:
                self.failure["error"], self.failure["bucket"] = buf, k
                return
            for name, shape, offset, numel in bucket["tensors"]:
                tensor = buf[int(offset) : int(offset) + int(numel)].view(shape)
                t1 = time.monotonic()
                self.digest.add(name, tensor)
                self.stats["digest_s"] += time.monotonic() - t1
                yield name, tensor
                self.loaded += 1
            del buf  # views still held by the loader keep the storage; this frame must not
        self.stats["iterated_at"] = time.monotonic()


class WeightReceiver(AdapterDigest):
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

    def _fa_pool(self, dtype: torch.dtype, device: torch.device) -> BucketPool:
        pool = getattr(self, "_fa_buckets", None)
        if pool is None or pool.dtype != dtype or pool.device != device:
            pool = self._fa_buckets = BucketPool(dtype, device)
        return pool

    def fa_receive(self, spec: str) -> dict:
        s = json.loads(spec)
        state = self._fa_state()
        if s["group"] != state["group"]:
            raise RuntimeError(f"sent for group {s['group']!r}, this worker is in {state['group']!r}")
        buckets = s["buckets"]
        flat = [t for bucket in buckets for t in bucket["tensors"]]
        problems = check_plan(flat, self._fa_headers())
        if problems:
            raise ValueError("weight plan does not fit this engine: " + "; ".join(problems))
        device = self._fa_device()
        pool = self._fa_pool(DTYPES[s["dtype"]], device)
        fresh_before = pool.fresh
        self._fa_loaded = None  # until this load completes, the server holds no proven set
        # Far longer than the group's own timeout, which bounds every broadcast: only a bug could reach it.
        stream = BucketStream(buckets, pool, state["pg"], device, patience=2 * float(s.get("timeout_s", 300.0)) + 60)
        start = time.monotonic()
        stream.load_into(self.model_runner.reload_weights)
        tied_heads = refresh_tied_heads(_model_of(self.model_runner)) if not stream.failure else 0
        end = time.monotonic()
        stats, failure = stream.stats, stream.failure
        if failure:
            raise RuntimeError(
                f"receiving weights failed at bucket {failure.get('bucket', '?')} of {len(buckets)} "
                f"({type(failure['error']).__name__}: {failure['error']}); {stream.loaded} of {len(flat)} tensors "
                "were loaded, so this server holds a mix of weight versions until the next sync succeeds"
            )
        nbytes = sum(int(b["numel"]) for b in buckets) * torch.empty((), dtype=pool.dtype).element_size()
        self._fa_loaded = {"digest": stream.digest.hexdigest(), "tensors": len(stream.digest),
                           "source": f"group {s['group']}", "digest_s": stats["digest_s"]}  # fmt: skip
        return {"tensors": len(flat), "bytes": nbytes, "buckets": len(buckets), "fresh_buffers": pool.fresh - fresh_before,
                "receive_s": stats["receive_s"], "stall_s": stats["stall_s"], "digest_s": stats["digest_s"],
                "load_s": stats.get("iterated_at", end) - start - stats["stall_s"],
                "finish_s": end - stats.get("iterated_at", end), "total_s": end - start,
                "tied_heads": tied_heads}  # fmt: skip

    def fa_reload(self, spec: str) -> dict:
        """Reload from the safetensors directory spec.path through vLLM's own loader, digesting every tensor the
        loader yields on its way in (see the module docstring). The model's directory becomes spec.path, as with
        `reload_weights(weights_path=...)`, so a server restarted later and a plan check read it."""
        from vllm.model_executor.model_loader import get_model_loader

        path = json.loads(spec)["path"]
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no weights directory {path}")
        runner = self.model_runner
        config = runner.vllm_config
        model_config = config.model_config
        # What reload_weights(weights_path=...) does before it reads: the revision and any separate weights source
        # belong to the directory loaded before.
        model_config.model, model_config.model_weights, model_config.revision = path, "", None
        weights = get_model_loader(config.load_config).get_all_weights(model_config, runner.get_model())
        digest = Digest()
        spent = [0.0]

        def digested():
            for name, tensor in weights:
                t0 = time.monotonic()
                digest.add(name, tensor)
                spent[0] += time.monotonic() - t0
                yield name, tensor

        self._fa_loaded = None  # until this load completes, the server holds no proven set
        start = time.monotonic()
        runner.reload_weights(weights_iterator=digested())
        tied_heads = refresh_tied_heads(_model_of(runner))
        self._fa_loaded = {"digest": digest.hexdigest(), "tensors": len(digest), "source": path, "digest_s": spent[0]}
        return {**self._fa_loaded, "total_s": time.monotonic() - start, "tied_heads": tied_heads}

    def fa_loaded_digest(self, spec: str = "{}") -> dict:
        """{"digest", "tensors", "source", "digest_s"} of the last completed load (digest None: none yet)."""
        return getattr(self, "_fa_loaded", None) or {"digest": None, "tensors": 0, "source": None, "digest_s": 0.0}
