"""A saved plans.json is the runtime's input: it runs as it is, and a file that does not belong is one error line."""

import json

import pytest

import pipeshard
from pipeshard.cli import main
from pipeshard.formats.manifest import load_pack
from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile

PROMPTS = ["Hi", "What is the capital of France, and why is it famous?", "Count: 1 2 3"]


@pytest.fixture(scope="module")
def budget(tiny_pack) -> int:
    """A budget where the tiny model does not fit whole (some tiers stream)."""
    planner = Planner(load_pack(tiny_pack).manifest, load_profile("laptop-8gb"), context=256)
    return planner.minimum_budget() + 600_000


@pytest.fixture(scope="module")
def plans_file(tiny_pack, budget, tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "plans.json"
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                str(budget),
                "--profile",
                "laptop-8gb",
                "--context",
                "256",
                "--tiers",
                "1,4,64",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    return path


def test_a_saved_plans_file_runs_as_it_is_with_the_in_process_plans_tokens(
    tiny_pack, budget, plans_file, monkeypatch
):
    planned = pipeshard.load(tiny_pack, vram=budget, device="sim", profile="laptop-8gb", context=256)
    expected = [planned.generate(p, max_new_tokens=16)[0].tokens for p in PROMPTS]  # the file's batch: 1
    saved = pipeshard.load(tiny_pack, device="sim", plans=plans_file)
    monkeypatch.setattr(Planner, "plan_tier", lambda *a: pytest.fail("the planner was asked"))
    assert [saved.generate(p, max_new_tokens=16)[0].tokens for p in PROMPTS] == expected
    document = json.loads(plans_file.read_text())
    assert {tier: plan.placements for tier, plan in saved.step.plans.items()} == {
        entry["tier"]: entry["chosen"]["placements"] for entry in document["tiers"]
    }
    assert saved.step.book.budget_bytes == document["budget_bytes"] and saved.step.tiers == [1, 4, 64]
    report = saved.step.report()
    assert (
        report.plans
        == {
            entry["tier"]: entry["chosen"]["strategy"]
            for entry in document["tiers"]
            if entry["tier"] in report.plans
        }
        and 1 in report.plans
    )
    assert 0 < report.peak_device_bytes <= report.budget_bytes == document["budget_bytes"]
    assert report.streamed_weight_bytes == saved.step.stats.streamed_bytes > 0 and report.steps > 0
    assert json.loads(json.dumps(report.to_json()))["plans"]["1"] == report.plans[1]


def test_run_with_plans_through_the_cli(tiny_pack, plans_file, capsys):
    assert (
        main(
            [
                "run",
                str(tiny_pack),
                "Hi",
                "--device",
                "sim",
                "--plans",
                str(plans_file),
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    assert "plans T=1:" in capsys.readouterr().err


def _one_error(capsys, argv, fragment):
    assert main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], lines


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: d.update(pack_sha256="0" * 64), "made for another pack"),
        (lambda d: d.update(schema_version=99), "schema_version is 99"),
        (lambda d: d["ladder"][0].update(budget_bytes=d["budget_bytes"] // 4), "over its budget"),
        (
            lambda d: d["ladder"][0]["tiers"][0]["chosen"]["placements"].pop("L0.attn"),
            "does not place exactly",
        ),
    ],
)
def test_a_plans_file_that_does_not_belong_is_one_error_line(
    tiny_pack, plans_file, tmp_path, capsys, change, fragment
):
    document = json.loads(plans_file.read_text())
    change(document)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    _one_error(capsys, ["run", tiny_pack, "Hi", "--device", "sim", "--plans", bad], fragment)


def test_a_budget_below_the_files_is_one_error_line(tiny_pack, plans_file, capsys):
    _one_error(
        capsys,
        ["run", tiny_pack, "Hi", "--device", "sim", "--plans", plans_file, "--vram", "1MiB"],
        "made for budgets of",
    )
    _one_error(capsys, ["run", tiny_pack, "Hi", "--plans", plans_file], "--device sim|cuda")


def test_bench_runs_a_saved_plans_file_in_its_auto_row(tiny_pack, plans_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(tiny_pack),
                "--plans",
                str(plans_file),
                "--new-tokens",
                "4",
                "--repeat",
                "1",
                "--prompt-tokens",
                "40",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    document = json.loads(plans_file.read_text())
    assert set(rows) == {"monolithic", "cpu", "auto"}
    assert rows["auto"]["facts"]["budget_bytes"] == document["budget_bytes"]
    assert rows["auto"]["tokens"] == rows["cpu"]["tokens"] == rows["monolithic"]["tokens"]


def test_a_budget_ladder_is_picked_from_when_the_budget_changes(tiny_pack, budget, tmp_path, monkeypatch):
    """A game takes VRAM back: the engine switches to the ladder's plans for the new budget, no planner."""
    ladder = tmp_path / "ladder.json"
    small, large = budget, budget + 3_000_000
    assert (
        main(
            [
                "plan",
                str(tiny_pack),
                "--vram",
                f"{small},{large}",
                "--profile",
                "laptop-8gb",
                "--context",
                "256",
                "--tiers",
                "1,4,64",
                "--out",
                str(ladder),
            ]
        )
        == 0
    )
    document = json.loads(ladder.read_text())
    assert [rung["budget_bytes"] for rung in document["ladder"]] == [large, small]
    rungs = {
        rung["budget_bytes"]: {e["tier"]: e["chosen"]["placements"] for e in rung["tiers"]}
        for rung in document["ladder"]
    }
    assert rungs[large] != rungs[small]
    in_process = pipeshard.load(tiny_pack, vram=small, device="sim", profile="laptop-8gb", context=256)
    expected = in_process.generate(PROMPTS[1], max_new_tokens=16)[0].tokens
    engine = pipeshard.load(tiny_pack, device="sim", plans=ladder)
    monkeypatch.setattr(Planner, "plan_tier", lambda *a: pytest.fail("the planner was asked"))
    assert {t: p.placements for t, p in engine.step.plans.items()} == rungs[large]
    engine.generate(PROMPTS[0], max_new_tokens=4)
    engine.set_vram_budget(small + 1000)  # between the rungs: the smaller one fits
    assert engine.generate(PROMPTS[1], max_new_tokens=16)[0].tokens == expected
    assert {t: p.placements for t, p in engine.step.plans.items()} == rungs[small]
    assert engine.step.device.ledger.peak <= large
