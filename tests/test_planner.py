"""Planner invariants on the reference profiles, the search against the exhaustive optimum, bad input."""

import json
from dataclasses import replace

import pytest

from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.formats.manifest import Manifest, load_pack
from pipeshard.partitioner.planner import Planner, plans_document
from pipeshard.profiles.db import REFERENCE_PROFILES, load_profile

MiB = 1024**2
TIERS = (1, 4, 16, 64, 256, 1024)


@pytest.fixture(scope="module")
def tiny_manifest(tiny_pack):
    return load_pack(tiny_pack).manifest


def scaled_manifest(manifest: Manifest, factor: int) -> Manifest:
    """The tiny pack with every weight `factor` times larger, so budgets of MiB matter."""

    def scaled(weight):
        shape = (weight.shape[0], weight.shape[1] * factor) if len(weight.shape) == 2 else weight.shape
        return replace(weight, bytes=weight.bytes * factor, shape=shape)

    sub_layers = tuple(
        replace(
            e,
            weights=tuple(scaled(w) for w in e.weights),
            blob=replace(e.blob, bytes=e.blob.bytes * factor) if e.blob else None,
        )
        for e in manifest.sub_layers
    )
    return replace(manifest, sub_layers=sub_layers)


def minimum(manifest, profile) -> int:
    return Planner(manifest, profile).minimum_budget()


@pytest.mark.parametrize("profile_name", REFERENCE_PROFILES)
def test_no_plan_exceeds_the_budget_and_more_budget_is_never_slower(tiny_manifest, profile_name):
    profile = load_profile(profile_name)
    manifest = scaled_manifest(tiny_manifest, 256)
    floor = minimum(manifest, profile)
    previous = {}
    for extra in (0, 16, 48, 128, 512):
        budget = floor + extra * MiB
        planned = Planner(manifest, profile, context=1024).plan(budget, TIERS)
        for entry in planned.tiers:
            for plan in [entry.chosen, *entry.alternatives, *entry.baselines.values()]:
                assert plan.vram.total <= budget, (plan.strategy, entry.tier, budget)
            step = entry.chosen.step_s
            assert step <= previous.get(entry.tier, float("inf")) * (1 + 1e-9), (entry.tier, extra)
            previous[entry.tier] = step


def test_streaming_wins_at_large_tiers_on_a_fast_link(tiny_manifest):
    manifest = scaled_manifest(tiny_manifest, 256)
    profile = load_profile("desktop-24gb")
    budget = minimum(manifest, profile) + 128 * MiB
    planned = Planner(manifest, profile, context=1024).plan_tier(1024, budget)
    static = next(p for p in planned.alternatives if p.strategy == "static")
    assert planned.chosen.strategy in ("gpu-only", "dynamic") and planned.chosen.counts()["streamed"]
    assert planned.chosen.step_s < static.step_s / 2


@pytest.mark.parametrize("strategy", ["dynamic", "static", "gpu-only", "layers"])
def test_a_prompts_steps_are_priced_at_the_context_each_attends_to(tiny_manifest, strategy):
    """A prompt prefilled in steps of its tier: each step attends to the tokens so far, so earlier steps cost less
    than a step at the planned context, and a one-step prompt at that context costs exactly the plan's step."""
    manifest = scaled_manifest(tiny_manifest, 256)
    profile = load_profile("desktop-24gb")
    budget = minimum(manifest, profile) + 64 * MiB
    tier = 1024

    def planned(planner):
        if strategy == "layers":
            return planner.baseline("layers", tier, budget)
        return planner.plan_for(strategy, tier, budget)

    planner = Planner(manifest, profile, context=8 * tier)
    plan = planned(planner)
    prompts = [planner.prompt_seconds(plan, steps * tier) for steps in (1, 2, 4, 8)]
    assert prompts == sorted(prompts) and prompts[0] < plan.step_s
    assert prompts[-1] < 8 * plan.step_s
    one_step = Planner(manifest, profile, context=tier)
    assert one_step.prompt_seconds(planned(one_step), tier) == pytest.approx(
        planned(one_step).step_s, rel=1e-12
    )


@pytest.mark.parametrize("profile_name", ["laptop-8gb", "laptop-4gb"])
def test_static_or_dynamic_wins_at_one_token_with_a_small_budget(tiny_manifest, profile_name):
    manifest = scaled_manifest(tiny_manifest, 256)
    profile = load_profile(profile_name)
    budget = minimum(manifest, profile) + 48 * MiB
    assert Planner(manifest, profile, context=1024).plan_tier(1, budget).chosen.strategy in (
        "static",
        "dynamic",
    )


