"""Peak device memory of a VLM's vision encoder, VLMOpt against a naive port, at 480p / 720p / 1080p / 1440p.

    python examples/vision_memory.py                       # predicted, the Cosmos-Reason1-7B (Qwen2.5-VL-7B) shape
    python examples/vision_memory.py --pack PACK --measure # + a SmolVLM pack on the simulated device's ledger

The predictions are partitioner/vision_memory.py's. Measured: the pack runs on the simulated device, the naive
way (every vision weight resident, every score stored, the decoder's plan held) and the VLMOpt way under
`--budget` (streamed weights, tiles in runs that fit, the decoder released if the encoder needs the room); the
figure is the ledger's peak while encoding. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from pipeshard.partitioner.vision_memory import (
    VisionShape,
    image_patches,
    naive_peak,
    qwen2_5_vl_shape,
    vlmopt_peak,
)
from pipeshard.units import parse_size

RESOLUTIONS = {"480p": (640, 480), "720p": (1280, 720), "1080p": (1920, 1080), "1440p": (2560, 1440)}
# Qwen2.5-VL-7B's vision tower (Cosmos-Reason1-7B's) and its decoder's bf16 weight bytes (7.07e9 parameters).
COSMOS_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
                 "fullatt_block_indexes": [7, 15, 23, 31]}
COSMOS_DECODER_BYTES = 2 * 7_070_000_000
MIB = 1024 ** 2


def prediction_table(shape: VisionShape, decoder_bytes: int, workspace: int, title: str) -> list[str]:
    lines = [f"### {title}: predicted", "",
             f"VLMOpt's attention workspace bound {workspace / MIB:.0f} MiB; the decoder's weights "
             f"{decoder_bytes / MIB:,.0f} MiB (held beside the naive encoder, released before VLMOpt's)", "",
             "| image | patches | naive encoder | naive + decoder | VLMOpt encoder | encoder, naive / VLMOpt |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (width, height) in RESOLUTIONS.items():
        naive = naive_peak(shape, width, height, decoder_bytes)
        vlmopt = vlmopt_peak(shape, width, height, workspace)
        alone = naive.total - decoder_bytes
        lines.append(f"| {name} ({width}x{height}) | {image_patches(shape, width, height)[0]:,} | "
                     f"{alone / MIB:,.0f} MiB | {naive.total / MIB:,.0f} MiB | {vlmopt.total / MIB:,.0f} MiB | "
                     f"{alone / vlmopt.total:.1f}x |")
    return lines


def measured_table(pack: Path, budget: int, threads: int | None) -> list[str]:
    import pipeshard
    from pipeshard.runtime.pack import load_pack
    from pipeshard.runtime.vision import PackVision

    manifest = load_pack(pack).manifest
    shape = VisionShape.from_pack(manifest["vision"])
    lines = [f"### {pack.name}: measured on the simulated device's ledger (budget {budget / MIB:.0f} MiB)", "",
             "| image | tiles | naive (decoder held) | VLMOpt | naive / VLMOpt | predicted naive / VLMOpt |",
             "|---|---:|---:|---:|---:|---:|"]
    engine = pipeshard.load(pack, device="sim", vram=budget * 8, profile="laptop-8gb", threads=threads)
    engine.generate("Hello", max_new_tokens=2)  # the decoder's plan is on the device, as in a running game
    step = engine.step
    naive = PackVision(step.pack, step.device, threads, naive=True)
    with tempfile.TemporaryDirectory() as folder:
        for name, (width, height) in RESOLUTIONS.items():
            path = Path(folder) / f"{name}.png"
            rng = np.random.default_rng(0)
            Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(path)
            naive.peak_device_bytes = 0
            engine.vision = naive
            engine.generate("Describe.", images=[path], max_new_tokens=1)
            naive_bytes = naive.peak_device_bytes
            step.set_budget(budget)
            streamed = PackVision(step.pack, step.device, threads, release_decoder=step.release_device_memory)
            engine.vision = streamed
            engine.generate("Describe.", images=[path], max_new_tokens=1)
            step.set_budget(budget * 8)
            tiles = len(_tiles(step.pack, path))
            predicted = (naive_peak(shape, width, height, 0).total /
                         vlmopt_peak(shape, width, height, budget - 2 * shape.largest_block_bytes).total)
            lines.append(f"| {name} | {tiles} | {naive_bytes / MIB:,.0f} MiB | "
                         f"{streamed.peak_device_bytes / MIB:,.0f} MiB | "
                         f"{naive_bytes / streamed.peak_device_bytes:.1f}x | {predicted:.1f}x |")
    return lines


def _tiles(pack, path: Path) -> list:
    from pipeshard.runtime.images import load_image, preprocess

    return list(preprocess([load_image(path)], pack.manifest["vision"]["preprocessing"]).pixel_values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, default=None, help="a VLM pack (pipeshard export smolvlm-256m ...)")
    parser.add_argument("--measure", action="store_true", help="run the pack on the simulated device")
    parser.add_argument("--workspace", default="512MiB", help="VLMOpt's attention workspace bound (predicted)")
    parser.add_argument("--budget", default="256MiB", help="the simulated device's budget for VLMOpt (measured)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    workspace = parse_size(args.workspace)
    lines = prediction_table(qwen2_5_vl_shape(COSMOS_VISION), COSMOS_DECODER_BYTES, workspace,
                             "Cosmos-Reason1-7B shape (Qwen2.5-VL-7B vision tower, bf16)")
    if args.pack is not None:
        from pipeshard.runtime.pack import load_pack

        manifest = load_pack(args.pack).manifest
        lines += ["", *prediction_table(VisionShape.from_pack(manifest["vision"]), manifest["total_weight_bytes"],
                                        workspace, args.pack.name)]
        if args.measure:
            lines += ["", *measured_table(args.pack, parse_size(args.budget), args.threads)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
