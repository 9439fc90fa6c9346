"""reward: reward sources (rule, judge, reward model, functions), their limits and failure policy, group_fn."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import DOTTED_PATH, FILE_FUNCTION, PATH, ConfigError, check_dotted, require

REWARD_KINDS = ("rule", "judge", "reward_model")
GROUP_FN_NAME = "group_fn"
"""reward.group_fn's name in reward stats, metrics (fully_async/reward/group_fn/*) and reward info."""
FAILURE_POLICIES = ("fallback", "drop", "raise")
JUDGE_FIELDS = ("question", "response", "reference")


@dataclass
class RewardLimitsConfig:
    max_concurrent: int = 0
    """Most calls of this source in flight at once across the cluster; 0 = no limit."""
    rpm: float = 0.0
    """Requests per minute across the cluster (every attempt counts, retries included); 0 = no limit."""
    tpm: float = 0.0
    """Tokens per minute across the cluster: reserved from an estimate (prompt + max output), settled with the usage the API reports; 0 = no limit."""
    burst_s: float = 1.0
    """Bucket capacity in seconds of rate: how far a quiet source may burst ahead of rpm / tpm."""
    lease_s: float = 0.1
    """Each process leases permits for about this many seconds of traffic per call to the limiter actor."""
    scope: Literal["cluster", "process"] = "cluster"
    """cluster = one named Ray actor per source holds the buckets for every process; process = a limiter per process."""

    def active(self) -> bool:
        return bool(self.max_concurrent or self.rpm or self.tpm)

    def validate_section(self, p: str) -> None:
        require(self.max_concurrent >= 0, p + "max_concurrent", self.max_concurrent, ">= 0 (0 = no limit)")
        require(self.rpm >= 0, p + "rpm", self.rpm, ">= 0 (0 = no limit)")
        require(self.tpm >= 0, p + "tpm", self.tpm, ">= 0 (0 = no limit)")
        require(self.lease_s > 0, p + "lease_s", self.lease_s, "> 0")
        require(
            self.burst_s >= 2 * self.lease_s,
            p + "burst_s",
            self.burst_s,
            f">= 2 * lease_s = {2 * self.lease_s:g} (a bucket must hold a lease with room to spare)",
        )


@dataclass
class JudgeConfig:
    base_url: str | None = None
    """OpenAI-compatible endpoint, e.g. http://host:8000/v1 (required for kind=judge)."""
    model: str | None = None
    """Model name sent with every request (required for kind=judge)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself); null = no key."""
    prompt_template: str = (
        "Grade the response to the question against the reference answer.\n\nQuestion:\n{question}\n\n"
        "Reference answer:\n{reference}\n\nResponse:\n{response}\n\n"
        "Reply with one line 'Score: X' where X is between 0 and 1."
    )
    """User message sent to the judge; placeholders {question}, {response}, {reference}."""
    score_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """Regular expression whose first group is the score in the judge's reply (the last match wins)."""
    score_scale: float = 1.0
    """The parsed score is divided by this (10 for a judge that scores out of 10)."""
    max_tokens: int = 64
    """Most tokens the judge may generate (also the output part of the TPM estimate)."""
    temperature: float = 0.0
    """Judge sampling temperature."""
    tokenizer: str | None = field(default=None, metadata=PATH)
    """Tokenizer directory for TPM estimates; null = the policy model's tokenizer."""

    def validate_section(self, p: str) -> None:
        import string

        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        except ValueError as e:
            raise ConfigError(
                f"{p}prompt_template is not a valid template ({e}); double braces write a literal one"
            ) from None
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown:
            raise ConfigError(
                f"{p}prompt_template uses unknown placeholders {unknown}; allowed: {list(JUDGE_FIELDS)} "
                "(double braces write a literal one)"
            )
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as e:
            raise ConfigError(f"{p}score_pattern is not a regular expression: {e}") from None
        require(pattern.groups >= 1, p + "score_pattern", self.score_pattern, "a regular expression with a group")
        require(self.score_scale > 0, p + "score_scale", self.score_scale, "> 0")
        require(self.max_tokens >= 1, p + "max_tokens", self.max_tokens, ">= 1")
        require(self.temperature >= 0, p + "temperature", self.temperature, ">= 0")


