"""The search agent's reward: exact match / F1 of the final `<answer>...</answer>` against the ground truth, plus a
format term (verl's signature: data_source, solution_str, ground_truth, extra_info).

score = 0.9 * F1 + 0.1 * format, where F1 is 1 on an exact match (after lower-casing and dropping punctuation and
articles, as SQuAD normalises) and format is 1 when the response holds exactly one answer block.
"""

from __future__ import annotations

import re
import string
from collections import Counter

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def f1(prediction: str, truth: str) -> float:
    p, t = normalize(prediction).split(), normalize(truth).split()
    common = sum((Counter(p) & Counter(t)).values())
    if not common:
        return 0.0
    precision, recall = common / len(p), common / len(t)
    return 2 * precision * recall / (precision + recall)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    answers = ANSWER.findall(solution_str)
    fmt = float(len(answers) == 1)
    if not answers:
        return {"score": 0.0, "em": 0.0, "f1": 0.0, "format": 0.0}
    prediction = answers[-1]
    em = float(normalize(prediction) == normalize(str(ground_truth)))
    score_f1 = 1.0 if em else f1(prediction, str(ground_truth))
    return {"score": 0.9 * score_f1 + 0.1 * fmt, "em": em, "f1": score_f1, "format": fmt}
