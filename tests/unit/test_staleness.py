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

    def __init__(self, eta, per_step, sync_every, n_prompts, version=0):
        """`version`: the run resumes at this weight version (a long run's later part, without its earlier steps)."""
        self.eta, self.per_step, self.sync_every = eta, per_step, sync_every
        self.ledger = StalenessLedger(eta, per_step * sync_every, version=version)
        # The groups accepted before the resume: one version's worth per version, as a real run leaves the ledger.
        self.ledger.accepted = self.accepted_before = version * per_step * sync_every
        self.dataset = [PromptRef(0, i) for i in range(n_prompts)]
        self.cursor = 0
        self.running: dict[PromptRef, int] = {}
        self.queue: list[tuple[PromptRef, int]] = []
        self.trainer_version = version
        self.steps = 0
        self.trained: list[tuple[PromptRef, int, int]] = []  # (prompt, min_version, trained_version)
        self.filtered: list[PromptRef] = []  # prompts dynamic sampling left out (done, not re-issued)

    def admit(self) -> bool:
        if not self.ledger.can_admit():
            return False
        p = self.ledger.next_reissue()
        if p is None:
            if self.cursor >= len(self.dataset) and not self.filtered:
                return False
            # Past the dataset, the next epoch's prompts (as the real cursor does): groups filtered at the end of
            # an epoch leave too few for a last full batch, and the next epoch's fill it.
            p = self.dataset[self.cursor] if self.cursor < len(self.dataset) else PromptRef(1, self.cursor)
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

    def filter(self, i: int, reissue: bool = False) -> None:
        """Dynamic sampling left the group out: done (or re-issued), never queued."""
        p = sorted(self.running)[i % len(self.running)]
        self.running.pop(p)
        self.ledger.filter(p, reissue)
        if not reissue:
            self.filtered.append(p)

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
        first_epoch = [p for p, _, _ in self.trained if p.epoch == 0] + [p for p in self.filtered if p.epoch == 0]
        return len(first_epoch) == len(self.dataset)

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
    # Versions well past the start and past the bound: a resumed run's ledger starts at any version.
    version = draw(st.one_of(st.just(0), st.integers(1, 20), st.integers(10**5, 10**9)))
    return eta, per_step, sync_every, n_prompts, version


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_random_interleavings_respect_the_bound_and_train_every_prompt_once(params, data):
    eta, per_step, sync_every, n_prompts, version = params
    sim = Sim(eta, per_step, sync_every, n_prompts, version)
    for _ in range(data.draw(st.integers(0, 120), label="random steps")):
        action = data.draw(st.sampled_from(["admit", "admit", "finish", "fail", "filter", "train", "restart"]))
        if action == "admit":
            sim.admit()
        elif action in ("finish", "fail") and sim.running:
            sim.finish(data.draw(st.integers(0, 100)), ok=action == "finish")
        elif action == "filter" and sim.running:
            sim.filter(data.draw(st.integers(0, 100)), reissue=data.draw(st.booleans()))
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

    prompts = [p for p, _, _ in sim.trained] + sim.filtered
    assert len(set(prompts)) == len(prompts), "a prompt was trained or filtered twice"
    assert sorted(p for p in prompts if p.epoch == 0) == sim.dataset, "a prompt was lost"
    for p, min_v, trained_v in sim.trained:
        assert trained_v - min_v <= eta, f"{p.uid} trained {trained_v - min_v} versions stale (bound {eta})"
        if eta == 0:
            assert min_v == trained_v
    assert sim.ledger.accepted == sim.accepted_before + len(sim.trained) + len(sim.queue)
    assert sim.ledger.filtered >= len(sim.filtered)


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


@settings(max_examples=500, deadline=None)
@given(
    trainer_version=st.one_of(st.integers(0, 50), st.integers(0, 10**12)),
    lag=st.integers(-3, 40),
    eta=st.integers(0, 30),
)
def test_is_fresh_is_exactly_the_bound_at_every_version(trainer_version, lag, eta):
    # The rule does not depend on how far the run has come: only the lag counts, at version 3 as at 10^12.
    min_version = trainer_version - lag
    assert is_fresh(min_version, trainer_version, eta) == (lag <= eta)
    assert StalenessLedger(eta, 1, version=max(0, trainer_version)).is_fresh(min_version, trainer_version) == (
        lag <= eta
    )


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 4),
    per_step=st.integers(1, 3),
    held_for=st.integers(1, 8),
    start=st.one_of(st.integers(0, 3), st.integers(6, 60), st.integers(10**6, 10**9)),
)
def test_a_straggler_is_trained_within_the_bound_or_dropped_and_reissued_at_any_version(eta, per_step, held_for, start):
    """One group admitted at the resume version `start` is held back while the trainer moves `held_for` versions
    on; it is trained only if `held_for <= eta`, else dropped, re-issued and trained fresh."""
    sim = Sim(eta, per_step, 1, n_prompts=per_step * (held_for + eta + 3), version=start)
    sim.admit()
    straggler = next(iter(sim.running))
    for _ in range(held_for):  # the others run normally; the straggler stays running
        while sim.admit():
            pass
        for p in [p for p in sorted(sim.running) if p != straggler]:
            v = sim.running.pop(p)
            sim.ledger.finish(p, True)
            sim.queue.append((p, v))
        before = sim.trainer_version
        while sim.train():
            pass
        if sim.trainer_version == before:
            break
    lag = sim.trainer_version - start
    sim.finish(sorted(sim.running).index(straggler), ok=True)
    while not sim.done():
        sim.round()
    trained = {p: (v, t) for p, v, t in sim.trained}
    for p, (v, t) in trained.items():
        assert t - v <= eta, f"{p.uid} trained {t - v} versions stale at version {t} (bound {eta})"
    if lag > eta:
        assert sim.ledger.dropped_stale >= 1 and trained[straggler][0] > start
    assert sorted(trained) == sim.dataset and len(sim.trained) == len(sim.dataset)


def test_a_filtered_group_frees_its_slot_and_is_done_or_reissued():
    ledger = StalenessLedger(max_staleness=0, groups_per_version=2)
    assert ledger.admit(PromptRef(0, 0)) and ledger.admit(PromptRef(0, 1)) and not ledger.can_admit()
    ledger.filter(PromptRef(0, 0))
    assert ledger.can_admit() and ledger.accepted == 0 and not ledger.reissue  # done: the slot goes to new work
    ledger.filter(PromptRef(0, 1), reissue=True)
    assert list(ledger.reissue) == [PromptRef(0, 1)]
    back = StalenessLedger.from_state(ledger.state_dict())
    assert back.stats()["filtered"] == 2 and list(back.reissue) == [PromptRef(0, 1)]
    with pytest.raises(LedgerError):
        ledger.filter(PromptRef(0, 0))
