"""The built-in OpenEnv environment: say the row's digit, with one second try. Written to OpenEnv's protocol with the
package's own server (`openenv.core.env_server.create_app`: /health, /schema, WebSocket sessions on /ws), so the
adapter is exercised against a real OpenEnv server process; `python -m fully_async.envs.serve
fully_async.envs.digits:app --port 8000` serves it by hand.

Episode: reset(ground_truth=d) shows "Reply with the digit."; each step's message is right when it opens with d
(reward 1.0 on the first try, 0.5 on the second) and ends the episode; a wrong first try gets "Wrong, try again."
(reward 0) and a second turn; a wrong second try ends it with reward 0. A policy that learned the built-in task
(fully_async/config/tasks.py) scores here without a change of prompt.
"""

from __future__ import annotations

import os
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from fully_async.envs import MAX_CONCURRENT_ENV

TRIES = 2


class DigitAction(Action):
    message: str = ""


class DigitObservation(Observation):
    message: str = ""


class DigitEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = ""

    def reset(self, seed=None, episode_id=None, ground_truth=None, **kwargs) -> DigitObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.target = str(ground_truth if ground_truth is not None else "").strip()
        return DigitObservation(message="Reply with the digit.", done=False, reward=0.0)

    def step(self, action: DigitAction, timeout_s=None, **kwargs) -> DigitObservation:
        self._state.step_count += 1
        right = bool(self.target) and action.message.lstrip().startswith(self.target)
        if right:
            return DigitObservation(message="Right.", done=True, reward=1.0 / self._state.step_count)
        if self._state.step_count < TRIES:
            return DigitObservation(message="Wrong, try again.", done=False, reward=0.0)
        return DigitObservation(message="Wrong.", done=True, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    DigitEnvironment,
    DigitAction,
    DigitObservation,
    env_name="fully_async_digits",
    max_concurrent_envs=int(os.environ.get(MAX_CONCURRENT_ENV, "64")),
)