@dataclass
class RewardModelConfig:
    urls: list[str] = field(default_factory=list, metadata={"paths": True})
    """Service mode: base URLs of the vLLM / SGLang servers hosting the reward model (a list, or one URL as a string; requests go to the least busy)."""
    endpoint: Literal["classify", "pooling", "chat"] = "classify"
    """Service API: /classify or /pooling (a score head), or chat = a generative judge prompt (judge settings)."""
    model: str | None = None
    """Model name sent to the service; null = the server's only model."""
    label: int = 0
    """Which output of a classify / pooling head is the score."""
    path: str | None = field(default=None, metadata=PATH)
    """Local mode (no urls): a Hugging Face sequence-classification model loaded in a Ray worker of our own."""
    max_batch: int = 16
    """Local mode: most items per forward pass."""
    max_wait_ms: float = 20.0
    """Local mode: how long the first request of a batch waits for more before the forward pass runs."""
    num_replicas: int = 1
    """Local mode: Ray workers holding a copy of the model."""

    def validate_section(self, p: str) -> None:
        require(self.max_batch >= 1, p + "max_batch", self.max_batch, ">= 1")
        require(self.max_wait_ms >= 0, p + "max_wait_ms", self.max_wait_ms, ">= 0")
        require(self.num_replicas >= 1, p + "num_replicas", self.num_replicas, ">= 1")
        require(self.label >= 0, p + "label", self.label, ">= 0")


