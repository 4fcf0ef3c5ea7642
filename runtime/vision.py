"""Image features for a VLM: the prompt's images preprocessed, run through the vision graph, and the prompt's
image placeholders expanded into the image tokens those features fill.

An export folder runs its `vision.onnx` as one session. A pack runs its vision blocks one after another: on the
CPU from the mapped blobs, or on a device as a vision plan places each block (the planner's, for the encode's
patch count; without a planner VLMOpt's, every block streamed): pinned blocks uploaded once per encode into one
buffer, streamed ones from host memory through two staging slots while the blocks before compute, the rest on
the CPU; the tiles go through in runs whose activations and attention workspace fit the budget; and every byte
is released before the decoder's prefill (the decoder's memory released first when both do not fit), so vision
and decoder weights are never resident together and peak device memory is the larger of the two, not their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from pipeshard.core.errors import UserError
from pipeshard.formats.export_info import NUMPY_DTYPES, ExportInfo, numpy_dtype
from pipeshard.formats.image_preprocessing import ImagePreprocessing
from pipeshard.formats.manifest import Pack, SubLayer
from pipeshard.formats.vision_inputs import qwen2_5_vl_vision_inputs
from pipeshard.formats.vision_memory import (
    CPU,
    PIN,
    STREAM,
    VisionPlan,
    VisionShape,
    copy_ready,
    copy_sequence,
    lay_out_plan,
    naive_workspace,
    resident_bytes,
)
from pipeshard.runtime import capi
from pipeshard.runtime.devices import DeviceKind
from pipeshard.runtime.images import expand_image_tokens, image_placeholder, load_image, preprocess
from pipeshard.runtime.stages import device_session

PIXEL_VALUES, IMAGE_FEATURES = "pixel_values", "image_features"
WEIGHTS, WORKSPACE = "vision weights", "vision workspace"


@dataclass
class EncodedImage:
    """One image as the decoder takes it: its run of image tokens in the prompt, and their features."""

    tokens: str
    features: np.ndarray
    grid_thw: np.ndarray | None = None  # qwen2_vl: int64 [3], the image's patches along t, h, w


def with_placeholders(prompt: str, count: int, config: ImagePreprocessing) -> str:
    """The prompt with one placeholder per image: as written where it has them, else all before the text (where
    the chat templates of these models put images)."""
    placeholder = image_placeholder(config)
    written = prompt.count(config.image_token)
    if written == 0:
        return placeholder * count + prompt
    if written != count:
        raise UserError(
            f"the prompt has {written} image placeholder(s) {config.image_token!r} but {count} "
            "image(s) were given"
        )
    return prompt


def expand_prompt(text: str, runs: list[str], config: ImagePreprocessing) -> str:
    """`text` (rendered, its placeholders in image order) with each placeholder replaced by its image's token run."""
    pieces = text.split(config.image_token)
    if len(pieces) - 1 != len(runs):
        raise UserError(f"the prompt has {len(pieces) - 1} image placeholder(s) but {len(runs)} image(s)")
    expanded = [pieces[0]]
    for run, piece in zip(runs, pieces[1:], strict=True):
        expanded += [run, piece]
    return "".join(expanded)


def open_images(images: list) -> list[Image.Image]:
    """Paths or PIL images, as RGB PIL images (a bad path is one UserError)."""
    return [load_image(image) if not isinstance(image, Image.Image) else image for image in images]


class ExportVision:
    """An export folder's vision graph as one ONNX Runtime session."""

    def __init__(self, folder: Path, info: ExportInfo, threads: int | None = None) -> None:
        if info.vision is None or info.vision.preprocessing is None:
            raise UserError(f"{folder}: export.json has no vision section with its preprocessing")
        self.description = info.vision
        self.config = info.vision.preprocessing
        self._rt = capi.runtime(threads)
        self._session = self._rt.session(Path(folder) / info.vision.file, threads)
        self._run_options = self._rt.run_options()

    def encode(self, pixel_values: np.ndarray, grid_thw: np.ndarray | None = None) -> np.ndarray:
        binding = self._session.binding()
        binding.bind_input(PIXEL_VALUES, np.ascontiguousarray(pixel_values, np.float32))
        for name, value in index_inputs(self.config, grid_thw).items():
            binding.bind_input(name, value)
        binding.bind_output_to_cpu(IMAGE_FEATURES)
        capi.run(self._session, binding, self._run_options)
        return binding.outputs()[0].numpy()


