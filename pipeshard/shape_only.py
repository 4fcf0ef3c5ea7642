"""`pipeshard export MODEL OUT --shape-only`: a model pack from a config alone, for planning. The exporter
traces a probe of a few layers on the meta device, the partitioner cuts it, and its last layer (its last expert,
a vision tower's windowed and full-attention blocks) is repeated to the model's counts (docs/model-pack.md,
"Shape-only packs")."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pipeshard.core.fsutil import atomic_output_dir, check_output_dir, read_json, write_json_atomic
from pipeshard.exporter.shape_only import GGUF_FORMATS, PROBE_LAYERS, expert_count, trace_shape_probe
from pipeshard.formats.manifest import MANIFEST_NAME, Manifest
from pipeshard.partitioner.partition import partition
from pipeshard.partitioner.repeat import repeat_experts, repeat_layers, repeat_vision_blocks


@dataclass
class ShapeOnlyResult:
    """What a shape-only export wrote."""

    pack: Path
    sub_layers: int
    weight_bytes: int
    seconds: float


def export_shape_only(
    model: str,
    out: Path,
    dtype: str = "fp16",
    force: bool = False,
    probe_layers: int = PROBE_LAYERS,
    attention_dtype: str | None = None,
) -> ShapeOnlyResult:
    """Write the shape-only pack of MODEL's config to OUT (atomically): manifest.json and config.json. `dtype`:
    fp32, fp16, or a GGUF format (q4_0 ... q6_k: the pack a GGUF of that format exports to, exporter/shape_only.py);
    `attention_dtype` fp16: a float32 pack's attention and KV cache in float16, as a GPU's export has them."""
    out = Path(out)
    check_output_dir(out, force)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipeshard-shape-only-") as scratch:
        export_dir, probe_pack = Path(scratch) / "export", Path(scratch) / "pack"
        export_dir.mkdir()
        traced = trace_shape_probe(model, dtype, export_dir, probe_layers, attention_dtype)
        config, vision = getattr(traced, "text_config", traced), getattr(traced, "vision_config", None)
        partition(export_dir, probe_pack)
        probe_manifest = probe_pack / MANIFEST_NAME
        manifest = Manifest.from_json(read_json(probe_manifest, "model pack"), str(probe_manifest))
        experts = expert_count(config)
        if experts:
            manifest = repeat_experts(manifest, experts)
        manifest = repeat_layers(manifest, config.num_hidden_layers)
        if vision is not None:
            tower = repeat_vision_blocks(manifest.vision, vision.depth, list(vision.fullatt_block_indexes))
            manifest = replace(manifest, vision=tower)
        source = {"config": model, "shape_only": True}
        if dtype in GGUF_FORMATS:
            source["format"] = GGUF_FORMATS[dtype]
        manifest = replace(manifest, source=source)
        with atomic_output_dir(out, force) as staging:
            config.save_pretrained(staging)
            write_json_atomic(staging / MANIFEST_NAME, manifest.to_json())
    return ShapeOnlyResult(
        out, len(manifest.sub_layers), manifest.total_weight_bytes, time.perf_counter() - started
    )
