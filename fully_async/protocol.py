"""Trajectory and TrajectoryGroup, and their compact binary encoding.

A Trajectory is one sampled response to one prompt with everything the trainer needs: token ids, the behaviour
log-probs the engine reported, a loss mask (0 for tool/environment tokens), and the policy version of every response
token (-1 for tokens no policy produced). A TrajectoryGroup is the rollout.n samples of one prompt; it is the unit
of admission, queueing, staleness checks and re-issue.

`encode_groups` / `decode_groups` give a self-describing byte format (a JSON header plus raw little-endian arrays)
for checkpoints and anything crossing a trust boundary: nothing is unpickled.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NO_VERSION = -1
"""Version of tokens that no policy produced (tool output, environment text)."""

_MAGIC = b"FAG1"
_ARRAYS = (  # (attribute, dtype) in encoding order; lengths: prompt, then response for the rest
    ("prompt_ids", np.dtype("<i4")),
    ("response_ids", np.dtype("<i4")),
    ("behaviour_logprobs", np.dtype("<f4")),
    ("loss_mask", np.dtype("u1")),
    ("token_versions", np.dtype("<i4")),
)


class ProtocolError(ValueError):
    """A trajectory is inconsistent, or encoded bytes are malformed."""


@dataclass(frozen=True, order=True)
class PromptRef:
    """Identity of one dataset prompt in one epoch: what is admitted, re-issued and trained exactly once."""

    epoch: int
    index: int

    @property
    def uid(self) -> str:
        return f"{self.epoch}:{self.index}"

    @classmethod
    def parse(cls, uid: str) -> PromptRef:
        epoch, index = uid.split(":")
        return cls(int(epoch), int(index))


def _array(value: Any, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(value, dtype=dtype).reshape(-1))


@dataclass(eq=False)
class Trajectory:
    """One sample. Arrays over response tokens all have len(response_ids)."""

    prompt: PromptRef
    sample_index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    loss_mask: np.ndarray | None = None
    start_version: int = 0
    """Weight version when generation started (the version of an empty response)."""
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    num_aborts: int = 0
    images: list[bytes] = field(default_factory=list)
    """The images as PNG bytes (fully_async/multimodal), in the order of the image tokens in prompt_ids, then in
    response_ids (a tool turn that showed one, agents/tool_images.py); empty for a text prompt. A prompt's bytes
    object is the row's own, shared by the group's samples: not a pixel tensor."""
    cache_versions: np.ndarray | None = None
    """The oldest weight version in each response token's context (its KV cache), int32, where it differs from
    token_versions: only under async_training.on_sync=keep (fully_async/engines/inflight.py); None = token_versions."""
    teacher_logprobs: np.ndarray | None = None
    """On-policy distillation (fully_async/distill/): the teacher's log-prob of every response token, float32, len
    response_length (tokens off the loss mask included, unused); None when no teacher scored the sample."""

    def __post_init__(self) -> None:
        self.prompt_ids = _array(self.prompt_ids, _ARRAYS[0][1])
        self.response_ids = _array(self.response_ids, _ARRAYS[1][1])
        self.behaviour_logprobs = _array(self.behaviour_logprobs, _ARRAYS[2][1])
        n = len(self.response_ids)
        self.loss_mask = _array(np.ones(n) if self.loss_mask is None else self.loss_mask, _ARRAYS[3][1])
        self.token_versions = _array(self.token_versions, _ARRAYS[4][1])
        if self.cache_versions is not None:
            self.cache_versions = _array(self.cache_versions, _ARRAYS[4][1])
            if np.array_equal(self.cache_versions, self.token_versions):
                self.cache_versions = None  # no token's cache older than itself: nothing to carry
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = _array(self.teacher_logprobs, _ARRAYS[2][1])
        for name in ("behaviour_logprobs", "loss_mask", "token_versions", "cache_versions", "teacher_logprobs"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ProtocolError(
                    f"trajectory {self.prompt.uid}#{self.sample_index}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} response tokens"
                )
        if len(self.prompt_ids) == 0:
            raise ProtocolError(f"trajectory {self.prompt.uid}#{self.sample_index}: empty prompt")

    @property
    def prompt_uid(self) -> str:
        return self.prompt.uid

    @property
    def epoch(self) -> int:
        return self.prompt.epoch

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def context_versions(self) -> np.ndarray:
        """Per response token, the oldest weights in its context: cache_versions where recorded, else its own."""
        return self.token_versions if self.cache_versions is None else self.cache_versions

    @property
    def min_version(self) -> int:
        """Oldest policy version among response tokens and their KV caches (start_version when no token carries
        one): what the staleness bound holds."""
        versions = self.context_versions
        versioned = versions[versions != NO_VERSION]
        return int(versioned.min()) if len(versioned) else self.start_version

    @property
    def max_version(self) -> int:
        versioned = self.token_versions[self.token_versions != NO_VERSION]
        return int(versioned.max()) if len(versioned) else self.start_version

    def same_as(self, other: Trajectory) -> bool:
        """Field-by-field equality (arrays compared exactly)."""
        return _scalars(self) == _scalars(other) and all(
            np.array_equal(getattr(self, a), getattr(other, a)) for a, _ in _ARRAYS
        )  # teacher_logprobs: in _scalars (encoded bytes compared)


@dataclass(eq=False)
class TrajectoryGroup:
    """The rollout.n samples of one prompt, plus the prompt's dataset fields the reward and metrics need."""

    prompt: PromptRef
    trajectories: list[Trajectory]
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable row fields (data_source, ground truth, extra_info)."""

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ProtocolError(f"group {self.prompt.uid} has no trajectories")
        for t in self.trajectories:
            if t.prompt != self.prompt:
                raise ProtocolError(f"group {self.prompt.uid} holds a trajectory of prompt {t.prompt.uid}")

    @property
    def uid(self) -> str:
        return self.prompt.uid

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group: what the staleness bound is checked against."""
        return min(t.min_version for t in self.trajectories)

    @property
    def max_version(self) -> int:
        return max(t.max_version for t in self.trajectories)

    def same_as(self, other: TrajectoryGroup) -> bool:
        return (
            self.prompt == other.prompt
            and self.meta == other.meta
            and len(self.trajectories) == len(other.trajectories)
            and all(a.same_as(b) for a, b in zip(self.trajectories, other.trajectories))
        )


