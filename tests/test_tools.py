"""Tools: `tool_choice` required or a named function gives a call whose arguments validate against the function's
schema (decoded under llguidance's grammar), streamed as `tool_calls` deltas; the tools reach the prompt through the
chat template or its fallback system message; earlier calls and tool results are part of a conversation."""

from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from test_server import server  # noqa: E402

from pipeshard.formats.chat_template import ChatTemplate  # noqa: E402
from pipeshard.tools import parse_tool_calls, template_messages, tool_spec  # noqa: E402

# Bounded strings and numbers: a random tiny model would otherwise write digits until it runs out of tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# A template that takes tools, as Qwen's and Hermes' do (tiny:llama's own takes none, and its 512-token context has
# no room for the fallback's JSON schemas of two tools in its byte-level tokens).
TOOL_TEMPLATE = """{% if tools %}<|im_start|>system
{% for t in tools %}{{ t.function.name }}
{% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ m.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def tool_pack(tiny_pack, tmp_path_factory):
    pack = tmp_path_factory.mktemp("tools") / "pack"
    shutil.copytree(tiny_pack, pack)
    template = pack / "chat_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    manifest = json.loads((pack / "manifest.json").read_text())  # the pack checks its files against it
    manifest["files"][template.name] = {
        "bytes": template.stat().st_size,
        "sha256": hashlib.sha256(template.read_bytes()).hexdigest(),
    }
    (pack / "manifest.json").write_text(json.dumps(manifest))
    return pack


@pytest.fixture(scope="module")
def base(tool_pack):
    with server(tool_pack, "--parallel", "4", "--context", "512") as url:
        yield url


def chat(base: str, **fields) -> dict:
    body = {"model": "pack", "messages": ASK, "tools": TOOLS, "max_tokens": 120, **fields}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_twenty_sampled_required_calls_all_validate_against_their_function(base):
    with ThreadPoolExecutor(4) as pool:
        choices = list(
            pool.map(lambda s: chat(base, tool_choice="required", temperature=1.0, seed=s), range(20))
        )
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1
        call = message["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len({c["message"]["tool_calls"][0]["function"]["arguments"] for c in choices}) > 2  # sampled


def test_a_named_tool_choice_calls_that_function(base):
    for seed in range(4):
        choice = chat(
            base, tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1.0, seed=seed
        )
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "add"
        jsonschema.validate(json.loads(call["arguments"]), ADD)


def test_a_streamed_call_arrives_as_tool_calls_deltas(base):
    body = {"model": "pack", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": True}
    body |= {"max_tokens": 120, "temperature": 1.0, "seed": 3}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    choices = [json.loads(line)["choices"][0] for line in lines[:-1]]
    deltas = [c["delta"]["tool_calls"] for c in choices if "tool_calls" in c["delta"]]
    assert deltas and choices[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in choices)  # the call is never streamed as text
    arguments = "".join(d[0]["function"]["arguments"] for d in deltas)
    assert deltas[0][0]["index"] == 0 and deltas[0][0]["type"] == "function"
    jsonschema.validate(json.loads(arguments), SCHEMAS[deltas[0][0]["function"]["name"]])
    whole = chat(base, tool_choice="required", temperature=1.0, seed=3)["message"]["tool_calls"][0][
        "function"
    ]
    assert whole["arguments"] == arguments  # the same call as unstreamed


def test_auto_and_none_answer_freely_and_a_conversation_with_calls_and_results_is_taken(base):
    free = chat(base, tool_choice="auto", temperature=0, max_tokens=8)
    assert free["finish_reason"] in ("stop", "length") and isinstance(free["message"]["content"], str)
    unused = chat(base, tool_choice="none", temperature=0, max_tokens=8)
    assert "tool_calls" not in unused["message"] and isinstance(unused["message"]["content"], str)
    earlier = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": true}'},
    }
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    answer = chat(base, messages=conversation, temperature=0, max_tokens=4)
    assert answer["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function"}]),
        ("tools", [{"type": "function", "function": {"name": "bad name!"}}]),
        ("tools", "get_weather"),
        ("tool_choice", {"type": "function", "function": {"name": "missing"}}),
        ("tool_choice", "sometimes"),
        ("parallel_tool_calls", "yes"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(base, field, value):
    body = {"model": "pack", "messages": ASK, "tools": TOOLS, "max_tokens": 2, field: value}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_tool_choice_without_tools_and_bad_earlier_calls_are_400s(base):
    body = {"model": "pack", "messages": ASK, "tool_choice": "required", "max_tokens": 2}
    assert httpx.post(base + "/v1/chat/completions", json=body).json()["error"]["param"] == "tool_choice"
    bad = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "["}}]},
    ]
    answer = httpx.post(base + "/v1/chat/completions", json={"messages": bad, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    answer = httpx.post(base + "/v1/completions", json={"prompt": "hi", "tools": TOOLS, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"


def test_a_template_without_tools_gets_them_in_a_system_message_and_one_with_tools_renders_them():
    spec = tool_spec({"tools": TOOLS})
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert not plain.takes_tools
    messages, tools = template_messages(ASK, spec, plain.takes_tools)
    assert tools is None and messages[0]["role"] == "system"
    compact = json.dumps(TOOLS[0]["function"], separators=(",", ":"))
    assert compact in messages[0]["content"] and messages[1:] == ASK
    rendered = plain.render(messages, tools)
    assert rendered.startswith("<system>Functions you may call") and '"name":"add"' in rendered
    # a template that reads `tools` gets them as transformers passes them, and earlier calls' arguments as objects
    aware = ChatTemplate(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.a }}{% endfor %}{% endfor %}"
    )
    assert aware.takes_tools
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 41, "b": true}'}}
    messages, tools = template_messages(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}], spec, True
    )
    assert aware.render(messages, tools) == "[weather][add]41"


def test_calls_are_parsed_out_of_a_free_answer_only_when_it_is_calls():
    spec = tool_spec({"tools": TOOLS})
    one = parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": false}}', spec)
    assert one[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": false}'}
    tagged = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', spec)
    assert json.loads(tagged[0]["function"]["arguments"]) == {"a": 2}
    lines = '{"name": "add", "arguments": {"a": 1}}\n{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert [c["function"]["name"] for c in parse_tool_calls(lines, spec)] == ["add", "weather"]
    assert len(parse_tool_calls(lines, tool_spec({"tools": TOOLS, "parallel_tool_calls": False}))) == 1
    for text in ["The weather is fine.", '{"name": "other", "arguments": {}}', '{"name": "add"}', ""]:
        assert parse_tool_calls(text, spec) is None


def test_a_batch_line_with_required_tools_gets_a_call_that_validates(tool_pack, tmp_path):
    from pipeshard.cli import main

    lines = [
        {"custom_id": f"q{seed}", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
        | {"temperature": 1.0, "seed": seed, "max_tokens": 120}
        for seed in range(3)
    ]
    openai_line = {
        "custom_id": "o1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120},
    }
    job, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in [*lines, openai_line]))
    assert main(["batch", str(tool_pack), str(job), str(out)]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for seed in range(3):
        record = records[f"q{seed}"]
        assert record["finish_reason"] == "tool_calls" and record["output"] is None
        call = record["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    choice = records["o1"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]


def test_a_template_without_tools_gets_the_fallback_and_a_required_call_still_validates(tiny_pack):
    """tiny:llama's own template takes no tools: they reach the model as the fallback system message."""
    with server(tiny_pack, "--parallel", "2", "--context", "512") as url:
        for seed in range(3):
            choice = chat(
                url, tools=TOOLS[1:], tool_choice="required", temperature=1.0, seed=seed, max_tokens=100
            )
            call = choice["message"]["tool_calls"][0]["function"]
            assert choice["finish_reason"] == "tool_calls" and call["name"] == "add"
            jsonschema.validate(json.loads(call["arguments"]), ADD)
