from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fully_async.data import COPY_REPEATS, SYNTHETIC_SOURCE, DataError, EpochCursor, load_rows, synthetic_rows
from fully_async.reward.rule import synthetic_score


def verl_row(i, **over):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    row.update(over)
    return row


def test_parquet_in_verl_layout_loads(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row(i) for i in range(3)]), path)
    rows = load_rows([str(path)])
    assert [r.ground_truth for r in rows] == ["1", "2", "3"]
    assert rows[2].messages == [{"role": "user", "content": "What is 2+1?"}]
    assert rows[1].meta()["extra_info"] == {"split": "train", "index": 1}
    json.dumps([r.meta() for r in rows])  # numpy values were converted


def test_jsonl_with_string_prompt_loads(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(verl_row(i, prompt=f"q{i}")) for i in range(2)) + "\n\n")
    rows = load_rows([str(path)])
    assert rows[1].messages == [{"role": "user", "content": "q1"}]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "reward_model": {"ground_truth": "1"}}, "line 2: missing field 'data_source'"),
        ({"data_source": "s", "reward_model": {"ground_truth": "1"}}, "line 2: missing field 'prompt'"),
        ({"data_source": "s", "prompt": "x"}, "line 2: missing field 'reward_model.ground_truth'"),
        ({"data_source": "s", "prompt": [{"role": "user"}], "reward_model": {"ground_truth": 1}}, "'prompt'[0]"),
    ],
)
def test_a_row_missing_a_field_names_file_and_row(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(verl_row(0)) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as err:
        load_rows([str(path)])
    assert str(path) in str(err.value) and message in str(err.value)


def test_missing_file_and_bad_format_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows([str(tmp_path / "nope.parquet")])
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported dataset format '.csv'"):
        load_rows([str(tmp_path / "d.csv")])
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="broken.jsonl:line 1: not valid JSON"):
        load_rows([str(tmp_path / "broken.jsonl")])


def test_copy_task_answers_with_the_echoed_digit():
    rows = synthetic_rows(30, seed=0)
    assert all(r.messages[0]["content"] == "echo " + r.ground_truth * COPY_REPEATS for r in rows)
    assert [r.messages[0]["content"] for r in synthetic_rows(30, seed=0, copy_repeats=1)] == [
        "echo " + r.ground_truth for r in rows
    ]
    assert len({r.ground_truth for r in rows}) > 5
    with pytest.raises(DataError, match="unknown synthetic task 'mul'"):
        synthetic_rows(3, 0, task="mul")


def test_add_task_is_deterministic_and_scored_by_its_rule():
    a, b = synthetic_rows(50, seed=3, task="add"), synthetic_rows(50, seed=3, task="add")
    assert [r.messages for r in a] == [r.messages for r in b]
    assert [r.messages for r in a] != [r.messages for r in synthetic_rows(50, seed=3, split="val", task="add")]
    for r in a:
        x, y = r.messages[0]["content"].rstrip("=").split("+")
        assert r.ground_truth == str(int(x) + int(y)) and r.data_source == SYNTHETIC_SOURCE
        assert synthetic_score(r.data_source, r.ground_truth + "<junk", r.ground_truth)["score"] == 1.0
    # No credit for a wrong digit: confident and wrong must not pay (docs/benchmarks.md, issue 4).
    assert synthetic_score(SYNTHETIC_SOURCE, " 12", "3") == {"score": 0.0, "acc": 0.0}
    assert synthetic_score(SYNTHETIC_SOURCE, "abc", "3")["score"] == 0.0
    # A policy that has not learned to stop still earns the answer: "3333" opens with "3".
    assert synthetic_score(SYNTHETIC_SOURCE, "3333", "3") == {"score": 1.0, "acc": 1.0}


def test_cursor_covers_each_epoch_once_and_resumes_exactly():
    cur = EpochCursor(10, seed=1)
    first = [cur.next() for _ in range(10)]
    assert sorted(p.index for p in first) == list(range(10)) and {p.epoch for p in first} == {0}
    mid = [cur.next() for _ in range(4)]
    state = cur.state_dict()
    rest = [cur.next() for _ in range(12)]
    again = EpochCursor(10, seed=999)
    again.load_state_dict(state)
    assert [again.next() for _ in range(12)] == rest
    assert sorted(p.index for p in mid + rest[:6]) == list(range(10)) and rest[6].epoch == 2
    assert [p.index for p in first] != [p.index for p in mid + rest[:6]]  # reshuffled per epoch
    with pytest.raises(DataError, match="dataset of 10 rows; this one has 11"):
        EpochCursor(11).load_state_dict(state)


def test_reverse_task_answers_with_the_reversed_string_graded_per_position():
    rows = synthetic_rows(40, seed=1, task="reverse", reverse_length=3)
    assert len({r.ground_truth for r in rows}) > 20
    for r in rows:
        blocks = r.messages[0]["content"].removeprefix("reverse ").split(" ")
        assert len(blocks) == 3 and all(len(set(b)) == 1 and len(b) == 5 and b.isdigit() for b in blocks)
        assert r.ground_truth == "".join(b[0] for b in blocks)[::-1]
    info = rows[0].extra_info
    assert synthetic_score(SYNTHETIC_SOURCE, "274<junk", "274", info) == {"score": 1.0, "acc": 1.0}
    assert synthetic_score(SYNTHETIC_SOURCE, "294", "274", info) == {"score": pytest.approx(2 / 3), "acc": 0.0}
    assert synthetic_score(SYNTHETIC_SOURCE, "4", "274", info)["score"] == 0.0
    assert synthetic_score(SYNTHETIC_SOURCE, "27", "274", info)["score"] == pytest.approx(2 / 3)
    # The one-digit tasks keep their all-or-nothing score.
    assert synthetic_score(SYNTHETIC_SOURCE, "294", "274")["score"] == 0.0


def test_task_reverse_sets_its_own_settings_and_refuses_a_response_too_short():
    from fully_async.config import ConfigError, compose

    cfg = compose(["task=reverse"])
    assert cfg.data.synthetic_task == "reverse"
    assert cfg.rollout.response_length >= cfg.data.synthetic_reverse_length
    with pytest.raises(ConfigError, match="rollout.response_length must be >= data.synthetic_reverse_length = 4"):
        compose(["task=reverse", "data.synthetic_reverse_length=4"])
