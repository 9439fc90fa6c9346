"""algorithm: advantage estimators, the policy loss and dynamic sampling (names checked against the installed verl)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fully_async.config.base import ConfigError, note_alias, require, set_from, was_given
from fully_async.config.sections.rollout_correction import RolloutCorrectionConfig


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal (zero group advantage) is not trained; it frees its staleness slot, is counted (fully_async/count/filtered_groups) and logged in trajectories.jsonl with filtered=true, and the trainer still gets async_training.groups_per_step useful groups per step. The entropy bonus and KL loss then no longer act on those prompts (docs/benchmarks.md, issue 19)."""
    metric: str = "reward"
    """What must vary within a group: reward, or a numeric key of the reward function's returned dict (e.g. acc)."""
    reissue: bool = False
    """Generate a filtered prompt again (a new group of samples) instead of counting it as done; a prompt whose groups are always constant then comes back until one varies."""

    def validate_section(self, p: str) -> None:
        require(bool(self.metric), p + "metric", self.metric, "'reward' or a reward-info key")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: a name verl's core_algos registers (docs/algorithms.md), checked against the installed verl; gae builds a critic (a value model on the trainer ranks); not remax (needs a greedy baseline rollout)."""
    policy_loss: str = "vanilla"
    """Policy loss: a name verl's core_algos registers (docs/algorithms.md), checked against the installed verl; vanilla = the clipped PPO loss on pi_theta / pi_prox."""
    policy_loss_args: dict = field(default_factory=dict)
    """Settings of the policy loss, by verl's names: clip_cov_ratio, clip_cov_lb, clip_cov_ub (clip_cov); kl_cov_ratio, ppo_kl_coef (kl_cov); dro_beta (dro, required); tau_pos, tau_neg (sapo); clip_ratio_c (dual clip of vanilla, dppo_*)."""
    gdpo_reward_keys: list[str] = field(default_factory=list)
    """adv_estimator=gdpo (required): the reward components normalised one by one, each a reward source's name or a key of the reward function's returned dict."""
    gdpo_reward_weights: list[float] = field(default_factory=list)
    """adv_estimator=gdpo: a weight per gdpo_reward_keys entry; empty = equal weights."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling: leave out groups whose rewards do not vary."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    gamma: float = 1.0
    """adv_estimator=gae: discount per response token."""
    lam: float = 1.0
    """adv_estimator=gae: GAE lambda (1 = Monte-Carlo returns minus the critic's values, 0 = one-step TD)."""
    value_clip: float = 0.5
    """adv_estimator=gae: clip of the critic's new values around the values it gave when the batch arrived (verl's critic.cliprange_value)."""
    clip_ratio_low: float = 0.2
    """PPO clip below 1 on pi_theta / pi_prox."""
    clip_ratio_high: float = 0.28
    """PPO clip above 1 on pi_theta / pi_prox."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction under verl's key names and presets (docs/algorithms.md): IS weights, rejection, bypass or decoupled mode."""
    recompute_prox: bool | None = None
    """Alias (older key): false = rollout_correction.bypass_mode=true, true = bypass_mode=false; null = unset."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Alias (older key) of rollout_correction.rollout_is; null = unset."""
    rollout_is_threshold: float | None = None
    """Alias (older key) of rollout_correction.rollout_is_threshold; null = unset."""
    use_kl_loss: bool = False
    """Add a KL(pi_theta || pi_ref) loss term (needs a reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses are aggregated over the global batch."""

    def __post_init__(self) -> None:
        """An older key set is read as its rollout_correction key (over a preset's value) and cleared; set beside
        that key to another value, the line means two things: validate_section says so."""
        rc = self.rollout_correction
        self.__dict__["_clashes"] = []
        for old, new, value in (
            ("recompute_prox", "bypass_mode", None if self.recompute_prox is None else not self.recompute_prox),
            ("rollout_is", "rollout_is", self.rollout_is),
            ("rollout_is_threshold", "rollout_is_threshold", self.rollout_is_threshold),
        ):
            if value is None or not isinstance(rc, RolloutCorrectionConfig):
                continue
            new_key = f"algorithm.rollout_correction.{new}"
            if was_given(rc, new) and getattr(rc, new) != value:
                self._clashes.append(f"{new_key} is set twice, to {getattr(rc, new)!r} and (by the older key "
                                     f"algorithm.{old}={getattr(self, old)}) to {value!r}; keep one")  # fmt: skip
            elif not was_given(rc, new):
                note_alias(f"algorithm.{old}", new_key, value)
                set_from(rc, new, value, f"older key algorithm.{old}")
            setattr(self, old, None)

    @property
    def bypass(self) -> bool:
        """Train on the engine's log-probs as pi_old (no proximal forward pass)."""
        return self.rollout_correction.bypass_mode

    def validate_section(self, p: str) -> None:
        if self.__dict__.get("_clashes"):
            raise ConfigError(self._clashes[0])
        self._validate_registry_names(p)
        require(0 <= self.clip_ratio_low < 1, p + "clip_ratio_low", self.clip_ratio_low, "in [0, 1)")
        require(self.clip_ratio_high >= 0, p + "clip_ratio_high", self.clip_ratio_high, ">= 0")
        require(self.kl_loss_coef >= 0, p + "kl_loss_coef", self.kl_loss_coef, ">= 0")
        require(self.entropy_coeff >= 0, p + "entropy_coeff", self.entropy_coeff, ">= 0")
        require(0 <= self.gamma <= 1, p + "gamma", self.gamma, "in [0, 1]")
        require(0 <= self.lam <= 1, p + "lam", self.lam, "in [0, 1]")
        require(self.value_clip > 0, p + "value_clip", self.value_clip, "> 0")

    def _validate_registry_names(self, p: str) -> None:
        """Names against the installed verl's registries (read without importing verl: config/verl_registry.py),
        then what each name needs. Without verl only the second part runs (the sim backend computes no loss)."""
        from fully_async.config.base import suggest
        from fully_async.config.verl_registry import registered_names

        names = registered_names()
        est, loss = self.adv_estimator, self.policy_loss
        if names is not None:
            for key, value, valid in (("adv_estimator", est, names[0]), ("policy_loss", loss, names[1])):
                if value not in valid:
                    raise ConfigError(
                        f"{p}{key} must be a name the installed verl's core_algos registers: {list(valid)}, "
                        f"got {value!r}{suggest(value, valid)}"
                    )
        if est in NEEDS_UNBUILT:
            raise ConfigError(f"{p}adv_estimator={est} needs {NEEDS_UNBUILT[est]}, which is not built yet")
        if est in NEEDS_PROX and self.bypass:
            raise ConfigError(
                f"{p}adv_estimator={est} needs {p}rollout_correction.bypass_mode=false (its baseline uses the trainer's pi_prox and "
                "sum of pi^2 per token, computed in the same forward pass)"
            )
        if est == "gdpo":
            require(bool(self.gdpo_reward_keys), p + "gdpo_reward_keys", self.gdpo_reward_keys,
                    "a non-empty list of reward components with adv_estimator=gdpo")  # fmt: skip
            require(
                not self.gdpo_reward_weights or len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys),
                p + "gdpo_reward_weights",
                self.gdpo_reward_weights,
                f"empty (equal) or one weight per gdpo_reward_keys entry ({len(self.gdpo_reward_keys)})",
            )
        if loss == "bypass_mode" and not self.bypass:
            raise ConfigError(
                f"{p}policy_loss=bypass_mode needs {p}rollout_correction.bypass_mode=true (it takes the behaviour "
                "log-probs as pi_old and computes its own importance weights)"
            )
        rc = self.rollout_correction
        if self.bypass and loss not in BYPASS_LOSSES and (rc.rollout_rs is not None or rc.loss_type != "ppo_clip"):
            raise ConfigError(
                f"{p}policy_loss={loss} with {p}rollout_correction.bypass_mode=true runs that loss on pi_behave as "
                f"pi_old, without verl's bypass correction: rollout_rs and loss_type=reinforce need policy_loss in "
                f"{list(BYPASS_LOSSES)}, got rollout_rs={rc.rollout_rs}, loss_type={rc.loss_type}"
            )
        unknown = sorted(set(self.policy_loss_args) - set(POLICY_LOSS_ARGS))
        if unknown:
            raise ConfigError(
                f"{p}policy_loss_args has unknown keys {unknown}; allowed: {list(POLICY_LOSS_ARGS)}"
                f"{suggest(unknown[0], POLICY_LOSS_ARGS)}"
            )
        for key, value in self.policy_loss_args.items():
            require(isinstance(value, int | float) and not isinstance(value, bool), f"{p}policy_loss_args.{key}",
                    value, "a number")  # fmt: skip
        if loss == "dro" and "dro_beta" not in self.policy_loss_args:
            raise ConfigError(
                f"{p}policy_loss=dro needs {p}policy_loss_args.dro_beta (its quadratic log-ratio penalty)"
            )


BYPASS_LOSSES = ("vanilla", "bypass_mode")
"""Policy losses that bypass mode replaces by verl's bypass_mode loss (loss_type, IS weights, rejection)."""


NEEDS_UNBUILT = {
    "remax": "a greedy baseline rollout per prompt (verl's reward_baselines)",
}
"""Estimators verl registers that need a part fully_async does not build yet."""
NEEDS_CRITIC = ("gae",)
"""Estimators that need the critic (a value model trained beside the policy)."""
NEEDS_PROX = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""Estimators whose baseline needs the proximal log-probs and sum of pi^2 per token (verl's OTB)."""
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "grpo_passk", "rloo", "rloo_vectorized", "opo",
                    "reinforce_plus_plus_baseline", "gpg", *NEEDS_PROX)  # fmt: skip
"""Estimators with a per-group baseline: they need rollout.n >= 2."""
POLICY_LOSS_ARGS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta",
                    "tau_pos", "tau_neg", "clip_ratio_c")  # fmt: skip
"""verl's policy-loss settings algorithm.policy_loss_args may set (PolicyLossConfig and ActorConfig fields)."""
