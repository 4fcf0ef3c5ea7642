"""Device memory of a VLM's vision encoder for one image, VLMOpt against a naive port, from the tower's shape alone.

The naive port (what a plain offload of the vision model does) keeps every vision weight on the device, computes
each attention's full scores (heads x queries x keys, fp32) and starts the decoder while the encoder's memory is
still held. VLMOpt (the paper's three parts): the weights stream through two staging slots of the largest block;
attention runs in query tiles of budget / (4 x heads x keys) queries (at least 64, a multiple of 64) so the scores
never exceed the workspace bound; the encoder's memory is released before the decoder's prefill, so the peak is
the larger of the two. Idefics3 towers attend within a tile (keys = patches per tile; tiles run in batches that
fit); Qwen2.5-VL towers attend within windows in most blocks and over the whole image in a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeshard.formats.manifest import WEIGHT_ALIGNMENT
from pipeshard.formats.plans import Placement

if TYPE_CHECKING:
    from pipeshard.formats.manifest import VisionSection

# a vision block's placements
PIN, STREAM, CPU = Placement.PINNED.value, Placement.STREAMED.value, Placement.CPU.value
SCORE_BYTES = 4  # attention scores and softmax in fp32
QUERY_TILE_STEP = 64


@dataclass(frozen=True)
class VisionShape:
    """What the estimate needs of a vision tower."""

    family: str  # "idefics3", "llava" (fixed-size images, as tiles) or "qwen2_vl"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    patch_size: int
    weight_bytes: int  # the whole tower's
    largest_block_bytes: int  # the largest streamed block's blob, alignment included (a staging slot)
    itemsize: int  # bytes per activation element
    tile_size: int = 0  # idefics3, llava: a tile's (an image's) side in pixels
    merge_size: int = 1  # qwen2_vl: patches merged per side
    window_patches: int = 0  # qwen2_vl: patches per side of an attention window
    full_attention_layers: int = 0  # qwen2_vl: blocks that attend over the whole image

    @classmethod
    def from_pack(cls, vision: VisionSection) -> VisionShape:
        """The shape of a pack's `vision` section (partitioner/partition.py)."""
        weights = [w for e in vision.sub_layers for w in e.weights]
        facts = vision.facts
        # Activations in the weights' type: half when most weight bytes are (a half-precision trace keeps its norm
        # weights in fp32, folded from their casts).
        half = sum(w.bytes for w in weights if w.dtype in ("float16", "bfloat16"))
        return cls(
            family=facts["family"],
            hidden_size=facts["hidden_size"],
            intermediate_size=facts["intermediate_size"],
            num_heads=facts["num_attention_heads"],
            num_layers=facts["num_layers"],
            patch_size=facts["patch_size"],
            weight_bytes=vision.total_weight_bytes,
            largest_block_bytes=max(e.blob.bytes if e.blob else 0 for e in vision.sub_layers),
            itemsize=2 if 2 * half > sum(w.bytes for w in weights) else 4,
            tile_size=facts.get("image_size", 0),
            merge_size=facts.get("merge_size", 1),
            window_patches=(facts.get("window_size") or 0) // facts["patch_size"],
            full_attention_layers=len(facts.get("fullatt_block_indexes", ())),
        )


@dataclass(frozen=True)
class VisionPeak:
    """Device bytes at the encoder's peak, by what holds them."""

    weights: int
    activations: int
    attention: int
    decoder: int  # the decoder's memory held at the same time (0: released first)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention + self.decoder


def _activations(shape: VisionShape, tokens: int) -> int:
    """The residual stream in and out and the widest intermediate, for `tokens` patches at once."""
    hidden = shape.hidden_size
    return tokens * (2 * hidden + max(3 * hidden, shape.intermediate_size)) * shape.itemsize


