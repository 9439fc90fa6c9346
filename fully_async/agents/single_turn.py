"""Single-turn chat: the prompt's messages through the tokenizer's chat template, one generation."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fully_async.agents.base import AgentLoop, Sample
from fully_async.protocol import Trajectory

if TYPE_CHECKING:
    from fully_async.engines import EngineClient


class SingleTurnAgentLoop(AgentLoop):
    def prompt_ids(self, sample: Sample) -> list[int]:
        ids = self.tokenizer.apply_chat_template(sample.row.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory:
        prompt_ids = self.prompt_ids(sample)
        start = time.monotonic()
        out = await client.generate(
            prompt_ids, self.response_length, self.sampling, continue_on_abort=self.continue_on_abort
        )
        return Trajectory(
            prompt=sample.prompt,
            sample_index=sample.sample_index,
            prompt_ids=prompt_ids,
            response_ids=out.token_ids,
            behaviour_logprobs=out.logprobs,
            token_versions=out.versions,
            start_version=out.start_version,
            finish_reason=out.finish_reason,
            num_aborts=out.num_aborts,
            timings={"generate_s": time.monotonic() - start},
        )
