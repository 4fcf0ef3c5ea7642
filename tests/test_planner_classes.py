"""The planner at scale: alike units decided as classes and scored in closed form, the simulation's collapsed runs
of streamed experts, and the pin prefix found by bisection."""

from types import SimpleNamespace

import pytest

from pipeshard.formats.manifest import load_pack
from pipeshard.formats.plans import Placement
from pipeshard.partitioner import simulate as simulation
from pipeshard.partitioner.classes import class_step_s, unit_classes
from pipeshard.partitioner.planner import Planner
from pipeshard.partitioner.simulate import ComputeSeconds
from pipeshard.profiles.db import load_profile

MiB = 1024**2


def moe_chain(layers: int = 3, experts: int = 20):
    """A synthetic MoE chain: per layer an attention, a router and `experts` alike experts gated by it."""
    units, compute, copies, gates = [], {}, {}, {}
    for layer in range(layers):
        for name, cpu_s, gpu_s, copy_s in (
            (f"L{layer}.attn", 4e-3, 1e-3, 3e-3),
            (f"L{layer}.router", 1e-4, 1e-4, 1e-5),
        ):
            units.append(SimpleNamespace(name=name))
            compute[name], copies[name] = ComputeSeconds(cpu_s, gpu_s), copy_s
        for expert in range(experts):
            name = f"L{layer}.expert{expert}"
            units.append(SimpleNamespace(name=name))
            compute[name], copies[name] = ComputeSeconds(2e-3, 2e-4), 1e-3
            gates[name] = f"L{layer}.router"
    return units, compute, copies, gates


def placements_of(units, attention: str, pinned_experts: int, streamed_experts: int) -> dict[str, str]:
    placements = {}
    for unit in units:
        index = int(unit.name.rsplit("expert", 1)[1]) if "expert" in unit.name else None
        if index is None:
            placements[unit.name] = attention if unit.name.endswith("attn") else Placement.PINNED
        else:
            placements[unit.name] = (
                Placement.PINNED
                if index < pinned_experts
                else Placement.STREAMED
                if index < pinned_experts + streamed_experts
                else Placement.CPU
            )
    return placements


@pytest.mark.parametrize("streamed", [0, 9, 16])
def test_collapsed_streamed_experts_take_the_unit_by_unit_time(monkeypatch, streamed):
    units, compute, copies, gates = moe_chain()
    placements = placements_of(units, Placement.STREAMED, 2, streamed)
    collapsed = simulation.simulate(units, placements, compute, copies, 1e-5, copy_gates=gates, detail=False)
    monkeypatch.setattr(simulation, "COLLAPSE_AFTER", 10**6)
    unit_by_unit = simulation.simulate(
        units, placements, compute, copies, 1e-5, copy_gates=gates, detail=False
    )
    assert collapsed.step_s == pytest.approx(unit_by_unit.step_s, rel=1e-12)


@pytest.mark.parametrize(
    "attention,pinned,streamed",
    [(Placement.PINNED, 0, 0), (Placement.CPU, 4, 0), (Placement.STREAMED, 0, 20), (Placement.CPU, 2, 7)],
)
def test_the_closed_form_score_follows_the_simulation(attention, pinned, streamed):
    units, compute, copies, gates = moe_chain()
    placements = placements_of(units, attention, pinned, streamed)
    exact = simulation.simulate(
        units, placements, compute, copies, 1e-5, copy_gates=gates, detail=False
    ).step_s
    names = {u.name for u in units}
    classes = unit_classes(units, compute, copies, gates, names, lambda unit: 0, dict.fromkeys(names, 1))
    assert len(classes) == 9  # per layer: attention, router, the experts as one class
    counts = [
        (
            sum(placements[n] == Placement.PINNED for n in c.names),
            sum(placements[n] == Placement.STREAMED for n in c.names),
        )
        for c in classes
    ]
    score = class_step_s(classes, [p for p, _ in counts], [s for _, s in counts], 2, 1e-5, 1.0, False)
    assert score == pytest.approx(exact, rel=0.1)


