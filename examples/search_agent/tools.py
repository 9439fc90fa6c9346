"""The search agent's tool: `search(query)` against the local retrieval server (retrieval_server.py).

The server's address comes from FA_RETRIEVAL_URL (default http://127.0.0.1:8000), read at each call (the function
`search`), or from the tool config (the class `SearchTool`, for rollout.multi_turn.tool_config_path). A server that
is down or answers an error makes the call raise; ToolAgentLoop turns that into a tool message the model reads
("Error: search failed: ...") and counts it (`tool_errors/tool_error`), and the episode goes on.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp

DEFAULT_URL = "http://127.0.0.1:8000"
TOPK = 3
_sessions: dict[int, aiohttp.ClientSession] = {}


def url() -> str:
    return os.environ.get("FA_RETRIEVAL_URL", DEFAULT_URL).rstrip("/")


async def _client() -> aiohttp.ClientSession:
    """One pooled session per event loop (a session cannot move between loops)."""
    key = id(asyncio.get_running_loop())
    session = _sessions.get(key)
    if session is None or session.closed:
        session = _sessions[key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    return session


async def search(query: str) -> str:
    """Search the knowledge base; returns the best matching documents."""
    return await retrieve(url(), query, TOPK)


async def retrieve(base_url: str, query: str, topk: int) -> str:
    """The server's best `topk` documents for `query`, as the text the model reads."""
    session = await _client()
    async with session.post(base_url + "/retrieve", json={"queries": [query], "topk": topk}) as r:
        if r.status != 200:
            raise RuntimeError(f"retrieval server answered {r.status}: {(await r.text())[:200]}")
        docs = (await r.json())["result"][0]
    if not docs:
        return "No documents found."
    return "\n".join(f"Doc {i + 1}: {d['contents']}" for i, d in enumerate(docs))


search.tool_schema = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base; returns the best matching documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up, e.g. a town's name"}},
            "required": ["query"],
        },
    },
}


class SearchTool:
    """The same tool in verl's tool-config format (rollout.multi_turn.tool_config_path), with its server in the config:

    tools:
      - class_name: examples.search_agent.tools.SearchTool
        config: {url: "http://127.0.0.1:8000", topk: 3}
        tool_schema: <search.tool_schema>
    """

    def __init__(self, config: dict, tool_schema: dict) -> None:
        self.url = str(config.get("url") or url()).rstrip("/")
        self.topk = int(config.get("topk", TOPK))
        self.tool_schema = tool_schema

    async def execute(self, instance_id: str, parameters: dict) -> str:
        return await retrieve(self.url, parameters["query"], self.topk)
