"""The environment's three parts as verifiers v1 declares them: taskset (data), task (rubric), env (protocol)."""

from __future__ import annotations

import verifiers.v1 as vf

TRIES = 2
RETRY = "Wrong, try again."


class DigitsTaskData(vf.TaskData):
    answer: str = ""


class DigitsTask(vf.Task[DigitsTaskData]):
    @vf.reward
    async def correct(self, task: DigitsTaskData, trace: vf.Trace) -> float:
        for k, reply in enumerate(trace.assistant_messages[:TRIES]):
            if (reply.content or "").lstrip().startswith(task.answer):
                return 1.0 / (k + 1)
        return 0.0


class DigitsTasksetConfig(vf.TasksetConfig):
    size: int = 200


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            d = str(i % 10)
            yield DigitsTask(DigitsTaskData(id=f"digit-{i}", prompt=f"Reply with the digit {d}.", answer=d))


class DigitsEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()


class DigitsEnv(vf.Env[DigitsEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as chat:
            seg = await chat.turn()
            for _ in range(TRIES - 1):
                if seg.terminated or seg.last_reply.startswith(task.data.answer):
                    break
                seg = await chat.turn(RETRY)
