"""Datasets: verl's parquet layout and jsonl, the built-in synthetic task, and the resumable epoch cursor.

A row (verl layout) has `data_source`, a prompt under `data.prompt_key` (chat messages `[{role, content}]` or a
string), `reward_model.ground_truth`, and optional `extra_info`. Rows that miss a field are rejected with the file
and row number, before any actor starts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fully_async.multimodal.colors import color_row
from fully_async.multimodal.images import IMAGE_PLACEHOLDER, ImageError, to_png
from fully_async.protocol import PromptRef
from fully_async.tasks.arith import problems

if TYPE_CHECKING:
    from fully_async.config import FullyAsyncConfig

SYNTHETIC_SOURCE = "fully_async/synthetic"


class DataError(ValueError):
    """A dataset file or row is malformed; the message names the file and the row."""


@dataclass
class PromptRow:
    """One prompt of the dataset, in the shape the agent loop and reward need."""

    data_source: str
    messages: list[dict[str, str]]
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    origin: str = ""
    """'file:row' for error messages."""
    images: list[bytes] = field(default_factory=list)
    """The prompt's images as PNG bytes, one per `<image>` in its messages (verl's `images` column); empty for text."""

    def reward_meta(self) -> dict[str, Any]:
        """What a reward source sees besides the response: the row's meta and the question (last user message)."""
        question = next((m.get("content", "") for m in reversed(self.messages) if m.get("role") == "user"), "")
        return {**self.meta(), "question": question}

    def meta(self) -> dict[str, Any]:
        """The JSON-serialisable fields a TrajectoryGroup carries to the trainer and the logs."""
        return {"data_source": self.data_source, "ground_truth": self.ground_truth, "extra_info": self.extra_info}


def _row(raw: dict[str, Any], prompt_key: str, origin: str, base_dir: Path | None = None) -> PromptRow:
    if not isinstance(raw, dict):
        raise DataError(f"{origin}: a row must be an object, got {type(raw).__name__}")
    source = raw.get("data_source")
    if not isinstance(source, str) or not source:
        raise DataError(f"{origin}: missing field 'data_source' (a string naming the reward function)")
    prompt = raw.get(prompt_key)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0:
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{origin}: field '{prompt_key}'[{i}] must be {{'role': str, 'content': str}}, got {m!r}"
                )
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise DataError(f"{origin}: missing field '{prompt_key}' (chat messages or a string), got {prompt!r}")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"{origin}: missing field 'reward_model.ground_truth'")
    extra = raw.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{origin}: field 'extra_info' must be an object, got {extra!r}")
    images = _images(raw.get("images"), messages, origin, base_dir)
    return PromptRow(source, messages, _plain(reward_model["ground_truth"]), _plain(extra), origin, images)


def _images(value: Any, messages: list[dict[str, str]], origin: str, base_dir: Path | None) -> list[bytes]:
    """verl's `images` column as PNG bytes; as many as the messages have `<image>` markers."""
    items = [] if value is None else list(value)
    markers = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if markers != len(items):
        raise DataError(f"{origin}: {markers} '{IMAGE_PLACEHOLDER}' marker(s) in the prompt for {len(items)} image(s)")
    try:
        return [to_png(_plain(x) if not isinstance(x, (bytes, dict)) else x, base_dir) for x in items]
    except ImageError as e:
        raise DataError(f"{origin}: field 'images': {e}") from e


