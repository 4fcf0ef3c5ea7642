"""Image features for a VLM: the prompt's images preprocessed, run through the vision graph, and the prompt's
image placeholders expanded into the image tokens those features fill.

An export folder runs its `vision.onnx` as one session. A pack runs its vision blocks one after another: on the
CPU from the mapped blobs, or on a device the VLMOpt way (the paper's three parts): each block's weights stream
from host memory through two staging slots while the block before computes, so the vision weights are never
resident; the tiles go through in runs whose activations and attention workspace fit the budget the decoder
leaves; and every byte is released before the decoder's prefill, so peak device memory is the larger of the
two, not their sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pipeshard.core.errors import UserError
from pipeshard.formats.export_info import NUMPY_DTYPES, ExportInfo, numpy_dtype
from pipeshard.formats.manifest import WEIGHT_ALIGNMENT, Pack, SubLayer
from pipeshard.formats.vision_inputs import qwen2_5_vl_vision_inputs
from pipeshard.formats.vision_memory import VisionShape, naive_workspace, tile_runs, vlmopt_peak
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


def with_placeholders(prompt: str, count: int, config: dict) -> str:
    """The prompt with one placeholder per image: as written where it has them, else all before the text (where
    the chat templates of these models put images)."""
    placeholder = image_placeholder(config)
    written = prompt.count(config["image_token"])
    if written == 0:
        return placeholder * count + prompt
    if written != count:
        raise UserError(
            f"the prompt has {written} image placeholder(s) {config['image_token']!r} but {count} "
            "image(s) were given"
        )
    return prompt


def expand_prompt(text: str, runs: list[str], config: dict) -> str:
    """`text` (rendered, its placeholders in image order) with each placeholder replaced by its image's token run."""
    pieces = text.split(config["image_token"])
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
        self.description = info.vision
        self.config = self.description["preprocessing"]
        self._rt = capi.runtime(threads)
        self._session = self._rt.session(Path(folder) / self.description["file"], threads)
        self._run_options = self._rt.run_options()

    def encode(self, pixel_values: np.ndarray, grid_thw: np.ndarray | None = None) -> np.ndarray:
        binding = self._session.binding()
        binding.bind_input(PIXEL_VALUES, np.ascontiguousarray(pixel_values, np.float32))
        for name, value in index_inputs(self.config, grid_thw).items():
            binding.bind_input(name, value)
        binding.bind_output_to_cpu(IMAGE_FEATURES)
        capi.run(self._session, binding, self._run_options)
        return binding.outputs()[0].numpy()


