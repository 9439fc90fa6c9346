"""kind=reward_model: a reward model served by vLLM / SGLang servers, or loaded in Ray workers of our own.

- Service (`reward_model.urls`): requests go to the replica with the fewest outstanding requests. Endpoints:
  `classify` (POST {url}/classify, vLLM's shape: data[0].probs[label]), `pooling` (POST {url}/pooling: the label-th
  value of the last row of data[0].data), or `chat` (a generative judge prompt through the openai client, with the
  judge settings). Transient failures are retried by the RewardAgent like any remote source.
- Local (`reward_model.path`): `num_replicas` Ray actors each hold a Hugging Face sequence-classification model and
  batch dynamically: requests are collected until `max_batch` items or `max_wait_ms` after the first, then scored in
  one forward pass (`DynamicBatcher`).

The model sees the conversation: the question as the user turn and the response as the assistant turn, through the
tokenizer's chat template when it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fully_async.aio import bounded
from fully_async.config import RewardSourceConfig
from fully_async.reward.judge import Judge, RemoteError, Reply, post_json
from fully_async.reward.sources import Source


class DynamicBatcher:
    """`await submit(item)`: items are gathered until `max_batch` or `max_wait_s` after the first of a batch, then
    `run(items)` scores them in one call (a list of results in order). Runs on the caller's event loop."""

    def __init__(self, run: Callable[[list[Any]], Awaitable[list[Any]]], max_batch: int, max_wait_s: float) -> None:
        self.run, self.max_batch, self.max_wait_s = run, max_batch, max_wait_s
        self._pending: list[tuple[Any, asyncio.Future, float]] = []  # (item, its caller's future, arrival time)
        self._full = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self.batches: list[int] = []  # size of every forward pass, in order

    async def submit(self, item: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut, time.monotonic()))
        if len(self._pending) >= self.max_batch:
            self._full.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        return await fut

    async def _flush_loop(self) -> None:
        while self._pending:
            # The oldest item waits at most max_wait_s from its arrival (time spent behind a running pass counts).
            left = self._pending[0][2] + self.max_wait_s - time.monotonic()
            if len(self._pending) < self.max_batch and left > 0:
                self._full.clear()
                with contextlib.suppress(asyncio.TimeoutError):  # timed out: run what we have
                    await bounded(self._full.wait(), left)
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            self.batches.append(len(batch))
            try:
                results = await self.run([item for item, _, _ in batch])
            except Exception as e:  # the whole batch failed: each caller gets the error, the batcher keeps going
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut, _), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)


class LocalRewardModel:
    """A sequence-classification reward model in this process, scored through a DynamicBatcher.

    Used as a Ray actor by the reward_model source (`ray.remote(LocalRewardModel)`), and directly in tests."""

    def __init__(self, path: str, max_batch: int, max_wait_ms: float, label: int = 0, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a checkpoint without a score head gets the same fresh head every time
            self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=max(1, label + 1))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()
        self.label = label
        self.batcher = DynamicBatcher(self._forward, max_batch, max_wait_ms / 1000.0)

    def text(self, question: str, response: str) -> str:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return f"{question}\n{response}"

    async def _forward(self, texts: list[str]) -> list[float]:
        return await asyncio.to_thread(self._forward_sync, texts)

    def _forward_sync(self, texts: list[str]) -> list[float]:
        import torch

        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True)
        with torch.inference_mode():
            logits = self.model(**enc).logits
        return [float(x) for x in logits[:, self.label]]

    async def score(self, question: str, response: str) -> float:
        return await self.batcher.submit(self.text(question, response))

    def forward_passes(self) -> list[int]:
        return list(self.batcher.batches)