def _plain(value: Any) -> Any:
    """numpy values from parquet -> JSON-serialisable Python values."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_rows(files: Sequence[str], prompt_key: str = "prompt") -> list[PromptRow]:
    """Read and check every row of the given parquet / jsonl files, in order."""
    rows: list[PromptRow] = []
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            raise DataError(f"{name}: dataset file does not exist")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                records = pq.read_table(path).to_pylist()
            except Exception as e:  # pyarrow raises several types for a corrupt file; the message is enough
                raise DataError(f"{name}: cannot read parquet: {e}") from e
            rows.extend(_row(r, prompt_key, f"{name}:row {i}", path.parent) for i, r in enumerate(records))
        elif path.suffix in (".jsonl", ".json"):
            with path.open() as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        raw = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{name}:line {i + 1}: not valid JSON: {e}") from e
                    rows.append(_row(raw, prompt_key, f"{name}:line {i + 1}", path.parent))
        else:
            raise DataError(f"{name}: unsupported dataset format {path.suffix!r}; use .parquet or .jsonl")
    if not rows:
        raise DataError(f"no rows in {list(files)}")
    return rows


COPY_REPEATS = 5
"""How often the copy task's prompt shows its digit (docs/benchmarks.md, issue 4: without credit for a wrong digit,
32 unlearned digits over twelve in-process seeds with one copy, 1 with five)."""


SYNTHETIC_TASKS = ("copy", "add", "guess", "lookup", "reverse", "colors", "arith")

GUESS_PROMPT = "guess one of 0123456789"
"""The prompt of every `guess` row: the digit is hidden, only the environment's answers tell it. The digits are shown
so the untrained model has them to copy (from random init, a digit is one of ~260 tokens; without them the first
24 steps of a run stayed at reward 0.03)."""

LOOKUP_PROMPT = "lookup"
"""The prompt of every `lookup` row: the digit is hidden, only the lookup tool (called by a one-letter turn,
fully_async/agents/lookup.py) tells it. Short, so that the tool's answer dominates what the answering turn sees, as
the copy task's digit dominates its prompt: with 'look up with a letter, then answer 0123456789' (digits shown as the
guess task shows them) the reward stayed at ~0.02 over 275 steps (docs/benchmarks.md)."""


def synthetic_rows(
    size: int,
    seed: int,
    split: str = "train",
    task: str = "copy",
    copy_repeats: int = COPY_REPEATS,
    env_delay_s: Sequence[float] = (0.0, 0.0),
    reverse_length: int = 2,
) -> list[PromptRow]:
    """The built-in tasks, answered by one digit: `copy` ('echo 77777' -> '7'), `add` ('3+4=' -> '7', sums < 10) and
    the multi-turn `guess` (a hidden digit; after a wrong one-digit guess the environment tells it, 'no, it is 77777',
    fully_async/agents/guess.py, after a delay drawn from `env_delay_s` = [low, high] seconds) and the tool task
    `lookup` (the same hidden digit, told only by the lookup tool a one-letter turn calls, fully_async/agents/lookup.py).

    A 2-layer model learns `copy` from random init by RL in minutes (the answer is a lookup of the prompt's digit,
    shown `copy_repeats` times: with one copy, first-layer attention to it could saturate at zero for some digits,
    which RL then never learned); `add` needs both digits and learns more slowly; `guess` can only be solved
    reliably from an earlier turn's answer. `reverse` ('reverse 44444 77777' -> '74', `reverse_length` digits, each
    shown `copy_repeats` times as for copy) is answered by several tokens, graded per position (reward/rule.py).
    `colors` is visual: a small image of one flat color, answered by the color's letter (multimodal/colors.py;
    needs a vision-language model, model.tiny.arch=qwen2_vl).
    `arith` is a real model's task: arithmetic word problems graded on the final number (fully_async/tasks/arith.py).
    Train and validation draw from disjoint seeds (arith: from disjoint sets of problems)."""
    if task not in SYNTHETIC_TASKS:
        raise DataError(f"unknown synthetic task {task!r}; choose one of {', '.join(SYNTHETIC_TASKS)}")
    if task == "arith":
        return arith_rows(size, seed, split)
    rng = random.Random(f"{seed}:{split}:{task}")
    rows = []
    for i in range(size):
        a = rng.randint(0, 9)
        extra: dict[str, Any] = {}
        images: list[bytes] = []
        if task == "colors":
            content, answer, images = color_row(rng)
        elif task == "copy":
            content, answer = f"echo {str(a) * copy_repeats}", a
        elif task == "reverse":
            digits = "".join(str(rng.randint(0, 9)) for _ in range(reverse_length))
            content, answer = "reverse " + " ".join(d * copy_repeats for d in digits), digits[::-1]
        elif task in ("guess", "lookup"):
            content, answer = (GUESS_PROMPT if task == "guess" else LOOKUP_PROMPT), a
            extra["env_delay_s"] = [float(x) for x in env_delay_s]
        else:
            b = rng.randint(0, 9 - a)
            content, answer = f"{a}+{b}=", a + b
        rows.append(
            PromptRow(
                data_source=SYNTHETIC_SOURCE,
                messages=[{"role": "user", "content": content}],
                ground_truth=str(answer),
                extra_info={"split": split, "index": i, "task": task, **extra},
                origin=f"synthetic:{split}:{i}",
                images=images,
            )
        )
    return rows


def arith_rows(size: int, seed: int, split: str) -> list[PromptRow]:
    """The arith task's rows of `split` (fully_async/tasks/arith.py): one user message each, the answer a number."""
    try:
        found = problems(size, seed, split)
    except ValueError as e:
        raise DataError(f"{e} (a run holds out a sixteenth of data.synthetic_size)") from e
    return [
        PromptRow(
            data_source=SYNTHETIC_SOURCE,
            messages=[{"role": "user", "content": p.question}],
            ground_truth=str(p.answer),
            extra_info={"split": split, "index": i, "task": "arith", "problem": p.key},
            origin=f"synthetic:{split}:{i}",
        )
        for i, p in enumerate(found)
    ]


def dataset(cfg: FullyAsyncConfig, split: str) -> list[PromptRow]:
    """The rows of `split` ("train" or "val"): data.train_files / data.val_files, or the synthetic task when none are
    given (its validation split a sixteenth of the training size, at least 32 rows)."""
    files = cfg.data.train_files if split == "train" else cfg.data.val_files
    if files:
        return load_rows(files, cfg.data.prompt_key)
    size = cfg.data.synthetic_size if split == "train" else max(32, cfg.data.synthetic_size // 16)
    return synthetic_rows(
        size,
        cfg.data.seed,
        split,
        cfg.data.synthetic_task,
        env_delay_s=cfg.data.synthetic_env_delay_s,
        reverse_length=cfg.data.synthetic_reverse_length,
    )


class EpochCursor:
    """Walks dataset indices epoch after epoch, shuffled per epoch by (seed, epoch); resumable from state_dict."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1:
            raise DataError("dataset is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self) -> PromptRef:
        if self.position >= self.size:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        ref = PromptRef(self.epoch, int(self._order[self.position]))
        self.position += 1
        return ref

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != self.size:
            raise DataError(f"checkpoint was taken on a dataset of {state['size']} rows; this one has {self.size}")
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order = self._permutation(self.epoch)
