"""TrajectoryGroups -> the tensors verl's engine consumes, advantages and off-policy importance weights.

Layout (as verl's PPO trainer builds it): `prompts` left-padded to P, `responses` right-padded to R, `input_ids` =
prompts ++ responses, `attention_mask`, `position_ids`, and `response_mask` (1 on response tokens that enter the loss:
padding and tool/environment tokens are 0). `to_engine_td` converts to verl's no-padding (nested) layout.

Rows for data parallelism: verl splits a batch into equal contiguous chunks per rank, and each rank's chunk into equal
mini-batches, asserting divisibility. `dp_layout` pads with inert rows (one prompt token, one response token, mask 0)
and spreads the real rows round-robin over (mini-batch, rank) slots, so every global mini-batch holds real tokens and
the loss — normalised by the global mini-batch's token count — does not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fully_async.protocol import NO_VERSION, TrajectoryGroup, flatten
from fully_async.training.vision_batch import vision_inputs

if TYPE_CHECKING:
    from fully_async.config import AlgorithmConfig
    from fully_async.multimodal.processor import VisionProcessor


@dataclass
class PaddedBatch:
    """Padded tensors of B rows. Rows past `num_real` (after `dp_layout`, rows where `source` is -1) are padding."""

    prompts: torch.Tensor
    """(B, P) int64, left-padded."""
    responses: torch.Tensor
    """(B, R) int64, right-padded."""
    attention_mask: torch.Tensor
    """(B, P + R) int64."""
    response_mask: torch.Tensor
    """(B, R) int64: 1 where the token enters the loss."""
    behaviour_logprobs: torch.Tensor
    """(B, R) float32 log-probs reported by the engine (0 on padding)."""
    token_versions: torch.Tensor
    """(B, R) int64 policy version per token (NO_VERSION on padding / tool tokens); for metrics only."""
    rewards: torch.Tensor
    """(B,) float32 scalar reward per trajectory."""
    group_index: np.ndarray
    """(B,) object array: the group uid of each row (advantage baselines are per group)."""
    source: np.ndarray
    """(B,) int64: index of the row in `flatten(groups)`, -1 for padding rows."""
    multi_modal_inputs: list[dict[str, torch.Tensor] | None] | None = None
    """Per row, verl's multi_modal_inputs of a prompt with images (pixel_values, image_grid_thw), None for a text row;
    None for a batch without images (training/vision_batch.py)."""
    mrope_position_ids: torch.Tensor | None = None
    """(B, 4, P + R) int64 position ids of a vision-language model (text row, then mrope's three), None otherwise."""
    cache_versions: torch.Tensor | None = None
    """(B, R) int64 the oldest weight version in each token's KV cache (NO_VERSION on padding / tool tokens), None when
    no row's differs from its token_versions (only async_training.on_sync=keep makes them differ); for metrics."""
    teacher_logprobs: torch.Tensor | None = None
    """(B, R) float32 the distillation teacher's log-probs (0 on padding), None when no row has them
    (training/distill_loss.py)."""

    @property
    def size(self) -> int:
        return self.prompts.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompts.shape[1] :].sum(-1)

    @property
    def position_ids(self) -> torch.Tensor:
        """(B, P + R), or (B, 4, P + R) for a vision-language model's batch."""
        if self.mrope_position_ids is not None:
            return self.mrope_position_ids
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def select(self, rows: np.ndarray) -> PaddedBatch:
        """Rows by index into this batch; index -1 gives an inert padding row."""
        rows = np.asarray(rows, dtype=np.int64)
        pad = rows < 0
        take = torch.from_numpy(np.where(pad, 0, rows))
        pad_t = torch.from_numpy(pad)
        out = {}
        for name in ("prompts", "responses", "attention_mask", "response_mask", "behaviour_logprobs", "rewards"):
            out[name] = getattr(self, name)[take].clone()
        out["token_versions"] = self.token_versions[take].clone()
        if pad.any():
            p = self.prompts.shape[1]
            out["attention_mask"][pad_t] = 0
            out["attention_mask"][pad_t, p - 1] = 1  # one prompt token: verl requires prompt length >= 1
            out["attention_mask"][pad_t, p] = 1  # one response token, masked out of the loss
            for name in ("response_mask", "behaviour_logprobs", "rewards"):
                out[name][pad_t] = 0
            out["token_versions"][pad_t] = NO_VERSION
        group_index = np.where(pad, "", self.group_index[np.where(pad, 0, rows)])
        source = np.where(pad, -1, self.source[np.where(pad, 0, rows)])
        if self.multi_modal_inputs is not None:
            out["multi_modal_inputs"] = [None if r < 0 else self.multi_modal_inputs[r] for r in rows]
            mrope = self.mrope_position_ids[take].clone()
            # A padding row's two tokens get text positions 0, 1 on all four rows (it carries no image).
            mrope[pad_t] = (out["attention_mask"][pad_t].cumsum(-1) - 1).clamp(min=0).unsqueeze(1)
            out["mrope_position_ids"] = mrope
        if self.cache_versions is not None:
            out["cache_versions"] = self.cache_versions[take].clone()
            out["cache_versions"][pad_t] = NO_VERSION
        if self.teacher_logprobs is not None:
            out["teacher_logprobs"] = self.teacher_logprobs[take].clone()
            out["teacher_logprobs"][pad_t] = 0
        return PaddedBatch(group_index=group_index, source=source, **out)


