"""The AgentLoop interface, chosen by dotted path (`rollout.agent_loop=pkg.module:Class`).

Contract: `await loop.run(client, sample)` returns one Trajectory for `sample` without its reward (the rollouter
scores `loop.reward_text(trajectory)`), or a list of Trajectories: the sample's training rows, in order, when one
episode is not one token sequence (agents/rollout_fn.py splits at history edits); the rows share the sample's reward
and the last one's advantage (training/batch.py). Tokens the policy generated carry the weight version the engine
client reports; tokens an environment or tool inserted carry `protocol.NO_VERSION` and loss_mask 0, so they are
neither trained on nor counted for staleness. A row's response never exceeds `response_length` tokens.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fully_async.data import PromptRow
from fully_async.protocol import PromptRef, Trajectory

if TYPE_CHECKING:
    from fully_async.config import MultiTurnConfig
    from fully_async.engines import EngineClient, Sampling
    from fully_async.multimodal.processor import VisionProcessor
    from fully_async.trace import Tracer


@dataclass
class Sample:
    """What an agent loop is asked to produce: sample `sample_index` of prompt `prompt` (dataset row `row`)."""

    prompt: PromptRef
    sample_index: int
    row: PromptRow


class AgentLoop(ABC):
    tracer: Tracer | None = None
    """The rollouter's event trace (fully_async/trace.py), for spans of the loop's own phases (tool calls on the
    `tools` lane); None outside a run."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
    ):
        """`continue_on_abort`: after a pause, keep the tokens so far and continue under the new weights (partial
        rollout); false restarts the sample from its prompt. `multi_turn`: the rollout.multi_turn section (tools and
        turn limits), for loops that use it."""
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.response_length = response_length
        self.continue_on_abort = continue_on_abort
        self.multi_turn = multi_turn

    @functools.cached_property
    def vision(self) -> VisionProcessor:
        """The model's vision processor (image tokens of a prompt with images), built on first use from the
        tokenizer's directory: the model's."""
        from fully_async.multimodal.processor import VisionProcessor

        return VisionProcessor(self.tokenizer.name_or_path)

    @abstractmethod
    async def run(self, client: EngineClient, sample: Sample) -> Trajectory | list[Trajectory]: ...

    def reward_text(self, traj: Trajectory) -> str:
        """What the reward sources score for the sample whose (last) row is `traj`: its decoded response."""
        return self.decode(traj.response_ids.tolist())

    def reward_meta(self, traj: Trajectory, row: PromptRow) -> dict[str, Any]:
        """What the reward sources see besides the text for the sample whose (last) row is `traj`: the row's meta
        (an environment loop adds the environment's reward, fully_async/envs/openenv.py)."""
        return row.reward_meta()

    def decode(self, token_ids: list[int]) -> str:
        """Response text as the reward sees it (special tokens removed)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def build_agent_loop(path: str, *args: Any, **kwargs: Any) -> AgentLoop:
    """Instantiate the AgentLoop subclass at dotted path `path` ('pkg.module:Class', from rollout.agent_loop)."""
    from fully_async.plugins import load

    cls = load(path, "rollout.agent_loop")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise TypeError(f"{path} is not an AgentLoop subclass")
    return cls(*args, **kwargs)
