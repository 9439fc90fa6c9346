"""An agent program written against the `openai` SDK only: it imports nothing of fully_async and would run the same
against any OpenAI-compatible server.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python agent.py < task.json

It reads its task (a JSON object with the prompt's `messages`) from stdin, asks the model, reads a check (it asks
again, with the question repeated), and prints the second answer as its last line: the gateway's loop hands that line
to the reward sources. Two model calls per episode; the conversation only grows, so the gateway records it as one
token-exact row.
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI


def answer(client: OpenAI, task: dict) -> str:
    """The episode: ask, read a check (the question again), ask again; the second answer is the result."""
    model = os.environ.get("FULLY_ASYNC_MODEL", "policy")
    messages = list(task["messages"])
    question = messages[-1]["content"]
    first = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": f"check: {question}"}]
    second = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
    print(f"first answer {first!r}, after the check {second!r}", file=sys.stderr)
    return second.strip()


def run(base_url: str, api_key: str, task: dict) -> str:
    """The same agent as a callable (rollout.multi_turn.gateway.function=/abs/path/agent.py:run): no process
    per episode, so no interpreter start and no `import openai` per episode."""
    return answer(OpenAI(base_url=base_url, api_key=api_key), task)


def main() -> int:
    task = json.loads(sys.stdin.readline())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    print(answer(client, task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