def assemble(
    groups: Sequence[TrajectoryGroup], pad_token_id: int = 0, vision: VisionProcessor | None = None
) -> PaddedBatch:
    """Pad the trajectories of `groups` (in `flatten` order) into one batch. Empty responses keep one padded slot.
    `vision`: the model's vision processor, which a batch with images needs (its pixel inputs and mrope positions
    are built here, from the trajectories' PNG bytes)."""
    trajs = flatten(groups)
    if not trajs:
        raise ValueError("cannot assemble a batch from zero trajectories")
    b = len(trajs)
    p = max(len(t.prompt_ids) for t in trajs)
    r = max(1, max(len(t.response_ids) for t in trajs))
    prompts = torch.full((b, p), pad_token_id, dtype=torch.int64)
    responses = torch.full((b, r), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, p + r), dtype=torch.int64)
    response_mask = torch.zeros((b, r), dtype=torch.int64)
    behaviour = torch.zeros((b, r), dtype=torch.float32)
    versions = torch.full((b, r), NO_VERSION, dtype=torch.int64)
    for i, t in enumerate(trajs):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        prompts[i, p - lp :] = torch.from_numpy(t.prompt_ids.astype(np.int64))
        attention_mask[i, p - lp : p + lr] = 1
        if lr:
            responses[i, :lr] = torch.from_numpy(t.response_ids.astype(np.int64))
            response_mask[i, :lr] = torch.from_numpy(t.loss_mask.astype(np.int64))
            behaviour[i, :lr] = torch.from_numpy(t.behaviour_logprobs.astype(np.float32))
            versions[i, :lr] = torch.from_numpy(t.token_versions.astype(np.int64))
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)
    group_index = np.array([t.prompt_uid for t in trajs], dtype=object)
    mm, mrope = vision_inputs(trajs, attention_mask, p, vision)
    teacher = teacher_logprobs(trajs, r)
    cache = None
    if any(t.cache_versions is not None for t in trajs):
        cache = torch.full((b, r), NO_VERSION, dtype=torch.int64)
        for i, t in enumerate(trajs):
            cache[i, : len(t.response_ids)] = torch.from_numpy(t.context_versions.astype(np.int64))
    return PaddedBatch(
        prompts=prompts,
        responses=responses,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        token_versions=versions,
        rewards=rewards,
        group_index=group_index,
        source=np.arange(b, dtype=np.int64),
        multi_modal_inputs=mm,
        mrope_position_ids=mrope,
        cache_versions=cache,
        teacher_logprobs=teacher,
    )


def teacher_logprobs(trajs: Sequence, r: int) -> torch.Tensor | None:
    """(B, R) the trajectories' teacher log-probs, right-padded with 0; None when none has them. Some with and some
    without is refused: a batch is scored by the teacher whole or not at all."""
    scored = [t.teacher_logprobs is not None for t in trajs]
    if not any(scored):
        return None
    if not all(scored):
        missing = [f"{t.prompt_uid}#{t.sample_index}" for t, ok in zip(trajs, scored) if not ok]
        raise ValueError(f"{len(missing)} trajectories have no teacher log-probs (e.g. {missing[:3]})")
    out = torch.zeros((len(trajs), r), dtype=torch.float32)
    for i, t in enumerate(trajs):
        if len(t.teacher_logprobs):
            out[i, : len(t.teacher_logprobs)] = torch.from_numpy(t.teacher_logprobs.astype(np.float32))
    return out