class VisionPlans(Protocol):
    """What the encoder asks of whoever places its blocks (the planner satisfies it)."""

    def vision_plan(self, tiles: int, patches: int, keys: int, budget_bytes: int) -> VisionPlan:
        """The placement of every vision block for an encode of `tiles` tiles (Qwen2.5-VL: images) and `patches`
        patches in groups of at most `keys` that attend together, within `budget_bytes`."""


class PackVision:
    """A pack's vision blocks, on the CPU (a `DeviceKind.CPU` device) or on the device as a vision plan places them
    (`plans`: the planner; without one, VLMOpt's: every block streamed), or with `naive` as a plain port does it
    (every weight resident, every score stored, the decoder kept), for comparing their peak device memory on the
    simulated device."""

    def __init__(
        self,
        pack: Pack,
        device,
        threads: int | None = None,
        release_decoder=None,
        naive: bool = False,
        workspace_bytes: int | None = None,
        plans: VisionPlans | None = None,
    ) -> None:
        """`workspace_bytes`: the most VLMOpt's activations and attention take at once (default: whatever the
        budget leaves); a planner's plans say their own."""
        self.pack = pack
        self.description = vision = pack.manifest.vision
        if vision.preprocessing is None:
            raise UserError(f"{pack.folder}: the manifest's vision section has no preprocessing")
        self.config = vision.preprocessing
        self.entries = vision.sub_layers
        self.shape = VisionShape.from_pack(vision)
        self.device = device
        self.release_decoder = release_decoder  # frees the decoder's device memory when the encoder needs it
        self.naive = naive
        self.workspace_bytes = workspace_bytes
        self.plans = plans
        self.last_plan: VisionPlan | None = None  # the plan the last encode on the device ran
        self._rt = capi.runtime(threads)
        self._threads = threads
        self._run_options = self._rt.run_options()
        self._sessions: dict[tuple[str, bool], capi.Session] = {}
        self.peak_device_bytes = 0  # the ledger's peak while encoding, over every encode
        self.encoder_peak_bytes = 0  # the same, less what the decoder held meanwhile
        self._held = self._peak_before_release = 0
        self.streamed_bytes = 0
        self.dtype = NUMPY_DTYPES[pack.model.dtype]
        self._indices: dict[str, np.ndarray] = {}  # qwen2_vl: the window order, rotary ids and groups
        self._sources: dict[
            str, object
        ] = {}  # a block's host bytes as the device uploads them (device.host_source)

    @property
    def on_device(self) -> bool:
        return self.device.kind != DeviceKind.CPU

    def _session(self, entry: SubLayer, on_device: bool) -> capi.Session:
        if (entry.name, on_device) not in self._sessions:
            if on_device:
                session = device_session(
                    self._rt,
                    self.device,
                    self.pack.path(entry.weights_as_inputs_file),
                    entry.name,
                    self._threads,
                )
            else:
                session = self._rt.session(self.pack.path(entry.graph_file), self._threads)
            self._sessions[entry.name, on_device] = session
        return self._sessions[entry.name, on_device]

    def encode(self, pixel_values: np.ndarray, grid_thw: np.ndarray | None = None) -> np.ndarray:
        """Image features of the tiles (idefics3) or patches of images of `grid_thw` (qwen2_vl)."""
        pixel_values = np.ascontiguousarray(pixel_values, self.dtype)
        self._indices = index_inputs(self.config, grid_thw)
        if not self.on_device:
            return self._run_all(pixel_values, None)
        ledger = self.device.ledger
        started_peak, ledger.peak = ledger.peak, ledger.used
        self._held, self._peak_before_release = ledger.used, 0
        try:
            return self._encode_naive(pixel_values) if self.naive else self._encode_placed(pixel_values)
        finally:
            self.peak_device_bytes = max(self.peak_device_bytes, ledger.peak, self._peak_before_release)
            # What the encoder itself took: above what the decoder held meanwhile.
            self.encoder_peak_bytes = max(self.encoder_peak_bytes, ledger.peak - self._held)
            ledger.peak = max(started_peak, ledger.peak, self._peak_before_release)

    def _plan(self, tiles: int, patches: int, keys: int, budget_bytes: int) -> VisionPlan | None:
        """The planner's plan within the budget, else VLMOpt's within `budget_bytes` (and the workspace bound)."""
        if self.plans is not None:
            return self.plans.vision_plan(tiles, patches, keys, self.device.ledger.budget_bytes)
        if self.workspace_bytes is not None:
            budget_bytes = min(budget_bytes, 2 * self.shape.largest_block_bytes + self.workspace_bytes)
        placements = {entry.name: STREAM for entry in self.entries}
        return lay_out_plan(
            self.description, placements, tiles, patches, keys, budget_bytes, "streamed", self.shape
        )

    def _encode_placed(self, pixel_values: np.ndarray) -> np.ndarray:
        """The plan's placement: pinned blocks uploaded once into one buffer, streamed ones through two slots, the
        rest on the CPU, the tiles in the plan's runs; the decoder's memory released first when both do not fit."""
        ledger = self.device.ledger
        tiles, patches, keys = encode_size(self.shape, pixel_values, self._indices)
        plan = self._plan(tiles, patches, keys, ledger.budget_bytes - ledger.used)
        if (plan is None or ledger.used + plan.peak_bytes > ledger.budget_bytes) and self.release_decoder:
            self._peak_before_release = ledger.peak
            self.release_decoder()  # the decoder's plan comes back at its next step
            self._held = ledger.peak = ledger.used
            plan = plan or self._plan(tiles, patches, keys, ledger.budget_bytes - ledger.used)
        if plan is None or ledger.used + plan.peak_bytes > ledger.budget_bytes:
            raise UserError(
                f"the VRAM budget leaves {max(ledger.budget_bytes - ledger.used, 0)} bytes for the vision encoder, "
                f"less than one tile needs with its weights streamed"
            )
        self.last_plan = plan
        pinned = {
            entry.name: self.device.alloc(resident_bytes(entry), WEIGHTS)
            for entry in self.entries
            if plan.placements[entry.name] == PIN and entry.blob
        }
        slots = [self.device.alloc(plan.slot_bytes, WEIGHTS) for _ in range(2)] if plan.slot_bytes else []
        self.device.reserve(plan.workspace_bytes, WORKSPACE)
        try:
            return self._run_placed(pixel_values, plan, pinned, slots)
        finally:
            self.device.unreserve(plan.workspace_bytes, WORKSPACE)
            for buffer in [*slots, *pinned.values()]:
                self.device.free(buffer, WEIGHTS)

    def _run_placed(
        self, pixel_values: np.ndarray, plan: VisionPlan, pinned: dict, slots: list
    ) -> np.ndarray:
        """Every block over each run of tiles where the plan puts it. The copies go in one queue in the order the
        blocks need them (formats/vision_memory.py `copy_sequence`); a streamed copy is issued once the streamed
        block two before it, whose slot it takes, has computed."""
        entries, placements = self.entries, plan.placements
        per_run = len(pixel_values) if self.shape.family == "qwen2_vl" else plan.tiles_per_run
        starts = range(0, len(pixel_values), per_run)
        sequence = copy_sequence(entries, placements, len(starts))
        waits = copy_ready(sequence, placements, entries)
        where, streamed = [], 0  # each copy's buffer: a pinned block's own, or the slot of a streamed one
        for _, index in sequence:
            name = entries[index].name
            if placements[name] == PIN:
                where.append(pinned[name])
            else:
                where.append(slots[streamed % 2])
                streamed += 1
        position_of = {copy: position for position, copy in enumerate(sequence)}
        copies: list = []
        computed: set[int] = set()

        def issue() -> None:
            while len(copies) < len(sequence) and (
                waits[len(copies)] is None or waits[len(copies)] in computed
            ):
                copies.append(self._upload(entries[sequence[len(copies)][1]], where[len(copies)]))

        issue()
        features = []
        for run, first in enumerate(starts):
            values: dict[str, object] = {PIXEL_VALUES: pixel_values[first : first + per_run], **self._indices}
            for index, entry in enumerate(entries):
                placement = placements[entry.name]
                position = position_of.get((run, index), position_of.get((0, index)))
                if placement == CPU or not entry.blob:
                    self._run_block(entry, values, placement != CPU)
                    continue
                copies[position].result()
                self._run_block(entry, values, True, where[position])
                computed.add(position)
                issue()
            features.append(values[IMAGE_FEATURES].numpy())
        return np.concatenate(features)

    def _encode_naive(self, pixel_values: np.ndarray) -> np.ndarray:
        """Every weight uploaded and resident, every tile at once with all its scores."""
        if self.shape.family == "qwen2_vl":
            reserved = naive_workspace(
                self.shape, len(pixel_values), int(self._indices["image_rows"].shape[1])
            )
        else:
            keys = (self.shape.tile_size // self.shape.patch_size) ** 2
            reserved = naive_workspace(self.shape, len(pixel_values) * keys, keys)
        weights = {
            entry.name: self.device.alloc(resident_bytes(entry), WEIGHTS)
            for entry in self.entries
            if entry.blob
        }
        self.device.reserve(reserved, WORKSPACE)
        try:
            for entry in self.entries:
                if entry.blob:
                    self._upload(entry, weights[entry.name]).result()
            return self._run_all(pixel_values, weights)
        finally:
            self.device.unreserve(reserved, WORKSPACE)
            for buffer in weights.values():
                self.device.free(buffer, WEIGHTS)

    def _upload(self, entry: SubLayer, slot):
        """Copy a block's weights into `slot` from the host bytes the device keeps for it (made once: on cuda
        they are page-locked memory, which must not be allocated per image)."""
        if entry.name not in self._sources:
            blob = entry.blob
            self._sources[entry.name] = self.device.host_source(self.pack.path(blob.file), 0, blob.bytes)
        self.streamed_bytes += entry.blob.bytes
        return self.device.upload(slot, self._sources[entry.name])

    def _run_all(self, pixel_values: np.ndarray, resident: dict | None) -> np.ndarray:
        """Every block over these tiles: on the CPU, or on the device reading each block's `resident` buffer."""
        values: dict[str, object] = {PIXEL_VALUES: pixel_values, **self._indices}
        for entry in self.entries:
            self._run_block(
                entry, values, resident is not None, None if resident is None else resident.get(entry.name)
            )
        return values[IMAGE_FEATURES].numpy()

    def _run_block(self, entry: SubLayer, values: dict, on_device: bool, buffer=None) -> None:
        """One block over `values` (its outputs added to them), its weights in `buffer` on the device."""
        session = self._session(entry, on_device)
        binding = session.binding()
        if on_device and entry.weights:
            self._bind_weights(binding, entry, buffer)
        for tensor in entry.inputs:
            value = values[tensor.name]
            if isinstance(value, np.ndarray):
                binding.bind_input(tensor.name, value)
            else:
                binding.bind_value_input(tensor.name, value)
        for tensor in entry.outputs:
            binding.bind_output_to_cpu(tensor.name)
        capi.run(session, binding, self._run_options)
        for tensor, value in zip(entry.outputs, binding.outputs(), strict=True):
            values[tensor.name] = value

    def _bind_weights(self, binding: capi.Binding, entry: SubLayer, buffer) -> None:
        memory = self.device.memory_info(self._rt)
        for weight in entry.weights:
            binding.bind_input_at(
                weight.name,
                memory,
                self.device.address(buffer) + weight.offset,
                numpy_dtype(weight.dtype),
                weight.shape,
                buffer,
            )


@dataclass
class PreparedImages:
    """Images preprocessed, not yet encoded: each one's token run, and all their tiles for one encoder run."""

    tokens: list[str]
    pixel_values: np.ndarray
    counts: list[int]  # image tokens (feature rows) per image
    grids: np.ndarray | None = None  # qwen2_vl: int64 [images, 3]


def prepare_images(config: ImagePreprocessing, images: list) -> PreparedImages:
    """Preprocess `images` (paths or PIL images) under a pack's preprocessing config."""
    prepared = [preprocess([image], config) for image in open_images(images)]
    grids = [inputs.image_grid_thw for inputs in prepared if inputs.image_grid_thw is not None]
    return PreparedImages(
        [expand_image_tokens(config.image_token, inputs, config) for inputs in prepared],
        np.concatenate([inputs.pixel_values for inputs in prepared]),
        [inputs.image_tokens[0] for inputs in prepared],
        np.concatenate(grids) if grids else None,
    )


def encode_prepared(encoder, prepared: PreparedImages) -> list[EncodedImage]:
    """Run prepared images' tiles through the encoder in one go."""
    features = encoder.encode(prepared.pixel_values, prepared.grids)
    if len(features) != sum(prepared.counts):
        raise RuntimeError(
            f"the vision graph gave {len(features)} feature rows for {sum(prepared.counts)} image tokens"
        )
    edges = np.cumsum([0, *prepared.counts])
    grids = [None] * len(prepared.tokens) if prepared.grids is None else list(prepared.grids)
    return [
        EncodedImage(tokens, features[edges[i] : edges[i + 1]], grid)
        for i, (tokens, grid) in enumerate(zip(prepared.tokens, grids, strict=True))
    ]


def image_grids(images: list[EncodedImage]) -> np.ndarray | None:
    """The patch grids of encoded images [images, 3] (what an M-RoPE decoder's positions need), or None."""
    grids = [image.grid_thw for image in images if image.grid_thw is not None]
    return np.stack(grids) if grids else None


def encode_size(shape: VisionShape, pixel_values: np.ndarray, indices: dict) -> tuple[int, int, int]:
    """(tiles, patches, keys) of an encode, a vision plan's tier: idefics3 tiles of patches that attend within
    their tile; qwen2_vl images (`indices`: `index_inputs`'s) whose patches attend within their image at the
    widest."""
    if shape.family == "qwen2_vl":
        return len(indices["image_rows"]), len(indices["rotary_ids"]), int(indices["image_rows"].shape[1])
    per_tile = (shape.tile_size // shape.patch_size) ** 2
    return len(pixel_values), len(pixel_values) * per_tile, per_tile


def index_inputs(config: ImagePreprocessing, grid_thw: np.ndarray | None) -> dict[str, np.ndarray]:
    """The vision graph's inputs besides the pixels: none for idefics3; Qwen2.5-VL's window order, rotary ids
    and attention groups for images of `grid_thw`."""
    if config.family != "qwen2_vl":
        return {}
    if grid_thw is None:
        raise ValueError("a Qwen2.5-VL vision graph needs the images' patch grids")
    return qwen2_5_vl_vision_inputs(grid_thw, config.to_json())  # the exporter traces with the same function


def encode_images(encoder, images: list) -> list[EncodedImage]:
    """Preprocess `images` (paths or PIL images) and run their tiles through the encoder in one go."""
    return encode_prepared(encoder, prepare_images(encoder.config, images))