class PackVision:
    """A pack's vision blocks, on the CPU (a `DeviceKind.CPU` device) or on the device: streamed (VLMOpt), or with
    `naive` as a plain port does it (every weight resident, every score stored, the decoder kept), for comparing
    their peak device memory on the simulated device."""

    def __init__(
        self,
        pack: Pack,
        device,
        threads: int | None = None,
        release_decoder=None,
        naive: bool = False,
        workspace_bytes: int | None = None,
    ) -> None:
        """`workspace_bytes`: the most the encoder's activations and attention take at once (default: whatever
        the budget leaves)."""
        self.pack = pack
        self.description = vision = pack.manifest.vision
        self.config = vision.facts["preprocessing"]  # the export's, as it wrote it
        self.entries = vision.sub_layers
        self.shape = VisionShape.from_pack(vision)
        self.device = device
        self.release_decoder = release_decoder  # frees the decoder's device memory when the encoder needs it
        self.naive = naive
        self.workspace_bytes = workspace_bytes
        self._rt = capi.runtime(threads)
        self._threads = threads
        self._run_options = self._rt.run_options()
        self._sessions: dict[str, capi.Session] = {}
        self.peak_device_bytes = 0  # the ledger's peak while encoding, over every encode
        self.encoder_peak_bytes = 0  # the same, less what the decoder held meanwhile
        self._held = self._peak_before_release = 0
        self.streamed_bytes = 0
        self.dtype = NUMPY_DTYPES[pack.model.dtype]
        self._indices: dict[str, np.ndarray] = {}  # qwen2_vl: the window order, rotary ids and groups

    @property
    def on_device(self) -> bool:
        return self.device.kind != DeviceKind.CPU

    def _session(self, entry: SubLayer) -> capi.Session:
        if entry.name not in self._sessions:
            if self.on_device:
                session = device_session(
                    self._rt,
                    self.device,
                    self.pack.path(entry.files["weights_as_inputs"]),
                    entry.name,
                    self._threads,
                )
            else:
                session = self._rt.session(self.pack.path(entry.files["onnx"]), self._threads)
            self._sessions[entry.name] = session
        return self._sessions[entry.name]

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
            return self._encode_naive(pixel_values) if self.naive else self._encode_streamed(pixel_values)
        finally:
            self.peak_device_bytes = max(self.peak_device_bytes, ledger.peak, self._peak_before_release)
            # What the encoder itself took: above what the decoder held meanwhile.
            self.encoder_peak_bytes = max(self.encoder_peak_bytes, ledger.peak - self._held)
            ledger.peak = max(started_peak, ledger.peak, self._peak_before_release)

    def _encode_streamed(self, pixel_values: np.ndarray) -> np.ndarray:
        """VLMOpt: two staging slots, tiles in runs whose workspace fits what the budget leaves."""
        ledger, shape, tiles = self.device.ledger, self.shape, len(pixel_values)
        slot_bytes = shape.largest_block_bytes
        if ledger.used + 2 * slot_bytes + self._runs(1, 0)[1] > ledger.budget_bytes and self.release_decoder:
            self._peak_before_release = ledger.peak
            self.release_decoder()  # the decoder's plan comes back at its next step
            self._held = ledger.peak = ledger.used
        free = ledger.budget_bytes - ledger.used - 2 * slot_bytes
        if self.workspace_bytes is not None:
            free = min(free, self.workspace_bytes)
        per_run, reserved = self._runs(tiles, max(free, 0))
        if reserved > free:
            raise UserError(
                f"the VRAM budget leaves {max(free, 0)} bytes for the vision encoder, less than one tile "
                f"needs ({reserved} bytes)"
            )
        slots = [self.device.alloc(slot_bytes, WEIGHTS) for _ in range(2)]
        self.device.reserve(reserved, WORKSPACE)
        try:
            return np.concatenate(
                [
                    self._run_all(pixel_values[first : first + per_run], slots)
                    for first in range(0, tiles, per_run)
                ]
            )
        finally:
            self.device.unreserve(reserved, WORKSPACE)
            for slot in slots:
                self.device.free(slot, WEIGHTS)

    def _runs(self, tiles: int, free: int) -> tuple[int, int]:
        """How many tiles go through at once and the workspace they reserve within `free` bytes. Qwen2.5-VL's
        patches attend across windows and whole images: one run of them all, its attention in query tiles."""
        if self.shape.family != "qwen2_vl":
            return tile_runs(self.shape, tiles, free)
        keys = int(self._indices["image_rows"].shape[1])
        peak = vlmopt_peak(self.shape, len(self._indices["rotary_ids"]), keys, free)
        return max(tiles, 1), peak.activations + peak.attention

    def _encode_naive(self, pixel_values: np.ndarray) -> np.ndarray:
        """Every weight uploaded and resident, every tile at once with all its scores."""
        if self.shape.family == "qwen2_vl":
            reserved = naive_workspace(
                self.shape, len(pixel_values), int(self._indices["image_rows"].shape[1])
            )
        else:
            keys = (self.shape.tile_size // self.shape.patch_size) ** 2
            reserved = naive_workspace(self.shape, len(pixel_values) * keys, keys)
        weights = self.device.alloc(sum(_resident_bytes(entry) for entry in self.entries), WEIGHTS)
        self.device.reserve(reserved, WORKSPACE)
        try:
            offset = 0
            for entry in self.entries:
                if entry.blob:
                    self._upload(entry, weights[offset:]).result()
                offset += _resident_bytes(entry)
            return self._run_all(pixel_values, [weights], resident=True)
        finally:
            self.device.unreserve(reserved, WORKSPACE)
            self.device.free(weights, WEIGHTS)

    def _upload(self, entry: SubLayer, slot):
        blob = entry.blob
        if blob is None:
            return None
        source = self.device.host_source(self.pack.path(blob.file), 0, blob.bytes)
        self.streamed_bytes += blob.bytes
        return self.device.upload(slot, source)

    def _run_all(self, pixel_values: np.ndarray, slots: list | None, resident: bool = False) -> np.ndarray:
        """Every block over these tiles. With two slots, block i + 1's weights copy while block i computes; with
        the weights `resident` in one buffer, each block reads its part of it."""
        values: dict[str, object] = {PIXEL_VALUES: pixel_values, **self._indices}
        streamed = slots is not None and not resident
        copies = [self._upload(self.entries[0], slots[0])] if streamed else []
        offset = 0
        for index, entry in enumerate(self.entries):
            session = self._session(entry)
            binding = session.binding()
            if streamed:
                if index + 1 < len(self.entries):
                    copies.append(self._upload(self.entries[index + 1], slots[(index + 1) % 2]))
                if copies[index] is not None:
                    copies[index].result()
                self._bind_weights(binding, entry, slots[index % 2], 0)
            elif resident:
                self._bind_weights(binding, entry, slots[0], offset)
                offset += _resident_bytes(entry)
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
        return values[IMAGE_FEATURES].numpy()

    def _bind_weights(self, binding: capi.Binding, entry: SubLayer, buffer, base: int) -> None:
        memory = self.device.memory_info(self._rt)
        for weight in entry.weights:
            binding.bind_input_at(
                weight.name,
                memory,
                self.device.address(buffer) + base + weight.offset,
                numpy_dtype(weight.dtype),
                weight.shape,
                buffer,
            )


def _resident_bytes(entry: SubLayer) -> int:
    """A block's room in a buffer of every vision weight: its blob, to the weights' alignment."""
    nbytes = entry.blob.bytes if entry.blob else 0
    return -(-nbytes // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT


@dataclass
class PreparedImages:
    """Images preprocessed, not yet encoded: each one's token run, and all their tiles for one encoder run."""

    tokens: list[str]
    pixel_values: np.ndarray
    counts: list[int]  # image tokens (feature rows) per image
    grids: np.ndarray | None = None  # qwen2_vl: int64 [images, 3]


def prepare_images(config: dict, images: list) -> PreparedImages:
    """Preprocess `images` (paths or PIL images) under a pack's preprocessing config."""
    prepared = [preprocess([image], config) for image in open_images(images)]
    grids = [inputs.image_grid_thw for inputs in prepared if inputs.image_grid_thw is not None]
    return PreparedImages(
        [expand_image_tokens(config["image_token"], inputs, config) for inputs in prepared],
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


def index_inputs(config: dict, grid_thw: np.ndarray | None) -> dict[str, np.ndarray]:
    """The vision graph's inputs besides the pixels: none for idefics3; Qwen2.5-VL's window order, rotary ids
    and attention groups for images of `grid_thw`."""
    if config["family"] != "qwen2_vl":
        return {}
    if grid_thw is None:
        raise ValueError("a Qwen2.5-VL vision graph needs the images' patch grids")
    return qwen2_5_vl_vision_inputs(grid_thw, config)


def encode_images(encoder, images: list) -> list[EncodedImage]:
    """Preprocess `images` (paths or PIL images) and run their tiles through the encoder in one go."""
    return encode_prepared(encoder, prepare_images(encoder.config, images))