def _scalars(t: Trajectory) -> dict[str, Any]:
    # Images only when there are some: a text trajectory's encoding stays byte for byte what it was.
    images = {"images": [base64.b64encode(png).decode() for png in t.images]} if t.images else {}
    if t.cache_versions is not None:  # likewise only under on_sync=keep
        images["cache_versions"] = base64.b64encode(t.cache_versions.astype("<i4").tobytes()).decode()
    if t.teacher_logprobs is not None:  # likewise only when a teacher scored it
        images["teacher_logprobs"] = base64.b64encode(t.teacher_logprobs.astype("<f4").tobytes()).decode()
    return {
        **images,
        "sample_index": t.sample_index,
        "start_version": t.start_version,
        "reward": float(t.reward),
        "reward_info": t.reward_info,
        "timings": t.timings,
        "finish_reason": t.finish_reason,
        "num_aborts": t.num_aborts,
        "lens": [len(t.prompt_ids), len(t.response_ids)],
    }


def encode_groups(groups: Iterable[TrajectoryGroup]) -> bytes:
    """Groups -> bytes: magic, u64 header length, JSON header, then each trajectory's arrays back to back."""
    header: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for g in groups:
        trajs = []
        for t in g.trajectories:
            trajs.append(_scalars(t))
            chunks.extend(getattr(t, a).tobytes() for a, _ in _ARRAYS)
        header.append({"epoch": g.prompt.epoch, "index": g.prompt.index, "meta": g.meta, "trajs": trajs})
    try:
        head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    except TypeError as e:
        raise ProtocolError(f"group meta / reward_info must be JSON-serialisable: {e}") from e
    return b"".join([_MAGIC, struct.pack("<Q", len(head)), head, *chunks])


def decode_groups(data: bytes) -> list[TrajectoryGroup]:
    """Inverse of encode_groups; raises ProtocolError on anything malformed (never executes code)."""
    mv = memoryview(data)
    if len(mv) < 12 or bytes(mv[:4]) != _MAGIC:
        raise ProtocolError("not an encoded trajectory-group blob (bad magic)")
    (hlen,) = struct.unpack("<Q", mv[4:12])
    if 12 + hlen > len(mv):
        raise ProtocolError("truncated header")
    try:
        header = json.loads(bytes(mv[12 : 12 + hlen]))
    except ValueError as e:
        raise ProtocolError(f"corrupt header: {e}") from e
    pos = 12 + hlen
    groups = []
    try:
        for g in header:
            ref = PromptRef(int(g["epoch"]), int(g["index"]))
            trajs = []
            for s in g["trajs"]:
                plen, rlen = (int(x) for x in s["lens"])
                arrays = {}
                for name, dtype in _ARRAYS:
                    n = plen if name == "prompt_ids" else rlen
                    size = n * dtype.itemsize
                    if pos + size > len(mv):
                        raise ProtocolError("truncated arrays")
                    arrays[name] = np.frombuffer(mv[pos : pos + size], dtype=dtype).copy()
                    pos += size
                trajs.append(
                    Trajectory(
                        prompt=ref,
                        sample_index=int(s["sample_index"]),
                        start_version=int(s["start_version"]),
                        reward=float(s["reward"]),
                        reward_info=dict(s["reward_info"]),
                        timings=dict(s["timings"]),
                        finish_reason=str(s["finish_reason"]),
                        num_aborts=int(s["num_aborts"]),
                        images=[base64.b64decode(x, validate=True) for x in s.get("images", [])],
                        cache_versions=_per_token(s.get("cache_versions"), rlen, "<i4", "cache_versions"),
                        teacher_logprobs=_per_token(s.get("teacher_logprobs"), rlen, "<f4", "teacher_logprobs"),
                        **arrays,
                    )
                )
            groups.append(TrajectoryGroup(prompt=ref, trajectories=trajs, meta=dict(g["meta"])))
    except (KeyError, TypeError, AttributeError, binascii.Error) as e:
        raise ProtocolError(f"corrupt header entry: {e!r}") from e
    if pos != len(mv):
        raise ProtocolError(f"{len(mv) - pos} trailing bytes after the last trajectory")
    return groups


def _per_token(encoded: str | None, rlen: int, dtype: str, name: str) -> np.ndarray | None:
    """An optional per-response-token array carried in the header (base64 of `dtype`), checked against `rlen`."""
    if encoded is None:
        return None
    raw = base64.b64decode(encoded, validate=True)
    if len(raw) != np.dtype(dtype).itemsize * rlen:
        raise ProtocolError(f"{name} hold {len(raw)} bytes for {rlen} response tokens")
    return np.frombuffer(raw, dtype=dtype).copy()


def flatten(groups: Sequence[TrajectoryGroup]) -> list[Trajectory]:
    """All trajectories of the groups, group by group, in sample order."""
    return [t for g in groups for t in g.trajectories]
