"""fa-vf-digits: a small verifiers (v1) environment, installed as a package like any environment from a hub
(`pip install -e examples/verifiers_digits`; scripts/setup.sh does it with the envs extra) and loaded by its name.

Taskset: "Reply with the digit d." for d = row index mod 10 (`size` rows). Env protocol (`DigitsEnv.run`): the
solver answers; a wrong first answer gets "Wrong, try again." and one second turn. Rubric (`DigitsTask.correct`):
1.0 when the first answer opens with d, 0.5 when the second does, else 0.
"""

from fa_vf_digits.env import DigitsEnv, DigitsEnvConfig, DigitsTask, DigitsTaskData, DigitsTaskset

__all__ = ["DigitsEnv", "DigitsEnvConfig", "DigitsTask", "DigitsTaskData", "DigitsTaskset"]
