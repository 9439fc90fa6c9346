"""Single-turn chat: the prompt's messages through the tokenizer's chat template, one generation.

A prompt with images (a vision-language model, docs/vlm.md) goes to the engine with one image token per image and
the images beside it; the engine expands each to the image's patch count, and the Trajectory keeps the expanded
prompt (what the trainer feeds its model) with the images' PNG bytes."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from fully_async.agents.base import AgentLoop, Sample
from fully_async.protocol import Trajectory

if TYPE_CHECKING:
    from fully_async.engines import EngineClient


class SingleTurnAgentLoop(AgentLoop):
    def prompt_ids(self, sample: Sample) -> list[int]:
        messages = sample.row.messages
        if sample.row.images:
            messages = [{**m, "content": self.vision.prompt_text(m["content"])} for m in messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory:
        prompt_ids = self.prompt_ids(sample)
        images = sample.row.images
        start = time.monotonic()
        sampling = self.sampling
        if images:  # the engine stops at a sampled vision token, which cut_response then drops
            stops = tuple(sampling.stop_token_ids) + self.vision.vision_token_ids
            sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        out = await client.generate(
            prompt_ids, self.response_length, sampling, continue_on_abort=self.continue_on_abort, images=images
        )
        tokens, logprobs, versions, finish = out.token_ids, out.logprobs, out.versions, out.finish_reason
        if images:
            prompt_ids = self.vision.expand(prompt_ids, images)
            tokens, logprobs, versions, finish = self.vision.cut_response(tokens, logprobs, versions, finish)
        return Trajectory(
            prompt=sample.prompt,
            sample_index=sample.sample_index,
            prompt_ids=prompt_ids,
            response_ids=tokens,
            behaviour_logprobs=logprobs,
            token_versions=versions,
            cache_versions=None if out.cache_versions is None else out.cache_versions[: len(tokens)],
            start_version=out.start_version,
            finish_reason=finish,
            images=list(images),
            num_aborts=out.num_aborts,
            timings={"generate_s": time.monotonic() - start},
        )
