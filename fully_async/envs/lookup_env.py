"""The built-in tool task `lookup` served as an OpenEnv environment: the task the tiny model learns on CPU
(fully_async/agents/lookup.py), with its tool behind an environment server, so that an environment's
infrastructure failures meet a learning curve (scripts/bench/env_failure_sweep.py --task lookup).
`python -m fully_async.envs.serve fully_async.envs.lookup_env:app --port 8000` serves it by hand; the job launches it
with `rollout.multi_turn.env.app=fully_async.envs.lookup_env:app` (examples/openenv_lookup).

Episode, one-token model turns as in task=lookup (the same call format, `agents.lookup.call_of`):
- reset(ground_truth=d) shows nothing: the prompt stays the row's own (`lookup`, data.LOOKUP_PROMPT);
- a letter calls the lookup tool: the observation is the digit shown REPEATS times ('7777777777'), reward 0, not done;
  the loop appends it as a user turn, token-exact, and the model answers in the next turn. One call per episode: a
  second call ends it with reward 0;
- a digit answers: reward 1.0 when it is d, else 0, done;
- anything else ends the episode unanswered, reward 0.
The difference from task=lookup is where the tool lives (a server the network can break, not the loop's process) and
that its answer comes as a user turn, not a tool turn.
"""

from __future__ import annotations

import os
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from fully_async.agents.lookup import REPEATS, call_of
from fully_async.envs import MAX_CONCURRENT_ENV
from fully_async.envs.digits import DigitAction, DigitObservation


class LookupEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.digit = ""
        self.called = False

    def reset(self, seed=None, episode_id=None, ground_truth=None, **kwargs) -> DigitObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.digit = str(ground_truth if ground_truth is not None else "").strip()
        self.called = False
        return DigitObservation(message="", done=False, reward=0.0)

    def step(self, action: DigitAction, timeout_s=None, **kwargs) -> DigitObservation:
        self._state.step_count += 1
        if call_of(action.message) is not None:
            if self.called:
                return DigitObservation(message="One lookup per episode.", done=True, reward=0.0)
            self.called = True
            return DigitObservation(message=self.digit * REPEATS, done=False, reward=0.0)
        first = action.message.strip()[:1]
        right = bool(self.digit) and first == self.digit
        return DigitObservation(message="Right." if right else "Wrong.", done=True, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    LookupEnvironment,
    DigitAction,
    DigitObservation,
    env_name="fully_async_lookup",
    max_concurrent_envs=int(os.environ.get(MAX_CONCURRENT_ENV, "64")),
)
