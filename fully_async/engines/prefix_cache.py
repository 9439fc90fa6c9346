"""Prefix-cache hits per engine server, read from the generate responses themselves (exact, no extra request).

Each answer of a server that reports them says how many of the request's prompt tokens it had in its prefix cache
when it first scheduled the request: vLLM's token-in endpoint in `usage.prompt_tokens` and
`usage.prompt_tokens_details.cached_tokens` (the server runs with --enable-prompt-tokens-details, engines/vllm.py),
SGLang's /generate in `meta_info.prompt_tokens` and `meta_info.cached_tokens`. `PrefixCacheCounts.record(idx, body)`
adds them to server idx's totals; an answer without them adds nothing, so an engine that reports nothing (engine=sim,
a vLLM without the flag) leaves the counts empty and yields no metric, never a rate of 0.

Chosen over vLLM's Prometheus counters (`vllm:prefix_cache_queries` / `_hits` on /metrics): those are as exact, but
cost one scrape of every server per reading and count every request a server ran, warm-up and other clients
included; these count exactly this client's requests, at the price of a few bytes per answer. Every segment counts,
a continuation after an abort included (its prompt is the prompt plus the tokens so far: real prefill work).
Behind a router (engine.router) the client does not know which server ran a request: only the total is meaningful.

The Rollouter's stats() carries `counts()`; fully_async/metrics.py's `prefix_cache_metrics` turns two readings into
the step's hit rates (docs/metrics.md).
"""

from __future__ import annotations

from typing import Any


def reported(body: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) of one generate answer, or None when it reports no cached tokens."""
    if not isinstance(body, dict):
        return None
    usage = body.get("usage")
    if isinstance(usage, dict):  # vLLM
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            return int(usage["prompt_tokens"]), int(details["cached_tokens"])
        return None
    meta = body.get("meta_info")
    if isinstance(meta, dict) and meta.get("cached_tokens") is not None:  # SGLang
        return int(meta["prompt_tokens"]), int(meta["cached_tokens"])
    return None


class PrefixCacheCounts:
    """Cumulative prompt and cached-prompt tokens per server index, of the answers that reported them."""

    def __init__(self) -> None:
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []

    def record(self, idx: int, body: Any) -> None:
        """Add generate answer `body` of server `idx` (nothing when it reports no cached tokens)."""
        got = reported(body)
        if got is None:
            return
        if idx >= len(self.prompt_tokens):
            grow = idx + 1 - len(self.prompt_tokens)
            self.prompt_tokens += [0] * grow
            self.cached_tokens += [0] * grow
        self.prompt_tokens[idx] += got[0]
        self.cached_tokens[idx] += got[1]

    def counts(self) -> dict[str, list[int]]:
        """{"prompt_tokens": [...], "cached_tokens": [...]} per server index so far; {} while nothing was reported."""
        if not self.prompt_tokens:
            return {}
        return {"prompt_tokens": list(self.prompt_tokens), "cached_tokens": list(self.cached_tokens)}
