"""Small synthetic TrajectoryGroups for the training-backend tests (deterministic from a seed)."""

from __future__ import annotations

import numpy as np

from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup


def make_groups(
    num_groups: int = 3,
    n: int = 2,
    seed: int = 0,
    prompt_len: tuple[int, int] = (2, 6),
    response_len: tuple[int, int] = (1, 7),
    vocab: int = 256,
    behaviour_logprob: float = -5.5,
    version: int = 0,
) -> list[TrajectoryGroup]:
    """`num_groups` groups of `n` trajectories with random lengths, rewards and ids; sample k of a group gets
    reward k (so groups are never constant)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        ref = PromptRef(0, g)
        trajs = []
        for s in range(n):
            lp = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
            lr = int(rng.integers(response_len[0], response_len[1] + 1))
            trajs.append(
                Trajectory(
                    prompt=ref,
                    sample_index=s,
                    prompt_ids=rng.integers(0, vocab, lp),
                    response_ids=rng.integers(0, vocab, lr),
                    behaviour_logprobs=np.full(lr, behaviour_logprob) + 0.1 * rng.standard_normal(lr),
                    token_versions=np.full(lr, version),
                    reward=float(s),
                )
            )
        groups.append(TrajectoryGroup(ref, trajs))
    return groups
