"""engine and placement: the inference servers (vLLM, SGLang or the simulated engine) and where Ray puts them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATH, require


@dataclass
class SimEngineConfig:
    time_scale: float = 1.0
    """Simulated seconds per wall second (all sim latencies are divided by it); must equal trainer.sim.time_scale."""
    length_median: float = 64.0
    """Median response length in tokens (log-normal; rollout.response_length caps it)."""
    length_sigma: float = 0.5
    """Log-normal sigma of the response length; 0 = every response is length_median tokens."""
    decode_step_s: float = 0.01
    """Seconds of one decode step of an engine with one sequence."""
    decode_step_per_seq_s: float = 0.0001
    """Extra seconds per decode step for each sequence in the engine's batch."""
    max_seqs: int = 256
    """Sequences one engine decodes at once; further requests wait for a slot."""
    prefill_tokens_per_s: float = 50000.0
    """Prompt tokens one engine prefills per second (a request's prefill delays its first token)."""
    pause_s: float = 0.01
    """Latency of a pause (abort or keep) on all engines."""
    resume_s: float = 0.01
    """Latency of a resume on all engines."""
    reload_s: float = 0.1
    """Latency of a weight reload on all engines."""
    token_id: int = 3
    """Token id of every simulated response token; must not occur in prompts (continuations are found by it)."""
    seed: int = 0
    """Seed of the response-length draws."""

    def validate_section(self, p: str) -> None:
        for name in ("time_scale", "length_median", "decode_step_s", "prefill_tokens_per_s"):
            require(getattr(self, name) > 0, p + name, getattr(self, name), "> 0")
        for name in ("length_sigma", "decode_step_per_seq_s", "pause_s", "resume_s", "reload_s"):
            require(getattr(self, name) >= 0, p + name, getattr(self, name), ">= 0")
        require(self.max_seqs >= 1, p + "max_seqs", self.max_seqs, ">= 1")
        require(self.token_id >= 0, p + "token_id", self.token_id, ">= 0")


