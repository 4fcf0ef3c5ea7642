"""The prefix cache across requests: prompts that share a long prefix take its KV from the cache and keep the texts
they get alone, on the CPU chain and on sim plans (device KV, KV streamed with its attention, a budget change
mid-way), within the cache's byte budget; `serve` counts the reused tokens and `batch` gives the same lines."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from test_server import metric, server

import pipeshard
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.generate import SamplingSettings
from pipeshard.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache
from pipeshard.runtime.scheduler import Scheduler

PREFIX = (
    "You answer questions about the weather, cities and numbers. Be short, be exact, and say when you do not "
    "know. Here are the rules of this game: one answer per question, no lists, no jokes. "
)
QUESTIONS = [
    "Hi",
    "What is 2+2?",
    "Name a city.",
    "Is it raining?",
    "Count to three.",
    "Why?",
    "Tell me more.",
    "Ok",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def minimum(tiny_pack):
    return Planner(load_pack(tiny_pack).manifest, load_profile("laptop-8gb")).minimum_budget()


def engine_for(tiny_pack, minimum, placement: str):
    if placement == "cpu":
        return pipeshard.load(tiny_pack, context=512)
    # On sim with four slots of 512 tokens: at +3 MB the decode plan pins the attentions (their KV in device
    # buffers); at +1.2 MB it streams them with their KV (its master on the host).
    extra, plan = {
        "sim": (2_000_000, "auto"),
        "sim-kv-on-device": (3_000_000, "gpu-only"),
        "sim-kv-streamed": (1_200_000, "gpu-only"),
    }[placement]
    return pipeshard.load(
        tiny_pack, vram=minimum + extra, device="sim", profile="laptop-8gb", plan=plan, context=512
    )


def answers(scheduler: Scheduler, prompts: list[list[int]], concurrent: int) -> list[list[int]]:
    settings = SamplingSettings(max_new_tokens=NEW_TOKENS)

    def ask(prompt):
        return list(scheduler.submit(prompt, settings))[-1].tokens

    with ThreadPoolExecutor(concurrent) as pool:
        return list(pool.map(ask, prompts))


@pytest.mark.parametrize("placement", ["cpu", "sim-kv-on-device", "sim-kv-streamed"])
def test_requests_sharing_a_prefix_reuse_it_and_get_their_solo_tokens(tiny_pack, minimum, placement):
    engine = engine_for(tiny_pack, minimum, placement)
    engine.codec.eos_token_ids = []  # every answer runs its full length
    prompts = [engine.generator.prompt_ids(PREFIX + q) for q in QUESTIONS]
    solo = [engine.generate(PREFIX + q, max_new_tokens=NEW_TOKENS)[0].tokens for q in QUESTIONS]
    budget = 1 << 20
    scheduler = Scheduler(engine, parallel=4, context=512, prefix_cache_bytes=budget)
    try:
        first = answers(scheduler, prompts[:1], 1)
        cache = scheduler.prefix_cache
        shared = (len(engine.generator.prompt_ids(PREFIX)) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        assert cache.reused_tokens == 0 and cache.bytes > 0
        rest = answers(scheduler, prompts[1:], 4)  # together: they wait for nothing, the prefix is kept
        assert first + rest == solo
        assert cache.reused_tokens >= (len(QUESTIONS) - 1) * shared
        assert cache.bytes <= budget
        residency = engine.step.residency
        if placement == "sim-kv-on-device":
            assert residency.kv_device and not residency.kv_streamed
        if placement == "sim-kv-streamed":
            assert residency.kv_streamed and residency.kv_slots
            assert engine.step.device.ledger.peak <= minimum + 1_200_000
    finally:
        scheduler.close()


def test_requests_arriving_together_wait_for_the_first_to_keep_their_shared_prefix(tiny_pack):
    engine = pipeshard.load(tiny_pack, context=512)
    engine.codec.eos_token_ids = []
    prompts = [engine.generator.prompt_ids(PREFIX + q) for q in QUESTIONS]
    solo = [engine.generate(PREFIX + q, max_new_tokens=NEW_TOKENS)[0].tokens for q in QUESTIONS]
    scheduler = Scheduler(engine, parallel=8, context=512, prefix_cache_bytes=1 << 20)
    try:
        assert answers(scheduler, prompts, 8) == solo
        shared = (len(engine.generator.prompt_ids(PREFIX)) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        assert scheduler.prefix_cache.reused_tokens >= (len(QUESTIONS) - 1) * shared
    finally:
        scheduler.close()


def test_a_small_budget_evicts_least_recently_used_blocks_and_stays_within_it(tiny_pack):
    engine = pipeshard.load(tiny_pack, context=512)
    engine.codec.eos_token_ids = []
    solo = [engine.generate(PREFIX + q, max_new_tokens=NEW_TOKENS)[0].tokens for q in QUESTIONS]
    block_bytes = engine.step.kv.dtype.itemsize * BLOCK_TOKENS * engine.step.head_dim * engine.step.kv_heads
    budget = 20 * block_bytes * len(engine.step.kv.past_names)  # 20 blocks: the prefix and a few suffixes
    scheduler = Scheduler(engine, parallel=2, context=512, prefix_cache_bytes=budget)
    try:
        prompts = [engine.generator.prompt_ids(PREFIX + q) for q in QUESTIONS]
        assert answers(scheduler, prompts, 2) == solo
        cache = scheduler.prefix_cache
        assert cache.bytes <= budget and cache.reused_tokens > 0
    finally:
        scheduler.close()


def test_the_cache_keeps_shared_blocks_once_and_evicts_leaves_first():
    kv = np.zeros((1, 1, 3 * BLOCK_TOKENS, 1), np.float16)  # 2 bytes a token
    cache = PrefixCache(budget_bytes=4 * 2 * BLOCK_TOKENS)  # room for four blocks
    base = list(range(2 * BLOCK_TOKENS))
    one, two = base + [900] * BLOCK_TOKENS, base + [901] * BLOCK_TOKENS
    cache.add(one, 0, kv)
    first, end = cache.missing(two)
    assert (first, end) == (2 * BLOCK_TOKENS, 3 * BLOCK_TOKENS)  # the shared blocks are kept once
    cache.add(two, first, kv[:, :, first:end])
    assert len(cache.blocks) == 4 and cache.bytes == cache.budget_bytes
    assert len(cache.longest(one)) == 3  # `one` is now the most recent: `two`'s leaf goes first
    cache.add(base + [902] * BLOCK_TOKENS, 2 * BLOCK_TOKENS, kv[:, :, :BLOCK_TOKENS])
    assert len(cache.longest(two)) == 2 and len(cache.longest(one)) == 3 and cache.evicted_blocks == 1
    assert cache.bytes <= cache.budget_bytes


def test_serve_counts_reused_tokens_and_keeps_texts_across_a_budget_change(tiny_pack, minimum):
    engine = engine_for(tiny_pack, minimum, "sim")
    solo = {q: engine.generate(PREFIX + q, max_new_tokens=NEW_TOKENS)[0].text for q in QUESTIONS}
    options = ["--device", "sim", "--vram", str(minimum + 2_000_000), "--profile", "laptop-8gb"]
    with server(tiny_pack, *options, "--context", "512", "--prefix-cache", "1MiB") as base:

        def ask(question: str) -> str:
            body = {"model": "pack", "messages": [{"role": "user", "content": PREFIX + question}]}
            body |= {"max_tokens": NEW_TOKENS, "temperature": 0}
            answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            return answer.json()["choices"][0]["message"]["content"]

        assert ask(QUESTIONS[0]) == solo[QUESTIONS[0]]
        changed = threading.Event()

        def ask_and_change(question: str) -> str:
            text = ask(question)
            if question == QUESTIONS[2]:
                small = httpx.post(base + "/v1/budget", json={"vram": str(minimum + 300_000)}, timeout=60)
                assert small.status_code == 200
                changed.set()
            return text

        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(ask_and_change, QUESTIONS[1:]))
        assert changed.is_set() and texts == [solo[q] for q in QUESTIONS[1:]]
        assert metric(base, "pipeshard_prefix_cache_reused_tokens_total") >= 100 * (len(QUESTIONS) - 1)
        assert 0 < metric(base, "pipeshard_prefix_cache_bytes") <= 1 << 20
        assert metric(base, "pipeshard_vram_budget_bytes") == minimum + 300_000


def test_batch_with_the_prefix_cache_gives_the_lines_it_gives_without(tiny_pack, tmp_path, capsys):
    from pipeshard.cli import main

    lines = [  # lines of two prefixes, interleaved: the job orders them to share
        {
            "custom_id": f"q{i}-{n}",
            "messages": [{"role": "user", "content": prefix + q}],
            "max_tokens": NEW_TOKENS,
        }
        for i, q in enumerate(QUESTIONS)
        for n, prefix in enumerate((PREFIX, PREFIX[::-1]))
    ]
    job = tmp_path / "in.jsonl"
    job.write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs = {}
    for cache in ("0", "1MiB"):
        out = tmp_path / f"out-{cache}.jsonl"
        command = ["batch", str(tiny_pack), str(job), str(out), "--parallel", "4", "--prefix-cache", cache]
        assert main(command) == 0
        outputs[cache] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(outputs["0"]) == len(outputs["1MiB"]) == len(lines)  # each line once
    texts = {cache: {r["custom_id"]: r["output"] for r in records} for cache, records in outputs.items()}
    assert texts["1MiB"] == texts["0"]
    assert "from the prefix cache" in capsys.readouterr().err
