"""Plans executed on the simulated device: lossless for every plan, within budget, surviving replans."""

import numpy as np
import pytest

import pipeshard
from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile

PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3", "Tell me a story."]
PLANS = ["auto", "gpu-only", "static", "dynamic", "layers", "offload", "cpu", "monolithic"]


@pytest.fixture(scope="module")
def minimum(tiny_pack):
    return Planner(load_pack(tiny_pack).manifest, load_profile("laptop-8gb")).minimum_budget()


@pytest.fixture(scope="module")
def reference(tiny_llama_export):
    engine = pipeshard.load(tiny_llama_export)
    return {
        "solo": [engine.generate(p, max_new_tokens=16)[0].tokens for p in PROMPTS[:3]],
        "batch": [g.tokens for g in engine.generate(PROMPTS, max_new_tokens=16)],
    }


def sim(tiny_pack, budget, plan="auto"):
    return pipeshard.load(tiny_pack, vram=budget, device="sim", profile="laptop-8gb", plan=plan, context=256)


@pytest.mark.parametrize("above_minimum", [600_000, 2_000_000])
@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_gives_the_monolithic_greedy_tokens(tiny_pack, minimum, reference, plan, above_minimum):
    # Budgets where the tiny model does not fit whole (gpu-only and offload must stream), and where most of it does.
    engine = sim(tiny_pack, minimum + above_minimum, plan)
    assert [engine.generate(p, max_new_tokens=16)[0].tokens for p in PROMPTS[:3]] == reference["solo"]
    assert [g.tokens for g in engine.generate(PROMPTS, max_new_tokens=16)] == reference["batch"]


@pytest.mark.parametrize("plan", ["gpu-only", "offload"])
def test_streaming_plans_really_stream(tiny_pack, minimum, plan):
    engine = sim(tiny_pack, minimum + 600_000, plan)
    engine.generate(PROMPTS[1], max_new_tokens=8)
    assert engine.step.stats.streamed_bytes > 0
    assert any(p.strategy == plan and p.counts()["streamed"] > 0 for p in engine.step.plans.values())


def test_plans_streaming_the_kv_with_its_attention_are_lossless(tiny_pack, minimum, reference):
    # Little above the minimum, the KV of 256 tokens cannot stay on the device beside the staging slots: the
    # streamed attentions' KV lives on the host and travels with their weights (a batch of four at a larger budget).
    for extra, prompts, expected in ((300_000, PROMPTS[:3], reference["solo"]), (600_000, [PROMPTS], None)):
        engine = sim(tiny_pack, minimum + extra, "gpu-only")
        tokens = [[g.tokens for g in engine.generate(p, max_new_tokens=16)] for p in prompts]
        assert tokens == ([[t] for t in expected] if expected else [reference["batch"]])
        step = engine.step
        streaming = [p for p in step.plans.values() if p.kv_streamed]
        assert streaming and all(p.vram.kv_staging > 0 and p.vram.total <= minimum + extra for p in streaming)
        report = step.report().to_json()
        assert report["streamed_kv_bytes"] > 0 and report["streamed_kv_bytes_per_step"] > 0
        assert step.device.ledger.peak <= minimum + extra


def test_ledger_peak_never_exceeds_the_budget_across_budgets(tiny_pack, minimum, reference):
    for extra in (0, 50_000, 150_000, 300_000, 450_000, 600_000, 900_000, 2_000_000):
        for plan in ("auto", "gpu-only", "offload"):
            engine = sim(tiny_pack, minimum + extra, plan)
            tokens = [g.tokens for g in engine.generate(PROMPTS, max_new_tokens=6)]
            ledger = engine.step.device.ledger
            assert ledger.peak <= minimum + extra, (extra, plan, ledger.peak)
            assert tokens == [t[:6] for t in reference["batch"]]


def test_a_budget_change_mid_generation_keeps_the_output(tiny_pack, minimum, reference):
    engine = sim(tiny_pack, minimum + 2_000_000)
    results = []
    for index, _ in enumerate(engine.stream(PROMPTS[1], results=results, max_new_tokens=16)):
        if index == 3:
            engine.set_vram_budget(minimum)  # a game takes its VRAM back
            assert engine.step.device.ledger.used == 0
        if index == 8:
            engine.set_vram_budget(minimum + 600_000)
    assert results[0].tokens == reference["solo"][1]
    assert engine.step.stats.plan_switches >= 3


def test_shrinking_below_the_minimum_is_an_error_naming_it_and_changes_nothing(tiny_pack, minimum, reference):
    engine = sim(tiny_pack, minimum + 600_000)
    engine.generate(PROMPTS[0], max_new_tokens=4)
    with pytest.raises(UserError, match="minimum"):
        engine.set_vram_budget(minimum - 1)
    assert engine.step.book.budget_bytes == minimum + 600_000
    assert engine.generate(PROMPTS[1], max_new_tokens=16)[0].tokens == reference["solo"][1]


def test_an_interrupted_step_leaves_the_engine_usable(tiny_pack, minimum, reference):
    engine = sim(tiny_pack, minimum + 600_000, "gpu-only")
    step = engine.step
    original = step._wait_for_slot
    calls = {"n": 0}

    def interrupt_once(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    step._wait_for_slot = interrupt_once
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[1], max_new_tokens=16)
    assert step.device.ledger.used == 0
    assert engine.generate(PROMPTS[1], max_new_tokens=16)[0].tokens == reference["solo"][1]


