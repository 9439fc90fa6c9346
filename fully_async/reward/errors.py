"""The two ways a reward failure leaves the reward package, by the source's (or group function's) policy.

Their own module so that the per-trajectory scorer (agent.py) and the group scorer (group.py) both raise them
without importing each other.
"""


class RewardDrop(RuntimeError):
    """A source with on_failure=drop failed: the sample's group is re-issued."""


class RewardFatal(RuntimeError):
    """A source with on_failure=raise failed: the run stops with this message."""
