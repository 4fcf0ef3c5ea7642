"""Mixture-of-experts end to end on tiny:moe (Qwen3-MoE-like) and tiny:mixtral: export per expert, cut,
routed execution on every plan, and only the routed experts run."""

import json

import numpy as np
import pytest
import torch

import pipeshard
from pipeshard.exporter.tiny import build_tiny_model
from pipeshard.formats.expert_stats import RoutingStats
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.moe import chosen_experts

PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Tell me a story."]
BATCH = ["Hi", "Count: 1 2 3", "What is the capital of France, and why is it famous?", "Tell me a story."]
PLANS = ["cpu", "gpu-only", "static", "dynamic", "layers", "offload", "auto"]


@pytest.fixture(scope="module", params=["moe", "mixtral"])
def moe_model(request, models):
    export, pack = models.export(f"tiny:{request.param}"), models.pack(f"tiny:{request.param}")
    manifest = load_pack(pack).manifest
    engine = pipeshard.load(export)
    reference = {
        "solo": [engine.generate(p, max_new_tokens=64)[0].tokens for p in PROMPTS],
        "batch": [g.tokens for g in engine.generate(BATCH, max_new_tokens=24)],
    }
    return request.param, export, pack, manifest, reference


def small_budget(manifest, share: float = 0.7) -> int:
    """The minimum plus a share of the model (KV and workspace take much of it at context 256): some
    experts fit on the device, the others do not."""
    planner = Planner(manifest, load_profile("laptop-8gb"))
    return planner.minimum_budget() + int(planner.model_bytes * share)


def _pytorch_greedy(architecture: str, prompt_ids: list[int], new_tokens: int, eos: set[int]):
    """PyTorch's greedy tokens, and per forward pass the experts each layer's router chose."""
    model, tokenizer = build_tiny_model(architecture)
    routed: list[tuple[int, list[int]]] = []
    for index, layer in enumerate(model.model.layers):

        def record(module, args, output, layer_index=index):
            routed.append((layer_index, sorted(set(output[2].flatten().tolist()))))

        layer.mlp.gate.register_forward_hook(record)
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    tokens = output[0, len(prompt_ids) :].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:stop], routed


def test_export_records_the_moe_dims_and_the_pack_cuts_every_expert(moe_model):
    _, export, _, manifest, _ = moe_model
    dims = json.loads((export / "export.json").read_text())["dims"]
    assert (dims["num_experts"], dims["experts_per_token"]) == (8, 2)
    names = [e.name for e in manifest.sub_layers]
    for block in manifest.moe_blocks:
        layer = block.layer
        assert block.experts == [f"L{layer}.expert{j}" for j in range(8)]
        assert names.index(f"L{layer}.attn") < names.index(block.router) < names.index(block.experts[0])
    experts = [e for e in manifest.sub_layers if e.kind == "expert"]
    assert len(experts) == 4 * 8 and not any(e.kind in ("ffn", "combine") for e in manifest.sub_layers)
    expected = 2 * 3 * dims["hidden_size"] * dims["expert_intermediate_size"]
    assert all(e.cost.flops == {"T": expected} for e in experts)  # T = tokens routed to the expert


def test_greedy_tokens_equal_pytorch(moe_model):
    architecture, export, pack, _, reference = moe_model
    engine = pipeshard.load(pack, plan="cpu")
    for prompt, expected in zip(PROMPTS, reference["solo"], strict=True):
        ids = engine.generator.prompt_ids(prompt)
        theirs, _ = _pytorch_greedy(architecture, ids, 64, set(engine.codec.eos_token_ids))
        assert expected == theirs[: len(expected)] and len(expected) > 8
        assert engine.generate(prompt, max_new_tokens=64)[0].tokens == expected


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_gives_the_dense_models_tokens(moe_model, plan):
    _, _, pack, manifest, reference = moe_model
    budget = small_budget(manifest)
    engine = pipeshard.load(pack, plan=plan, device="sim", vram=budget, profile="laptop-8gb", context=256)
    assert [engine.generate(p, max_new_tokens=64)[0].tokens for p in PROMPTS] == reference["solo"]
    assert [g.tokens for g in engine.generate(BATCH, max_new_tokens=24)] == reference["batch"]
    if plan != "cpu":
        assert engine.step.device.ledger.peak <= budget


