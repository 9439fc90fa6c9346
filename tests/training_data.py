"""Small synthetic TrajectoryGroups for the training-backend tests (deterministic from a seed)."""

from __future__ import annotations

import numpy as np

from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup, flatten


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


def load_hf_model(model_dir):
    """A Hugging Face causal LM as the trainer computes it on CPU (float32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")


def hf_log_probs(model, groups: list[TrajectoryGroup], temperature: float) -> list[np.ndarray]:
    """Log-probs of each response token under `model` (a transformers or PEFT model) at `temperature`, one array
    per trajectory in `flatten(groups)` order (the trainer's compute_log_probs, computed independently)."""
    import torch

    out = []
    for t in flatten(groups):
        ids = torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / temperature
        p = len(t.prompt_ids)
        out.append(torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None])[:, 0].numpy())
    return out
