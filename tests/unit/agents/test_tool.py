"""ToolAgentLoop and its toolkit against a scripted engine client (tests/fakes.py:ScriptedClient; the real vLLM
engine is in tests/integration/test_agents_tool_engine.py): hermes parsing, errors as tool messages, limits, the
response budget, per-token arrays, a sync between turns, partial rollout off, tool loading."""

from __future__ import annotations

import asyncio
import time

import pytest

from fully_async.agents import Sample
from fully_async.agents.tool import TRUNCATED, ToolAgentLoop
from fully_async.agents.toolkit import check_arguments, function_tool, load_tools, parse_tool_calls
from fully_async.config import ConfigError, MultiTurnConfig, compose
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def im_end(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def sample():
    return Sample(PromptRef(0, 3), 1, PromptRow("t", [{"role": "user", "content": "go"}], "1"))


def loop(tok, response_length=400, tools=None, **cfg):
    tools = tools if tools is not None else {t.name: t for t in map(function_tool, [fakes.echo_tool])}
    return ToolAgentLoop(tok, Sampling(), response_length, multi_turn=MultiTurnConfig(**cfg), tools=tools)


def call(name, **args):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_two_turn_episode_arrays_line_up_with_the_text(tok):
    agent = loop(tok)
    client = fakes.ScriptedClient(tok, [call("echo_tool", text="ab", times=2), "done"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    inserted = "\n<|im_start|>tool\nabab<|im_end|>\n<|im_start|>assistant\n"
    turn1 = tok.encode(call("echo_tool", text="ab", times=2)) + [im_end(tok)]
    turn2 = tok.encode("done") + [im_end(tok)]
    assert t.response_ids.tolist() == turn1 + tok.encode(inserted) + turn2
    assert t.loss_mask.tolist() == [1] * len(turn1) + [0] * len(tok.encode(inserted)) + [1] * len(turn2)
    model = t.loss_mask == 1
    assert (t.token_versions[~model] == NO_VERSION).all() and (t.token_versions[model] == 0).all()
    assert (t.behaviour_logprobs[~model] == 0).all() and (t.behaviour_logprobs[model] < 0).all()
    # The second call was sent the exact token list so far: nothing re-rendered.
    assert client.prompts[1] == t.prompt_ids.tolist() + t.response_ids.tolist()[: -len(turn2)]
    assert t.reward_info["turns"] == 2 and t.reward_info["tool_calls"] == 1 and t.reward_info["tool_error"] is False
    assert t.finish_reason == "stop" and t.timings["tool_s"] >= 0


@pytest.mark.parametrize(
    "text, kind, says",
    [
        ("<tool_call>{not json</tool_call>", "malformed", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "malformed", "must be a JSON object"),
        ("<tool_call>" + '{"name": "echo_tool"', "malformed", "no closing"),
        (call("nope", x=1), "unknown_tool", "unknown tool 'nope'"),
        (call("echo_tool", times=2), "bad_arguments", "missing required argument(s) ['text']"),
        (call("echo_tool", text="a", colour="red"), "bad_arguments", "unknown argument(s) ['colour']"),
        (call("echo_tool", text="a", times="2"), "bad_arguments", "must be of type integer"),
    ],
)
def test_model_mistakes_become_tool_messages_and_the_episode_goes_on(tok, text, kind, says):
    agent = loop(tok)
    client = fakes.ScriptedClient(tok, [text, "ok"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    assert says in tok.decode(t.response_ids[t.loss_mask == 0].tolist())
    assert t.reward_info["turns"] == 2  # the model saw the error and went on
    assert t.reward_info["tool_errors"] == 1 and t.reward_info[f"tool_errors/{kind}"] == 1
    assert t.reward_info["tool_error"] is True


def test_a_hanging_tool_is_cut_at_its_timeout_and_the_others_run(tok):
    tools = {t.name: t for t in map(function_tool, [fakes.echo_tool, fakes.hanging_tool])}
    agent = loop(tok, tools=tools, tool_timeout_s=0.3)
    client = fakes.ScriptedClient(tok, [call("hanging_tool") + call("echo_tool", text="z"), "ok"], end=im_end(tok))
    start = time.monotonic()
    t = asyncio.run(agent.run(client, sample()))
    assert time.monotonic() - start < 2.0
    text = tok.decode(t.response_ids.tolist())
    assert "hanging_tool timed out after 0.3 s" in text and "<|im_start|>tool\nz<|im_end|>" in text
    assert t.reward_info["tool_errors/timeout"] == 1 and t.reward_info["turns"] == 2
    assert 0.3 <= t.timings["tool_s"] < 1.5


def test_limits_turns_parallel_calls_and_response_tokens(tok):
    agent = loop(tok, max_turns=2, max_parallel_calls=2, max_tool_response_tokens=5)
    many = "".join(call("echo_tool", text=c * 9) for c in "abc")
    client = fakes.ScriptedClient(tok, [many, call("echo_tool", text="q"), "never"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    text = tok.decode(t.response_ids.tolist())
    assert "aaaaa" + TRUNCATED in text and "bbbbb" + TRUNCATED in text and "ccc" not in text.split("</tool_call>")[-1]
    assert t.reward_info["tool_calls"] == 2 and t.reward_info["tool_calls_skipped"] == 1
    assert t.reward_info["tool_truncated"] == 2
    assert len(client.prompts) == 2 and t.reward_info["max_turns_reached"] is True  # the 2nd turn's call never ran


def test_the_response_budget_is_never_exceeded(tok):
    turns = [call("echo_tool", text="x" * 20)] * 6
    stops = 0
    for budget in range(1, 200):  # every budget, so the one a tool turn fills exactly is among them
        client = fakes.ScriptedClient(tok, turns, end=im_end(tok))
        t = asyncio.run(loop(tok, response_length=budget, max_turns=6).run(client, sample()))
        assert t.response_length <= budget
        assert all(b >= 1 for b in client.budgets)
        assert t.finish_reason == "length"
        if t.reward_info.get("budget_stop"):  # a tool block that would leave no room was not appended
            assert t.loss_mask[-1] == 1
            stops += 1
    assert stops > 0


def test_max_tokens_per_turn_closes_the_cut_turn(tok):
    agent = loop(tok, max_tokens_per_turn=len(tok.encode(call("echo_tool", text="k"))))
    client = fakes.ScriptedClient(tok, [call("echo_tool", text="k") + " trailing text", "fin"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    # The cut turn had no <|im_end|>: it is inserted (mask 0) before the tool turn.
    first_insert = t.response_ids[t.loss_mask == 0].tolist()
    assert first_insert[:2] == [im_end(tok), tok.encode("\n")[0]]
    assert client.budgets[0] == agent.multi_turn.max_tokens_per_turn and t.reward_info["turns"] == 2


def test_a_sync_during_a_tool_call_labels_each_turn_with_its_version(tok):
    client = fakes.ScriptedClient(tok, [call("echo_tool", text="v"), "after"], end=im_end(tok), versions=[3, 4])
    t = asyncio.run(loop(tok).run(client, sample()))
    model = t.token_versions[t.loss_mask == 1].tolist()
    n1 = len(tok.encode(call("echo_tool", text="v"))) + 1
    assert model == [3] * n1 + [4] * (len(model) - n1)
    assert (t.start_version, t.min_version, t.max_version) == (3, 3, 4) and t.reward_info["restarts"] == 0


def test_partial_rollout_off_restarts_an_episode_that_spans_two_versions(tok):
    agent = ToolAgentLoop(
        tok, Sampling(), 400, continue_on_abort=False, multi_turn=MultiTurnConfig(),
        tools={"echo_tool": function_tool(fakes.echo_tool)},
    )  # fmt: skip
    turns = [call("echo_tool", text="v"), "after", call("echo_tool", text="v"), "after"]
    client = fakes.ScriptedClient(tok, turns, end=im_end(tok), versions=[3, 4, 4, 4])
    t = asyncio.run(agent.run(client, sample()))
    assert t.reward_info["restarts"] == 1 and len(client.prompts) == 4
    assert set(t.token_versions[t.loss_mask == 1].tolist()) == {4} and t.start_version == 4


def test_parse_tool_calls():
    calls = parse_tool_calls(
        'x<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> y <tool_call>\n'
        '{"name": "b", "arguments": "{\\"z\\": 2}"}\n</tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"k": 1}, None), ("b", {"z": 2}, None)]
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls('<tool_call>{"name": "a"}')[0].error.startswith("a <tool_call> block has no closing")
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": 3}</tool_call>')[0].error.startswith("the arg")


def test_check_arguments():
    params = {"properties": {"n": {"type": "integer"}, "f": {"type": "boolean"}}, "required": ["n"]}
    assert check_arguments(params, {"n": 1, "f": True}) is None
    assert "must be of type integer" in check_arguments(params, {"n": True})  # a bool is not an integer here
    assert check_arguments({}, {"anything": 1}) is None


def test_load_tools_functions_and_verl_yaml(tmp_path):
    (tmp_path / "tools.yaml").write_text(
        "tools:\n"
        "  - class_name: tests.fakes.VerlStyleTool\n"
        "    config: {prefix: 'got '}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: lookup\n"
        "        description: look it up\n"
        "        parameters: {type: object, properties: {q: {type: string}}, required: [q]}\n"
    )
    tools = load_tools(["tests.fakes:echo_tool", "tests.fakes:sync_upper"], str(tmp_path / "tools.yaml"))
    assert sorted(tools) == ["echo_tool", "lookup", "sync_upper"]
    params = tools["echo_tool"].parameters
    assert params["required"] == ["text"] and params["properties"]["times"] == {"type": "integer"}
    assert tools["echo_tool"].schema["function"]["description"] == "Repeat the text."

    async def go():
        await tools["lookup"].create("ep")
        out = [await tools["lookup"].call("ep", {"q": "x"}), await tools["sync_upper"].call("ep", {"text": "a"})]
        await tools["lookup"].release("ep")
        return out

    assert asyncio.run(go()) == [("got x#1", 0.0, {}), "A"]
    with pytest.raises(ValueError, match="two tools are named 'echo_tool'"):
        load_tools(["tests.fakes:echo_tool", "tests.fakes:echo_tool"])
    (tmp_path / "bad.yaml").write_text("tools:\n  - config: {}\n")
    with pytest.raises(ValueError, match=r"tools\[0\] needs class_name"):
        load_tools([], str(tmp_path / "bad.yaml"))


def test_verl_style_tool_instances_are_created_and_released_per_episode(tok, tmp_path):
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: tests.fakes:VerlStyleTool\n    tool_schema: {type: function, function: {name: lookup,"
        " parameters: {type: object, properties: {q: {type: string}}, required: [q]}}}\n"
    )
    agent = ToolAgentLoop(
        tok, Sampling(), 400, multi_turn=MultiTurnConfig(tool_config_path=str(tmp_path / "tools.yaml"))
    )
    client = fakes.ScriptedClient(tok, [call("lookup", q="a") + call("lookup", q="b"), "ok"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    assert "a#1" in tok.decode(t.response_ids.tolist()) and "b#2" in tok.decode(t.response_ids.tolist())
    assert agent.prompt_ids(sample()) == t.prompt_ids.tolist()
    assert agent.tools["lookup"].release.__self__.released == ["0:3#1"]  # released once, at the episode's end


def test_multi_turn_config_validation():
    cfg = compose(["rollout.multi_turn.max_turns=3", "rollout.multi_turn.tools=[tests.fakes:echo_tool]"])
    assert cfg.rollout.multi_turn.max_turns == 3 and cfg.rollout.multi_turn.tools == ["tests.fakes:echo_tool"]
    for key, bad in [("max_turns", 0), ("max_parallel_calls", 0), ("tool_timeout_s", 0), ("max_tokens_per_turn", -1)]:
        with pytest.raises(ConfigError, match=f"rollout.multi_turn.{key} must be"):
            compose([f"rollout.multi_turn.{key}={bad}"])
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tools\[0\] must be a dotted path"):
        compose(["rollout.multi_turn.tools=[not-a-path]"])


class GuessTheDigit(ToolAgentLoop):
    """An environment (no tool) answers each guess with higher / lower until the guess is 5."""

    async def environment_turn(self, sample, turn, text):
        guess = int(text.replace("<|im_end|>", "").strip())
        return None if guess == 5 else [{"role": "user", "content": "higher" if guess < 5 else "lower"}]


def test_environment_turns_go_through_the_same_machinery(tok):
    agent = GuessTheDigit(tok, Sampling(), 400, multi_turn=MultiTurnConfig(), tools={})
    client = fakes.ScriptedClient(tok, ["3", "7", "5", "never"], end=im_end(tok))
    t = asyncio.run(agent.run(client, sample()))
    assert t.reward_info["turns"] == 3 and t.reward_info["env_turns"] == 2 and t.reward_info["tool_calls"] == 0
    want = "3<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n<|im_start|>user\n"
    want += "lower<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    assert tok.decode(t.response_ids.tolist()) == want
    model = [tok.decode([i]) for i in t.response_ids[t.loss_mask == 1].tolist()]
    assert model == ["3", "<|im_end|>", "7", "<|im_end|>", "5", "<|im_end|>"]
    # Not asked after the last allowed turn: the episode just ends there.
    agent.multi_turn.max_turns = 2
    t = asyncio.run(agent.run(fakes.ScriptedClient(tok, ["3", "7"], end=im_end(tok)), sample()))
    assert t.reward_info["turns"] == 2 and t.reward_info["env_turns"] == 1 and "max_turns_reached" not in t.reward_info


def test_qwen25_style_episode_reads_as_the_template_renders_the_whole_chat():
    """Under an append-only (Qwen2.5-style) template the exact token list decodes to the template's render of the
    whole chat: the prompt carries the tools' schemas, the tool turn is grouped in a user turn of tool responses."""
    from tests.unit.agents.test_tokens import QWEN25, qwen_like_tokenizer

    qtok = qwen_like_tokenizer(QWEN25)
    end = qtok.convert_tokens_to_ids("<|im_end|>")
    agent = ToolAgentLoop(
        qtok, Sampling(), 600, multi_turn=MultiTurnConfig(), tools={"echo_tool": function_tool(fakes.echo_tool)}
    )
    turn1 = call("echo_tool", text="hi", times=3)
    t = asyncio.run(agent.run(fakes.ScriptedClient(qtok, [turn1, "done"], end=end), sample()))
    chat = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": turn1},
        {"role": "tool", "content": "hihihi"},
    ]
    rendered = qtok.apply_chat_template(chat, tools=agent.tool_schemas, tokenize=False, add_generation_prompt=True)
    assert qtok.decode(t.prompt_ids.tolist() + t.response_ids.tolist()) == rendered + "done<|im_end|>"
    assert '"name": "echo_tool"' in qtok.decode(t.prompt_ids.tolist())


def test_tool_calls_wait_for_their_tools_limiter_and_are_traced(tok, tmp_path):
    from fully_async.config import RewardLimitsConfig
    from fully_async.trace import Tracer, load

    tools = {t.name: t for t in map(function_tool, [fakes.echo_tool, fakes.hanging_tool])}
    limits = RewardLimitsConfig(max_concurrent=1, scope="process")
    agent = loop(tok, tools=tools, tool_limits=limits, max_parallel_calls=4)
    agent.tracer = Tracer(tmp_path, "rollouter")
    sleepy = call("hanging_tool", seconds=0.25)
    client = fakes.ScriptedClient(tok, [sleepy + sleepy + call("echo_tool", text="e") + call("nope"), "ok"],
                                  end=im_end(tok))  # fmt: skip
    t = asyncio.run(agent.run(client, sample()))
    # One hanging_tool call at a time: the second waited for the first (the echo tool has its own limiter).
    assert t.timings["tool_s"] >= 0.5 and t.reward_info["tool_limiter_wait_s"] >= 0.2
    assert set(agent.limiters) == {"echo_tool", "hanging_tool"}
    agent.tracer.close()
    spans, _ = load(tmp_path)
    assert [s.lane for s in spans] == ["tools"] * 4 and {s.name for s in spans} == {"tool_call"}
    assert sorted((s.args["tool"], s.args["error"]) for s in spans) == [
        ("echo_tool", None), ("hanging_tool", None), ("hanging_tool", None), ("nope", "unknown_tool")]  # fmt: skip
    slow = sorted((s for s in spans if s.args["tool"] == "hanging_tool"), key=lambda s: s.start)
    assert slow[1].start >= slow[0].end - 0.01  # serialised by the limiter
    assert not loop(tok, tools=tools).limiters  # no limits: no limiter at all
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_limits.tpm must be 0"):
        compose(["rollout.multi_turn.tool_limits.tpm=100"])
