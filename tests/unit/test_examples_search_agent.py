"""examples/search_agent: the generated corpus, BM25 ranking and the EM/F1 reward with its format term."""

from __future__ import annotations

import json

import pytest

from examples.search_agent.corpus import DATA_SOURCE, generate, write
from examples.search_agent.retrieval_server import BM25
from examples.search_agent.reward import compute_score
from fully_async.data import load_rows


@pytest.mark.needs_extra("envs")  # bm25s
def test_corpus_questions_are_answered_by_their_document_and_bm25_finds_it(tmp_path):
    docs, questions = generate(60, seed=3)
    assert len(docs) == 60 and len(questions) == 4 * 60
    index = BM25(docs)
    top1 = [index.search([q["question"]], 3)[0][0][0] for q in questions]
    # The question names its town: the town's document ranks first (ties only between identical scores).
    assert sum(str(i) == q["doc"] for i, q in zip(top1, questions)) == len(questions)
    for q in questions[:20]:
        assert q["answer"] in docs[int(q["doc"])]["contents"]
    hits = index.search(["zzz nothing", questions[0]["question"]], 2)
    assert hits[0] == [] and len(hits[1]) == 2 and hits[1][0][1] >= hits[1][1][1] > 0
    paths = write(tmp_path, entities=20)
    rows = load_rows([str(paths["train"]), str(paths["val"])])
    assert {r.data_source for r in rows} == {DATA_SOURCE} and len(rows) == 80
    assert rows[0].messages[0]["role"] == "system" and len(paths["corpus"].read_text().splitlines()) == 20
    assert all("contents" in json.loads(line) for line in paths["corpus"].read_text().splitlines())


def test_reward_exact_match_f1_and_format():
    assert compute_score("s", "<answer>The Velmora</answer>", "velmora")["score"] == 1.0
    partial = compute_score("s", "I think <answer>Kalo Mirven</answer>", "Kalo Tal")
    assert partial["em"] == 0.0 and partial["f1"] == 0.5 and abs(partial["score"] - (0.9 * 0.5 + 0.1)) < 1e-9
    assert compute_score("s", "Velmora", "velmora") == {"score": 0.0, "em": 0.0, "f1": 0.0, "format": 0.0}
    two = compute_score("s", "<answer>x</answer> <answer>velmora</answer>", "velmora")
    assert two["em"] == 1.0 and two["format"] == 0.0 and two["score"] == 0.9


@pytest.mark.needs_extra("envs")  # bm25s
def test_bm25_scores_match_the_formula():
    import math

    docs = [{"id": "0", "contents": "a b"}, {"id": "1", "contents": "a c c"}, {"id": "2", "contents": "d"}]
    (hits,) = BM25(docs).search(["c a"], 3)
    avgdl, k1, b = 2.0, 1.5, 0.75

    def term(tf, dl, df):
        idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
        return idf * tf / (tf + k1 * (1 - b + b * dl / avgdl))  # Lucene's variant (bm25s)

    assert [i for i, _ in hits] == [1, 0]  # document 2 shares no term: left out
    assert abs(hits[0][1] - (term(2, 3, 1) + term(1, 3, 2))) < 1e-6 and abs(hits[1][1] - term(1, 2, 2)) < 1e-6
