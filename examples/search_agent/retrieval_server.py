"""A local BM25 retrieval server in Search-R1's API shape (aiohttp, 127.0.0.1 by default).

    .venv/bin/python -m examples.search_agent.retrieval_server --corpus ~/data/search_agent/corpus.jsonl --port 8000

- `POST /retrieve` `{"queries": [str, ...], "topk": int (default 3), "return_scores": bool (default false)}` ->
  `{"result": [[doc, ...] per query]}` with doc = `{"id", "contents"}`, or with scores `{"document": doc, "score"}`.
- `GET /health` -> `{"status": "ok", "documents": N, "requests": ..., "batches": ..., "queries": ...}`.

Batching: queries of requests that arrive within `--batch-wait-ms` of each other (at most `--max-batch` queries) are
scored together in one pass over the index, so many concurrent agents cost one scoring call per batch.

BM25 is bm25s's (the envs extra: `pip install -e .[envs]`; a missing package names the extra), Lucene's variant,
k1 = 1.5, b = 0.75, over lower-cased alphanumeric terms: a query's score for a document is the sum over its terms of
idf(t) * tf / (tf + k1 (1 - b + b |d| / avgdl)), idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from fully_async.envs import require

log = logging.getLogger(__name__)
_TERM = re.compile(r"[a-z0-9]+")


def terms(text: str) -> list[str]:
    return _TERM.findall(text.lower())


class BM25:
    """An Okapi BM25 index over `docs` (each `{"id", "contents"}`), bm25s's (Lucene's variant)."""

    def __init__(self, docs: list[dict[str, Any]], k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("the corpus is empty")
        bm25s = require("bm25s", "bm25s")
        self.docs = docs
        self.index = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.index.index(self._terms([d["contents"] for d in docs]), show_progress=False)

    @staticmethod
    def _terms(texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, token_pattern=_TERM.pattern, stopwords=None, show_progress=False,
                              return_ids=False)  # fmt: skip

    def search(self, queries: list[str], topk: int) -> list[list[tuple[int, float]]]:
        """Per query, the `topk` best (document index, score) pairs with a positive score, best first."""
        vocab = self.index.vocab_dict
        out = []
        k = min(topk, len(self.docs))
        for q in self._terms(queries):
            known = [t for t in q if t and t in vocab]
            row = self.index.get_scores(known) if known else np.zeros(len(self.docs))
            best = np.argpartition(-row, k - 1)[:k]
            best = best[np.argsort(-row[best], kind="stable")]
            out.append([(int(i), float(row[i])) for i in best if row[i] > 0])
        return out


class Batcher:
    """Collects the queries of concurrent requests and scores them together (see the module docstring)."""

    def __init__(self, index: BM25, wait_s: float = 0.005, max_batch: int = 256) -> None:
        self.index, self.wait_s, self.max_batch = index, wait_s, max_batch
        self._pending: list[tuple[list[str], int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.stats = {"requests": 0, "queries": 0, "batches": 0}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def search(self, queries: list[str], topk: int) -> list[list[tuple[int, float]]]:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((queries, topk, fut))
        self.stats["requests"] += 1
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.wait_s)  # let the other requests of this burst arrive
            self._wake.clear()
            batch, size = [], 0
            while self._pending and (not batch or size + len(self._pending[0][0]) <= self.max_batch):
                item = self._pending.pop(0)
                batch.append(item)
                size += len(item[0])
            if self._pending:
                self._wake.set()
            if not batch:
                continue
            queries = [q for qs, _, _ in batch for q in qs]
            topk = max(k for _, k, _ in batch)
            try:
                found = self.index.search(queries, topk)
            except Exception as e:  # one bad batch fails its requests, not the server
                log.exception("scoring a batch failed")
                for _, _, fut in batch:
                    fut.done() or fut.set_exception(e)
                continue
            self.stats["batches"] += 1
            self.stats["queries"] += len(queries)
            at = 0
            for qs, k, fut in batch:
                if not fut.done():
                    fut.set_result([hits[:k] for hits in found[at : at + len(qs)]])
                at += len(qs)


def build_app(corpus: list[dict[str, Any]], batch_wait_ms: float = 5.0, max_batch: int = 256):
    from aiohttp import web

    index = BM25(corpus)
    batcher = Batcher(index, batch_wait_ms / 1000.0, max_batch)

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            queries = body["queries"]
            if isinstance(queries, str):
                queries = [queries]
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise TypeError("queries must be a list of strings")
            topk = int(body.get("topk", 3))
            if topk < 1:
                raise ValueError("topk must be >= 1")
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e!r}"}, status=400)
        found = await batcher.search(queries, topk)
        if body.get("return_scores", False):
            result = [[{"document": corpus[i], "score": s} for i, s in hits] for hits in found]
        else:
            result = [[corpus[i] for i, _ in hits] for hits in found]
        return web.json_response({"result": result})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(corpus), **batcher.stats})

    async def on_startup(_app: web.Application) -> None:
        batcher.start()

    async def on_cleanup(_app: web.Application) -> None:
        await batcher.stop()

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def load_corpus(path: Path) -> list[dict[str, Any]]:
    docs = [json.loads(line) for line in path.expanduser().read_text().splitlines() if line.strip()]
    for i, d in enumerate(docs):
        if not isinstance(d.get("contents"), str):
            raise ValueError(f"{path}:{i + 1}: a document needs a string 'contents'")
        d.setdefault("id", str(i))
    return docs


def main() -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-batch", type=int, default=256)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = build_app(load_corpus(args.corpus), args.batch_wait_ms, args.max_batch)
    web.run_app(
        app, host=args.host, port=args.port, print=lambda *_: log.info("serving on %s:%d", args.host, args.port)
    )


if __name__ == "__main__":
    main()
