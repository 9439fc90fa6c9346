"""Builders of real protocol objects for tests (not fakes: these are the product's own dataclasses)."""

from __future__ import annotations

import numpy as np

from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup


def make_group(index: int, version: int = 0, n: int = 2, response_len: int = 8, epoch: int = 0, prompt_len: int = 4):
    """A group of n trajectories whose tokens all carry `version`."""
    ref = PromptRef(epoch, index)
    trajs = [
        Trajectory(
            prompt=ref,
            sample_index=s,
            prompt_ids=np.arange(1, prompt_len + 1),
            response_ids=np.full(response_len, 7 + s),
            behaviour_logprobs=np.full(response_len, -0.5, dtype=np.float32),
            token_versions=np.full(response_len, version),
            start_version=version,
            reward=float(s % 2),
        )
        for s in range(n)
    ]
    return TrajectoryGroup(ref, trajs, meta={"data_source": "test", "ground_truth": str(index)})
