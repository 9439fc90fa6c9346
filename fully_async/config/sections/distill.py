"""distill: on-policy distillation from a teacher that scores every sampled token (docs/distillation.md).

Off by default (`distill.enable=false`). On: each finished sample is also scored by the teacher (its log-prob of
every response token, prompt + response in one request), beside the reward and under the same kind of limits, and
the trainer's per-token advantage becomes coef x (teacher log-prob - the student's current log-prob), plus (1 - coef)
x the estimator's advantage of the task reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import PATH, ConfigError, require
from fully_async.config.sections.reward import RewardLimitsConfig

TEACHER_KINDS = ("vllm",)
"""Engine kinds a teacher may be served by: the ones whose servers return prompt log-probs (vLLM's token-in
generate endpoint with sampling_params.prompt_logprobs). SGLang's CPU build and the simulated engine do not."""
TEACHER_SOURCE = "teacher"
"""The teacher's name in reward stats and metrics (fully_async/reward/teacher/*) and its limiter actor's name."""
TEACHER_BASELINES = ("none", "group")
"""Values of distill.baseline (fully_async/training/distill_loss.py)."""
TEACHER_FAILURE_POLICIES = ("drop", "raise")
"""What a teacher call that failed after its retries does: drop = the sample's group is re-issued; raise = the run
stops. There is no fallback: a made-up teacher log-prob would be a training signal nobody measured."""


@dataclass
class TeacherConfig:
    path: str | None = field(default=None, metadata=PATH)
    """The teacher served on engine servers of its own: a model directory, a hub id, a .gguf file, a pkg:// file, or the name of a shipped model group (smollm2); null = use `url`."""
    url: str | None = None
    """Or an OpenAI-compatible server already running (e.g. http://host:8000/v1) whose /completions returns prompt log-probs (vLLM's prompt_logprobs); null = use `path`."""
    model: str | None = None
    """The model name sent to `url` (required with url)."""
    tokenizer: str | None = field(default=None, metadata=PATH)
    """The teacher's tokenizer directory, compared with the student's before Ray starts (required with url; with path, the model's own)."""
    api_key_env: str | None = None
    """Name of the environment variable holding `url`'s API key (never the key itself); null = no key."""
    kind: Literal["vllm"] = "vllm"
    """Engine kind of the teacher's servers (one that returns prompt log-probs)."""
    num_servers: int = 1
    """Teacher engine servers (each a replica of the teacher; they take the rollout's engine settings otherwise)."""
    kv_cache_gib: float = 0.0
    """KV cache of each teacher server on CPU; 0 = engine.kv_cache_gib."""

    def validate_section(self, p: str) -> None:
        if self.path and self.url:
            raise ConfigError(f"{p}path and {p}url both name the teacher; set only one")
        if self.url:
            require(self.url.startswith(("http://", "https://")), p + "url", self.url, "an http(s) URL")
            require(bool(self.model), p + "model", self.model, f"a model name with {p}url")
        require(self.kind in TEACHER_KINDS, p + "kind", self.kind,
                f"one of {list(TEACHER_KINDS)} (a kind whose servers return prompt log-probs)")  # fmt: skip
        require(self.num_servers >= 1, p + "num_servers", self.num_servers, ">= 1")
        require(self.kv_cache_gib >= 0, p + "kv_cache_gib", self.kv_cache_gib, ">= 0 (0 = engine.kv_cache_gib)")


@dataclass
class DistillConfig:
    enable: bool = False
    """On-policy distillation on: every sample is scored by the teacher and its advantage mixes in the teacher's signal."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Where the teacher is: its own engine servers (path) or a running server (url)."""
    coef: float = 1.0
    """Weight of the teacher's per-token advantage: 1.0 = pure distillation, below 1 = coef x teacher + (1 - coef) x the task reward's advantage."""
    discount: float = 0.0
    """Discount of the teacher's per-token signal over later tokens of the sample: 0 = each token's own (teacher - student) log-prob, 1 = the sum over the rest of the response."""
    baseline: str = "none"
    """Centring of the teacher's signal: none = each token's (teacher - student) log-prob as it is; group = less the mean over the group's other samples (leave-one-out, unbiased): far less variance while the student is far from the teacher (docs/distillation.md)."""
    timeout_s: float = 120.0
    """Most seconds one teacher call may take (an attempt; retries each get their own)."""
    retries: int = 3
    """Attempts after the first for a teacher call that failed transiently (connection lost, 5xx, timeout), each back through the limiter."""
    backoff_s: float = 0.5
    """First retry backoff; it doubles per attempt, with full jitter."""
    backoff_max_s: float = 10.0
    """Longest backoff between retries."""
    on_failure: str = "drop"
    """A teacher call that failed after its retries: drop = the group is re-issued (never trained on a made-up signal); raise = the run stops."""
    limits: RewardLimitsConfig = field(default_factory=RewardLimitsConfig)
    """Concurrency / RPM / TPM limits on teacher calls, held across the cluster (tokens = prompt + response)."""

    def validate_section(self, p: str) -> None:
        require(0.0 < self.coef <= 1.0, p + "coef", self.coef, "in (0, 1] (1 = pure distillation)")
        require(0.0 <= self.discount <= 1.0, p + "discount", self.discount, "in [0, 1]")
        require(self.baseline in TEACHER_BASELINES, p + "baseline", self.baseline, f"one of {list(TEACHER_BASELINES)}")
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.retries >= 0, p + "retries", self.retries, ">= 0")
        require(self.backoff_s >= 0, p + "backoff_s", self.backoff_s, ">= 0")
        require(self.backoff_max_s >= self.backoff_s, p + "backoff_max_s", self.backoff_max_s, f">= {p}backoff_s")
        require(self.on_failure in TEACHER_FAILURE_POLICIES, p + "on_failure", self.on_failure,
                f"one of {list(TEACHER_FAILURE_POLICIES)} (no fallback: a teacher failure is never a signal)")  # fmt: skip
        if self.enable and not (self.teacher.path or self.teacher.url):
            raise ConfigError(f"{p}teacher.path or {p}teacher.url must name the teacher with {p}enable=true")


def distill_problems(cfg) -> list[str]:
    """Cross-section rules of distill (FullyAsyncConfig.validate): what the teacher's signal cannot work with."""
    d = cfg.distill
    if not d.enable:
        return []
    out = []
    if cfg.algorithm.adv_estimator == "gae":
        out.append("distill.enable=true works with the group estimators' advantages, not algorithm.adv_estimator=gae "
                   "(the critic's targets would not include the teacher's signal)")  # fmt: skip
    if d.coef == 1.0 and cfg.algorithm.filter_groups.enable:
        out.append("algorithm.filter_groups.enable must be false with distill.coef=1.0: a group whose rewards do not "
                   "vary still carries the teacher's signal, and pure distillation does not use the rewards")  # fmt: skip
    if d.teacher.url is None and cfg.engine.kind == "sim":
        out.append("distill.teacher.path needs real engine servers; engine.kind=sim has no model to serve it "
                   "(use engine=vllm, or distill.teacher.url)")  # fmt: skip
    return out
