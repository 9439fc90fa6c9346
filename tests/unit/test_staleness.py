"""The staleness ledger under random interleavings of admit / finish / fail / train / sync / restart."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fully_async.protocol import PromptRef
from fully_async.staleness import LedgerError, StalenessLedger, is_fresh


class Sim:
    """A rollouter + FIFO queue + trainer driven step by step around a real StalenessLedger.

    A group's oldest token is its admission version (no partial continuation lowers or raises it)."""

    def __init__(self, eta, per_step, sync_every, n_prompts):
        self.eta, self.per_step, self.sync_every = eta, per_step, sync_every
        self.ledger = StalenessLedger(eta, per_step * sync_every)
        self.dataset = [PromptRef(0, i) for i in range(n_prompts)]
        self.cursor = 0
        self.running: dict[PromptRef, int] = {}
        self.queue: list[tuple[PromptRef, int]] = []
        self.trainer_version = 0
        self.steps = 0
        self.trained: list[tuple[PromptRef, int, int]] = []  # (prompt, min_version, trained_version)

    def admit(self) -> bool:
        if not self.ledger.can_admit():
            return False
        p = self.ledger.next_reissue()
        if p is None:
            if self.cursor >= len(self.dataset):
                return False
            p = self.dataset[self.cursor]
            self.cursor += 1
        assert self.ledger.admit(p)
        self.running[p] = self.ledger.version
        return True

    def finish(self, i: int, ok: bool) -> None:
        p = sorted(self.running)[i % len(self.running)]
        v = self.running.pop(p)
        self.ledger.finish(p, ok)
        if ok:
            self.queue.append((p, v))

    def train(self) -> bool:
        stale = [(p, v) for p, v in self.queue if not is_fresh(v, self.trainer_version, self.eta)]
        self.queue = [(p, v) for p, v in self.queue if is_fresh(v, self.trainer_version, self.eta)]
        self.ledger.drop_stale(p for p, _ in stale)
        if len(self.queue) < self.per_step:
            return False
        batch, self.queue = self.queue[: self.per_step], self.queue[self.per_step :]
        self.trained.extend((p, v, self.trainer_version) for p, v in batch)
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.trainer_version += 1
            self.ledger.on_sync(self.trainer_version)
        return True

    def restart(self) -> None:
        """Crash + resume: running generations are lost; ledger and queue come back from their checkpoint."""
        self.ledger = StalenessLedger.from_state(self.ledger.state_dict())
        self.running.clear()

    def done(self) -> bool:
        return len(self.trained) == len(self.dataset)

    def round(self) -> None:
        """Admit what the bound allows, finish it all in admission order, train what can be trained."""
        while self.admit():
            pass
        while self.running:
            self.finish(0, ok=True)
        while self.train():
            pass


@st.composite
def scenario(draw):
    eta = draw(st.integers(0, 3))
    per_step = draw(st.integers(1, 4))
    sync_every = draw(st.integers(1, 3))
    n_prompts = per_step * draw(st.integers(1, 8))
    return eta, per_step, sync_every, n_prompts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_random_interleavings_respect_the_bound_and_train_every_prompt_once(params, data):
    eta, per_step, sync_every, n_prompts = params
    sim = Sim(eta, per_step, sync_every, n_prompts)
    for _ in range(data.draw(st.integers(0, 120), label="random steps")):
        action = data.draw(st.sampled_from(["admit", "admit", "finish", "fail", "train", "restart"]))
        if action == "admit":
            sim.admit()
        elif action in ("finish", "fail") and sim.running:
            sim.finish(data.draw(st.integers(0, 100)), ok=action == "finish")
        elif action == "train":
            sim.train()
        elif action == "restart" and data.draw(st.integers(0, 9)) == 0:
            sim.restart()
        # The admission invariant holds after every action.
        assert sim.ledger.accepted + len(sim.ledger.running) <= sim.ledger.capacity

    # Drain: every round admits what the bound allows, finishes it, trains what it can. It must always progress.
    for _ in range(10 * n_prompts + 10):
        if sim.done():
            break
        sim.round()
    assert sim.done(), f"stalled: {sim.ledger.stats()}, queue={len(sim.queue)}, trained={len(sim.trained)}"

    prompts = [p for p, _, _ in sim.trained]
    assert sorted(prompts) == sim.dataset, "a prompt was lost or trained twice"
    for p, min_v, trained_v in sim.trained:
        assert trained_v - min_v <= eta, f"{p.uid} trained {trained_v - min_v} versions stale (bound {eta})"
        if eta == 0:
            assert min_v == trained_v
    assert not sim.running and sim.ledger.accepted == len(sim.trained)


def test_in_order_completion_never_drops_anything():
    # With groups finishing in admission order the rule alone keeps every group within the bound.
    for eta in range(3):
        sim = Sim(eta, per_step=2, sync_every=2, n_prompts=40)
        while not sim.done():
            sim.round()
        assert sim.ledger.dropped_stale == 0


def test_admission_rule_numbers():
    ledger = StalenessLedger(max_staleness=1, groups_per_version=4)
    admitted = [ledger.admit(PromptRef(0, i)) for i in range(10)]
    assert admitted == [True] * 8 + [False] * 2  # (1 + 0 + 1) * 4
    ledger.on_sync(1)
    assert ledger.headroom() == 4
    assert ledger.admit(PromptRef(0, 8))


def test_state_round_trip_turns_running_into_reissues():
    ledger = StalenessLedger(2, 3)
    for i in range(5):
        ledger.admit(PromptRef(1, i))
    ledger.finish(PromptRef(1, 0))
    ledger.finish(PromptRef(1, 1), ok=False)
    ledger.drop_stale([PromptRef(1, 0)])
    ledger.on_sync(2)
    back = StalenessLedger.from_state(ledger.state_dict())
    assert back.version == 2 and back.accepted == 0
    assert list(back.reissue) == [PromptRef(1, 1), PromptRef(1, 0), PromptRef(1, 2), PromptRef(1, 3), PromptRef(1, 4)]
    assert back.stats()["dropped_stale"] == 1 and back.stats()["failed"] == 1


def test_protocol_violations_raise():
    ledger = StalenessLedger(0, 1)
    with pytest.raises(LedgerError):
        ledger.finish(PromptRef(0, 0))
    with pytest.raises(LedgerError):
        ledger.drop_stale([PromptRef(0, 0)])
    ledger.on_sync(3)
    with pytest.raises(LedgerError, match="backwards"):
        ledger.on_sync(2)
