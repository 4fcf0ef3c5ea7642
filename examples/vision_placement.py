"""The vision encoder's placement per block: the planner's choice beside VLMOpt's all-streamed and the all-CPU encoder,
predicted and (with --measure) measured on the simulated device.

    python examples/vision_placement.py PACK --profile PROFILE [--vram 25%] [--image-size 1280x720,...]
                                        [--measure] [--repeat 3] [--threads 2]

Each row: an image size, a policy (the planner's `auto`, VLMOpt's `streamed`, `cpu`, and `mixed`: pinned, streamed
and CPU blocks in turns, a check of the estimator on every placement at once), its placement (blocks pinned /
streamed / on the CPU), the tiles per run, the device bytes it holds, the predicted encode time and, measured, the
median encode time over --repeat (after one warm-up) and the encoder's peak on the device's ledger. The decoder's
memory is released before an encode that needs it (VLMOpt), so the budget is the encoder's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from PIL import Image

import pipeshard
from pipeshard.core.units import format_bytes
from pipeshard.partitioner.vision_plan import POLICIES, EncodeSize
from pipeshard.runtime.vision import encode_prepared, encode_size, index_inputs, prepare_images


class Fixed:
    """A vision plan source that answers one plan."""

    def __init__(self, plan) -> None:
        self.plan = plan

    def vision_plan(self, tiles: int, patches: int, keys: int, budget_bytes: int):
        return self.plan


def placement_text(plan) -> str:
    counts = plan.counts()
    return " / ".join(str(counts.get(kind, 0)) for kind in ("pinned", "streamed", "cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("pack")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--vram", default="25%")
    parser.add_argument("--image-size", default="1280x720")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    engine = pipeshard.load(
        args.pack, device="sim", vram=args.vram, profile=args.profile, threads=args.threads
    )
    vision, planner = engine.vision, engine.step.book.source
    budget = engine.step.book.budget_bytes
    print(f"budget {format_bytes(budget)} for the encoder (the decoder's memory released first)\n")
    print(
        "| image | tiles | patches | policy | pinned / streamed / cpu | tiles per run | device bytes | predicted | "
        "measured | measured peak |"
    )
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for size in args.image_size.split(","):
        width, height = (int(v) for v in size.split("x"))
        prepared = prepare_images(vision.config, [Image.new("RGB", (width, height), (90, 140, 200))])
        tiles, patches, keys = encode_size(
            vision.shape, prepared.pixel_values, index_inputs(vision.config, prepared.grids)
        )
        plans = {policy: planner.vision_plan(tiles, patches, keys, budget, policy) for policy in POLICIES}
        plans["mixed"] = planner.vision_planner.mixed(EncodeSize(tiles, patches, keys), budget)
        for policy, plan in plans.items():
            if plan is None:
                print(f"| {width}x{height} | {tiles} | {patches:,} | {policy} | does not fit | | | | | |")
                continue
            measured, peak = "", ""
            if args.measure:
                vision.plans = Fixed(plan)
                encode_prepared(vision, prepared)  # warm-up: sessions made, pages read
                vision.encoder_peak_bytes = 0
                samples = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    encode_prepared(vision, prepared)
                    samples.append(time.perf_counter() - started)
                measured = f"{statistics.median(samples):.2f} s"
                peak = format_bytes(vision.encoder_peak_bytes)
            print(
                f"| {width}x{height} | {tiles} | {patches:,} | {policy} | {placement_text(plan)} | "
                f"{plan.tiles_per_run} | {format_bytes(plan.peak_bytes)} | {plan.predicted_s:.2f} s | {measured} | "
                f"{peak} |"
            )


if __name__ == "__main__":
    main()
