"""The profile DB: a small real measurement validates; reference profiles load; bad DBs are clear errors."""

import copy
import json
import logging
from dataclasses import replace

import pytest

from pipeshard.cli import main
from pipeshard.core.errors import UserError
from pipeshard.formats.profile_db import ProfileDb
from pipeshard.profiles.db import (
    MAX_DB_BYTES,
    REFERENCE_PROFILES,
    load_profile,
    reference_profile_path,
    save_profile,
)
from pipeshard.profiles.measure import QUICK, measure_machine
from pipeshard.profiles.reference import reference_profile
from pipeshard.profiles.summary import summarize

TINY_SWEEP = replace(
    QUICK,
    tiers=(1, 16),
    shapes=((256, 512),),
    dtypes=("fp32",),
    attention_tokens=(1,),
    attention_contexts=(128,),
    copy_sizes=(1024 * 1024,),
    bandwidth_bytes=8 * 1024 * 1024,
    seconds_per_point=0.01,
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    document = measure_machine(TINY_SWEEP, [1], use_cuda=False)
    path = tmp_path_factory.mktemp("profile") / "db.json"
    save_profile(document, path)
    return path


def test_a_measured_db_validates_and_has_every_section(measured):
    profile = load_profile(measured)
    assert profile.source == "measured" and profile.device.kind == "sim"
    rates = profile.cpu.threads[1]
    assert [row.M for row in rates.matmul["fp32"]] == [1, 16]
    assert all(row.gflops > 0 for row in rates.matmul["fp32"] + rates.under_copy_load.matmul["fp32"])
    assert rates.memory_read_gbps > 0 and rates.hop_us > 0 and rates.attention[0].C == 128
    assert profile.link.kind == "sim-memcpy" and profile.link.h2d[0].gbps > 0
    factors = profile.contention.cpu_matmul_slowdown_under_copy[1]
    assert set(factors.by_tier) == {1, 16} and all(value > 0 for value in factors.by_tier.values())
    assert factors.memory_read > 0
    assert measured.stat().st_size < MAX_DB_BYTES


def test_a_db_reads_back_as_the_document_it_was(measured):
    """The record is the whole file: what it writes back is what it read (no field lost, none added)."""
    documents = [json.loads(measured.read_text())] + [
        json.loads(reference_profile_path(name).read_text()) for name in REFERENCE_PROFILES
    ]
    for document in documents:
        assert ProfileDb.from_json(document, "db.json").to_json() == document


@pytest.mark.parametrize("name", REFERENCE_PROFILES)
def test_reference_profiles_are_spec_current_and_summarized(name, capsys):
    shipped = json.loads(reference_profile_path(name).read_text())
    regenerated = json.loads(json.dumps(reference_profile(name)))
    assert shipped == regenerated, "regenerate: python -m pipeshard.profiles.reference"
    assert shipped["source"] == "spec" and shipped["spec"]["link"]["gbps"] > 0
    assert reference_profile_path(name).stat().st_size < MAX_DB_BYTES
    assert main(["profile", "--show", name]) == 0
    out = capsys.readouterr().out
    assert "source spec" in out and "link: pcie" in out


def test_reference_machines_cover_the_required_gpus():
    memory = {name: load_profile(name).device.memory_bytes for name in REFERENCE_PROFILES}
    assert memory == {
        "laptop-8gb": 8 * 1024**3,
        "desktop-24gb": 24 * 1024**3,
        "laptop-4gb": 4 * 1024**3,
        "desktop-rtx5090": 32 * 1024**3,
    }
    assert "x8" in load_profile("laptop-8gb").link.name and "x16" in load_profile("desktop-24gb").link.name
    paper = load_profile("desktop-rtx5090")  # the paper's machine: PCIe 5.0 x16, 16 CPU threads
    assert paper.source == "spec" and "5.0 x16" in paper.link.name and 16 in paper.cpu.threads


def test_show_summarizes_a_measured_db(measured, capsys):
    assert main(["profile", "--show", str(measured)]) == 0
    assert "contention, CPU MatMul under copy, 1 threads" in capsys.readouterr().out
    assert "sim" in summarize(load_profile(measured))


@pytest.mark.parametrize(
    "content, field",
    [
        ("{ not json", "not valid JSON"),
        ('{"schema_version": 2}', "schema_version is 2"),
        ('{"schema_version": 1, "source": "measured"}', "created is missing"),
    ],
)
def test_bad_db_is_one_error_line_naming_file_and_field(tmp_path, capsys, content, field):
    path = tmp_path / "broken.json"
    path.write_text(content)
    assert main(["profile", "--show", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "broken.json" in err[0] and field in err[0]


def test_schema_invalid_nested_field_is_named(measured, tmp_path):
    document = json.loads(measured.read_text())
    del document["cpu"]["threads"]["1"]["hop_us"]
    path = tmp_path / "nested.json"
    path.write_text(json.dumps(document))
    with pytest.raises(UserError, match=r"cpu\.threads\.1\.hop_us"):
        load_profile(path)


def _edited(document: dict, path: list, value) -> dict:
    """The document with the field at `path` set to `value` (a last element of None: the field renamed)."""
    edited = copy.deepcopy(document)
    parent = edited
    for key in path[:-2]:
        parent = parent[key]
    if path[-1] is None:  # rename parent[path[-2]] to `value`
        parent[value] = parent.pop(path[-2])
    else:
        parent[path[-2]][path[-1]] = value
    return edited


@pytest.mark.parametrize(
    "path, value, named",
    [
        (["cpu", "threads", "1", "hop_uss"], 5.0, "cpu.threads.1.hop_uss is not a known field"),
        (["cpu", "threads", "1", "op_us", None], "op_uss", "cpu.threads.1.op_uss is not a known field"),
        (["cpu", "threads", "1", "hop_us"], "fast", "cpu.threads.1.hop_us must be a finite number"),
        (["device", "launch_us", None], "launch_usec", "device.launch_usec is not a known field"),
        (["link", "h2d", 0, "pinned"], "yes", "link.h2d[0].pinned must be true or false"),
        (
            ["cpu", "threads", "1", "attention", 0, "kv_heads"],
            3,
            "attention[0].kv_heads is 3: it must divide",
        ),
        (["contention", "copy_slowdown_under_cpu_matmul"], [1.0], "copy_slowdown_under_cpu_matmul must be a"),
        (["device", "memory_bytes"], "8 GiB", "device.memory_bytes must be an integer"),
    ],
)
def test_a_misspelt_or_mistyped_field_is_one_error_line_naming_file_and_field(
    measured, tmp_path, capsys, path, value, named
):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(_edited(json.loads(measured.read_text()), path, value)))
    assert main(["profile", "--show", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(broken) in err[0] and named in err[0], err


def test_a_profile_from_another_machine_is_reported(measured, tmp_path, caplog):
    document = json.loads(measured.read_text())
    document["fingerprint"]["cpu_model"] = "Some Other CPU 9000"
    document["fingerprint_id"] = "0123456789ab"
    document["fingerprint"]["onnxruntime"] = "0.1"
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING):
        load_profile(path)
    assert "another machine" in caplog.text and "onnxruntime 0.1" in caplog.text


def test_unknown_profile_name_lists_the_known_ones(capsys):
    assert main(["profile", "--show", "gaming-rig"]) == 2
    assert "laptop-8gb" in capsys.readouterr().err


def test_threads_must_be_positive_integers(capsys):
    assert main(["profile", "--threads", "0,x"]) == 2
    assert "--threads" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_profile_finishes_within_two_minutes(tmp_path, capsys):
    import time

    started = time.perf_counter()
    assert main(["profile", "--quick", "--out", str(tmp_path / "quick.json"), "--no-cuda"]) == 0
    assert time.perf_counter() - started < 120
    path = tmp_path / "quick.json"
    assert load_profile(path).to_json() == json.loads(path.read_text())


def test_profile_with_a_pack_times_its_own_sub_layers_and_the_estimator_uses_them(tiny_pack, tmp_path):
    from pipeshard.formats.manifest import load_pack
    from pipeshard.partitioner.estimator import Estimator

    manifest = load_pack(tiny_pack).manifest
    sweep = replace(TINY_SWEEP, pack_pasts=(8, 32))
    document = measure_machine(sweep, [1], use_cuda=False, pack=str(tiny_pack))
    save_profile(document, tmp_path / "db.json")
    profile = load_profile(tmp_path / "db.json")
    assert profile.to_json() == document
    timings = profile.pack_timings
    assert timings.model_sha256 == manifest.source["model_sha256"]
    rows = timings.threads[1]
    for placement in ("cpu", "device"):  # the chain's CPU sessions, and every unit pinned on the sim device
        mine = [r for r in rows if r.placement == placement]
        assert {(r.kind, r.T, r.C) for r in mine} >= {
            ("attn", 16, 48),
            ("ffn", 1, 9),
            ("final", 64, 72),
            ("step", 1, 9),
        }
    attn = next(e for e in manifest.sub_layers if e.kind == "attn")
    exact = Estimator(profile, manifest.model, 1, manifest.source["model_sha256"])
    for placement in ("cpu", "device"):
        row, whole = (
            next(r for r in rows if (r.placement, r.kind, r.T, r.C) == (placement, kind, 16, 48))
            for kind in ("attn", "step")
        )
        # The kind's time apart, scaled by the whole step's time over its parts' (what joined runs save).
        assert exact.compute_seconds(attn, 16, 48, on_device=placement == "device") == pytest.approx(
            row.seconds * whole.ratio
        )
    # The copies of a run streaming every unit on sim (they share the cores with its compute): the rate copies
    # beside compute are charged at.
    copy = next(r for r in rows if (r.placement, r.kind, r.T) == ("streamed", "copy", 1))
    assert exact.copy_seconds(10**6, under_cpu_load=True, tokens=1) == pytest.approx(1e6 / (copy.gbps * 1e9))
    roofline = Estimator(profile, manifest.model, 1, "another model")
    assert roofline.compute_seconds(attn, 16, 48, on_device=False) != pytest.approx(row.seconds * whole.ratio)
