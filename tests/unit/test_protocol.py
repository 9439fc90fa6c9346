from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_async.protocol import (
    NO_VERSION,
    PromptRef,
    ProtocolError,
    Trajectory,
    TrajectoryGroup,
    decode_groups,
    encode_groups,
)


def traj(prompt=PromptRef(0, 1), sample_index=0, plen=3, versions=(0, 0, 1), **kw):
    n = len(versions)
    return Trajectory(
        prompt=prompt,
        sample_index=sample_index,
        prompt_ids=np.arange(1, plen + 1),
        response_ids=np.arange(10, 10 + n),
        behaviour_logprobs=-np.linspace(0.1, 1.0, n),
        token_versions=versions,
        **kw,
    )


def test_versions_ignore_tool_tokens_and_fall_back_to_start_version():
    t = traj(versions=(3, NO_VERSION, 2, 4), loss_mask=[1, 0, 1, 1])
    assert (t.min_version, t.max_version) == (2, 4)
    empty = traj(versions=(), start_version=7)
    assert (empty.min_version, empty.max_version) == (7, 7)
    tool_only = traj(versions=(NO_VERSION,), start_version=5, loss_mask=[0])
    assert tool_only.min_version == 5


def test_group_min_version_is_the_oldest_token():
    g = TrajectoryGroup(PromptRef(0, 1), [traj(versions=(5, 6)), traj(sample_index=1, versions=(4, 6))])
    assert g.min_version == 4 and g.max_version == 6


def test_inconsistent_lengths_and_foreign_trajectories_are_rejected():
    with pytest.raises(ProtocolError, match="token_versions has 1 entries for 3"):
        Trajectory(PromptRef(0, 0), 0, [1], [1, 2, 3], [0.0, 0.0, 0.0], [0])
    with pytest.raises(ProtocolError, match="holds a trajectory of prompt 0:2"):
        TrajectoryGroup(PromptRef(0, 1), [traj(prompt=PromptRef(0, 2))])
    with pytest.raises(ProtocolError, match="empty prompt"):
        traj(plen=0)


@st.composite
def groups(draw):
    out = []
    for gi in range(draw(st.integers(1, 4))):
        ref = PromptRef(draw(st.integers(0, 3)), gi)
        trajs = []
        for si in range(draw(st.integers(1, 3))):
            n = draw(st.integers(0, 20))
            trajs.append(
                Trajectory(
                    prompt=ref,
                    sample_index=si,
                    prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=10)),
                    response_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
                    behaviour_logprobs=draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n)),
                    token_versions=draw(st.lists(st.integers(-1, 100), min_size=n, max_size=n)),
                    loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
                    reward=draw(st.floats(-1, 1)),
                    reward_info={"acc": draw(st.booleans()), "source": "math"},
                    timings={"generate_s": 0.5},
                    finish_reason=draw(st.sampled_from(["stop", "length"])),
                    num_aborts=draw(st.integers(0, 3)),
                )
            )
        out.append(TrajectoryGroup(ref, trajs, meta={"data_source": "synthetic", "ground_truth": str(gi)}))
    return out


@settings(max_examples=50, deadline=None)
@given(groups())
def test_encode_decode_round_trip(gs):
    back = decode_groups(encode_groups(gs))
    assert len(back) == len(gs)
    assert all(a.same_as(b) for a, b in zip(gs, back))


def test_decode_rejects_garbage_without_unpickling():
    blob = encode_groups([TrajectoryGroup(PromptRef(0, 1), [traj()])])
    with pytest.raises(ProtocolError, match="bad magic"):
        decode_groups(b"\x80\x04pickle")
    with pytest.raises(ProtocolError, match="truncated"):
        decode_groups(blob[:-3])
    with pytest.raises(ProtocolError, match="trailing"):
        decode_groups(blob + b"xx")
    with pytest.raises(ProtocolError, match="JSON-serialisable"):
        encode_groups([TrajectoryGroup(PromptRef(0, 1), [traj(reward_info={"obj": object()})])])
