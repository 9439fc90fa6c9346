"""On-policy distillation's per-token advantage, mixed into the estimator's (docs/distillation.md).

Contract:
- The teacher's signal at response token t of a sample is r_t = log pi_teacher(y_t | prefix) - log pi_student(y_t |
  prefix): the negative of the per-token reverse-KL estimate log pi_student - log pi_teacher, taken at the token the
  student sampled. pi_student is the trainer's current policy, the proximal log-probs the backend computes before the
  update (pi_prox, `old_log_probs`): the reverse KL's gradient at the weights being trained is
  E[grad log pi (log pi_teacher - log pi)] at those weights, and the loss's importance weight min(pi_prox / pi_behave,
  cap) carries a stale sample over to them, exactly as for a task advantage. Taking r_t against the behaviour
  log-prob instead (the engine's, up to max_staleness versions old) adds grad KL(pi || pi_behave) to the ascent: a
  push away from the policy that sampled, which a trust region exists to stop. With no proximal pass
  (`algorithm.bypass`) pi_prox is the behaviour policy and r_t is taken against it.
- With `discount` g the advantage is the discounted sum over the sample's later loss tokens,
  A_t = sum_{k >= t, mask_k = 1} g^(number of loss tokens between t and k) r_k; g = 0 is r_t alone. Tokens off the
  loss mask (tool and environment output, padding) carry no signal and get advantage 0; the sum bridges them.
- With `baseline` "group" the signal is first centred per group: each row's r_t less b, the mean over the group's
  OTHER samples of each sample's mean r over its loss tokens (leave-one-out: b does not depend on the row's own
  tokens, so E[grad log pi x b] = 0 and the gradient stays unbiased; a sample split into rows is one sample; a
  group of one sample gets b = 0). The reverse KL's per-token value is mostly a constant for a student far from
  the teacher (every sampled token is one the teacher disfavours); that constant carries no information, only
  variance, and under gradient clipping it takes the step's norm from the part that does. With a discount, b is
  subtracted once from each token's discounted sum, never from each r_k inside it: there every later token would
  add -b to the advantage, a reward for length.
- The advantage trained on is coef x A_teacher + (1 - coef) x A_task, where A_task is the estimator's advantage of
  the task reward (GRPO's group baseline, ...). Both are 0 off the mask.
- A batch in which any trajectory lacks its teacher log-probs is refused (ValueError): a missing score is never
  replaced by a made-up one (the rollouter re-issues a group whose teacher call failed).
"""

from __future__ import annotations

import numpy as np
import torch

from fully_async.protocol import NO_VERSION
from fully_async.training.correction import BUCKETS


def teacher_signal(teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) r_t = teacher - student log-prob on loss tokens, 0 elsewhere (float32)."""
    keep = mask > 0
    return torch.where(keep, teacher.float() - student.float(), torch.zeros_like(student, dtype=torch.float32))


def group_baseline(signal: torch.Tensor, mask: torch.Tensor, groups: np.ndarray, owners: np.ndarray) -> torch.Tensor:
    """(B,) the leave-one-out group baseline of each row (module docstring): `groups` the rows' group ids, `owners`
    the row each row's sample is owned by (training/batch.py `sample_owners`)."""
    keep = (mask > 0).double()
    tokens = np.zeros(len(owners))
    total = np.zeros(len(owners))
    np.add.at(tokens, owners, keep.sum(dim=1).numpy())  # per sample, at its owner row
    np.add.at(total, owners, (signal.double() * keep).sum(dim=1).numpy())
    scored = tokens > 0  # owner rows of samples with loss tokens
    mean = np.where(scored, total / np.maximum(tokens, 1.0), 0.0)
    _, gid = np.unique(np.asarray(groups, dtype=str), return_inverse=True)
    group_sum, group_n = np.zeros(gid.max() + 1), np.zeros(gid.max() + 1)
    np.add.at(group_sum, gid[scored], mean[scored])
    np.add.at(group_n, gid[scored], 1.0)
    own = scored[owners]  # whether the row's own sample counts in its group's sums
    others = group_n[gid[owners]] - own
    sums = group_sum[gid[owners]] - np.where(own, mean[owners], 0.0)
    return torch.from_numpy(np.where(others > 0, sums / np.maximum(others, 1.0), 0.0)).float()


