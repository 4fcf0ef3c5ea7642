"""The planner places each vision block (pinned, streamed or on the CPU) for an image's patch count, and the runtime
runs that placement: the CPU chain's features and tokens, never over the budget, predicted at least as fast as
VLMOpt's all-streamed encoder and the all-CPU one. Predicted against measured encode times is
examples/vision_placement.py's (a benchmark, not a timed test: docs/vlm.md has its figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import pipeshard
from pipeshard.formats.manifest import load_pack
from pipeshard.formats.vision_memory import CPU, PIN, STREAM, copy_ready, copy_sequence
from pipeshard.partitioner.planner import Planner
from pipeshard.partitioner.vision_plan import EncodeSize
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.vision import encode_prepared, encode_size, index_inputs, prepare_images


class FixedPlan:
    """A vision plan source that always answers one plan."""

    def __init__(self, plan) -> None:
        self.plan = plan

    def vision_plan(self, tiles: int, patches: int, keys: int, budget_bytes: int):
        return self.plan


@pytest.fixture(scope="module")
def vlm_pack(models) -> Path:
    return models.pack("tiny:smolvlm")


@pytest.fixture(scope="module")
def qwen_pack(models) -> Path:
    return models.pack("tiny:qwen2_5_vl")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """An image split into tiles by the tiny SmolVLM's processor (several runs when the budget is small)."""
    path = tmp_path_factory.mktemp("image") / "image.png"
    rng = np.random.default_rng(5)
    Image.fromarray((rng.random((61, 90, 3)) * 255).astype(np.uint8)).save(path)
    return path


def size_of(vision, prepared) -> EncodeSize:
    return EncodeSize(
        *encode_size(vision.shape, prepared.pixel_values, index_inputs(vision.config, prepared.grids))
    )


def test_copies_go_in_the_order_blocks_need_them_and_a_streamed_one_waits_for_its_slot():
    blob = SimpleNamespace(bytes=64)
    entries = [SimpleNamespace(name=name, blob=blob) for name in "abcde"]
    entries.insert(1, SimpleNamespace(name="weightless", blob=None))
    placements = {"a": PIN, "weightless": STREAM, "b": STREAM, "c": CPU, "d": STREAM, "e": STREAM}
    sequence = copy_sequence(entries, placements, 2)
    # the pinned block once, the streamed ones every run, the weightless one never
    assert sequence == [(0, 0), (0, 2), (0, 4), (0, 5), (1, 2), (1, 4), (1, 5)]
    # a streamed copy takes the slot of the streamed copy two before it
    assert copy_ready(sequence, placements, entries) == [None, None, None, 1, 2, 3, 4]


@pytest.mark.parametrize("which", ["smolvlm", "qwen"])
@pytest.mark.parametrize("profile", ["laptop-8gb", "laptop-4gb"])
def test_the_planned_placement_fits_and_is_never_predicted_slower_than_vlmopt_or_the_cpu(
    which, profile, vlm_pack, qwen_pack, image
):
    pack = load_pack(vlm_pack if which == "smolvlm" else qwen_pack)
    planner = Planner(pack.manifest, load_profile(profile), context=256)
    engine = pipeshard.load(pack.folder)
    prepared = prepare_images(engine.vision.config, [str(image)] * 2)
    size = size_of(engine.vision, prepared)
    largest = max(e.blob.bytes for e in pack.manifest.vision.sub_layers if e.blob)
    for budget in (3 * largest, 8 * largest, 64 * largest):
        plans = {
            p: planner.vision_plan(size.tiles, size.patches, size.keys, budget, p)
            for p in ("auto", "streamed", "cpu")
        }
        chosen = plans["auto"]
        assert chosen.peak_bytes <= budget
        assert chosen.predicted_s <= plans["cpu"].predicted_s
        assert plans["streamed"] is None or chosen.predicted_s <= plans["streamed"].predicted_s
        assert set(chosen.placements) == {e.name for e in pack.manifest.vision.sub_layers}


