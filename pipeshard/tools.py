"""Tools (OpenAI's `tools` / `tool_choice`): the functions go into the prompt through the model's chat template, as
transformers' `apply_chat_template(tools=...)` passes them, or, for a template that takes no tools, as a system
message listing them (`FALLBACK_INSTRUCTIONS`); a forced call ("required" or a named function) is decoded under the
grammar of `{"name": ..., "arguments": {...}}` (`call_schema`, through `pipeshard/structured.py`); a free answer
("auto") is read for calls written as the fallback asks or as tool-using templates write them (`<tool_call>`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A template without tools gets this as (the end of) its system message.
FALLBACK_INSTRUCTIONS = (
    "Functions you may call:\n{tools}\nTo call them, answer only with one JSON object per call, one per line: "
    '{{"name":<function name>,"arguments":<its arguments object>}}'
)
COMPACT = (",", ":")
TAGGED_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolError(ValueError):
    """A request's tools cannot be used as given; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools: `tools` as it gave them, `choice` auto / none / required / function (then `forced` names
    it), and whether several calls may come in one answer."""

    tools: tuple[dict, ...]
    choice: str
    forced: str | None
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    @property
    def forced_call(self) -> bool:
        """The answer must be a call (required or a named function): decoded under `call_schema`."""
        return self.choice in ("required", "function")


def tool_spec(body: dict) -> ToolSpec | None:
    """The request's tools, checked (a ToolError names the field at fault); None when it has none."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {type: function, function: {...}}", "tools")
    names: set[str] = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError("each of 'tools' must be {type: function, function: {name, parameters}}", "tools")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError("a function's name in 'tools' must be 1-64 letters, digits, _ or -", "tools")
        if name in names:
            raise ToolError(f"two of 'tools' are named {name!r}", "tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"'tools': the parameters of {name!r} must be a JSON schema object", "tools")
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"'tools': the description of {name!r} must be a string", "tools")
        names.add(name)
    forced = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        forced = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or forced not in names:
            raise ToolError(
                "'tool_choice' must be auto, none, required or {type: function, function: {name}} of a tool",
                "tool_choice",
            )
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise ToolError("'tool_choice' must be auto, none, required or a named function", "tool_choice")
    return ToolSpec(tuple(tools), choice, forced, parallel is not False)


def call_schema(spec: ToolSpec) -> dict:
    """The JSON schema of one call the answer must be (`{"name": ..., "arguments": {...}}`, name first): of the
    forced function, or of any tool."""

    def one(tool: dict) -> dict:
        function = tool["function"]
        arguments = dict(function.get("parameters") or {"type": "object"})
        arguments.setdefault("type", "object")
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    chosen = [t for t in spec.tools if spec.forced in (None, t["function"]["name"])]
    return one(chosen[0]) if len(chosen) == 1 else {"anyOf": [one(t) for t in chosen]}


def template_messages(
    messages: list[dict], spec: ToolSpec | None, template_takes_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """The conversation and tools a chat template renders. A template that takes tools gets them and the messages
    as transformers hands them over (a call's arguments as an object); one that does not gets the fallback system
    message and each earlier call written as the fallback asks for it."""
    if template_takes_tools:
        return [_with_argument_objects(m) for m in messages], list(spec.tools) if spec else None
    written = [
        {"role": m["role"], "content": _written_calls(m) if m.get("tool_calls") else m.get("content") or ""}
        for m in messages
    ]
    if spec is None:
        return written, None
    instructions = FALLBACK_INSTRUCTIONS.format(
        tools="\n".join(json.dumps(t["function"], ensure_ascii=False, separators=COMPACT) for t in spec.tools)
    )
    if written and written[0]["role"] == "system":
        return [
            {"role": "system", "content": written[0]["content"] + "\n\n" + instructions},
            *written[1:],
        ], None
    return [{"role": "system", "content": instructions}, *written], None


def _with_argument_objects(message: dict) -> dict:
    """A message as transformers' templates read it: each call's `arguments` an object, not OpenAI's JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": _arguments_object(call["function"])}}
        for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _written_calls(message: dict) -> str:
    """An assistant message's calls as the fallback asks the model to write them (after its text, if any)."""
    lines = [
        json.dumps(
            {"name": call["function"]["name"], "arguments": _arguments_object(call["function"])},
            ensure_ascii=False,
            separators=COMPACT,
        )
        for call in message["tool_calls"]
    ]
    return "\n".join(([message["content"]] if message.get("content") else []) + lines)


def _arguments_object(function: dict) -> dict:
    arguments = function.get("arguments")
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def check_message_calls(message: dict) -> None:
    """An assistant message's `tool_calls` as OpenAI sends them back (function name, arguments as JSON object
    text); a ToolError naming `messages` otherwise."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ToolError("'tool_calls' must be a non-empty list", "messages")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(
                "each tool call must be {type: function, function: {name, arguments}}", "messages"
            )
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ToolError("a tool call's 'arguments' must be a JSON object (as text)", "messages")


def parse_tool_calls(text: str, spec: ToolSpec) -> list[dict] | None:
    """OpenAI's `tool_calls` for an answer that is calls of the request's tools: a JSON object per line (or one
    object, or a list of them), or `<tool_call>` blocks; None for an answer that is anything else."""
    tagged = TAGGED_CALL.findall(text)
    if tagged and not TAGGED_CALL.sub("", text).strip():
        pieces = tagged
    else:
        stripped = text.strip()
        try:
            whole = json.loads(stripped)
        except json.JSONDecodeError:
            pieces = stripped.splitlines()
        else:
            pieces = [json.dumps(one) for one in whole] if isinstance(whole, list) else [stripped]
    calls = [_call(piece, spec) for piece in pieces if piece.strip()]
    if not calls or None in calls:
        return None
    return calls if spec.parallel else calls[:1]


def _call(text: str, spec: ToolSpec) -> dict | None:
    """One call in OpenAI's shape, or None when `text` is not a call of one of the tools."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in spec.names:
        return None
    if spec.forced is not None and call["name"] != spec.forced:
        return None
    arguments = call.get("arguments", call.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def may_become_call(text: str) -> bool:
    """Whether a free answer begun with `text` may still turn out to be a call (streaming holds it back until
    it cannot)."""
    start = text.lstrip()
    return not start or start[0] in "{[" or "<tool_call>".startswith(start[:11])