@pytest.mark.parametrize("tier", [1, 64, 1024])
@pytest.mark.parametrize("extra_mib", [24, 96])
def test_dynamic_search_matches_the_exhaustive_optimum(tiny_manifest, tier, extra_mib):
    manifest = scaled_manifest(tiny_manifest, 256)
    profile = load_profile("desktop-24gb")
    budget = minimum(manifest, profile) + extra_mib * MiB
    planner = Planner(manifest, profile, context=1024)
    found = planner.dynamic(tier, budget)
    best = min((planner.exhaustive_dynamic(tier, budget, slots) for slots in (2, 1)), key=lambda p: p.step_s)
    reference = found.step_s if found else planner.static(tier, budget).step_s
    assert reference <= best.step_s * 1.05, (reference, best.step_s)


def test_too_small_budget_names_the_minimum(tiny_manifest):
    profile = load_profile("laptop-8gb")
    floor = minimum(tiny_manifest, profile)
    with pytest.raises(UserError, match=f"minimum of any plan: {floor / MiB:.0f} MiB"):
        Planner(tiny_manifest, profile).plan_tier(1, floor - 1)


def test_replanning_for_a_new_budget_is_fast(tiny_manifest):
    import time

    planner = Planner(scaled_manifest(tiny_manifest, 256), load_profile("laptop-8gb"), context=1024)
    planner.plan_tier(1, 1 << 30)
    budget = minimum(planner.manifest, planner.profile) + 40 * MiB
    started = time.perf_counter()
    planner.plan_tier(1, budget)
    assert time.perf_counter() - started < 0.5


def test_plans_json_carries_placements_times_and_vram(tiny_manifest, tmp_path):
    profile = load_profile("laptop-8gb")
    budget = minimum(tiny_manifest, profile) + 64 * MiB
    planner = Planner(tiny_manifest, profile)
    document = plans_document(planner, planner.plan(budget, (1, 64)), "pack", "laptop-8gb", "0" * 64, budget)
    assert document["schema_version"] == 2 and [t["tier"] for t in document["tiers"]] == [1, 64]
    chosen = document["tiers"][0]["chosen"]
    assert set(chosen["placements"].values()) <= {"pinned", "streamed", "cpu"}
    assert chosen["vram"]["total"] <= document["budget_bytes"] and chosen["step_s"] > 0
    assert set(chosen["predicted_s"]) == {e.name for e in tiny_manifest.sub_layers}
    json.dumps(document)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--vram", "2XB", "--profile", "laptop-8gb"], "cannot read size '2XB'"),
        (["--vram", "1GiB", "--profile", "gamer-pc"], "laptop-8gb"),
        (["--vram", "1GiB", "--profile", "laptop-8gb", "--tiers", "1,-4"], "--tiers"),
        (["--vram", "1GiB", "--profile", "laptop-8gb", "--tiers", "one"], "--tiers"),
        (["--vram", "1MiB", "--profile", "laptop-8gb"], "minimum"),
    ],
)
def test_plan_bad_input_is_one_error_line(tiny_pack, capsys, argv, fragment):
    assert main(["plan", str(tiny_pack), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0]


def test_plan_cli_table_json_and_out(tiny_pack, tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                "1GiB",
                "--profile",
                "laptop-8gb",
                "--tiers",
                "1,64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "vs layers" in table and "static" in table or "gpu-only" in table
    assert json.loads(out.read_text())["tiers"][1]["tier"] == 64


def test_a_profile_from_another_machine_warns_and_plans(tiny_pack, tmp_path, capsys, caplog):
    document = load_profile("laptop-8gb").to_json()
    document["source"] = "measured"
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(document))
    assert main(["plan", str(tiny_pack), "--vram", "1GiB", "--profile", str(path), "--tiers", "1"]) == 0
    assert "another machine" in caplog.text


def test_plan_plot_draws_the_timelines(tiny_pack, tmp_path, capsys):
    picture = tmp_path / "timeline.png"
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                "1GiB",
                "--profile",
                "laptop-8gb",
                "--tiers",
                "1,64",
                "--plot",
                str(picture),
            ]
        )
        == 0
    )
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
