"""Forward-only passes over verl's ranks: the log-probs of a role (policy or reference) and the critic's values.

Contract: `RankForward(ranks, budget, temperature, pad_token_id, vision, support)`; `engine_td(batch, **tensors)` is
verl's engine batch of a DP-laid-out PaddedBatch with the micro-batch token budget read from `budget()` at each call
(so the budget can change between calls without rebuilding the workers) and `support` (a SamplingSupport: the top-k /
nucleus truncation every log-prob is taken under); `log_probs` and `values` give (B, R) tensors of a laid-out batch; `per_trajectory(groups, read)` lays groups out over the DP ranks, runs `read` and returns one
float32 array per trajectory in `flatten(groups)` order (the response tokens only). Nothing here changes weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fully_async.multimodal.processor import VisionProcessor
from fully_async.protocol import TrajectoryGroup
from fully_async.training import batch as B
from fully_async.training.sampling_support import SamplingSupport
from fully_async.training.verl_ranks import RankGroups


class RankForward:
    """Reads of the ranks' models over laid-out batches. See the module docstring."""

    def __init__(
        self,
        ranks: RankGroups,
        budget: Callable[[], int],
        temperature: float,
        pad_token_id: int,
        vision: VisionProcessor | None,
        support: SamplingSupport | None = None,
    ):
        self.ranks, self.budget = ranks, budget
        self.support = support or SamplingSupport()
        self.support.require_patch()
        self.temperature, self.pad_token_id, self.vision = temperature, pad_token_id, vision

    def engine_td(self, batch: B.PaddedBatch, **tensors: torch.Tensor):
        from verl.utils import tensordict_utils as tu

        budget = self.budget()
        longest = int(batch.attention_mask.sum(-1).max())
        if longest > budget:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds trainer.max_token_len_per_gpu={budget}; raise the budget to "
                "at least data.max_prompt_length + rollout.response_length"
            )
        td = B.to_engine_td(batch, self.temperature, self.support.non_tensor(), **tensors)
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
        return td

    def log_probs(self, role: str, batch: B.PaddedBatch, sum_pi_squared: bool = False):
        """(B, R) log-probs of `batch` (already laid out for DP) under `role`'s weights; with `sum_pi_squared`, the
        pair (log-probs, sum over the vocabulary of pi^2 per token) from the same forward pass."""
        from verl.utils import tensordict_utils as tu

        td = self.engine_td(batch)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, calculate_sum_pi_squared=sum_pi_squared)
        gather = self._gatherer(role, td)
        return (gather("log_probs"), gather("sum_pi_squared")) if sum_pi_squared else gather("log_probs")

    def values(self, batch: B.PaddedBatch) -> torch.Tensor:
        """(B, R) critic values of `batch` (laid out for DP): V(state before each response token)."""
        from verl.utils import tensordict_utils as tu

        td = self.engine_td(batch)
        tu.assign_non_tensor(td, compute_loss=False)
        return self._gatherer("critic", td)("values")

    def _gatherer(self, role: str, td) -> Callable[[str], torch.Tensor]:
        """Run `role`'s infer_batch on `td`; the returned call joins one output key of every rank as (B, R) float."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        outs, chunks = self.ranks.data_call(role, "infer_batch", td)

        def gather(key: str) -> torch.Tensor:
            parts = [no_padding_2_padding(tu.get(o, key), c) for o, c in zip(outs, chunks, strict=True)]
            return torch.cat(parts, dim=0).float()

        return gather

    def per_trajectory(
        self, groups: Sequence[TrajectoryGroup], read: Callable[[B.PaddedBatch], torch.Tensor]
    ) -> list[np.ndarray]:
        full = B.assemble(groups, self.pad_token_id, self.vision)
        rows, _ = B.dp_layout(full.size, self.ranks.dp_size, 1)
        laid = full.select(rows)
        values = read(laid)
        out: list[np.ndarray] = [None] * full.size  # type: ignore[list-item]
        for k, src in enumerate(laid.source):
            if src >= 0:
                out[src] = values[k, : int(laid.response_lengths[k])].numpy().copy()
        return out
