"""The search agent's corpus and questions, generated locally (deterministic, no download).

    .venv/bin/python -m examples.search_agent.corpus --out ~/data/search_agent [--entities 300]

Writes corpus.jsonl (`{"id", "contents"}` per document, Search-R1's corpus shape), train.jsonl and val.jsonl (verl
layout: data_source `search_agent`, a chat prompt, `reward_model.ground_truth` = the answer). Each document describes
one invented place (so no model knows the answers beforehand); each question asks one of its facts, so answering
needs a search for the place's name.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_SOURCE = "search_agent"
SYSTEM = (
    "Answer the question. You may call the search tool to look facts up. Put the final answer, a few words only, "
    "inside <answer></answer>."
)
_SYL = ["ka", "lo", "mir", "ven", "tal", "dor", "sa", "quel", "bri", "on", "zu", "fen", "ra", "thi", "gor", "el"]
FACTS = {
    "province": ("{name} is a town in the province of {value}.", "Which province is {name} in?"),
    "river": ("The river that runs through {name} is the {value}.", "Which river runs through {name}?"),
    "founder": ("{name} was founded by {value}.", "Who founded {name}?"),
    "product": ("{name} is known for its {value}.", "What is {name} known for?"),
}
_PRODUCTS = ["glass beads", "blue cheese", "copper bells", "wool rugs", "paper kites", "salt fish", "clay pipes"]


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def generate(entities: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(documents, questions): one document per invented town with its four facts, one question per fact."""
    rng = random.Random(seed)
    names: set[str] = set()
    docs, questions = [], []
    while len(names) < entities:
        names.add(_word(rng, 3))
    for i, name in enumerate(sorted(names)):
        values = {
            "province": _word(rng, 2),
            "river": _word(rng, 2),
            "founder": f"{_word(rng, 2)} {_word(rng, 2)}",
            "product": rng.choice(_PRODUCTS),
        }
        text = " ".join(FACTS[k][0].format(name=name, value=v) for k, v in values.items())
        docs.append({"id": str(i), "contents": f"{name}\n{text}"})
        for k, v in values.items():
            questions.append({"question": FACTS[k][1].format(name=name), "answer": v, "doc": str(i)})
    return docs, questions


def row(q: dict, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q["question"]}],
        "reward_model": {"ground_truth": q["answer"]},
        "extra_info": {"split": split, "index": index, "doc": q["doc"]},
    }


def write(out: Path, entities: int = 300, seed: int = 0, val_share: float = 0.1) -> dict[str, Path]:
    """Write the corpus and the two splits under `out`; the splits hold disjoint questions."""
    docs, questions = generate(entities, seed)
    random.Random(seed + 1).shuffle(questions)
    n_val = max(1, int(len(questions) * val_share))
    out.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl", "val": out / "val.jsonl"}
    paths["corpus"].write_text("".join(json.dumps(d) + "\n" for d in docs))
    for split, qs in (("val", questions[:n_val]), ("train", questions[n_val:])):
        paths[split].write_text("".join(json.dumps(row(q, i, split)) + "\n" for i, q in enumerate(qs)))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("~/data/search_agent").expanduser())
    p.add_argument("--entities", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name, path in write(args.out.expanduser(), args.entities, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
