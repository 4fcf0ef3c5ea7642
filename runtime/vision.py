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

from pipeshard.errors import UserError
from pipeshard.runtime import capi
from pipeshard.runtime.exportdir import NUMPY_DTYPES
from pipeshard.runtime.images import ImageInputs, expand_image_tokens, image_placeholder, load_image, preprocess

PIXEL_VALUES, IMAGE_FEATURES = "pixel_values", "image_features"
MIN_QUERY_TILE = 64  # the paper's artifact: tiled queries in multiples of 64, at least 64
WEIGHTS, WORKSPACE = "vision weights", "vision workspace"


@dataclass
class PromptImages:
    """A prompt with its images: the text with every placeholder expanded, and the features of its image tokens."""

    text: str
    features: np.ndarray
    inputs: ImageInputs


def with_placeholders(prompt: str, count: int, config: dict) -> str:
    """The prompt with one placeholder per image: as written where it has them, else all before the text (where
    the chat templates of these models put images)."""
    placeholder = image_placeholder(config)
    written = prompt.count(config["image_token"])
    if written == 0:
        return placeholder * count + prompt
    if written != count:
        raise UserError(f"the prompt has {written} image placeholder(s) {config['image_token']!r} but {count} "
                        "image(s) were given")
    return prompt


def open_images(images: list) -> list[Image.Image]:
    """Paths or PIL images, as RGB PIL images (a bad path is one UserError)."""
    return [load_image(image) if not isinstance(image, Image.Image) else image for image in images]


def vision_workspace(vision: dict, tiles: int, itemsize: int, fused: bool = True) -> int:
    """Device bytes a run of `tiles` tiles needs besides weights: the residual stream in and out, the widest
    intermediate (q/k/v or the FFN's), and the attention's scores: a fused op's query tiles of
    budget / (4 x heads x patches) queries (at least 64), or, unfused, every score."""
    patches, hidden = int(vision["patches_per_tile"]), int(vision["hidden_size"])
    heads = int(vision["num_attention_heads"])
    activations = tiles * patches * (2 * hidden + max(3 * hidden, int(vision["intermediate_size"]))) * itemsize
    queries = min(patches, MIN_QUERY_TILE) if fused else patches
    return activations + tiles * heads * queries * patches * 4


class ExportVision:
    """An export folder's vision graph as one ONNX Runtime session."""

    def __init__(self, folder: Path, info: dict, threads: int | None = None) -> None:
        self.description = info["vision"]
        self.config = self.description["preprocessing"]
        self._rt = capi.runtime(threads)
        self._session = self._rt.session(Path(folder) / self.description["file"], threads)
        self._run_options = self._rt.run_options()

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        binding = self._session.binding()
        binding.bind_input(PIXEL_VALUES, np.ascontiguousarray(pixel_values, np.float32))
        binding.bind_output_to_cpu(IMAGE_FEATURES)
        capi.run(self._session, binding, self._run_options)
        return binding.outputs()[0].numpy()


