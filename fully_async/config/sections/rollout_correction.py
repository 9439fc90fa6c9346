"""algorithm.rollout_correction: verl's rollout correction (IS weights, rejection sampling, bypass or decoupled mode)
under verl's own key names, its named presets, and the fail-closed rule for asynchronous runs.

The keys and values are verl 0.9.1's `RolloutCorrectionConfig` (verl/trainer/config/algorithm.py); training drives
verl's `rollout_corr_helper` with them (fully_async/training/correction.py). The presets are written out here so the
config validates without importing verl (before Ray); tests/unit/training/test_correction.py checks them against the
installed verl's preset methods. Imports only the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fully_async.config.base import ConfigError, require, resolve_unset, settable, suggest

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_GEO = "0.999_1.001"
PRESETS: dict[str, dict] = {
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO),
    "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "bypass_ppo_clip": dict(rollout_is=None, bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(
        rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True
    ),  # fmt: skip
    "bypass_ppo_clip_k3_rs": dict(
        rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True
    ),  # fmt: skip
    "bypass_pg_is": dict(rollout_is="sequence", bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": dict(
        rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True, loss_type="reinforce"
    ),  # fmt: skip
    "bypass_pg_geo_rs": dict(
        rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True, loss_type="reinforce"
    ),  # fmt: skip
    "bypass_pg_geo_rs_seq_tis": dict(
        rollout_is="sequence",
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=_GEO,
        bypass_mode=True,
        loss_type="reinforce",
    ),  # fmt: skip
    "bypass_pg_geo_rs_token_tis": dict(
        rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True, loss_type="reinforce"
    ),  # fmt: skip
    "disabled": dict(rollout_is=None),
}
"""verl's preset methods by name -> the keys each sets (the rest keep verl's defaults: threshold 2.0, no batch
normalisation, no rejection, decoupled mode, ppo_clip)."""

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # fmt: skip
"""verl's rejection-sampling options (rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS)."""

_VERL_DEFAULTS = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                      rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip")  # fmt: skip


@dataclass
class RolloutCorrectionConfig:
    preset: str | None = None
    """A verl preset by name (decoupled_token_is, decoupled_geo_rs_token_tis, bypass_pg_geo_rs, decoupled_k3_rs, ...; docs/algorithms.md); it sets the keys no YAML or command line sets (the rest take verl's defaults); a key set explicitly always wins, even set to its default value (`--cfg job` marks the keys the preset set)."""
    rollout_is: str | None = settable("token")
    """Importance weight pi_prox / pi_behave (decoupled) or pi_theta / pi_behave (bypass + reinforce) per token or per sequence; null = none."""
    rollout_is_threshold: str | float = settable(2.0)
    """IS bound: a number truncates the weight above it (TIS); 'lower_upper' (e.g. '0.5_5.0') zeroes weights outside [lower, upper] (IcePop)."""
    rollout_is_batch_normalize: bool = settable(False)
    """Divide the IS weights by their batch mean (mean weight 1)."""
    rollout_rs: str | None = settable(None)
    """Rejection sampling: comma-separated verl options token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1 = geometric mean ratio), seq_max_k2/k3; null = none. A rejected token keeps its place in the loss denominator."""
    rollout_rs_threshold: str | float | None = settable(None)
    """Rejection bound per rollout_rs option: k1 takes 'lower_upper' ratio bounds (one number = upper, lower its reciprocal); k2/k3 an upper bound."""
    bypass_mode: bool = settable(False)
    """True = train on the engine's log-probs as pi_old (no proximal forward pass; verl's bypass_mode loss with loss_type); false = recompute pi_prox with the trainer's weights (decoupled PPO)."""
    loss_type: str = settable("ppo_clip")
    """bypass_mode: ppo_clip (PPO clip on pi_theta / pi_behave, IS weights not applied) or reinforce (policy gradient times the IS weights)."""
    allow_uncorrected: bool = False
    """Opt out of the fail-closed rule: allow async_training.max_staleness >= 1 with a configuration that corrects nothing."""

    def __post_init__(self) -> None:
        # The preset fills only the keys nobody set (an unknown name fills nothing: validate_section reports it).
        preset = {**_VERL_DEFAULTS, **PRESETS[self.preset]} if self.preset in PRESETS else None
        resolve_unset(self, preset, f"preset {self.preset}")

    def validate_section(self, p: str) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(
                f"{p}preset must be one of verl's presets {list(PRESETS)} or null, got {self.preset!r}"
                f"{suggest(self.preset, PRESETS)}"
            )
        require(self.rollout_is in (None, "token", "sequence"), p + "rollout_is", self.rollout_is,
                "'token', 'sequence' or null")  # fmt: skip
        require(
            self.loss_type in ("ppo_clip", "reinforce"), p + "loss_type", self.loss_type, "'ppo_clip' or 'reinforce'"
        )
        _check_bounds(p + "rollout_is_threshold", self.rollout_is_threshold, pair=True, upper_at_least_1=True)
        if self.rollout_rs is None:
            return
        options = [o.strip() for o in self.rollout_rs.split(",") if o.strip()]
        bad = [o for o in options if o not in RS_OPTIONS]
        if not options or bad:
            raise ConfigError(
                f"{p}rollout_rs must be a comma-separated list of {list(RS_OPTIONS)}, got {self.rollout_rs!r}"
                f"{suggest(bad[0], RS_OPTIONS) if bad else ''}"
            )
        if self.rollout_rs_threshold is None:
            raise ConfigError(f"{p}rollout_rs_threshold must be set with {p}rollout_rs={self.rollout_rs}, got null")
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",")]
        require(len(specs) in (1, len(options)), p + "rollout_rs_threshold", self.rollout_rs_threshold,
                f"one bound for all or one per rollout_rs option ({len(options)})")  # fmt: skip
        for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs, strict=False):
            k1 = option.endswith("k1")
            _check_bounds(f"{p}rollout_rs_threshold ({option})", spec, pair=k1, upper_at_least_1=k1)

    def corrects(self) -> bool:
        """Whether anything acts on the gap between the behaviour policy and the trained one: IS weights that the
        loss applies (not bypass + ppo_clip, whose ratio is already on pi_behave and which ignores them) or rejection."""
        weighs = self.rollout_is is not None and not (self.bypass_mode and self.loss_type == "ppo_clip")
        return weighs or self.rollout_rs is not None

    def rejects(self) -> bool:
        """Whether some loss tokens can get weight 0: rejection sampling, or IS with IcePop's 'lower_upper' bound
        (weights outside it are zeroed)."""
        return self.rollout_rs is not None or (self.rollout_is is not None and "_" in str(self.rollout_is_threshold))

    def verl_fields(self) -> dict:
        """The keyword arguments of verl's RolloutCorrectionConfig."""
        return {k: getattr(self, k) for k in _VERL_DEFAULTS}