@pytest.mark.parametrize("which", ["smolvlm", "qwen"])
def test_the_runtime_runs_a_mixed_placement_with_the_chains_features_and_tokens(
    which, vlm_pack, qwen_pack, image
):
    pack = vlm_pack if which == "smolvlm" else qwen_pack
    chain = pipeshard.load(pack)
    engine = pipeshard.load(pack, device="sim", vram="60%", profile="laptop-8gb")
    vision, planner, budget = engine.vision, engine.step.book.source, engine.step.book.budget_bytes
    prepared = prepare_images(vision.config, [str(image)])
    size = size_of(vision, prepared)
    entries = vision.entries
    plan = planner.vision_planner.mixed(size, budget)
    assert plan is not None and set(plan.counts()) == {PIN, STREAM, CPU}
    vision.plans = FixedPlan(plan)
    features = encode_prepared(vision, prepared)
    expected = encode_prepared(chain.vision, prepared)
    np.testing.assert_allclose(features[0].features, expected[0].features, atol=1e-5)
    assert vision.last_plan is plan and 0 < vision.encoder_peak_bytes <= budget
    runs = 1 if which == "qwen" else -(-size.tiles // plan.tiles_per_run)
    blobs = {e.name: e.blob.bytes for e in entries if e.blob}
    assert vision.streamed_bytes == sum(
        nbytes * (runs if plan.placements[name] == STREAM else 1)
        for name, nbytes in blobs.items()
        if plan.placements[name] != CPU
    )
    # The decoder's tokens follow the mixed placement's features exactly as the chain's.
    (placed,) = engine.generate("What is it?", images=[str(image)], max_new_tokens=8)
    (reference,) = chain.generate("What is it?", images=[str(image)], max_new_tokens=8)
    assert placed.tokens == reference.tokens
    assert engine.step.device.ledger.peak <= budget


def test_encodes_read_each_blocks_host_bytes_once_and_the_naive_port_gives_the_chains_features(
    vlm_pack, image
):
    """The host bytes a block is uploaded from are made once per block, not per image (on cuda they are page-locked
    memory); the naive port (every weight resident) holds each block's weights in its own buffer."""
    from pipeshard.runtime.vision import PackVision

    chain = pipeshard.load(vlm_pack)
    engine = pipeshard.load(vlm_pack, device="sim", vram="60%", profile="laptop-8gb")
    prepared = prepare_images(engine.vision.config, [str(image)])
    expected = encode_prepared(chain.vision, prepared)[0].features
    naive = PackVision(engine.step.pack, engine.step.device, naive=True)
    blocks = [e for e in naive.entries if e.blob]
    host_source = engine.step.device.host_source
    for vision in (engine.vision, naive):
        made = []
        engine.step.device.host_source = lambda *where, made=made: made.append(where) or host_source(*where)
        for _ in range(2):
            np.testing.assert_allclose(encode_prepared(vision, prepared)[0].features, expected, atol=1e-5)
        assert 0 < len(made) == len(set(made)) <= len(blocks)
    assert naive.streamed_bytes == 2 * sum(e.blob.bytes for e in blocks)


def test_plan_prints_each_sizes_placement_and_encode_times(vlm_pack):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeshard",
            "plan",
            str(vlm_pack),
            "--vram",
            "25%",
            "--profile",
            "laptop-8gb",
            "--tiers",
            "1",
            "--image-size",
            "64x48,1280x720",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    placed = [line for line in done.stdout.splitlines() if line.startswith("    placed: ")]
    times = [line for line in done.stdout.splitlines() if line.startswith("    encode predicted: ")]
    assert len(placed) == len(times) == 2
    for line in times:
        seconds = [float(part.split()[-2]) for part in line.split(": ", 1)[1].split(", ")]
        assert len(seconds) == 3 and seconds[0] <= min(seconds[1:])
