"""Peak device memory of a VLM's vision encoder, VLMOpt against a naive port, at 480p / 720p / 1080p / 1440p.

    python examples/vision_memory.py                       # predicted, the Cosmos-Reason1-7B (Qwen2.5-VL-7B) shape
    python examples/vision_memory.py --pack PACK --measure # + a VLM pack on the simulated device's ledger
    python examples/vision_memory.py --pack PACK --measure --resolutions 480p,720p   # the sizes the CPU runs

The predictions are pipeshard/formats/vision_memory.py's. Measured: the pack runs on the simulated device, the naive
way (every vision weight resident, every score stored, the decoder's plan held) and the VLMOpt way under
`--budget` (streamed weights, tiles in runs within `--workspace`, the decoder released if the encoder needs the
room); the figure is the ledger's peak while encoding. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from pipeshard.core.units import parse_size
from pipeshard.formats.vision_memory import (
    VisionShape,
    image_patches,
    naive_peak,
    qwen2_5_vl_shape,
    vlmopt_peak,
)

RESOLUTIONS = {"480p": (640, 480), "720p": (1280, 720), "1080p": (1920, 1080), "1440p": (2560, 1440)}
# Qwen2.5-VL-7B's vision tower (Cosmos-Reason1-7B's) and its decoder's bf16 weight bytes (7.07e9 parameters).
COSMOS_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
COSMOS_DECODER_BYTES = 2 * 7_070_000_000
MIB = 1024**2


def prediction_table(
    shape: VisionShape, decoder_bytes: int, workspace: int, title: str, tiles: dict[str, int] | None = None
) -> list[str]:
    lines = [
        f"### {title}: predicted",
        "",
        f"VLMOpt's workspace bound {workspace / MIB:.0f} MiB; the decoder's weights "
        f"{decoder_bytes / MIB:,.0f} MiB (held beside the naive encoder, released before VLMOpt's)",
        "",
        "| image | patches | naive encoder | naive + decoder | VLMOpt encoder | encoder, naive / VLMOpt |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (width, height) in RESOLUTIONS.items():
        patches, keys = image_patches(shape, width, height, (tiles or {}).get(name, 0))
        naive = naive_peak(shape, patches, keys, decoder_bytes)
        vlmopt = vlmopt_peak(shape, patches, keys, workspace)
        alone = naive.total - decoder_bytes
        lines.append(
            f"| {name} ({width}x{height}) | {patches:,} | {alone / MIB:,.0f} MiB | "
            f"{naive.total / MIB:,.0f} MiB | {vlmopt.total / MIB:,.0f} MiB | {alone / vlmopt.total:.1f}x |"
        )
    return lines


def measured_table(
    pack: Path, budget: int, workspace: int, threads: int | None, resolutions: list[str]
) -> list[str]:
    import pipeshard
    from pipeshard.runtime.vision import PackVision

    lines = [
        f"### {pack.name}: measured on the simulated device's ledger (VLMOpt under a budget of "
        f"{budget / MIB:.0f} MiB, workspace bound {workspace / MIB:.0f} MiB)",
        "",
        "| image | tiles (Qwen2.5-VL: patches) | naive: device peak (decoder held) | naive: encoder | "
        "VLMOpt: device peak | VLMOpt: encoder | encoder, naive / VLMOpt |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    roomy = 64 * budget  # the naive port's device: room for everything it holds
    engine = pipeshard.load(pack, device="sim", vram=roomy, profile="laptop-8gb", threads=threads)
    step = engine.step
    naive = PackVision(step.pack, step.device, threads, naive=True)
    streamed = PackVision(
        step.pack, step.device, threads, release_decoder=step.release_device_memory, workspace_bytes=workspace
    )
    for name, path in _images().items():
        if name not in resolutions:
            continue
        engine.generate(
            "Hello", max_new_tokens=2
        )  # the decoder's plan is on the device, as in a running game
        naive.peak_device_bytes = streamed.peak_device_bytes = naive.encoder_peak_bytes = 0
        streamed.encoder_peak_bytes = 0
        engine.vision = naive
        engine.generate("Describe.", images=[path], max_new_tokens=1)
        step.set_budget(budget)
        engine.generate("Hello", max_new_tokens=2)
        engine.vision = streamed
        engine.generate("Describe.", images=[path], max_new_tokens=1)
        step.set_budget(roomy)
        lines.append(
            f"| {name} | {len(_tiles(step.pack, path))} | {naive.peak_device_bytes / MIB:,.0f} MiB | "
            f"{naive.encoder_peak_bytes / MIB:,.0f} MiB | {streamed.peak_device_bytes / MIB:,.0f} MiB | "
            f"{streamed.encoder_peak_bytes / MIB:,.0f} MiB | "
            f"{naive.encoder_peak_bytes / streamed.encoder_peak_bytes:.1f}x |"
        )
    return lines


def _images() -> dict[str, Path]:
    folder = Path(tempfile.mkdtemp(prefix="vision-memory-"))
    paths = {}
    for name, (width, height) in RESOLUTIONS.items():
        paths[name] = folder / f"{name}.png"
        rng = np.random.default_rng(0)
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(paths[name])
    return paths


def _tiles(pack, path: Path) -> list:
    from pipeshard.runtime.images import load_image, preprocess

    return list(preprocess([load_image(path)], pack.manifest.vision.preprocessing).pixel_values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pack", type=Path, default=None, help="a VLM pack (pipeshard export smolvlm-256m ...)"
    )
    parser.add_argument("--measure", action="store_true", help="run the pack on the simulated device")
    parser.add_argument(
        "--workspace", default="256MiB", help="VLMOpt's workspace bound (activations + scores)"
    )
    parser.add_argument(
        "--budget", default="768MiB", help="the simulated device's budget for VLMOpt (measured)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--resolutions", default=",".join(RESOLUTIONS), help="which of them to measure")
    args = parser.parse_args()
    workspace = parse_size(args.workspace)
    lines = prediction_table(
        qwen2_5_vl_shape(COSMOS_VISION),
        COSMOS_DECODER_BYTES,
        workspace,
        "Cosmos-Reason1-7B shape (Qwen2.5-VL-7B vision tower, bf16)",
    )
    if args.pack is not None:
        from pipeshard.formats.manifest import load_pack

        pack = load_pack(args.pack)
        tiles = {name: len(_tiles(pack, path)) for name, path in _images().items()}
        lines += [
            "",
            *prediction_table(
                VisionShape.from_pack(pack.manifest.vision),
                pack.manifest.total_weight_bytes,
                workspace,
                args.pack.name,
                tiles,
            ),
        ]
        if args.measure:
            lines += [
                "",
                *measured_table(
                    args.pack, parse_size(args.budget), workspace, args.threads, args.resolutions.split(",")
                ),
            ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