def test_a_small_budget_splits_the_experts_over_pinned_streamed_and_cpu(moe_model):
    _, _, pack, manifest, reference = moe_model
    engine = pipeshard.load(
        pack, plan="gpu-only", device="sim", vram=small_budget(manifest), profile="laptop-8gb", context=256
    )
    engine.generate(PROMPTS[1], max_new_tokens=16)
    placements = engine.step.active.placements
    experts = [e.name for e in manifest.sub_layers if e.kind == "expert"]
    assert {placements[e] for e in experts} == {"pinned", "streamed"}
    static = pipeshard.load(
        pack, plan="static", device="sim", vram=small_budget(manifest), profile="laptop-8gb", context=256
    )
    static.generate(PROMPTS[1], max_new_tokens=4)
    assert {static.step.active.placements[e] for e in experts} == {"pinned", "cpu"}


def test_only_the_routers_choices_run(moe_model):
    """Every expert session run is one the router chose, per step and layer, as PyTorch's router chose."""
    architecture, _, pack, manifest, _ = moe_model
    engine = pipeshard.load(pack, plan="cpu")
    step = engine.step
    runs: list[tuple[int, int, int]] = []
    for entry in (e for e in manifest.sub_layers if e.kind == "expert"):
        stage = step._cpu_stage(entry.name)

        def counted(*args, original=stage.run_on_arrays, entry=entry):
            runs.append((entry.layer, entry.expert, len(step.expert_stats.trace)))
            return original(*args)

        stage.run_on_arrays = counted
    step.expert_stats.trace = []
    ids = engine.generator.prompt_ids(PROMPTS[1])
    (ours,) = engine.generator.generate([ids], pipeshard.api.SamplingSettings(max_new_tokens=24))
    theirs, routed = _pytorch_greedy(architecture, ids, 24, set(engine.codec.eos_token_ids))
    assert ours.tokens == theirs[: len(ours.tokens)]
    trace = step.expert_stats.trace
    assert trace == routed[: len(trace)] and len(trace) == 4 * len(ours.tokens)
    # The session runs are exactly the traced choices: one run per chosen expert, nothing else.
    assert len(runs) == sum(len(experts) for _, experts in trace)
    assert [(layer, expert) for layer, expert, _ in runs] == [
        (layer, e) for layer, experts in trace for e in experts
    ]


def test_expert_weight_bytes_read_per_decode_step_are_k_experts_per_layer(moe_model):
    _, _, pack, manifest, _ = moe_model
    expert_bytes = {e.name: e.weight_bytes for e in manifest.sub_layers if e.kind == "expert"}
    blocks = manifest.moe_blocks
    # Everything streamed: what a decode step copies is what it reads.
    planner = Planner(manifest, load_profile("laptop-8gb"), context=256)
    budget = planner.minimum_budget() + planner.model_bytes // 3
    engine = pipeshard.load(
        pack, plan="offload", device="sim", vram=budget, profile="laptop-8gb", context=256
    )
    step = engine.step
    step.expert_stats.trace = []
    engine.generate(PROMPTS[0], max_new_tokens=2)  # activate the plans
    copied: list[int] = []
    upload = step.device.upload

    def recorded_upload(buffer, source):
        if any(buffer is slot for slot in step._expert_slots):
            copied.append(source.nbytes)
        return upload(buffer, source)

    step.device.upload = recorded_upload
    prompt_ids = engine.generator.prompt_ids(PROMPTS[0])
    step.start(1, 256)
    ids = np.array([prompt_ids], np.int64)
    step.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    one_expert = next(iter(expert_bytes.values()))
    for position in range(ids.shape[1], ids.shape[1] + 6):
        before_trace = len(step.expert_stats.trace)
        del copied[:]
        step.forward(np.array([[5]]), np.ones((1, position + 1), np.int64), np.array([[position]]))
        streamed = {n for n, p in step.active.placements.items() if p == "streamed" and n in expert_bytes}
        assert streamed
        chosen = [
            blocks[layer].experts[e]
            for layer, experts in step.expert_stats.trace[before_trace:]
            for e in experts
        ]
        assert len(chosen) == 2 * len(blocks)  # k experts per layer, nothing else ran
        assert sum(expert_bytes[name] for name in chosen) == 2 * len(blocks) * one_expert
        assert sum(copied) == sum(expert_bytes[name] for name in chosen if name in streamed)


def test_chosen_experts_groups_token_rows_by_expert():
    routing = np.zeros((1, 3, 4), np.float32)
    routing[0, 0, [1, 3]] = 0.5
    routing[0, 1, [1, 2]] = 0.5
    routing[0, 2, [3, 0]] = 0.5
    chosen = chosen_experts(routing)
    assert [(e, rows.tolist()) for e, rows in chosen] == [(0, [2]), (1, [0, 1]), (2, [1]), (3, [0, 2])]
    padded = chosen_experts(routing, live=np.array([[0, 1, 1]]))  # row 0 is a shorter prompt's padding
    assert [(e, rows.tolist()) for e, rows in padded] == [(0, [2]), (1, [1]), (2, [1]), (3, [2])]


