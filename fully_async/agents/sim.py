"""The agent loop of simulation runs (engine=sim): single turn, with what only real text needs left out.

Prompt ids are built once per prompt (the n samples of a group share them) and a response decodes to its length
as text: simulated token ids carry no text, and decoding thousands of them per sample would cost more CPU than the
rest of the rollout path. Generation goes through the real EngineClient like any other loop.
"""

from __future__ import annotations

from fully_async.agents.base import Sample
from fully_async.agents.single_turn import SingleTurnAgentLoop


class SimAgentLoop(SingleTurnAgentLoop):
    _cache_size = 4096

    def prompt_ids(self, sample: Sample) -> list[int]:
        cache = self.__dict__.setdefault("_prompts", {})
        key = sample.prompt
        if key not in cache:
            if len(cache) >= self._cache_size:
                cache.pop(next(iter(cache)))
            cache[key] = super().prompt_ids(sample)
        return cache[key]

    def decode(self, token_ids: list[int]) -> str:
        return str(len(token_ids))
