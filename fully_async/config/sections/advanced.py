"""advanced: internal bounds, buffer sizes and test knobs that a normal run never sets.

Their defaults are measured (docs/benchmarks.md) or generous; a run that needs one changed says so in its error
message, which names the key. The schedule's own choices (staleness, cadence, weight transport, sync mode, the proof
of a sync) stay in async_training; the engine's control bounds and recovery timers stay in engine (a large model's
reload needs engine.control_timeout_s raised). The keys these came from are still read, each with one note
(`read_moved_keys`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fully_async.config.base import ConfigError, note_alias, require, resolve_unset, set_from, settable, was_given

STAGINGS = ("device", "pinned")
"""Values of advanced.staging."""

MOVED = (
    ("async_training", "get_timeout_s"),
    ("async_training", "sync_timeout_s"),
    ("async_training", "staging"),
    ("async_training", "bucket_mb"),
    ("rollout", "ignore_eos"),
)
"""(section, key) of each key that moved here under the same name; the section keeps it as an alias (null = unset)."""


@dataclass
class AdvancedConfig:
    get_timeout_s: float = settable(1800.0)
    """How long the trainer waits for a batch before failing the run with the queue and rollouter state."""
    sync_timeout_s: float = settable(300.0)
    """Timeout of each weight-sync phase (pause, the transport's phases, resume); passing it fails the run naming the phase."""
    staging: Literal["device", "pinned"] = settable("device")
    """Where a background sync's collective transport keeps its copy of the weights (one model's size in the engine dtype, printed at the first sync): device (a second buffer on the trainer's device, sent as it is) or pinned (pinned host memory, copied into the two send buckets on the device as it goes out; costs no device memory). On CPU both are plain host memory; pinned runs the same copy-through code there."""
    bucket_mb: int = settable(16)
    """Size of each flat bucket the collective weight transport broadcasts (engines load one while the next is on the wire; 16: fastest of 16/64/256 in docs/benchmarks.md)."""
    ignore_eos: bool = settable(False)
    """Generate exactly rollout.response_length tokens, ignoring end tokens (benchmarks and tests of long rollouts)."""
    failed_groups_in_a_row: int = 200
    """Groups that may fail one after another with none finishing in between (an engine error after its retries, a reward source's drop, an environment's failures past their budget) before the run fails with the last one's error: a request every server refuses (a 4xx, such as an adapter no server holds) would otherwise be re-issued for ever; 0 = no limit."""

    def __post_init__(self) -> None:
        resolve_unset(self)  # a key set here, even to its default, is known as set: an older key then clashes

    def validate_section(self, p: str) -> None:
        if self.__dict__.get("_clashes"):
            raise ConfigError(self._clashes[0])
        require(self.get_timeout_s > 0, p + "get_timeout_s", self.get_timeout_s, "> 0")
        require(self.sync_timeout_s > 0, p + "sync_timeout_s", self.sync_timeout_s, "> 0")
        require(self.staging in STAGINGS, p + "staging", self.staging, f"one of {list(STAGINGS)}")
        require(self.bucket_mb >= 1, p + "bucket_mb", self.bucket_mb, ">= 1")
        require(self.failed_groups_in_a_row >= 0, p + "failed_groups_in_a_row", self.failed_groups_in_a_row, ">= 0")


def read_moved_keys(cfg: Any) -> None:
    """A value set under a key's old place (MOVED) becomes advanced's, said once per key; the old one is cleared so
    that nothing reads it. Set beside advanced's own key to another value, the line means two things:
    advanced.validate_section says so."""
    clashes = cfg.advanced.__dict__.setdefault("_clashes", [])
    for section, key in MOVED:
        old = getattr(cfg, section)
        value = getattr(old, key)
        if value is None:
            continue
        if was_given(cfg.advanced, key) and getattr(cfg.advanced, key) != value:
            clashes.append(f"advanced.{key} is set twice, to {getattr(cfg.advanced, key)!r} and (by the older key "
                           f"{section}.{key}) to {value!r}; keep one")  # fmt: skip
        elif not was_given(cfg.advanced, key):
            note_alias(f"{section}.{key}", f"advanced.{key}", value)
            set_from(cfg.advanced, key, value, f"older key {section}.{key}")
        setattr(old, key, None)