def test_planner_expects_uniform_distinct_experts_and_reads_measured_stats(moe_model):
    _, _, _, manifest, _ = moe_model
    planner = Planner(manifest, load_profile("laptop-8gb"))
    for tokens in (1, 4, 16, 64):
        expected = 8 * (1 - (1 - 2 / 8) ** tokens)
        assert all(abs(v - expected) < 1e-9 for v in planner.expected_distinct_experts(tokens).values())
    # Measured: two hot experts per layer take almost every token.
    stats = RoutingStats.from_json(
        {
            "schema_version": 1,
            "layers": {
                str(b.layer): {"tokens": [500, 480, 5, 5, 4, 3, 2, 1], "activations": [0] * 8}
                for b in manifest.moe_blocks
            },
        },
        "measured routing",
    )
    hot = Planner(manifest, load_profile("laptop-8gb"), expert_stats=stats)
    assert all(v < 3.5 for v in hot.expected_distinct_experts(16).values())
    experts = [e.name for e in hot.priority if e.kind == "expert"]
    assert experts[: 2 * len(manifest.moe_blocks)] == sorted(
        [b.experts[0] for b in manifest.moe_blocks] + [b.experts[1] for b in manifest.moe_blocks],
        key=experts.index,
    )
    assert {n.split(".")[1] for n in experts[: 2 * len(manifest.moe_blocks)]} == {"expert0", "expert1"}


def test_gpu_check_dry_run_covers_a_moe_pack(moe_model, tiny_pack, tmp_path):
    """The GPU check's MoE part, on the simulated device."""
    import importlib.util
    from pathlib import Path

    architecture, _, pack, _, _ = moe_model
    if architecture != "moe":
        pytest.skip("one MoE pack is enough")
    script = Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check"
    summary = gpu_check.main(
        [
            "--pack",
            str(tiny_pack),
            "--moe-pack",
            str(pack),
            "--dry-run",
            "--budgets",
            "0.7",
            "--out",
            str(out),
        ]
    )
    assert summary["ok"] and summary["stages"]["moe_bench"]["ok"]
    (moe_bench,) = out.glob("*-moe_bench.json")
    rows = json.loads(moe_bench.read_text())["budgets"]["70%"]["rows"]
    assert list(rows) == ["cpu", "auto", "layers", "offload"]
    assert any(row["streamed_bytes_per_run"] for row in rows.values())


def test_routing_stats_round_trip_through_the_cli(moe_model, tmp_path, capsys):
    """run --save-expert-stats writes what plan --expert-stats reads; a file that is not one is an error line."""
    from pipeshard.cli import main

    architecture, _, pack, _, _ = moe_model
    if architecture != "moe":
        pytest.skip("one MoE pack is enough")
    stats = tmp_path / "stats.json"
    assert (
        main(
            [
                "run",
                str(pack),
                PROMPTS[2],
                "--plan",
                "cpu",
                "--max-new-tokens",
                "16",
                "--save-expert-stats",
                str(stats),
            ]
        )
        == 0
    )
    saved = json.loads(stats.read_text())
    assert saved["schema_version"] == 1 and saved["steps"] >= 1
    assert all(sum(layer["tokens"]) == 2 * saved["routed_tokens"] for layer in saved["layers"].values())
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                str(pack),
                "--vram",
                "70%",
                "--profile",
                "laptop-8gb",
                "--context",
                "256",
                "--expert-stats",
                str(stats),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "experts per MoE layer, pinned/streamed/cpu" in table and "L3 " in table
    assert (
        main(
            [
                "plan",
                str(pack),
                "--vram",
                "70%",
                "--profile",
                "laptop-8gb",
                "--expert-stats",
                str(pack / "manifest.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "expert stats" in err[0]


def test_inspect_totals_count_k_experts_per_token(moe_model):
    from pipeshard.runtime.pack_info import pack_summary

    _, _, pack, manifest, _ = moe_model
    summary = pack_summary(load_pack(pack), context=64)
    dense = sum(r["flops_T1"] for r in summary["sub_layers"] if r["kind"] != "expert")
    per_expert_token = next(r["flops_T1"] for r in summary["sub_layers"] if r["kind"] == "expert")
    expected = dense + len(manifest.moe_blocks) * 2 * per_expert_token  # k = 2 experts per layer and token
    assert abs(summary["totals"]["flops_T1"] - expected) < 1e-6 * expected
