"""Tools for ToolAgentLoop: loading them, parsing hermes-style calls, checking arguments, running under a timeout.

A tool is an OpenAI function schema plus an async callable taking the call's arguments as keywords and returning
the response (a string; an object with `.text` and `.images` shows the model images too, agents/tool_images.py;
anything else is sent as JSON). Two ways to configure them:

- `rollout.multi_turn.tools=[pkg.mod:fn, ...]`: plain functions (async, or sync ones run in a thread). The schema
  is the function's `tool_schema` attribute if it has one, else derived from its signature (str/int/float/bool/list/
  dict annotations; parameters without defaults are required) with the docstring's first line as description.
- `rollout.multi_turn.tool_config_path=tools.yaml` in verl's format: a top-level `tools:` list of
  `{class_name, config, tool_schema}`. `class_name` ('pkg.mod.Class' or 'pkg.mod:Class') is built as
  `Class(config=config, tool_schema=tool_schema)` (the schema as a plain dict) and called per episode like verl's
  BaseTool: `await create(instance_id)` (optional), `await execute(instance_id, parameters)` (returns the response,
  or a tuple whose first item is it, or an object with `.text`), `await release(instance_id)` (optional).

Contract of `run_call`: it never raises for the model's mistakes or the tool's failures: a malformed call, an
unknown tool, bad arguments, an exception and a timeout each come back as a ToolResult whose text tells the model
what went wrong and whose `error` names the kind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fully_async.aio import bounded
from fully_async.multimodal.images import ImageError, to_png

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}
_PY_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "tool_error", "timeout")
"""`ToolResult.error` values (None = the call succeeded)."""


@dataclasses.dataclass
class ToolCall:
    """One parsed call; `error` is set (and name/arguments may be empty) when the model's text was not a valid call."""

    name: str = ""
    arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


@dataclasses.dataclass
class ToolResult:
    text: str
    """What the model reads (the tool message's content)."""
    error: str | None = None
    """One of ERROR_KINDS, or None."""
    seconds: float = 0.0
    images: list[bytes] = dataclasses.field(default_factory=list)
    """Images the model is shown in the tool turn, before the text (PNG bytes; a vision-language model only,
    agents/tool_images.py). A tool returns them as an object with `.text` and `.images` (e.g. a ToolResult); any
    image format or data URL is converted to PNG."""


@dataclasses.dataclass
class Tool:
    name: str
    schema: dict[str, Any]
    """OpenAI function-tool schema: {"type": "function", "function": {"name", "description", "parameters"}}."""
    call: Callable[[str, dict[str, Any]], Awaitable[Any]]
    """(episode id, arguments) -> the response."""
    create: Callable[[str], Awaitable[Any]] | None = None
    release: Callable[[str], Awaitable[Any]] | None = None

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema.get("function", {}).get("parameters") or {}