@dataclass
class EngineConfig:
    kind: Literal["vllm", "sglang", "sim"] = "vllm"
    """Inference engine adapter: vllm, sglang (docs/engines.md), or sim = emulated engines in the rollouter's process
    (engine.sim)."""
    num_servers: int = 1
    """Engine server processes (one model replica each), each placed by Ray on a node with its GPUs."""
    min_servers: int = 1
    """Elastic pool: `fully_async.ctl engines --remove` refuses to leave fewer servers than this."""
    max_servers: int = 0
    """Elastic pool: `fully_async.ctl engines --add` refuses to pass this many servers (0 = as many as fit)."""
    replace_retry_s: float = 30.0
    """A server whose node is gone is replaced on another node; when none has room, try again after this many seconds."""
    hung_host_s: float = 120.0
    """A server set aside whose engine host does not answer (its node hung) is replaced once Ray declares the node
    dead, or after this many seconds if Ray has not; restarted in place if the host answers again first."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per engine server: its GPUs (one placement-group bundle, on one node) on GPUs; on CPU
    (engine.kind=vllm only) processes joined by gloo, each bound to its own cores, at most one rank per core."""
    python: str | None = field(default=None, metadata=PATH)
    """Interpreter of the engine environment; null = .venv-engine/bin/python (vllm) or .venv-sglang/bin/python
    (sglang) at the repository root."""
    host: str = "auto"
    """Address the engine servers listen on; auto = 127.0.0.1 on the Rollouter's node, the node's IP elsewhere (then
    behind an auth proxy that requires the run's token)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weight dtype; auto = float32 on CPU (bf16 log-probs drift ~1e-2), bfloat16 on GPU."""
    max_model_len: int = 512
    """Longest prompt + response the engine accepts; 0 = data.max_prompt_length + rollout.response_length (what a
    verl command line gets, as verl derives it)."""
    kv_cache_gib: float = 1.0
    """KV cache size in whole GiB on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE; SGLang's --max-total-tokens from it)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory the engine may take (GPU only)."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile warm-up (faster start-up, slower decode)."""
    startup_timeout_s: float = 300.0
    """How long to wait for a server to become healthy before failing with its log tail."""
    request_timeout_s: float = 300.0
    """Per-request HTTP timeout for generation."""
    warmup_requests: int = -1
    """Throw-away generate requests each server answers at once (after one alone) when it starts, restarts or joins,
    before it takes traffic: the longest of the first dataset prompts to rollout.response_length tokens (at most 64)
    with the run's sampling (fully_async/engines/warmup.py), so the first batch costs what a steady one does; -1 = the samples the
    first batch runs on each server at once (rollout.start_concurrent over engine.num_servers), 0 = no warm-up."""
    control_timeout_s: float = 60.0
    """Bound of a control call that may be slow: a weight reload (while the server still answers a liveness probe
    within engine.control_deadline_s), a call to one server (a join, a restart, an rpc), the router's worker list."""
    control_deadline_s: float = 10.0
    """Deadline of a pool-wide control call (pause, resume, set version, reset prefix cache; a reload's liveness
    probe; the disk transport's copy to a node that stops answering): a server that misses it is set aside (marked
    down, then restarted or replaced) and the call goes on with the others; if every server misses it, it fails."""
    max_retries: int = 2
    """Times a request is retried on another server after a server failure."""
    resume_timeout_s: float = 600.0
    """How long a request aborted by a pause waits for the resume before failing."""
    auto_restart: bool = True
    """Restart a server whose process died (with the latest weights and version); requests go elsewhere meanwhile."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills into chunks that share a step with decodes: vLLM --[no-]enable-chunked-prefill; SGLang: false = --chunked-prefill-size -1 (true is its default); null = the engine's default."""
    max_num_batched_tokens: int = 0
    """Most tokens one engine step computes: vLLM --max-num-batched-tokens; SGLang --chunked-prefill-size (its prefill chunk, the same cap on a step's prefill); 0 = the engine's default."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed to every engine server."""
    env: dict = field(default_factory=dict)
    """Extra environment variables for the engine processes."""
    router: Literal["none", "sglang"] = "none"
    """sglang: generation goes through an sglang-router in front of the servers (kind=sglang only; control calls still
    go to each server); none: the client balances over the servers itself (docs/engines.md)."""
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    """The router's load-balancing policy (engine.router=sglang)."""
    router_host: str = "127.0.0.1"
    """Address the router binds (engine.router=sglang); anything but loopback exposes it, unauthenticated."""
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    """Latency model of the emulated engines (kind=sim)."""

    def validate_section(self, p: str) -> None:
        require(self.num_servers >= 1, p + "num_servers", self.num_servers, ">= 1")
        require(1 <= self.min_servers <= self.num_servers, p + "min_servers", self.min_servers,
                f">= 1 and <= engine.num_servers ({self.num_servers})")  # fmt: skip
        require(self.max_servers == 0 or self.max_servers >= self.num_servers, p + "max_servers", self.max_servers,
                f"0 (no limit) or >= engine.num_servers ({self.num_servers})")  # fmt: skip
        require(self.replace_retry_s > 0, p + "replace_retry_s", self.replace_retry_s, "> 0")
        require(self.max_num_batched_tokens >= 0, p + "max_num_batched_tokens", self.max_num_batched_tokens,
                ">= 0 (0 = the engine's default)")  # fmt: skip
        require(self.tensor_parallel_size >= 1, p + "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        require(bool(str(self.host).strip()), p + "host", self.host, "'auto' or an address")
        require(self.max_model_len == 0 or self.max_model_len >= 2, p + "max_model_len", self.max_model_len,
                "0 (derived) or >= 2")  # fmt: skip
        require(
            self.kv_cache_gib >= 1 and float(self.kv_cache_gib).is_integer(),
            p + "kv_cache_gib",
            self.kv_cache_gib,
            "a whole number >= 1 (vLLM's VLLM_CPU_KVCACHE_SPACE takes integer GiB)",
        )
        require(
            0 < self.gpu_memory_utilization <= 1, p + "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]"
        )
        for name in ("startup_timeout_s", "request_timeout_s", "control_timeout_s", "control_deadline_s",
                     "resume_timeout_s", "hung_host_s"):  # fmt: skip
            require(getattr(self, name) > 0, p + name, getattr(self, name), "> 0")
        require(self.max_retries >= 0, p + "max_retries", self.max_retries, ">= 0")
        require(self.warmup_requests >= -1, p + "warmup_requests", self.warmup_requests, ">= -1 (-1 = auto, 0 = off)")
        require(self.router == "none" or self.kind == self.router, p + "router", self.router,
                f"'none' with engine.kind={self.kind} (the sglang router only fronts engine.kind=sglang)")  # fmt: skip
        require(bool(str(self.router_host).strip()), p + "router_host", self.router_host, "an address")


@dataclass
class PlacementConfig:
    resources: Literal["auto", "gpu", "cpu"] = "auto"
    """What trainer ranks and engine servers reserve from Ray: gpu = GPUs (trainer.nnodes x n_gpus_per_node, and
    engine.tensor_parallel_size per server); cpu = CPUs (one per trainer rank, placement.engine_cpus per engine
    server's tensor-parallel rank); auto = gpu when the cluster declares GPUs."""
    timeout_s: float = 120.0
    """How long to wait for Ray to grant the placement groups before failing (a cluster that is still starting)."""
    engine_cpus: float = 1.0
    """Ray CPUs each engine host reserves (its server's tokenizer and API process); without GPUs, once per
    tensor-parallel rank (each rank computes on cores of its own)."""
    engine_resources: dict = field(default_factory=dict)
    """Custom Ray resources each engine server's bundle also reserves, e.g. {inference: 1}: engines then go only to
    nodes started with `--resources '{"inference": N}'` (scripts/cluster/start_worker.sh passes extra ray flags)."""
    trainer_resources: dict = field(default_factory=dict)
    """Custom Ray resources each trainer bundle also reserves (keeps the trainer ranks on the nodes that declare them)."""

    def validate_section(self, p: str) -> None:
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.engine_cpus >= 0, p + "engine_cpus", self.engine_cpus, ">= 0")
        for name in ("engine_resources", "trainer_resources"):
            for key, amount in getattr(self, name).items():
                require(isinstance(amount, int | float) and amount > 0 and key not in ("CPU", "GPU", "memory"),
                        f"{p}{name}.{key}", amount, "a custom resource (not CPU/GPU/memory) with an amount > 0")  # fmt: skip
