"""The top-k / nucleus truncation the trainer's log-probs repeat, so that they are of the distribution the engine
sampled from (docs/algorithms.md, "top_p / top_k").

Contract: `SamplingSupport.of_rollout(rollout, engine_truncates)` is the rollout's (top_k, top_p) when the engine's
behaviour log-probs are those of the truncated distribution (vLLM: --logprobs-mode processed_logprobs), else off;
`non_tensor()` is what goes into verl's batch (nothing when off: the forward is then the same to the last bit);
`require_patch()` fails early, naming the fix, when verl lacks patches/0007 (which applies it inside verl's forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PATCH = "0007-logprobs-of-the-truncated-sampling-distribution"


@dataclass(frozen=True)
class SamplingSupport:
    """(top_k, top_p) of the rollout's sampling; -1 / 1.0 = no truncation."""

    top_k: int = -1
    top_p: float = 1.0

    @classmethod
    def of_rollout(cls, rollout: Any, engine_truncates: bool) -> SamplingSupport:
        """`rollout` (RolloutConfig): its top_k and top_p. `engine_truncates`: the engine kind's log-probs are of the
        truncated distribution (EngineKind.logprobs_truncated); when not (SGLang returns the full softmax at the
        temperature), the trainer must not truncate either, or an unchanged policy's ratio would not be 1."""
        if not engine_truncates:
            return cls()
        return cls(top_k=int(rollout.top_k), top_p=float(rollout.top_p))

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def non_tensor(self) -> dict[str, Any]:
        """verl batch keys read by patch 0007 (FSDPEngineWithLMHead.prepare_model_outputs); empty when off."""
        return {"top_k": self.top_k, "top_p": self.top_p} if self.active else {}

    def require_patch(self) -> None:
        """Raise, naming the fix, when truncation is on and verl's forward would silently ignore it."""
        import verl.utils.torch_functional as verl_f

        if self.active and not hasattr(verl_f, "truncate_to_sampling_support"):
            raise RuntimeError(
                f"rollout.top_k={self.top_k} / rollout.top_p={self.top_p} need verl patch patches/{PATCH}.patch "
                "(the trainer's log-probs of the truncated distribution); run scripts/apply_verl_patches.sh"
            )
