"""The built-in task `task=arith`: short arithmetic word problems in plain English, graded on the final number.

A problem is one operation on two numbers (KINDS: a sum, the kind measured to suit SmolLM2-135M-Instruct) told as a
one- or two-sentence story ("Mia has 47 marbles and gets 18 more. How many marbles does Mia have now?") with one
instruction line (INSTRUCTION). It is asked
through the model's own chat template (a one-message user turn, as every synthetic task) and graded by `arith_score`:
the last number in the response must equal the answer (commas between thousands and a trailing `.0` are read; a
fraction, or no number at all, is wrong).

Train and held-out sets are disjoint: every arithmetic problem (operation and operands, whatever its wording) belongs to
exactly one split, decided by a hash of the problem and the data seed (one in HELD_OUT_SHARE held out). No held-out
problem repeats. The rows of a split are a fixed sequence for a seed: the first n rows of a larger set are the
rows of a set of n, so `python -m fully_async.eval --n 200` grades the first 200 held-out problems a run validates on.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import operator
import random
import re
from dataclasses import dataclass

HELD_OUT_SHARE = 4
"""One problem in this many (by hash) belongs to the held-out split, the others to training."""

INSTRUCTION = "Answer with the number only."
"""The line after every question. The answer is read as the last number of the response, so a model that shows its
working anyway ("59 + 7 = 66.") is graded on the result it ends with. Asking for the working step by step made
SmolLM2's answers ~120 tokens long (mean) at a lower accuracy (12.5 % over 64 mixed problems)."""


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class Kind:
    """One kind of problem: an operation over operand ranges and the stories that tell it."""

    op: str
    a: tuple[int, int]
    b: tuple[int, int]
    stories: tuple[str, ...]

    def answer(self, a: int, b: int) -> int:
        return OPS[self.op](a, b)

    def pool(self) -> int:
        """How many distinct (a, b) this kind can draw."""
        return (self.a[1] - self.a[0] + 1) * (self.b[1] - self.b[0] + 1)


KINDS = (
    Kind("+", (10, 60), (2, 30), (
        "{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?",
        "There are {a} {items} in a box. {name} puts in {b} more. How many {items} are in the box now?",
        "{name} collected {a} {items} on Monday and {b} {items} on Tuesday. How many {items} did {name} collect in all?",
        "A class has {a} {items}. The teacher brings {b} more. How many {items} does the class have now?",
        "{name} had {a} {items}. A friend gave {name} {b} {items}. How many {items} does {name} have now?",
    )),
)  # fmt: skip
"""The problem kinds, drawn with equal chance: a number from 10 to 60 plus one from 2 to 30, told as a story.
Measured on SmolLM2-135M-Instruct, greedy, answers up to 64 tokens (docs/models.md): subtraction stories were answered
right 0 times in 51 (even with a one-digit number taken away: "76 - 5 = 13"), which leaves RL no correct sample to
learn from; sums up to 99 + 49 scored 14 % (of 77) and up to 99 + 29 9 % (of 100), below the 10 % floor a base model
should clear for RL to find correct samples; up to 60 + 30 23 % (of 47); multiplication tables 15-33 % but too few
distinct problems for a 200-problem held-out set. 1,479 distinct sums, a quarter held out (HELD_OUT_SHARE)."""

NAMES = ("Mia", "Sam", "Lena", "Omar", "Ravi", "Anna", "Tom", "Yuki", "Leo", "Zoe", "Ben", "Nora")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins")


def split_of(seed: int, op: str, a: int, b: int) -> str:
    """The split ("val" or "train") a problem belongs to under data seed `seed`, whatever its wording."""
    digest = hashlib.sha256(f"{seed}:{op}:{a}:{b}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0 else "train"


@dataclass(frozen=True)
class Problem:
    question: str
    """The story and the instruction, the user message."""
    answer: int
    key: str
    """'op:a:b': the arithmetic, without the wording."""


def problems(size: int, seed: int, split: str) -> list[Problem]:
    """The first `size` problems of `split` ("val", else training) under seed `seed`, from a stream fixed by (seed,
    split). Held-out problems are distinct (ValueError when the split has fewer than `size`); training problems may
    repeat, each a fresh wording, so an epoch can be longer than the training split."""
    held_out = split == "val"
    split = "val" if held_out else "train"
    capacity = int(sum(k.pool() for k in KINDS) / HELD_OUT_SHARE * 0.8)  # below the pool: rejection stays cheap
    if held_out and size > capacity:
        raise ValueError(f"the arith task's held-out split holds about {capacity} distinct problems, {size} were asked")
    rng = random.Random(f"arith:{seed}:{split}")
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < size:
        kind = rng.choice(KINDS)
        a, b = rng.randint(*kind.a), rng.randint(*kind.b)
        story, name, items = rng.choice(kind.stories), rng.choice(NAMES), rng.choice(ITEMS)
        key = f"{kind.op}:{a}:{b}"
        if (held_out and key in seen) or split_of(seed, kind.op, a, b) != split:
            continue
        seen.add(key)
        question = story.format(a=a, b=b, name=name, items=items) + "\n" + INSTRUCTION
        out.append(Problem(question, kind.answer(a, b), key))
    return out


_NUMBER = re.compile(r"(?<![\d.,])-?\d{1,3}(?:,\d{3})+(?![\d])(?:\.\d+)?|(?<![\d.,])-?\d+(?:\.\d+)?")
"""A number as a response writes it: digits with an optional minus sign, commas between thousands and a decimal
part. A minus sign right after a digit is the operation ('5-3'), not a sign: the match then starts at the digit."""


def final_number(text: str) -> float | None:
    """The last number in `text`, or None when it has none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def arith_score(text: str, answer: str | int) -> dict[str, float]:
    """{"score", "acc"}: 1.0 when the last number of the response equals the answer, else 0.0."""
    value = final_number(text)
    correct = value is not None and value == float(answer)
    return {"score": float(correct), "acc": float(correct)}