@pytest.fixture(scope="module")
def moe_manifest(models):
    return load_pack(models.pack("tiny:moe")).manifest


@pytest.mark.parametrize("tier", [1, 64])
@pytest.mark.parametrize("share", [0.3, 0.6])
def test_the_class_search_plans_as_fast_as_the_unit_search(moe_manifest, tier, share):
    profile = load_profile("laptop-8gb")
    unit_search = Planner(moe_manifest, profile, context=256)
    class_search = Planner(moe_manifest, profile, context=256)
    class_search.at_scale = True
    budget = unit_search.minimum_budget() + int(unit_search.model_bytes * share)
    by_units = unit_search.strategies(tier, budget)[0]
    by_classes = class_search.strategies(tier, budget)[0]
    assert by_classes.vram.total <= budget
    assert by_classes.step_s <= by_units.step_s * 1.05, (by_classes.strategy, by_units.strategy)


def test_the_pin_prefix_is_the_longest_that_fits(moe_manifest):
    planner = Planner(moe_manifest, load_profile("laptop-8gb"), context=256)
    all_cpu = {e.name: Placement.CPU for e in planner.placeable}
    for share in (0.05, 0.2, 0.5, 0.9):
        budget = planner.minimum_budget() + int(planner.model_bytes * share)
        placements = planner._pinned(16, all_cpu, 0, budget)[0]
        pinned = sum(p == Placement.PINNED for p in placements.values())
        assert planner.vram(placements, 16, 0).total <= budget
        if pinned < len(planner.priority):
            one_more = {**placements, planner.priority[pinned].name: Placement.PINNED}
            assert planner.vram(one_more, 16, 0).total > budget


@pytest.mark.parametrize("share", [0.1, 0.4, 1.2])
def test_the_artifact_strategies_fit_and_our_choice_is_no_slower(moe_manifest, share):
    from pipeshard.partitioner.planner import ARTIFACT_STRATEGIES

    planner = Planner(moe_manifest, load_profile("desktop-24gb"), context=256)
    budget = planner.minimum_budget() + int(planner.model_bytes * share)
    for tier in (1, 256):
        artifact = [planner.artifact_plan(name, tier, budget) for name in ARTIFACT_STRATEGIES]
        viable = [p for p in artifact if p is not None]
        assert viable and all(p.vram.total <= budget for p in viable)
        assert planner.strategies(tier, budget)[0].step_s <= min(p.step_s for p in viable) * (1 + 1e-9)


def test_layers_baseline_offloads_large_batches_to_the_device(moe_manifest):
    planner = Planner(moe_manifest, load_profile("desktop-24gb"), context=256)
    budget = planner.minimum_budget() + int(planner.model_bytes * 0.8)
    decode, prefill = planner.baseline("layers", 1, budget), planner.baseline("layers", 256, budget)
    assert decode.counts()["streamed"] == 0 and prefill.counts()["streamed"] > 0 and not prefill.prefetch


def test_shard_attn_prio_streams_the_ffn_once_every_attention_is_pinned(moe_manifest):
    """The artifact's shard-attn-prio: attentions pinned first; with all of them pinned and room left, the rest of
    the model streams through the slot (none of it left on the CPU but the output layer)."""
    planner = Planner(moe_manifest, load_profile("desktop-24gb"), context=256)
    budget = planner.minimum_budget() + int(planner.model_bytes * 0.5)
    plan = planner.artifact_plan("shard-attn-prio", 1, budget)
    kinds = {unit.name: unit.kind for unit in planner.placeable}
    assert all(plan.placements[n] == Placement.PINNED for n, kind in kinds.items() if kind == "attn")
    assert plan.counts()["streamed"] > 0 and plan.vram.total <= budget