def test_long_prompts_are_prefilled_in_chunks_of_the_largest_tier(tiny_pack, minimum, tiny_llama_export):
    engine = pipeshard.load(
        tiny_pack, vram=minimum + 600_000, device="sim", profile="laptop-8gb", context=512
    )
    engine.step.tiers = [1, 4, 16]
    prompt = "one two three four five six seven eight nine ten " * 3
    whole = pipeshard.load(tiny_llama_export)
    assert (
        engine.generate(prompt, max_new_tokens=8)[0].tokens
        == whole.generate(prompt, max_new_tokens=8)[0].tokens
    )
    assert max(engine.step.stats.tiers_used) == 16


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--device", "cuda", "--vram", "1GiB", "--profile", "laptop-8gb"], "no usable CUDA"),
        (["--device", "sim", "--vram", "1MiB", "--profile", "laptop-8gb"], "minimum"),
        (["--device", "sim", "--profile", "laptop-8gb"], "--vram"),
        (["--device", "tpu", "--vram", "1GiB"], "unknown device"),
        (
            ["--device", "sim", "--vram", "1GiB", "--profile", "laptop-8gb", "--plan", "fastest"],
            "unknown plan",
        ),
    ],
)
def test_run_device_errors_are_one_line(tiny_pack, capsys, argv, fragment):
    assert main(["run", str(tiny_pack), "hello", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0]


def test_run_on_sim_says_sim_wherever_figures_are_printed(tiny_pack, capsys):
    assert (
        main(
            [
                "run",
                str(tiny_pack),
                "hello",
                "--device",
                "sim",
                "--vram",
                "1GiB",
                "--profile",
                "laptop-8gb",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    assert "device sim (simulated: not GPU speed)" in capsys.readouterr().err


def test_logits_of_a_streamed_plan_match_the_chain(tiny_pack, minimum):
    chain = pipeshard.load(tiny_pack)
    engine = sim(tiny_pack, minimum + 600_000, "gpu-only")
    ids = np.array([[5, 17, 99, 3]], dtype=np.int64)
    args = (ids, np.ones_like(ids), np.arange(4)[None])
    chain.step.all_logits = engine.step.all_logits = True
    chain.step.start(1)
    engine.step.start(1)
    assert np.abs(chain.step.forward(*args) - engine.step.forward(*args)).max() < 1e-5


def test_chat_streams_answers_and_changes_the_budget_live(tiny_pack, minimum, monkeypatch, capsys):
    lines = iter(["/plan", "hello there", f"/budget {minimum}", "/budget 1MiB", "/plan", "again", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert (
        main(
            [
                "chat",
                str(tiny_pack),
                "--device",
                "sim",
                "--vram",
                str(minimum + 600_000),
                "--profile",
                "laptop-8gb",
                "--max-new-tokens",
                "6",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = captured.out
    assert f"budget now {minimum}" in out
    assert (
        "error:" in captured.err and "minimum" in captured.err
    )  # the 1 MiB budget is refused, the chat goes on
    assert out.count("device sim (simulated: not GPU speed)") == 2


def test_a_batch_larger_than_planned_is_replanned_so_its_kv_is_reserved(tiny_pack, minimum, reference):
    engine = sim(tiny_pack, minimum + 600_000)
    assert engine.step.book.source.batch == 1
    assert [g.tokens for g in engine.generate(PROMPTS, max_new_tokens=16)] == reference["batch"]
    assert engine.step.book.source.batch == len(PROMPTS)
    attention_on_device = [
        n for n, p in engine.step.active.placements.items() if n.endswith("attn") and p != "cpu"
    ]
    kv_per_attn = 2 * 2 * 16 * 4 * engine.step.book.source.context * len(PROMPTS)
    assert engine.step.device.ledger.by_purpose.get("kv", 0) == kv_per_attn * len(attention_on_device)
    assert engine.step.device.ledger.peak <= minimum + 600_000


def test_activations_cross_devices_only_where_the_placement_changes(tiny_pack, minimum):
    """Copies between the host's and the device's residual buffers sit only where a tensor's producer and a
    reader are on different sides (the host reads the last positions for the output layer, and a MoE layer's
    residual)."""
    engine = sim(tiny_pack, minimum + 2_000_000, "gpu-only")
    engine.generate(PROMPTS[0], max_new_tokens=2)
    step = engine.step
    placements = step.active.placements
    assert all(placements[f"L{i}.{part}"] != "cpu" for i in range(4) for part in ("attn", "ffn"))
    output_of = {
        e.name: [o.name for o in e.outputs if not o.name.startswith("present.")] for e in step.layout.in_line
    }
    copies = [
        (action, name) for split in step.splits for action, name in split.after if action.startswith("copy")
    ]
    assert copies[0] == ("copy in", output_of["embed"][0])
    assert ("copy out", output_of["L3.ffn"][0]) in copies or placements.get("final", "pinned") != "cpu"
    assert not {name for _, name in copies} & {
        output_of[f"L{i}.{part}"][0] for i in range(3) for part in ("attn", "ffn")
    }
    static = sim(tiny_pack, minimum + 2_000_000, "static")
    static.generate(PROMPTS[0], max_new_tokens=2)
    placements = static.step.active.placements
    chain = ["embed"] + [f"L{i}.{part}" for i in range(4) for part in ("attn", "ffn")] + ["final"]
    side = {name: "cpu" if placements.get(name, "cpu") == "cpu" else "device" for name in chain}
    assert len(set(side.values())) == 2
    expected = [output_of[a][0] for a, b in zip(chain[:-1], chain[1:], strict=True) if side[a] != side[b]]
    copies = [(a, n) for split in static.step.splits for a, n in split.after if a.startswith("copy")]
    assert [n for _, n in copies] == expected  # the decode step's: the output layer reads its input directly