def query_tile(workspace_bytes: int, heads: int, keys: int) -> int:
    """The paper's artifact: budget / (4 x heads x keys) queries, at least 64, a multiple of 64."""
    tile = workspace_bytes // (SCORE_BYTES * heads * keys)
    return max(QUERY_TILE_STEP, tile // QUERY_TILE_STEP * QUERY_TILE_STEP)


def image_patches(shape: VisionShape, width: int, height: int, tiles: int = 0) -> tuple[int, int]:
    """(patches the tower sees, patches per attention group at its widest): for idefics3, `tiles` tiles (the
    preprocessing's count, global view included) of patches per tile; for qwen2_vl the image of width x height
    resized to multiples of patch x merge."""
    if shape.family != "qwen2_vl":  # idefics3 tiles, llava images
        per_tile = (shape.tile_size // shape.patch_size) ** 2
        return tiles * per_tile, per_tile
    unit = shape.patch_size * shape.merge_size
    patches = (
        max(unit, round(width / unit) * unit)
        // shape.patch_size
        * (max(unit, round(height / unit) * unit) // shape.patch_size)
    )
    return patches, patches if shape.full_attention_layers else shape.window_patches**2


def naive_workspace(shape: VisionShape, patches: int, keys: int) -> int:
    """Activations and every attention score of `patches` patches in groups of `keys` that attend together."""
    return _activations(shape, patches) + shape.num_heads * patches * keys * SCORE_BYTES


def naive_peak(shape: VisionShape, patches: int, keys: int, decoder_bytes: int) -> VisionPeak:
    """Everything resident, every score stored (groups of `keys` patches attending together), the decoder
    already loaded."""
    activations = _activations(shape, patches)
    return VisionPeak(
        shape.weight_bytes, activations, naive_workspace(shape, patches, keys) - activations, decoder_bytes
    )


def tile_runs(shape: VisionShape, tiles: int, workspace_bytes: int) -> tuple[int, int]:
    """idefics3: how many tiles go through at once, and the bytes their activations and (query-tiled) scores take
    within `workspace_bytes` (one tile at least, whatever it takes)."""
    keys = (shape.tile_size // shape.patch_size) ** 2
    queries = min(keys, query_tile(workspace_bytes, shape.num_heads, keys))
    per_tile = _activations(shape, keys) + shape.num_heads * queries * keys * SCORE_BYTES
    per_run = max(1, min(tiles, workspace_bytes // per_tile))
    return per_run, per_run * per_tile


def vlmopt_peak(shape: VisionShape, patches: int, keys: int, workspace_bytes: int) -> VisionPeak:
    """Streamed weights, query-tiled attention within `workspace_bytes`, the decoder released first."""
    if shape.family != "qwen2_vl":  # idefics3 tiles, llava images
        per_run, reserved = tile_runs(shape, patches // keys, workspace_bytes)
        activations = _activations(shape, per_run * keys)
        return VisionPeak(2 * shape.largest_block_bytes, activations, reserved - activations, 0)
    # Every patch's activations at once (the full-attention blocks see them all); the scores' query tiles take
    # what the bound leaves beside them.
    activations = _activations(shape, patches)
    queries = min(keys, query_tile(max(workspace_bytes - activations, 0), shape.num_heads, keys))
    return VisionPeak(
        2 * shape.largest_block_bytes, activations, shape.num_heads * queries * keys * SCORE_BYTES, 0
    )


def qwen2_5_vl_shape(vision: dict, itemsize: int = 2) -> VisionShape:
    """A Qwen2.5-VL vision tower's shape from its config (`vision_config`), for planning without weights: blocks
    of fused qkv + projection and a gated FFN, the patch embedding and the merger counted from the dimensions."""
    hidden, inter = vision["hidden_size"], vision["intermediate_size"]
    attention = 4 * hidden * hidden + 4 * hidden
    ffn = 3 * hidden * inter + 2 * inter + hidden
    norms = 2 * hidden
    merged = hidden * vision.get("spatial_merge_size", 2) ** 2
    merger = merged * merged + merged * vision["out_hidden_size"] + merged + vision["out_hidden_size"]
    patch = (
        vision.get("in_channels", 3)
        * vision.get("temporal_patch_size", 2)
        * vision["patch_size"] ** 2
        * hidden
    )
    blocks = vision["depth"] * (attention + ffn + norms)
    return VisionShape(
        family="qwen2_vl",
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=vision["num_heads"],
        num_layers=vision["depth"],
        patch_size=vision["patch_size"],
        weight_bytes=(blocks + merger + patch) * itemsize,
        largest_block_bytes=max(attention, ffn, merger) * itemsize,
        itemsize=itemsize,
        merge_size=vision.get("spatial_merge_size", 2),
        window_patches=vision["window_size"] // vision["patch_size"],
        full_attention_layers=len(vision.get("fullatt_block_indexes", [])),
    )


def encoder_workspace(shape: VisionShape, tiles: int, patches: int, keys: int, free: int) -> tuple[int, int]:
    """(tiles per run, bytes reserved) of the encoder's activations and attention within `free` bytes: idefics3
    tiles in runs that fit; qwen2_vl every patch in one run (its full-attention blocks see them all), the scores'
    query tiles taking what the activations leave."""
    if shape.family != "qwen2_vl":
        return tile_runs(shape, tiles, free)
    peak = vlmopt_peak(shape, patches, keys, free)
    return max(tiles, 1), peak.activations + peak.attention


@dataclass(frozen=True)
class VisionPlan:
    """How the encoder runs images of one patch count (its tier): each block pinned (uploaded once per encode and
    held until it ends), streamed (through two staging slots) or on the CPU; the tiles per run, the slot, pinned
    and workspace bytes; the planner's predicted seconds (0 when no planner priced it). Every byte is released
    when the encode ends, before the decoder's prefill (VLMOpt: vision and decoder weights never held together)."""

    policy: str  # "auto" (the planner's choice), "streamed" (VLMOpt: every block streamed), "cpu"
    patches: int
    placements: dict[str, str]
    tiles_per_run: int
    slot_bytes: int
    pinned_bytes: int
    workspace_bytes: int
    predicted_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """Device bytes the encode holds at once."""
        return self.pinned_bytes + 2 * self.slot_bytes + self.workspace_bytes

    def counts(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for placement in self.placements.values():
            counted[placement] = counted.get(placement, 0) + 1
        return counted


def resident_bytes(entry) -> int:
    """A block's room in a device buffer: its blob, to the weights' alignment."""
    nbytes = entry.blob.bytes if entry.blob else 0
    return -(-nbytes // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT


def lay_out_plan(
    vision: VisionSection,
    placements: dict[str, str],
    tiles: int,
    patches: int,
    keys: int,
    budget_bytes: int,
    policy: str,
    shape: VisionShape | None = None,
) -> VisionPlan | None:
    """The memory of `placements` for an encode of `tiles` tiles / `patches` patches (groups of `keys` attending
    together) within `budget_bytes` (`shape`: the section's, when the caller has it): the pinned blocks' buffers,
    two slots of the largest streamed block, and the workspace of the runs that fit what is left; None when one
    run does not fit."""
    shape = shape or VisionShape.from_pack(vision)
    entries = vision.sub_layers
    pinned = sum(resident_bytes(e) for e in entries if placements[e.name] == PIN)
    slot = max((e.blob.bytes for e in entries if placements[e.name] == STREAM and e.blob), default=0)
    if all(placements[e.name] == CPU for e in entries):
        return VisionPlan(policy, patches, dict(placements), max(tiles, 1), 0, 0, 0)
    free = budget_bytes - pinned - 2 * slot
    if free <= 0:
        return None
    per_run, workspace = encoder_workspace(shape, tiles, patches, keys, free)
    if workspace > free:
        return None
    return VisionPlan(policy, patches, dict(placements), per_run, slot, pinned, workspace)


def copy_sequence(entries, placements: dict[str, str], passes: int) -> list[tuple[int, int]]:
    """The encode's weight copies in the order the runtime issues them: (pass, block index) of every pinned block
    in the first pass and every streamed block in every pass, the blocks without weights left out."""
    return [
        (run, index)
        for run in range(passes)
        for index, entry in enumerate(entries)
        if entry.blob and (placements[entry.name] == STREAM or (placements[entry.name] == PIN and run == 0))
    ]


def copy_ready(sequence: list[tuple[int, int]], placements: dict[str, str], entries) -> list[int | None]:
    """For each copy, the position in `sequence` of the streamed copy whose slot it takes (two streamed copies
    before it), whose block must have computed first; None when it waits for nothing."""
    streamed: list[int] = []
    waits: list[int | None] = []
    for position, (_, index) in enumerate(sequence):
        if placements[entries[index].name] == STREAM:
            waits.append(streamed[-2] if len(streamed) >= 2 else None)
            streamed.append(position)
        else:
            waits.append(None)
    return waits
