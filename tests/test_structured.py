"""Structured output: `response_format` json_schema / json_object answers always parse and validate (llguidance
masks every token the schema's grammar does not allow), sampled or greedy, alone or among other requests."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from test_server import server  # noqa: E402

# Bounded strings and numbers: a random tiny model would otherwise write digits until it runs out of tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def base(tiny_pack):
    with server(tiny_pack, "--parallel", "4", "--context", "512") as url:
        yield url


def ask(base: str, seed: int, **fields) -> dict:
    body = {
        "model": "pack",
        "messages": [{"role": "user", "content": "Describe someone as JSON."}],
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        **fields,
    }
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_fifty_sampled_answers_all_validate_against_the_schema(base):
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda seed: ask(base, seed), range(50)))
    documents = [json.loads(c["message"]["content"]) for c in choices]
    for document in documents:
        jsonschema.validate(document, SCHEMA)
    assert all(c["finish_reason"] == "stop" for c in choices)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 10  # sampled, not one answer


def test_a_seeded_constrained_answer_is_the_same_streamed_alone_or_among_others(base):
    alone = ask(base, 7)["message"]["content"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda seed: ask(base, seed)["message"]["content"], [7, 8, 9, 7]))
    assert together[0] == together[3] == alone


def test_json_object_on_completions_and_logprobs_of_the_model_itself(base):
    body = {
        "model": "pack",
        "prompt": "JSON:",
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "logprobs": 1,
    }
    choice = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:  # greedy may run long inside a string: what it wrote is still the start of an object
        assert choice["text"].startswith("{")
    # logprobs are the raw model's: the grammar's first token ("{") is scored as the model scores it, beside the
    # model's own likeliest tokens, which the grammar did not allow
    first = choice["logprobs"]["top_logprobs"][0]
    assert choice["logprobs"]["tokens"][0] == "{" and max(first.values()) >= first["{"]
    assert all(value <= 0 for value in choice["logprobs"]["token_logprobs"])


def test_the_mask_costs_little_per_token(tiny_llama_export):
    """The per-token cost of constrained decoding on the scheduler's thread: one mask and one token consumed
    (tiny:llama's 259-token vocabulary here; `examples/bench_structured.py` measures a real one)."""
    from pipeshard.runtime.text import TextCodec
    from pipeshard.structured import constraint_for

    codec = TextCodec(tiny_llama_export)
    constraint = constraint_for(SCHEMA, codec, 259)
    rng = np.random.default_rng(0)
    started, tokens = time.perf_counter(), 0
    while True:
        allowed = np.flatnonzero(constraint.allowed())
        tokens += 1
        if not constraint.accept(int(rng.choice(allowed))) or tokens > 300:
            break
    per_token_ms = (time.perf_counter() - started) / tokens * 1e3
    print(f"constrained decoding: {per_token_ms:.3f} ms per token over {tokens} tokens")
    assert per_token_ms < 5


def test_a_batch_line_with_a_schema_gets_json_that_validates(tiny_pack, tmp_path):
    from pipeshard.cli import main

    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    lines = [
        {"custom_id": f"q{seed}", "prompt": "JSON:", "temperature": 1.0, "seed": seed, "max_tokens": 200}
        | {"response_format": schema}
        for seed in range(4)
    ]
    job, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    for record in map(json.loads, out.read_text().splitlines()):
        jsonschema.validate(json.loads(record["output"]), SCHEMA)
