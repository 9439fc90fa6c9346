"""Off-policy correction of one training batch: verl's rollout-correction helper driven by
`algorithm.rollout_correction`, rejection that keeps the loss denominator, and diagnostics that separate the two
causes of a gap between the engine's behaviour log-probs and the trainer's.

Contract:
- `correct(prox, behave, mask, rc, ...)` (decoupled mode: pi_prox recomputed by the trainer) returns the per-token
  weights the loss multiplies its terms by: verl's IS weights (1 without IS) times verl's rejection mask. The
  response mask itself is left alone, so a rejected token still counts in the token-mean denominator (the step is
  not rescaled up by what it rejected). A rejected token adds no entropy bonus and no KL term either (verl patch
  0008 aggregates both over the tokens with a weight above 0). `None` when nothing is weighed or rejected.
- A group whose every loss token is rejected is dropped (it adds nothing to the gradient) and counted in
  `offpolicy/groups_all_rejected`; it is not generated again.
- `diagnostics(prox, behave, mask, versions, trainer_version)`: mismatch metrics over loss tokens, overall and per
  staleness bucket. Bucket 0 (the token was sampled by the version the trainer holds) measures engine-vs-trainer
  numerics alone (precision, top_p / top_k processing, LoRA); the other buckets add the version gap.
- Bypass mode computes no pi_prox: verl's bypass_mode loss applies IS and rejection per micro-batch (its
  `rollout_corr/*` metrics come back with the actor's), and the driver has nothing to compare here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fully_async.config.sections.rollout_correction import RolloutCorrectionConfig
from fully_async.protocol import NO_VERSION

SAFETY = 20.0
"""Clamp of log-ratios before exp (verl's rollout_corr_helper.SAFETY_BOUND): the metrics stay finite."""
BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 4, "3_4"), (5, 8, "5_8"), (9, 1 << 30, "9plus"))
"""Staleness buckets (inclusive version gaps) of the per-staleness mismatch metrics."""
TAIL = 2.0
"""Ratio tails: the fraction of tokens with pi_prox / pi_behave above TAIL and below 1 / TAIL."""


def correct(
    prox: torch.Tensor,
    behave: torch.Tensor,
    mask: torch.Tensor,
    rc: RolloutCorrectionConfig,
    group_index: Sequence | np.ndarray | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(weights or None, metrics) for (B, R) log-probs of the trainer (`prox`) and the engine (`behave`) over the
    loss tokens `mask`. See the module docstring."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if not mask.any():
        return None, {}
    is_proto, kept, metrics = compute_rollout_correction_and_rejection_mask(
        prox, behave, mask, **{k: v for k, v in rc.verl_fields().items() if k not in ("bypass_mode", "loss_type")}
    )
    if is_proto is None and rc.rollout_rs is None:
        return None, metrics
    weights = is_proto.batch["rollout_is_weights"].float() if is_proto is not None else torch.ones_like(prox)
    # A token is out when rejection sampling drops it or IcePop zeroes its weight (TIS's weights never reach 0).
    keep = kept.float() * mask.float() * (weights > 0).float()
    metrics.update(rejection_metrics(mask, keep, group_index))
    return weights * keep, metrics


def rejection_metrics(mask: torch.Tensor, keep: torch.Tensor, group_index: Sequence | np.ndarray | None) -> dict:
    """How much of the step was rejected: tokens, sequences (every loss token rejected) and whole groups."""
    loss = mask > 0
    rejected = loss & (keep <= 0)
    has_loss = loss.any(-1)
    seq_out = has_loss & ~(loss & (keep > 0)).any(-1)
    out = {
        "offpolicy/rejected_tokens": float(rejected.sum()),
        "offpolicy/rejected_token_frac": float(rejected.sum()) / max(1, int(loss.sum())),
        "offpolicy/rejected_seqs": float(seq_out.sum()),
        "offpolicy/rejected_seq_frac": float(seq_out.sum()) / max(1, int(has_loss.sum())),
    }
    if group_index is not None:
        groups: dict = {}
        for g, out_row, live in zip(group_index, seq_out.tolist(), has_loss.tolist(), strict=True):
            if live:
                groups[g] = groups.get(g, True) and out_row
        out["offpolicy/groups_all_rejected"] = float(sum(groups.values()))
    return out


def diagnostics(
    prox: torch.Tensor,
    behave: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    trainer_version: int | None,
    cache_versions: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mismatch between trainer and engine log-probs over loss tokens: |diff|, k1 / k2 / k3, ratio tails, the
    effective sample size of the raw ratios and the non-finite rate; the same per staleness bucket when the tokens'
    versions are known (`trainer_version` minus each token's version), and per bucket of the KV cache's staleness
    when `cache_versions` are given (async_training.on_sync=keep: a token's context may be older than itself)."""
    loss = mask > 0
    if not loss.any():
        return {}
    finite = torch.isfinite(prox) & torch.isfinite(behave)
    out = {"offpolicy/nonfinite_frac": float((loss & ~finite).sum()) / int(loss.sum())}
    ok = loss & finite
    out.update(_stats(prox, behave, ok, "offpolicy/"))
    if trainer_version is None:
        return out
    out.update(_by_staleness(prox, behave, ok, versions, trainer_version, "offpolicy/staleness_"))
    if cache_versions is not None:
        older = ok & (cache_versions != NO_VERSION) & (cache_versions < versions)
        out["offpolicy/cache_older_tokens"] = float(older.sum())
        out.update(_by_staleness(prox, behave, ok, cache_versions, trainer_version, "offpolicy/cache_staleness_"))
    return out


def _by_staleness(
    prox: torch.Tensor, behave: torch.Tensor, ok: torch.Tensor, versions: torch.Tensor, trainer: int, prefix: str
) -> dict[str, float]:
    gap = trainer - versions
    known = ok & (versions != NO_VERSION)
    out: dict[str, float] = {}
    for lo, hi, name in BUCKETS:
        sel = known & (gap >= lo) & (gap <= hi)
        if sel.any():
            out.update(_stats(prox, behave, sel, f"{prefix}{name}/"))
    return out


def _stats(prox: torch.Tensor, behave: torch.Tensor, sel: torch.Tensor, prefix: str) -> dict[str, float]:
    if not sel.any():
        return {}
    lr = (prox[sel] - behave[sel]).double().clamp(-SAFETY, SAFETY)
    ratio = lr.exp()
    return {
        f"{prefix}tokens": float(sel.sum()),
        f"{prefix}abs_diff": float(lr.abs().mean()),
        f"{prefix}k1": float((-lr).mean()),
        f"{prefix}k2": float((0.5 * lr**2).mean()),
        f"{prefix}k3": float((ratio - 1 - lr).mean()),
        f"{prefix}ratio_above_tail": float((ratio > TAIL).double().mean()),
        f"{prefix}ratio_below_tail": float((ratio < 1 / TAIL).double().mean()),
        f"{prefix}ess": float(ratio.sum() ** 2 / (ratio.numel() * (ratio**2).sum())),
    }