def discounted(signal: torch.Tensor, keep: torch.Tensor, discount: float) -> torch.Tensor:
    """(B, R) each loss token's discounted sum of the signal over the row's later loss tokens (0 off the mask)."""
    out = torch.zeros_like(signal)
    running = torch.zeros(signal.shape[0], dtype=torch.float32)
    for t in range(signal.shape[1] - 1, -1, -1):  # responses are short next to the forward pass this precedes
        running = torch.where(keep[:, t], signal[:, t] + discount * running, running)
        out[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return out


def teacher_advantages(
    teacher: torch.Tensor,
    student: torch.Tensor,
    mask: torch.Tensor,
    discount: float = 0.0,
    baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, R) the teacher's per-token advantage (module docstring) against the student's log-probs `student`
    (pi_prox), less the (B,) `baseline` per row when given, 0 off the mask."""
    signal = teacher_signal(teacher, student, mask)
    keep = mask > 0
    out = signal if discount == 0.0 else discounted(signal, keep, discount)
    if baseline is not None:  # once per token, after the sum: inside it every later token would pay -b (length)
        out = torch.where(keep, out - baseline[:, None], out)
    return out


def mix(task: torch.Tensor, teacher: torch.Tensor, coef: float) -> torch.Tensor:
    """coef x the teacher's advantage + (1 - coef) x the task's (coef = 1: the task's is not used at all)."""
    if coef == 1.0:
        return teacher.float()
    return (coef * teacher + (1.0 - coef) * task).float()


def teacher_metrics(
    teacher: torch.Tensor, behave: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor, trainer_version: int | None
) -> dict[str, float]:
    """The student's reverse KL to the teacher per loss token, estimated on the sampled tokens (mean of
    behave - teacher), overall and per staleness bucket (trainer version minus the token's version, the buckets of
    training/correction.py), and the mean teacher log-prob."""
    keep = mask > 0
    if not keep.any():
        return {}
    gap = behave.double() - teacher.double()
    out = {
        "distill/teacher_kl": float(gap[keep].mean()),
        "distill/teacher_logprob": float(teacher.double()[keep].mean()),
        "distill/tokens": float(keep.sum()),
    }
    if trainer_version is None:
        return out
    known = keep & (versions != NO_VERSION)
    lag = trainer_version - versions
    for lo, hi, name in BUCKETS:
        sel = known & (lag >= lo) & (lag <= hi)
        if sel.any():
            out[f"distill/staleness_{name}/teacher_kl"] = float(gap[sel].mean())
    return out


def distill_advantages(
    task: torch.Tensor,
    teacher: torch.Tensor | None,
    behave: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    coef: float,
    discount: float,
    trainer_version: int | None = None,
    student: torch.Tensor | None = None,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(the advantages trained on, distill metrics) for a batch's (B, R) tensors; `teacher` None is refused. The
    signal is taken against `student`, the proximal log-probs (None: no proximal pass ran, the behaviour log-probs
    stand for them); the metrics describe the sampled policy (behaviour log-probs). `groups` (the rows' group ids,
    their sample owners) centres the signal on the leave-one-out group baseline; None leaves it uncentred."""
    if teacher is None:
        raise ValueError("distill.enable=true but the batch holds no teacher log-probs (a sample was never scored)")
    student = behave if student is None else student
    base = None if groups is None else group_baseline(teacher_signal(teacher, student, mask), mask, *groups)
    adv = teacher_advantages(teacher, student, mask, discount, base)
    metrics = teacher_metrics(teacher, behave, mask, versions, trainer_version)
    keep = mask > 0
    if keep.any():
        metrics["distill/advantage_mean"] = float(adv[keep].mean())
        if base is not None:
            metrics["distill/baseline_mean"] = float(base[keep.any(dim=1)].mean())
    return mix(task, adv, coef) * mask.float(), metrics
