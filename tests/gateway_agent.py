"""An agent program for the gateway's tests: plain `openai` SDK, nothing of fully_async imported.

    python tests/gateway_agent.py MODE

Modes: `two_calls` (ask, read a check, ask again; stdout's last line is the answer), `stream` (the same, streamed),
`tools` (a tool call answered as a tool message), `killed_once` (after its first call it writes its pid to
$AGENT_PID_FILE and waits to be SIGKILLed, unless $AGENT_MARK exists; it creates that file first), `crash`
(exits 3 after one call), `sigkill_first` (the first $AGENT_KILL_COUNT agents SIGKILL themselves after their first
call; files under $AGENT_KILLS count them), `file` (answers in
$FULLY_ASYNC_ANSWER_FILE), `post` (answers with a POST to $FULLY_ASYNC_REWARD_URL), `chatty` (calls until refused,
prints the error's code, exits 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

from openai import OpenAI


def main(mode: str) -> int:
    task = json.loads(sys.stdin.readline())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY name the session
    messages = list(task["messages"])
    if mode == "tools":
        return tools(client, messages)
    if mode == "chatty":
        try:
            while True:
                reply = client.chat.completions.create(model="any", messages=messages)
                messages += [
                    reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "more"},
                ]
        except Exception as e:  # the gateway's limit error
            print(getattr(e, "code", None) or type(e).__name__)
            return 1
    first = ask(client, messages, stream=mode == "stream")
    if mode == "killed_once" and not os.path.exists(os.environ["AGENT_MARK"]):
        open(os.environ["AGENT_MARK"], "w").close()
        with open(os.environ["AGENT_PID_FILE"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.environ["AGENT_PID_FILE"] + ".tmp", os.environ["AGENT_PID_FILE"])
        time.sleep(3600)
    if mode == "sigkill_first" and _claim_a_kill():
        os.kill(os.getpid(), signal.SIGKILL)  # mid-episode: one call made, the next never comes
    if mode == "crash":
        print("boom", file=sys.stderr)
        return 3
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "check: are you sure?"}]
    second = ask(client, messages, stream=mode == "stream")
    if mode == "file":
        with open(os.environ["FULLY_ASYNC_ANSWER_FILE"], "w") as f:
            json.dump({"answer": "from-file"}, f)
    if mode == "post":
        req = urllib.request.Request(os.environ["FULLY_ASYNC_REWARD_URL"], data=json.dumps({"answer": "posted"}).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})  # fmt: skip
        urllib.request.urlopen(req).read()
    print("log line")
    print(second)
    return 0


def _claim_a_kill() -> bool:
    """True for the first $AGENT_KILL_COUNT agents that ask (files created exclusively under $AGENT_KILLS)."""
    for k in range(int(os.environ["AGENT_KILL_COUNT"])):
        try:
            os.close(os.open(os.path.join(os.environ["AGENT_KILLS"], f"kill-{k}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            continue
    return False


def ask(client: OpenAI, messages: list, stream: bool) -> str:
    if not stream:
        return (
            client.chat.completions.create(model="any", messages=messages, temperature=0.3).choices[0].message.content
        )
    parts = client.chat.completions.create(model="any", messages=messages, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def tools(client: OpenAI, messages: list) -> int:
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties":
              {"key": {"type": "string"}}, "required": ["key"]}}}  # fmt: skip
    reply = client.chat.completions.create(model="any", messages=messages, tools=[schema]).choices[0]
    call = reply.message.tool_calls[0]
    assert reply.finish_reason == "tool_calls", reply.finish_reason
    messages += [reply.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "A=" + json.loads(call.function.arguments)["key"]}]  # fmt: skip
    final = client.chat.completions.create(model="any", messages=messages, tools=[schema]).choices[0].message.content
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