def dp_layout(num_real: int, dp_size: int, num_mini_batches: int) -> tuple[np.ndarray, int]:
    """Row order for `dp_size` ranks x mini-batches: returns (rows, mini-batches actually used), where `rows[k]` is
    a real row index or -1 (padding). len(rows) is a multiple of dp_size x mini-batches.

    Slot s = (mini-batch s // dp_size, rank s % dp_size); real row j goes to slot j % slots. The number of
    mini-batches is capped so that each global mini-batch gets at least one real row (an empty one would be 0/0).
    """
    if num_real < 1:
        raise ValueError("dp_layout needs at least one real row")
    num_mini = max(1, min(num_mini_batches, -(-num_real // dp_size)))
    slots = dp_size * num_mini
    per_slot = -(-num_real // slots)
    table = np.full((slots, per_slot), -1, dtype=np.int64)
    for j in range(num_real):
        table[j % slots, j // slots] = j
    # verl hands rank r the contiguous chunk r, and within it mini-batch m is the contiguous block m.
    order = [table[m * dp_size + rank] for rank in range(dp_size) for m in range(num_mini)]
    return np.concatenate(order), num_mini


def token_level_rewards(batch: PaddedBatch) -> torch.Tensor:
    """(B, R) with each trajectory's reward on its last response token (whether or not that token is in the loss)."""
    out = torch.zeros(batch.responses.shape, dtype=torch.float32)
    lengths = batch.response_lengths
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = batch.rewards[rows]
    return out


def reward_components(groups: Sequence[TrajectoryGroup], keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-trajectory reward components (in `flatten` order) for verl's gdpo: each key is a reward function's own
    output (top level of reward info, one source) or a reward source's name (its score)."""
    out: dict[str, list[float]] = {k: [] for k in keys}
    for t in flatten(groups):
        info = t.reward_info or {}
        for k in keys:
            value = info.get(k)
            if not isinstance(value, int | float):
                value = (info.get("sources", {}).get(k) or {}).get("score")
            if not isinstance(value, int | float):
                raise ValueError(
                    f"algorithm.gdpo_reward_keys: {k!r} is neither a numeric output of the reward function nor a "
                    f"reward source's name in trajectory {t.prompt_uid} (reward info keys: {sorted(info)})"
                )
            out[k].append(float(value))
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def sample_owners(groups: Sequence[TrajectoryGroup]) -> np.ndarray:
    """(B,) in `flatten` order: for each row, the row whose advantage it takes, i.e. the last row of its sample
    (same prompt and sample_index). A sample split into several rows (agents/rollout_fn.py) counts once in the
    group baseline; an unsplit row owns itself."""
    trajs = flatten(groups)
    last = {(t.prompt_uid, t.sample_index): i for i, t in enumerate(trajs)}
    return np.array([last[(t.prompt_uid, t.sample_index)] for t in trajs], dtype=np.int64)


def compute_advantages(
    batch: PaddedBatch,
    algorithm: AlgorithmConfig,
    *,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    components: dict[str, np.ndarray] | None = None,
    owners: np.ndarray | None = None,
) -> torch.Tensor:
    """(B, R) advantages from verl's `core_algos` estimator `algorithm.adv_estimator` (outcome rewards, gamma = 1),
    0 off the mask. Called the way verl's own trainer calls each estimator: every input below that the estimator's
    signature names is passed. `old_log_probs` / `sum_pi_squared` (the proximal pass) are required by the optimal
    token baselines, `components` (from `reward_components`) by gdpo. `owners` (from `sample_owners`): the estimator
    sees only the rows that own their sample; every other row gets its owner's mean advantage per loss token."""
    if owners is not None and (owners != np.arange(batch.size)).any():
        return _owned_advantages(
            batch, algorithm, owners, old_log_probs, sum_pi_squared, rollout_is_weights, components
        )
    import inspect

    from verl.trainer.config.algorithm import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(algorithm.adv_estimator)
    mask = batch.response_mask.float()
    config = AlgoConfig(
        gamma=1.0,
        lam=1.0,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std,
        gdpo_reward_keys=list(algorithm.gdpo_reward_keys) or None,
        gdpo_reward_weights=list(algorithm.gdpo_reward_weights) or None,
    )
    available = dict(
        token_level_rewards=token_level_rewards(batch),
        response_mask=mask,
        index=batch.group_index,
        config=config,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        non_tensor_batch=components,
        batch={"prompts": batch.prompts, "attention_mask": batch.attention_mask},
    )
    params = inspect.signature(fn).parameters
    for name in ("old_log_probs", "sum_pi_squared"):
        if name in params and available[name] is None:
            raise ValueError(f"advantage estimator {algorithm.adv_estimator} needs {name}")
    if "non_tensor_batch" in params and components is None:
        raise ValueError(f"advantage estimator {algorithm.adv_estimator} needs its reward components")
    adv, _ = fn(**{k: v for k, v in available.items() if k in params})
    return (adv * mask).float()


def _owned_advantages(
    batch: PaddedBatch,
    algorithm: AlgorithmConfig,
    owners: np.ndarray,
    old_log_probs: torch.Tensor | None,
    sum_pi_squared: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    components: dict[str, np.ndarray] | None,
) -> torch.Tensor:
    """compute_advantages over the rows that own their sample only; every other row gets its owner's mean advantage
    per loss token."""
    own = np.unique(owners)
    idx = torch.from_numpy(own)

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[idx]

    sub = batch.select(own)
    sub_adv = compute_advantages(
        sub,
        algorithm,
        old_log_probs=pick(old_log_probs),
        sum_pi_squared=pick(sum_pi_squared),
        rollout_is_weights=pick(rollout_is_weights),
        components=None if components is None else {k: v[own] for k, v in components.items()},
    )
    sub_mask = sub.response_mask.float()
    per_sample = (sub_adv * sub_mask).sum(-1) / sub_mask.sum(-1).clamp(min=1)
    pos = torch.from_numpy(np.searchsorted(own, owners))
    adv = per_sample[pos][:, None] * batch.response_mask.float()
    adv[idx] = sub_adv
    return adv.float()


def gae(batch: PaddedBatch, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, R) and 0 off the mask, from verl's `compute_gae_advantage_return` over outcome
    rewards and the critic's `values` (B, R): the value of the state before each response token. Tokens off the mask
    (tool output) are skipped: the TD step bridges them. The reward sits on the last loss token (verl's GAE drops a
    reward that sits on a skipped token, as on a response that ends in tool output). Advantages are whitened over the
    batch's loss tokens (as verl does); returns = GAE + values are the critic's targets."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    mask = batch.response_mask.float()
    rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = batch.rewards[rows]
    adv, returns = compute_gae_advantage_return(
        token_level_rewards=rewards,
        values=values.float() * mask,
        response_mask=mask,
        gamma=torch.tensor(float(gamma)),
        lam=torch.tensor(float(lam)),
    )
    return (adv * mask).float(), (returns * mask).float()


def value_metrics(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """How well the critic's values (before this step's update) predict the returns, over loss tokens: explained
    variance 1 - Var(returns - values) / Var(returns) (1 = perfect, 0 = no better than the mean, < 0 worse), the
    mean squared error and the means. The explained variance is left out when the returns do not vary (every
    reward of the batch equal): it is undefined there (verl divides by Var + 1e-5 and logs values like -1e7)."""
    keep = response_mask > 0
    if not keep.any():
        return {}
    v, r = values[keep].double(), returns[keep].double()
    var_r = r.var(unbiased=False)
    out = {
        "critic/value_mse": float(((v - r) ** 2).mean()),
        "critic/values_mean": float(v.mean()),
        "critic/returns_mean": float(r.mean()),
    }
    if var_r > 1e-8:
        out["critic/vf_explained_var"] = float(1.0 - (r - v).var(unbiased=False) / var_r)
    return out


def to_engine_td(batch: PaddedBatch, temperature: float, support: dict | None = None, **tensors: torch.Tensor):
    """verl's no-padding TensorDict for `batch`, with extra (B, R) padded `tensors` (old_log_probs, advantages, ...).
    `support`: SamplingSupport.non_tensor() (the rollout's top_k / top_p for the forward; None or empty = none)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    fields = dict(
        prompts=batch.prompts,
        responses=batch.responses,
        input_ids=torch.cat([batch.prompts, batch.responses], dim=1),
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        response_mask=batch.response_mask,
    )
    fields.update(tensors)
    if batch.multi_modal_inputs is not None:
        fields["multi_modal_inputs"] = list(batch.multi_modal_inputs)
    td = tu.get_tensordict(tensor_dict=fields, non_tensor_dict=dict(temperature=float(temperature), **(support or {})))
    return left_right_2_no_padding(td)


def version_metrics(batch: PaddedBatch, trainer_version: int) -> dict[str, float]:
    """Staleness of the trained tokens: trainer_version minus each token's policy version, over loss tokens."""
    keep = (batch.response_mask > 0) & (batch.token_versions != NO_VERSION)
    if not keep.any():
        return {}
    lag = (trainer_version - batch.token_versions[keep]).float()
    return {"staleness/token_mean": lag.mean().item(), "staleness/token_max": lag.max().item()}
