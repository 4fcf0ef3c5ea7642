"""SmolLM2 on the simulated device at 25 % of the model's bytes: every plan gives the monolithic tokens."""

import pytest
from prompts import SMOLLM2_PROMPTS

import pipeshard
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile

pytestmark = pytest.mark.slow
PROMPTS = SMOLLM2_PROMPTS
NEW_TOKENS = 32
BATCH = ["Hi!", "Name three colors.", "What is 2 + 2? Explain briefly.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def setup(smollm2_export, models):
    pack = models.pack("smollm2-135m")
    planner = Planner(load_pack(pack).manifest, load_profile("laptop-8gb"))
    budget = planner.minimum_budget() + planner.model_bytes // 4
    whole = pipeshard.load(smollm2_export, threads=2)
    reference = {
        "solo": [whole.generate(p, max_new_tokens=NEW_TOKENS)[0].tokens for p in PROMPTS],
        "batch": [g.tokens for g in whole.generate(BATCH, max_new_tokens=NEW_TOKENS)],
    }
    return pack, budget, reference


@pytest.mark.parametrize("plan", ["auto", "gpu-only", "static", "dynamic", "layers", "offload", "cpu"])
def test_plan_is_lossless_at_a_quarter_of_the_model(setup, plan):
    pack, budget, reference = setup
    engine = pipeshard.load(
        pack, vram=budget, device="sim", profile="laptop-8gb", plan=plan, threads=2, context=256
    )
    assert [engine.generate(p, max_new_tokens=NEW_TOKENS)[0].tokens for p in PROMPTS] == reference["solo"]
    assert [g.tokens for g in engine.generate(BATCH, max_new_tokens=NEW_TOKENS)] == reference["batch"]
    if plan != "cpu":
        assert engine.step.device.ledger.peak <= budget
    if plan == "gpu-only":  # viable at a quarter of the model: the 108 MiB output layer streams in row chunks
        assert {p.strategy for p in engine.step.plans.values()} == {"gpu-only"}
        assert engine.step.stats.streamed_bytes > 0


def test_a_long_context_streams_the_kv_of_streamed_attentions_and_stays_lossless(setup, smollm2_export):
    """At a 4096-token context the KV of every attention (190 MiB) cannot sit beside a quarter of the model on the
    device: the planner's plans keep it in host memory for the streamed attentions and stream it with them."""
    pack, budget, _ = setup
    prompt = (
        " ".join(
            f"Note {i}: the river {['rises', 'falls', 'bends', 'rests'][i % 4]} near town {i % 17}."
            for i in range(260)
        )
        + " Summarize the notes."
    )
    whole = pipeshard.load(smollm2_export, threads=2)
    expected = whole.generate(prompt, max_new_tokens=8)[0]
    assert 3000 < len(expected.prompt_tokens) <= 4096 - 8
    engine = pipeshard.load(pack, vram=budget, device="sim", profile="laptop-8gb", threads=2, context=4096)
    assert engine.generate(prompt, max_new_tokens=8)[0].tokens == expected.tokens
    step = engine.step
    decode = step.plans[1]
    assert decode.kv_streamed and decode.vram.kv_staging > 0 and decode.vram.total <= budget
    report = step.report().to_json()
    assert report["streamed_kv_bytes"] > 0 and report["kv_streamed"]["1"] == len(decode.kv_streamed)
    assert step.device.ledger.peak <= budget
