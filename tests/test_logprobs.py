"""Logprobs as a harness reads them: chat's and completions' (echo of the prompt included), streamed or not, on the
chain and on sim, each within 1e-4 of the log-softmax of transformers' logits over the same tokens."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

import pipeshard
from pipeshard.runtime.text import TextCodec

torch = pytest.importorskip("torch")
from test_server import server  # noqa: E402

TOLERANCE = 1e-4
TOP = 3
PROMPT = "Once upon a time there was a"


@pytest.fixture(scope="module")
def reference():
    """tiny:llama in transformers (the weights its export has): token ids -> log-softmax of every position."""
    from pipeshard.exporter.tiny import build_tiny_model

    model, _ = build_tiny_model("llama")

    def log_softmax(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1).numpy()

    return log_softmax


@pytest.fixture(scope="module")
def codec(tiny_llama_export):
    return TextCodec(tiny_llama_export)


def _sim_options(tiny_pack) -> list[str]:
    from pipeshard.formats.manifest import load_pack
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    minimum = Planner(load_pack(tiny_pack).manifest, load_profile("laptop-8gb")).minimum_budget()
    return ["--device", "sim", "--vram", str(minimum + 600_000), "--profile", "laptop-8gb"]


@pytest.fixture(scope="module", params=["chain", "sim"])
def base(request, tiny_pack):
    options = _sim_options(tiny_pack) if request.param == "sim" else []
    with server(tiny_pack, "--parallel", "2", "--context", "512", *options) as url:
        yield url


def post(base: str, route: str, body: dict, stream: bool) -> list[dict]:
    """The answer's choices: one for a whole answer, one per chunk of a streamed one."""
    body = {"model": "pack", "temperature": 0, **body, "stream": stream}
    if not stream:
        answer = httpx.post(base + route, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"]
    choices = []
    with httpx.stream("POST", base + route, json=body, timeout=120) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line[6:])["choices"]
    return choices


def check_entry(expected_row: np.ndarray, token: int, logprob: float, top_values: list[float]) -> None:
    assert abs(logprob - expected_row[token]) < TOLERANCE
    best = np.sort(expected_row)[::-1][: len(top_values)]
    assert np.allclose(top_values, best, atol=TOLERANCE), (top_values, best)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_transformers_log_softmax(base, reference, codec, tiny_pack, stream):
    messages = [{"role": "user", "content": "Tell me a story."}]
    prompt = codec.encode(codec.render_messages(messages))
    generated = pipeshard.load(tiny_pack).generate("Tell me a story.", max_new_tokens=12)[0].tokens
    choices = post(
        base,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 12, "logprobs": True, "top_logprobs": TOP},
        stream,
    )
    content = [entry for c in choices if c.get("logprobs") for entry in c["logprobs"]["content"]]
    expected = reference(prompt + generated)
    assert len(content) >= len(
        generated
    )  # an end-of-sequence token's entry comes last, when the answer stops
    for position, (token, entry) in enumerate(zip(generated, content, strict=False)):
        assert bytes(entry["bytes"]) == codec.token_bytes(token)
        assert len(entry["top_logprobs"]) == TOP
        check_entry(
            expected[len(prompt) + position - 1],
            token,
            entry["logprob"],
            [t["logprob"] for t in entry["top_logprobs"]],
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("new_tokens", [0, 6])
def test_completion_logprobs_and_the_echoed_prompts_equal_transformers(
    base, reference, codec, tiny_pack, stream, new_tokens
):
    # Over 256 tokens: the prompt is prefilled in two chunks, the second's first token scored by the first's end.
    prompt = codec.encode(PROMPT * 10, add_special_tokens=True)
    assert len(prompt) > 256
    body = {"prompt": prompt, "max_tokens": new_tokens, "logprobs": TOP, "echo": True}
    choices = post(base, "/v1/completions", body, stream)
    tokens, values, tops, offsets = [], [], [], []
    for choice in choices:
        if choice.get("logprobs"):
            tokens += choice["logprobs"]["tokens"]
            values += choice["logprobs"]["token_logprobs"]
            tops += choice["logprobs"]["top_logprobs"]
            offsets += choice["logprobs"]["text_offset"]
    text = "".join(c["text"] for c in choices)
    assert text.startswith(codec.decode(prompt, skip_special_tokens=False))
    assert values[0] is None and tops[0] is None  # nothing scores the first token
    assert offsets == sorted(offsets) and offsets[0] == 0
    generated = []
    if new_tokens:
        engine = pipeshard.load(tiny_pack)
        (alone,) = engine.generator.generate(
            [prompt], pipeshard.api.SamplingSettings(max_new_tokens=new_tokens)
        )
        generated = alone.tokens
    ids = prompt + generated
    assert len(values) >= len(ids)
    expected = reference(ids)
    for position in range(1, len(ids)):
        top = sorted(tops[position].values(), reverse=True)
        check_entry(expected[position - 1], ids[position], values[position], top[:1])
        assert tokens[position] == codec.token_bytes(ids[position]).decode(errors="replace")


def test_a_batch_line_carries_logprobs_and_echo(tiny_pack, reference, codec, tmp_path):
    from pipeshard.cli import main

    prompt = codec.encode(PROMPT, add_special_tokens=True)
    lines = [
        {"custom_id": "plain", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
        {
            "custom_id": "openai",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True},
        },
        {
            "custom_id": "tools",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function"}],
        },
    ]
    job, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["batch", str(tiny_pack), str(job), str(out)]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    plain = records["plain"]
    assert plain["output"] == codec.decode(prompt, skip_special_tokens=False)
    expected = reference(prompt)
    values = plain["logprobs"]["token_logprobs"]
    assert values[0] is None and len(values) == len(prompt)
    assert all(abs(values[k] - expected[k - 1][prompt[k]]) < TOLERANCE for k in range(1, len(prompt)))
    content = records["openai"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and all(entry["top_logprobs"] == [] for entry in content)
    assert "'tools'" in records["tools"]["error"]
