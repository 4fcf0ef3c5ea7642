"""A plan cut into splits (runtime/splits.py): what `pipeshard plan --explain` prints is what the step runs."""

import pytest

import pipeshard
from pipeshard.cli import main
from pipeshard.formats.manifest import load_pack
from pipeshard.formats.plans import Placement, all_cpu_plan
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.splits import Layout, schedule


@pytest.fixture(scope="module")
def planner(tiny_pack):
    return Planner(load_pack(tiny_pack).manifest, load_profile("laptop-8gb"), context=256)


def placed(planner, **kinds) -> dict[str, str]:
    return {u.name: kinds.get(u.kind, Placement.CPU) for u in planner.units}


def test_the_all_cpu_plan_decodes_as_one_split_with_nothing_between_runs(planner):
    layout = Layout(planner.manifest, planner.units)
    plan = all_cpu_plan(list(layout.units))
    (split,) = schedule(layout, plan, tokens=1)
    assert split.side == "cpu" and not split.after and split.wait is None
    assert [unit for unit, _ in split.runs][0] == "embed"  # the prologue's values are the step's at one token
    prefill = schedule(layout, plan, tokens=8)
    assert [action for split in prefill for action, _ in split.after] == ["hand on", "last position"]


def test_pinned_attention_alternates_sides_with_a_copy_at_every_change(planner):
    layout = Layout(planner.manifest, planner.units)
    plan = planner.evaluate("static", 1, placed(planner, attn=Placement.PINNED), 1 << 40)
    splits = schedule(layout, plan, tokens=1)
    assert [s.side for s in splits] == ["cpu"] + ["device", "cpu"] * 4
    assert [a for s in splits for a, _ in s.after] == ["copy in", "copy out"] * 4


def test_every_streamed_unit_is_a_split_that_waits_for_it_and_releases_its_slot(planner):
    layout = Layout(planner.manifest, planner.units)
    plan = planner.evaluate(
        "gpu-only", 1, placed(planner, attn=Placement.STREAMED, ffn=Placement.PINNED), 1 << 40
    )
    splits = schedule(layout, plan, tokens=1)
    streamed = [s for s in splits if s.wait]
    assert [s.wait for s in streamed] == [f"L{i}.attn" for i in range(4)]
    assert all(
        s.runs == [(s.wait, Placement.STREAMED)] and s.after[0] == ("release", s.wait) for s in streamed
    )


def test_explain_prints_each_tiers_splits(tiny_pack, planner, capsys):
    budget = str(planner.minimum_budget() + 2_000_000)
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                budget,
                "--profile",
                "laptop-8gb",
                "--context",
                "256",
                "--tiers",
                "1,16",
                "--explain",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tier 1, " in out and "tier 16, " in out and "split   1 on cpu   : embed" in out


def test_the_step_runs_the_schedule_it_explains(tiny_pack, planner):
    engine = pipeshard.load(
        tiny_pack,
        vram=planner.minimum_budget() + 2_000_000,
        device="sim",
        profile="laptop-8gb",
        plan="static",
        context=256,
    )
    engine.generate("Hi", max_new_tokens=3)
    step = engine.step
    assert step.splits == schedule(step.layout, step.active, tokens=1)  # the last step's: one new token
    assert any(" on device:" in line for line in step.explain())
    device_runs = [unit for split in step.splits if split.side == "device" for unit, _ in split.runs]
    assert device_runs and all(step.active.placements[unit] != Placement.CPU for unit in device_runs)