class _Replicas:
    """Least-outstanding routing: each call goes to the replica with the fewest calls in flight (ties: the first)."""

    def __init__(self, targets: Sequence[Any]) -> None:
        self.targets = list(targets)
        self.outstanding = [0] * len(self.targets)
        self.sent = [0] * len(self.targets)

    async def call(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        i = min(range(len(self.targets)), key=self.outstanding.__getitem__)
        self.outstanding[i] += 1
        self.sent[i] += 1
        try:
            return await fn(self.targets[i])
        finally:
            self.outstanding[i] -= 1


class RewardModelService(Source):
    remote = True

    def __init__(self, cfg: RewardSourceConfig, key: str, count_tokens) -> None:
        super().__init__(cfg, key)
        rm = cfg.reward_model
        self.count_tokens = count_tokens
        if rm.endpoint == "chat":
            judges = []
            for url in rm.urls:
                judge_cfg = type(cfg.judge)(**{**vars(cfg.judge), "base_url": url})
                judges.append(Judge(judge_cfg, cfg.timeout_s, key + ".judge"))
            self.replicas = _Replicas(judges)
        else:
            self.replicas = _Replicas([u.rstrip("/") for u in rm.urls])
        self._session = None

    def estimate_tokens(self, solution: str, meta: dict[str, Any]) -> float:
        extra = self.cfg.judge.max_tokens if self.cfg.reward_model.endpoint == "chat" else 0
        return float(self.count_tokens(f"{meta.get('question', '')}\n{solution}") + extra)

    async def attempt(self, solution: str, meta: dict[str, Any]) -> Reply:
        if self.cfg.reward_model.endpoint == "chat":
            prompt = self.replicas.targets[0].render(solution, meta)
            return await bounded(self.replicas.call(lambda j: j.ask(prompt)), self.cfg.timeout_s)
        return await bounded(self.replicas.call(lambda url: self._post(url, solution, meta)), self.cfg.timeout_s)

    async def _post(self, url: str, solution: str, meta: dict[str, Any]) -> Reply:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        rm = self.cfg.reward_model
        messages = [{"role": "user", "content": meta.get("question", "")}, {"role": "assistant", "content": solution}]
        body: dict[str, Any] = {"messages": messages}
        if rm.model:
            body["model"] = rm.model
        data = await post_json(self._session, f"{url}/{rm.endpoint}", body, "reward model")
        try:
            item = data["data"][0]
            if rm.endpoint == "classify":
                value = item["probs"][rm.label]
            else:
                rows = item["data"]
                value = (rows[-1] if isinstance(rows[-1], list) else rows)[rm.label]
            score = float(value)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise RemoteError(f"reward model sent a malformed response: {type(e).__name__}: {e}") from None
        usage = (data.get("usage") or {}).get("total_tokens")
        return Reply(score, {"usage_tokens": usage} if usage is not None else {}, usage)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.cfg.reward_model.endpoint == "chat":
            for judge in self.replicas.targets:
                await judge.close()


class LocalRewardModelSource(Source):
    """`num_replicas` Ray actors holding the model; calls go to the least busy one and are batched there."""

    def __init__(self, cfg: RewardSourceConfig, key: str, namespace: str) -> None:
        import ray

        super().__init__(cfg, key)
        rm = cfg.reward_model
        actor = ray.remote(LocalRewardModel).options(num_cpus=0, max_concurrency=1000)
        self.actors = [actor.remote(rm.path, rm.max_batch, rm.max_wait_ms, rm.label) for _ in range(rm.num_replicas)]
        self.replicas = _Replicas(self.actors)

    async def attempt(self, solution: str, meta: dict[str, Any]) -> Reply:
        question = meta.get("question", "")
        start = time.monotonic()
        score = await bounded(self.replicas.call(lambda a: a.score.remote(question, solution)), self.cfg.timeout_s)
        return Reply(score, {"model_s": time.monotonic() - start}, None)

    async def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def build_reward_model_source(cfg: RewardSourceConfig, key: str, count_tokens, namespace: str) -> Source:
    if cfg.reward_model.urls:
        return RewardModelService(cfg, key, count_tokens)
    return LocalRewardModelSource(cfg, key, namespace)