# ---- parsing ---------------------------------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> list[ToolCall]:
    """Hermes-style calls in a model turn: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in order.
    An opening tag with no closing tag after the last complete call counts as one malformed call."""
    calls = []
    for body in TOOL_CALL.findall(text):
        calls.append(_parse_one(body.strip()))
    tail = text[text.rfind("</tool_call>") + len("</tool_call>") :] if calls else text
    if "<tool_call>" in tail:
        calls.append(ToolCall(error="a <tool_call> block has no closing </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            return ToolCall(name=obj["name"], error=f"the arguments are not valid JSON ({e})")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error="the arguments must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args)


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` against a JSON-schema object `parameters` (required keys, unknown keys when
    properties are listed, primitive types), or None."""
    props = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if props:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and kind != "boolean")):
            return f"argument {key!r} must be of type {kind}, got {type(value).__name__}"
    return None


# ---- running ---------------------------------------------------------------------------------------------------------
async def run_call(tools: dict[str, Tool], call: ToolCall, episode_id: str, timeout_s: float) -> ToolResult:
    """Run one parsed call (see the module contract)."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}.", "malformed")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}.", "unknown_tool")
    problem = check_arguments(tool.parameters, call.arguments)
    if problem is not None:
        return ToolResult(f"Error: bad arguments for {call.name}: {problem}.", "bad_arguments")
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        out = await bounded(tool.call(episode_id, call.arguments), timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(f"Error: {call.name} timed out after {timeout_s:g} s.", "timeout", loop.time() - start)
    except TypeError as e:  # a signature the schema did not describe
        return ToolResult(f"Error: bad arguments for {call.name}: {e}.", "bad_arguments", loop.time() - start)
    except Exception as e:  # the tool's own failure is the model's observation, not the run's end (the loop logs it)
        return ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", "tool_error", loop.time() - start)
    seconds = loop.time() - start
    try:
        images = _images(out)
    except ImageError as e:  # an unreadable image is the tool's failure: the model is told, the run goes on
        return ToolResult(f"Error: {call.name} returned an unreadable image: {e}", "tool_error", seconds)
    return ToolResult(_as_text(out), None, seconds, images)


def _images(out: Any) -> list[bytes]:
    if isinstance(out, tuple) and out:
        out = out[0]
    return [to_png(img) for img in getattr(out, "images", None) or []]


def _as_text(out: Any) -> str:
    if isinstance(out, tuple) and out:  # verl's execute returns (response, reward, metrics)
        out = out[0]
    if hasattr(out, "text") and not isinstance(out, str):
        out = out.text
    if isinstance(out, str):
        return out
    return json.dumps(out)


# ---- loading ---------------------------------------------------------------------------------------------------------
def function_tool(fn: Callable[..., Any]) -> Tool:
    """A plain function as a Tool (schema from `fn.tool_schema` or its signature)."""
    schema = getattr(fn, "tool_schema", None) or _schema_from_signature(fn)
    name = schema["function"]["name"]
    if inspect.iscoroutinefunction(fn):

        async def call(_episode: str, args: dict[str, Any]) -> Any:
            return await fn(**args)
    else:

        async def call(_episode: str, args: dict[str, Any]) -> Any:
            # A thread cannot be killed: a sync tool that hangs is abandoned at its timeout, not stopped.
            return await asyncio.to_thread(fn, **args)

    return Tool(name=name, schema=schema, call=call)


def _schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    hints = getattr(fn, "__annotations__", {})
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = hints.get(p.name)
        if isinstance(hint, str):  # `from __future__ import annotations`
            hint = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(hint)
        props[p.name] = {"type": _PY_TYPES[hint]} if hint in _PY_TYPES else {}
        if p.default is p.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc[0] if doc else "",
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def class_tool(class_name: str, config: dict[str, Any], schema: dict[str, Any], key: str = "class_name") -> Tool:
    """A verl-style tool class entry as a Tool (see the module docstring); `key` names the entry in errors."""
    from fully_async.plugins import load

    path = class_name if ":" in class_name else "{}:{}".format(*class_name.rsplit(".", 1))
    obj = load(path, key)(config=config or {}, tool_schema=schema)

    async def call(episode: str, args: dict[str, Any]) -> Any:
        return await obj.execute(episode, args)

    return Tool(
        name=schema["function"]["name"],
        schema=schema,
        call=call,
        create=getattr(obj, "create", None),
        release=getattr(obj, "release", None),
    )


def load_tools(paths: list[str], config_path: str | None = None) -> dict[str, Tool]:
    """Tools by name from dotted function paths and a verl-format YAML file; duplicate names are an error."""
    from fully_async.plugins import load

    tools = [function_tool(load(p, f"rollout.multi_turn.tools[{i}]")) for i, p in enumerate(paths)]
    if config_path:
        import yaml

        data = yaml.safe_load(Path(config_path).read_text()) or {}
        for i, entry in enumerate(data.get("tools") or []):
            try:
                schema = entry["tool_schema"]
                schema["function"]["name"]  # noqa: B018 - a missing name fails here, naming the entry
                key = f"{config_path}: tools[{i}].class_name"
                tools.append(class_tool(entry["class_name"], entry.get("config") or {}, schema, key))
            except (KeyError, TypeError) as e:
                raise ValueError(
                    f"{config_path}: tools[{i}] needs class_name and tool_schema.function.name ({e!r})"
                ) from e
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out
