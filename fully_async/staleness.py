"""The staleness ledger: admission and consumption rules that bound off-policyness, as pure logic.

Version v = number of completed weight syncs. With eta = max_staleness and G = groups per version
(groups_per_step * sync_every), the rollouter admits a new prompt group only while

    accepted + running < (eta + version + 1) * G

where `accepted` counts groups that finished generation and were not dropped since the start (queued or trained;
a group filtered by dynamic sampling is never accepted, so it frees its slot),
and `running` counts groups generating now. Group number k (in admission order) is then admitted at a version
>= floor(k / G) - eta, and the trainer trains it at version floor(k / G) when groups arrive in order, so its oldest
token is at most eta versions old. Groups that finish out of order can still arrive late; the consumer re-checks

    trainer_version - min_token_version <= eta

and a group that fails is dropped AND its prompt is re-issued: nothing is trained past the bound, nothing is lost.
eta = 0 gives synchronous on-policy training on separate resources.

Units are groups (one prompt, rollout.n samples), as in AReaL's rule with samples replaced by groups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from fully_async.protocol import PromptRef


def is_fresh(min_version: int, trainer_version: int, max_staleness: int) -> bool:
    """The consumption check: may a group whose oldest token has `min_version` train at `trainer_version`?"""
    return trainer_version - min_version <= max_staleness


class LedgerError(RuntimeError):
    """The ledger was driven out of protocol (finishing a prompt it never admitted, ...): a bug, never data."""


class StalenessLedger:
    """Admission control and the re-issue list of the rollouter. Not thread-safe; owned by one event loop."""

    def __init__(self, max_staleness: int, groups_per_version: int, version: int = 0) -> None:
        if max_staleness < 0 or groups_per_version < 1:
            raise ValueError(
                f"max_staleness >= 0 and groups_per_version >= 1 required, got {max_staleness}, {groups_per_version}"
            )
        self.max_staleness = max_staleness
        self.groups_per_version = groups_per_version
        self.version = version
        self.accepted = 0
        self.running: dict[PromptRef, int] = {}  # prompt -> version at admission
        self.reissue: deque[PromptRef] = deque()
        self.dropped_stale = 0
        self.failed = 0
        self.reissued = 0
        self.filtered = 0

    # -- admission ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Groups that may have been admitted (finished or running) by now."""
        return (self.max_staleness + self.version + 1) * self.groups_per_version

    def can_admit(self) -> bool:
        return self.accepted + len(self.running) < self.capacity

    def headroom(self) -> int:
        """How many more groups may be admitted at the current version."""
        return max(0, self.capacity - self.accepted - len(self.running))

    def admit(self, prompt: PromptRef) -> bool:
        """Start generating `prompt` if the bound allows; False (nothing changed) when it does not."""
        if prompt in self.running:
            raise LedgerError(f"prompt {prompt.uid} is already running")
        if not self.can_admit():
            return False
        self.running[prompt] = self.version
        return True

    def next_reissue(self) -> PromptRef | None:
        """The oldest prompt waiting to be generated again (dropped stale or failed), if any; it is removed."""
        return self.reissue.popleft() if self.reissue else None

    # -- completion and consumption ---------------------------------------------------------------------------
    def finish(self, prompt: PromptRef, ok: bool = True) -> None:
        """Generation of `prompt` ended: ok -> it is accepted (queued); not ok -> it is re-issued."""
        if prompt not in self.running:
            raise LedgerError(f"finish() for prompt {prompt.uid} that is not running")
        del self.running[prompt]
        if ok:
            self.accepted += 1
        else:
            self.failed += 1
            self._reissue(prompt)

    def filter(self, prompt: PromptRef, reissue: bool = False) -> None:
        """Generation of `prompt` ended in a group that will not be trained (dynamic sampling: all rewards equal).
        Its slot is freed without counting it as accepted, so admission replaces it and the groups that are trained
        keep the bound's numbering; `reissue` puts the prompt back on the re-issue list, else it is done."""
        if prompt not in self.running:
            raise LedgerError(f"filter() for prompt {prompt.uid} that is not running")
        del self.running[prompt]
        self.filtered += 1
        if reissue:
            self._reissue(prompt)

    def drop_stale(self, prompts: Iterable[PromptRef]) -> None:
        """The consumer dropped these accepted groups as too stale: free their slots and re-issue their prompts."""
        for p in prompts:
            if self.accepted <= 0:
                raise LedgerError(f"drop_stale({p.uid}) with no accepted groups")
            self.accepted -= 1
            self.dropped_stale += 1
            self._reissue(p)

    def _reissue(self, prompt: PromptRef) -> None:
        self.reissue.append(prompt)
        self.reissued += 1

    def is_fresh(self, min_version: int, trainer_version: int) -> bool:
        return is_fresh(min_version, trainer_version, self.max_staleness)

    def on_sync(self, new_version: int) -> None:
        """A weight sync completed: the trainer's weights are now `new_version`."""
        if new_version < self.version:
            raise LedgerError(f"version went backwards: {self.version} -> {new_version}")
        self.version = new_version

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state. Running prompts are saved as re-issues: their partial generations die with the
        process, so on restore they are generated again (never lost, never trained twice)."""
        pending = [*self.reissue, *sorted(self.running)]
        return {
            "max_staleness": self.max_staleness,
            "groups_per_version": self.groups_per_version,
            "version": self.version,
            "accepted": self.accepted,
            "reissue": [p.uid for p in pending],
            "counters": {
                "dropped_stale": self.dropped_stale,
                "failed": self.failed,
                "reissued": self.reissued,
                "filtered": self.filtered,
            },  # fmt: skip
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], max_staleness: int | None = None, groups_per_version: int | None = None
    ) -> StalenessLedger:
        """Restore; the bound and batch size may be changed on resume (the new values apply from now on)."""
        ledger = cls(
            state["max_staleness"] if max_staleness is None else max_staleness,
            state["groups_per_version"] if groups_per_version is None else groups_per_version,
            version=int(state["version"]),
        )
        ledger.accepted = int(state["accepted"])
        ledger.reissue = deque(PromptRef.parse(u) for u in state["reissue"])
        counters = state.get("counters", {})
        ledger.dropped_stale = int(counters.get("dropped_stale", 0))
        ledger.failed = int(counters.get("failed", 0))
        ledger.reissued = int(counters.get("reissued", 0))
        ledger.filtered = int(counters.get("filtered", 0))
        return ledger

    def stats(self) -> dict[str, int]:
        return {
            "version": self.version,
            "accepted": self.accepted,
            "running": len(self.running),
            "capacity": self.capacity,
            "pending_reissue": len(self.reissue),
            "dropped_stale": self.dropped_stale,
            "failed": self.failed,
            "reissued": self.reissued,
            "filtered": self.filtered,
        }