class PackVision:
    """A pack's vision blocks, on the CPU (`device.kind == "cpu"`) or streamed through the device (VLMOpt)."""

    def __init__(self, pack, device, threads: int | None = None, release_decoder=None) -> None:
        self.pack = pack
        self.description = pack.manifest["vision"]
        self.config = self.description["preprocessing"]
        self.entries = self.description["sub_layers"]
        self.device = device
        self.release_decoder = release_decoder  # frees the decoder's device memory when the encoder needs it
        self._rt = capi.runtime(threads)
        self._threads = threads
        self._run_options = self._rt.run_options()
        self._sessions: dict[str, capi.Session] = {}
        self.peak_device_bytes = 0  # the ledger's peak while encoding, over every encode
        self.streamed_bytes = 0
        self.dtype = NUMPY_DTYPES[pack.model["dtype"]]

    @property
    def on_device(self) -> bool:
        return self.device.kind != "cpu"

    def _session(self, entry: dict) -> capi.Session:
        if entry["name"] not in self._sessions:
            if self.on_device:
                session = self._rt.session(self.pack.path(entry["files"]["weights_as_inputs"]), self._threads,
                                           cuda_options=self.device.cuda_options)
            else:
                session = self._rt.session(self.pack.path(entry["files"]["onnx"]), self._threads)
            self._sessions[entry["name"]] = session
        return self._sessions[entry["name"]]

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        pixel_values = np.ascontiguousarray(pixel_values, self.dtype)
        if not self.on_device:
            return self._run_all(pixel_values, None)
        return self._encode_on_device(pixel_values)

    def _encode_on_device(self, pixel_values: np.ndarray) -> np.ndarray:
        ledger = self.device.ledger
        slot_bytes = max(e["weight_bytes"] for e in self.entries)
        one_tile = vision_workspace(self.description, 1, np.dtype(self.dtype).itemsize)
        if ledger.used + 2 * slot_bytes + one_tile > ledger.budget_bytes and self.release_decoder is not None:
            self.release_decoder()  # the decoder's plan comes back at its next step
        free = ledger.budget_bytes - ledger.used - 2 * slot_bytes
        if free < one_tile:
            raise UserError(f"the VRAM budget leaves {max(free, 0)} bytes for the vision encoder's workspace, "
                            f"less than one tile needs ({one_tile} bytes)")
        tiles = len(pixel_values)
        per_run = max(t for t in range(1, tiles + 1)
                      if vision_workspace(self.description, t, np.dtype(self.dtype).itemsize) <= free)
        workspace = vision_workspace(self.description, per_run, np.dtype(self.dtype).itemsize)
        started_peak = ledger.peak
        ledger.peak = ledger.used
        slots = [self.device.alloc(slot_bytes, WEIGHTS) for _ in range(2)]
        self.device.reserve(workspace, WORKSPACE)
        try:
            runs = [self._run_all(pixel_values[first: first + per_run], slots)
                    for first in range(0, tiles, per_run)]
        finally:
            self.device.unreserve(workspace, WORKSPACE)
            for slot in slots:
                self.device.free(slot, WEIGHTS)
            self.peak_device_bytes = max(self.peak_device_bytes, ledger.peak)
            ledger.peak = max(started_peak, ledger.peak)
        return np.concatenate(runs)

    def _upload(self, entry: dict, slot):
        blob = entry.get("blob")
        if blob is None:
            return None
        source = self.device.host_source(self.pack.path(blob["file"]), 0, blob["bytes"])
        self.streamed_bytes += blob["bytes"]
        return self.device.upload(slot, source)

    def _run_all(self, pixel_values: np.ndarray, slots: list | None) -> np.ndarray:
        """Every block over these tiles; with slots, block i + 1's weights copy while block i computes."""
        values: dict[str, object] = {PIXEL_VALUES: pixel_values}
        copies = [self._upload(self.entries[0], slots[0])] if slots else []
        for index, entry in enumerate(self.entries):
            session = self._session(entry)
            binding = session.binding()
            if slots:
                if index + 1 < len(self.entries):
                    copies.append(self._upload(self.entries[index + 1], slots[(index + 1) % 2]))
                if copies[index] is not None:
                    copies[index].result()
                self._bind_weights(binding, entry, slots[index % 2])
            for tensor in entry["inputs"]:
                value = values[tensor["name"]]
                if isinstance(value, np.ndarray):
                    binding.bind_input(tensor["name"], value)
                else:
                    binding.bind_value_input(tensor["name"], value)
            for tensor in entry["outputs"]:
                binding.bind_output_to_cpu(tensor["name"])
            capi.run(session, binding, self._run_options)
            for tensor, value in zip(entry["outputs"], binding.outputs(), strict=True):
                values[tensor["name"]] = value
        return values[IMAGE_FEATURES].numpy()

    def _bind_weights(self, binding: capi.Binding, entry: dict, slot) -> None:
        memory = self.device.memory_info(self._rt)
        for weight in entry["weights"]:
            binding.bind_input_at(weight["name"], memory, self.device.address(slot) + weight["offset"],
                                  NUMPY_DTYPES[weight["dtype"]], weight["shape"], slot)


def prompt_images(encoder, prompt: str, images: list) -> PromptImages:
    """Preprocess `images`, encode them, and expand the prompt's placeholders into their image tokens."""
    opened = open_images(images)
    inputs = preprocess(opened, encoder.config)
    text = expand_image_tokens(with_placeholders(prompt, len(opened), encoder.config), inputs, encoder.config)
    features = encoder.encode(inputs.pixel_values)
    if len(features) != sum(inputs.image_tokens):
        raise RuntimeError(f"the vision graph gave {len(features)} feature rows for {sum(inputs.image_tokens)} "
                           "image tokens")
    return PromptImages(text, features, inputs)