@dataclass
class RewardSourceConfig:
    kind: str = "rule"
    """rule (scorer chosen by data_source), judge, reward_model, or a dotted path 'pkg.mod:fn' of compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (sync or async)."""
    name: str | None = None
    """Name in reward info, metrics and the limiter actor; null = the kind (rule, judge, reward_model, the function)."""
    weight: float = 1.0
    """A trajectory's reward is the weighted sum of its sources' scores."""
    timeout_s: float = 10.0
    """Hard timeout of one call (one attempt for judge / reward_model); a sync function's worker is killed when it passes."""
    on_failure: Literal["fallback", "drop", "raise"] = "fallback"
    """fallback = fallback_score with the failure flagged; drop = the whole group is re-issued; raise = the run fails."""
    fallback_score: float = 0.0
    """Score used (and flagged) when the source fails under on_failure=fallback."""
    retries: int = 4
    """judge / reward_model: retries after the first attempt on timeouts, connection errors, 408, 429 and 5xx."""
    backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter, up to backoff_max_s (a Retry-After header wins)."""
    backoff_max_s: float = 30.0
    """Longest retry delay; a Retry-After longer than this ends the retries (then on_failure applies)."""
    limits: RewardLimitsConfig = field(default_factory=RewardLimitsConfig)
    """Concurrency, RPM and TPM limits of this source."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """kind=judge (and reward_model with endpoint=chat): the OpenAI-compatible endpoint, prompt and parser."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """kind=reward_model: a service (urls) or a model in our own Ray workers (path)."""

    @property
    def label(self) -> str:
        return self.name or (self.kind if self.kind in REWARD_KINDS else self.kind.rpartition(":")[2])

    def validate_section(self, p: str) -> None:
        if self.kind not in REWARD_KINDS and not DOTTED_PATH.match(self.kind) and not FILE_FUNCTION.match(self.kind):
            from fully_async.config.base import suggest

            raise ConfigError(
                f"{p}kind must be one of {list(REWARD_KINDS)}, a dotted path 'package.module:function' or a file "
                "'/abs/path/file.py:function', "
                f"got {self.kind!r}{suggest(self.kind, REWARD_KINDS)}"
            )
        require(self.timeout_s > 0, p + "timeout_s", self.timeout_s, "> 0")
        require(self.retries >= 0, p + "retries", self.retries, ">= 0")
        require(self.backoff_s >= 0, p + "backoff_s", self.backoff_s, ">= 0")
        require(self.backoff_max_s >= self.backoff_s, p + "backoff_max_s", self.backoff_max_s, ">= backoff_s")
        self.limits.validate_section(p + "limits.")
        self.judge.validate_section(p + "judge.")
        self.reward_model.validate_section(p + "reward_model.")
        if self.kind == "judge" or (self.kind == "reward_model" and self.reward_model.endpoint == "chat"):
            for key in ("base_url", "model"):
                if not getattr(self.judge, key) and not (self.kind == "reward_model" and key == "base_url"):
                    raise ConfigError(f"{p}judge.{key} must be set for kind={self.kind}, got null")
        if self.kind == "reward_model" and bool(self.reward_model.urls) == bool(self.reward_model.path):
            raise ConfigError(
                f"{p}reward_model needs exactly one of urls (a service) or path (a model in our Ray workers), got "
                f"urls={self.reward_model.urls!r}, path={self.reward_model.path!r}"
            )


@dataclass
class RewardConfig:
    sources: list[RewardSourceConfig] = field(default_factory=lambda: [RewardSourceConfig()])
    """Reward sources, each {kind, weight, limits, on_failure, ...}; the reward is their weighted sum."""
    num_workers: int = 2
    """Processes running synchronous reward functions (shared by every rule / dotted-path source)."""
    limiter_namespace: str = "fully_async"
    """Ray namespace of the per-source limiter actors: processes in one namespace share each source's limits."""
    group_fn: str | None = None
    """Dotted path 'pkg.mod:fn' of fn(group) -> rewards or (rewards, info), sync or async, run once all samples of a group are scored and before the group is queued; group = {prompt_uid, data_source, ground_truth, extra_info, question, samples: [{sample_index, response, reward, reward_info, response_length, finish_reason}]}, rewards = one number per sample (its new reward), info = one dict for the group or one per sample (fully_async/reward/group.py); null = off."""
    group_fn_timeout_s: float = 30.0
    """Hard timeout of one group_fn call (a sync function's worker is killed when it passes)."""
    group_fn_on_failure: Literal["fallback", "drop", "raise"] = "fallback"
    """When group_fn fails or times out: fallback = keep the per-sample scores, flagged; drop = re-issue the group; raise = the run fails."""
    overlong_buffer: int = 0
    """DAPO overlong reward shaping: a response longer than rollout.response_length - overlong_buffer tokens loses overlong_penalty x (excess / overlong_buffer), up to overlong_penalty at the budget; 0 = off."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: the penalty at the full response budget (the shaping is linear over the buffer)."""

    def validate_section(self, p: str) -> None:
        check_dotted(p + "group_fn", self.group_fn)
        require(self.group_fn_timeout_s > 0, p + "group_fn_timeout_s", self.group_fn_timeout_s, "> 0")
        require(self.overlong_buffer >= 0, p + "overlong_buffer", self.overlong_buffer, ">= 0 (0 = off)")
        require(self.overlong_penalty >= 0, p + "overlong_penalty", self.overlong_penalty, ">= 0")
        require(bool(self.sources), p + "sources", self.sources, "a non-empty list of reward sources")
        require(self.num_workers >= 1, p + "num_workers", self.num_workers, ">= 1")
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            src.validate_section(f"{p}sources[{i}].")
            if src.label == GROUP_FN_NAME:
                raise ConfigError(
                    f"{p}sources[{i}].name: {GROUP_FN_NAME!r} names reward.group_fn's metrics; choose another"
                )
            if src.label in seen:
                raise ConfigError(
                    f"{p}sources[{i}].name: {src.label!r} is already the name of sources[{seen[src.label]}]; "
                    "give each source its own name (it names its metrics and its limiter)"
                )
            seen[src.label] = i