def _check_bounds(key: str, spec: str | float, pair: bool, upper_at_least_1: bool = False) -> None:
    """A positive number, or (pair) 'lower_upper' with 0 < lower <= upper: what verl's parsers accept. A ratio bound
    given as one number must be >= 1: Hydra and YAML read an unquoted 0.5_5 as the number 0.55."""
    text = str(spec).strip()
    parts = text.split("_", 1) if pair and "_" in text else [text]
    nums = [float(x) for x in parts if _NUMBER.fullmatch(x.strip())]  # not float()'s own '0.5_2' = 0.52
    nums = nums if len(nums) == len(parts) else []
    lone_below_1 = upper_at_least_1 and len(nums) == 1 and nums[0] < 1
    if not nums or min(nums) <= 0 or nums[0] > nums[-1] or lone_below_1:
        allowed = "a positive number" + (" >= 1" if upper_at_least_1 else "")
        if pair:
            allowed += " or 'lower_upper' with 0 < lower <= upper (quoted: an unquoted 0.5_5 reads as 0.55)"
        raise ConfigError(f"{key} must be {allowed}, got {spec!r}")


def uncorrected_problem(rc: RolloutCorrectionConfig, max_staleness: int, prefix: str = "algorithm.") -> str | None:
    """The fail-closed rule: an asynchronous run (max_staleness >= 1) must name a correction or opt out."""
    if max_staleness < 1 or rc.allow_uncorrected or rc.corrects():
        return None
    mode = "bypass" if rc.bypass_mode else "decoupled"
    return (
        f"async_training.max_staleness={max_staleness} trains on samples up to {max_staleness} versions old, but "
        f"{prefix}rollout_correction corrects nothing ({mode} mode, rollout_is={rc.rollout_is}, rollout_rs=null"
        f"{', loss_type=ppo_clip ignores IS weights' if rc.bypass_mode and rc.rollout_is else ''}); name one, e.g. "
        f"{prefix}rollout_correction.preset=decoupled_token_is (the default), decoupled_geo_rs_token_tis, "
        f"decoupled_k3_rs or bypass_pg_geo_rs (docs/algorithms.md), or set "
        f"{prefix}rollout_correction.allow_uncorrected=true to train uncorrected"
    )
