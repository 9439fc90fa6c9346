"""The arith task (fully_async/tasks/arith.py): disjoint, deterministic splits and the final-number grade, and its
hooks in the dataset (data.synthetic_rows) and the built-in reward rule."""

from __future__ import annotations

import pytest

from fully_async.data import DataError, synthetic_rows
from fully_async.reward.rule import synthetic_score
from fully_async.tasks.arith import arith_score, final_number, problems, split_of


def test_train_and_held_out_problems_are_disjoint_and_held_out_ones_distinct():
    train, val = problems(5000, 0, "train"), problems(250, 0, "val")
    train_keys, val_keys = {p.key for p in train}, {p.key for p in val}
    assert len(val_keys) == 250  # no held-out problem repeats
    assert len(train_keys) > 900  # training repeats problems only once it has drawn most of its split
    assert not train_keys & val_keys
    assert {split_of(0, *_parts(k)) for k in val_keys} == {"val"}
    # The partition moves with the seed: under another seed most of these are training problems.
    assert sum(split_of(1, *_parts(k)) == "train" for k in val_keys) > 150


def _parts(key: str) -> tuple[str, int, int]:
    op, a, b = key.split(":")
    return op, int(a), int(b)


def test_the_rows_of_a_seed_are_fixed_and_a_smaller_set_is_a_prefix():
    assert problems(200, 7, "val") == problems(200, 7, "val")
    assert problems(50, 7, "val") == problems(200, 7, "val")[:50]
    assert problems(200, 7, "val") != problems(200, 8, "val")
    for p in problems(200, 7, "val"):
        op, a, b = _parts(p.key)
        assert p.answer == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert f" {a} " in p.question and f" {b} " in p.question


def test_a_split_too_small_for_the_size_asked_is_refused():
    with pytest.raises(ValueError, match="held-out split holds about"):
        problems(100_000, 0, "val")
    with pytest.raises(
        DataError, match="the arith task's held-out split holds about .* sixteenth of data.synthetic_size"
    ):
        synthetic_rows(100_000, 0, "val", "arith")
    assert len(synthetic_rows(5000, 0, "train", "arith")) == 5000


@pytest.mark.parametrize(
    ("text", "answer", "correct"),
    [
        ("17 + 25 = 42.", 42, True),  # the final number, not the first
        ("17 + 25 = 32.", 42, False),
        ("The answer is 42.0", 42, True),
        ("42 apples. Oh wait, 41", 42, False),  # a correction after the answer counts
        ("She has 1,234 stamps.", 1234, True),
        ("83-9=74", 74, True),  # a minus after a digit is the operation, not a sign
        ("It is -7 now", -7, True),
        ("**15**", 15, True),
        ("3.5", 3, False),
        ("I cannot tell.", 0, False),
        ("", 0, False),
    ],
)
def test_the_grade_reads_the_final_number(text, answer, correct):
    assert arith_score(text, str(answer)) == {"score": float(correct), "acc": float(correct)}


def test_final_number():
    assert final_number("a 12, then 3,400 and 5.25 ") == 5.25
    assert final_number("1,2345") == 1.0  # not a thousands group: the first digits alone
    assert final_number("7-2") == 2.0 and final_number("was -2") == -2.0  # a minus after a digit is the operation
    assert final_number("none") is None


def test_the_dataset_and_the_rule_grade_arith_rows_by_their_final_number():
    rows = synthetic_rows(8, 3, "val", "arith")
    assert [r.messages[0]["content"] for r in rows] == [p.question for p in problems(8, 3, "val")]
    row = rows[0]
    assert row.extra_info["task"] == "arith" and row.ground_truth == str(problems(1, 3, "val")[0].answer)
    worded = f"The total is {row.ground_truth}."  # does not open with the answer, as the one-digit tasks' rule wants
    assert synthetic_score(row.data_source, worded, row.ground_truth, row.extra_info)["score"] == 1.0
    assert synthetic_score(row.data_source, "The total is 0.", row.ground_truth, row.extra_info)["score"] == 0.0
