"""Image preprocessing for vision-language packs, with numpy and Pillow only.

The export records the model's image processor (exporter/image_processing.py), read as an ImagePreprocessing
record (pipeshard/formats/image_preprocessing.py); this module turns images into the vision graph's inputs the
way the transformers processor does (same resize chain, same float arithmetic, so the pixels match it bit for
bit), expands each image placeholder in the prompt into the image tokens the model expects, and computes
Qwen2.5-VL's window-attention indices and rotary positions, which its vision tower derives in Python and the
ONNX vision graph takes as inputs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from pipeshard.core.errors import UserError
from pipeshard.formats.image_preprocessing import ImagePreprocessing
from pipeshard.runtime.kv import MropeSettings


@dataclass
class ImageInputs:
    """The vision graph's inputs for the images of one prompt, and how each image lays out in the prompt.

    pixel_values is float32: idefics3 [tiles, 3, S, S] (every image's tiles, in order, each image's global
    view last); llava [images, 3, S, S]; qwen2_vl [patches, C * temporal_patch * patch * patch]. image_tokens[i]
    is the number of image-token positions image i fills in the prompt (= its rows of image features).
    """

    family: str
    pixel_values: np.ndarray
    image_tokens: list[int]
    rows: list[int] = field(default_factory=list)  # idefics3: tile rows per image (0: not split)
    cols: list[int] = field(default_factory=list)  # idefics3: tile columns per image (0: not split)
    image_grid_thw: np.ndarray | None = None  # qwen2_vl: int64 [images, 3], patches along t, h, w


def load_image(path: str | os.PathLike) -> Image.Image:
    """An image file as RGB, upright per its EXIF orientation; a file that is not a readable image is a UserError."""
    name = os.fspath(path)
    if os.path.isdir(name):
        raise UserError(f"{name} is a directory, not an image file")
    if not os.path.exists(name):
        raise UserError(f"image file not found: {name}")
    try:
        with Image.open(name) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
            return to_rgb(image)
    except UnidentifiedImageError:
        raise UserError(f"{name} is not an image file Pillow can read") from None
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise UserError(f"cannot read image {name}: {error}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white, as the transformers processors convert."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def image_placeholder(config: ImagePreprocessing) -> str:
    """What a prompt holds for one image before expansion (what the model's chat template writes)."""
    if config.family in ("idefics3", "gemma3", "llava"):
        return config.image_token
    return config.vision_start_token + config.image_token + config.vision_end_token


def preprocess(images: list[Image.Image], config: ImagePreprocessing) -> ImageInputs:
    """The vision inputs for `images` (one prompt's, in prompt order) under the pack's preprocessing config."""
    if not images:
        raise ValueError("preprocess needs at least one image")
    rgb = [to_rgb(image) for image in images]
    if config.family == "idefics3":
        return _preprocess_idefics3(rgb, config)
    if config.family == "gemma3":
        return _preprocess_gemma3(rgb, config)
    if config.family == "llava":
        return _preprocess_llava(rgb, config)
    return _preprocess_qwen2_vl(rgb, config)


def expand_image_tokens(text: str, inputs: ImageInputs, config: ImagePreprocessing) -> str:
    """`text` with its i-th image token replaced by image i's token run, as the transformers processor writes it."""
    pieces = text.split(config.image_token)
    placeholders = len(pieces) - 1
    if placeholders != len(inputs.image_tokens):
        raise UserError(
            f"the prompt has {placeholders} image placeholder(s) {config.image_token!r} "
            f"but {len(inputs.image_tokens)} image(s) were given"
        )
    if config.family == "idefics3":
        runs = [
            _idefics3_image_text(rows, cols, config)
            for rows, cols in zip(inputs.rows, inputs.cols, strict=True)
        ]
    elif config.family == "gemma3":
        runs = [_gemma3_image_text(config)] * len(inputs.image_tokens)
    else:
        runs = [config.image_token * count for count in inputs.image_tokens]
    expanded = [pieces[0]]
    for run, piece in zip(runs, pieces[1:], strict=True):
        expanded += [run, piece]
    return "".join(expanded)


def _resize(image: Image.Image, height: int, width: int, config: ImagePreprocessing) -> Image.Image:
    return image.resize((width, height), resample=Image.Resampling[config.resample])


def _rescale_and_normalize(image: Image.Image, config: ImagePreprocessing) -> np.ndarray:
    """Channels-first float32 pixels, with the processor's arithmetic: rescale in float64, normalize in float32."""
    pixels = np.asarray(image).transpose(2, 0, 1)
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return pixels


# --- Idefics3 / SmolVLM: the image resized to a multiple of the tile size, cut into tiles, plus a global view.


def idefics3_resized_size(height: int, width: int, config: ImagePreprocessing) -> tuple[int, int]:
    """The size the processor first resizes to: longest edge to `longest_edge` (even short edge), capped."""
    longest_edge = config.longest_edge
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)

    cap = config.max_resolution
    aspect_ratio = width / height
    if width >= height and width > cap:
        width = cap
        height = int(width / aspect_ratio)
    elif height > width and height > cap:
        height = cap
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def idefics3_tiled_size(height: int, width: int, config: ImagePreprocessing) -> tuple[int, int]:
    """The size the processor resizes to before tiling: both edges up to multiples of the tile size."""
    tile = config.max_image_size
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width


def _preprocess_idefics3(images: list[Image.Image], config: ImagePreprocessing) -> ImageInputs:
    tile = config.max_image_size
    tiles: list[np.ndarray] = []
    rows: list[int] = []
    cols: list[int] = []
    for image in images:
        if config.do_resize:
            image = _resize(image, *idefics3_resized_size(image.height, image.width, config), config)
        if not config.do_image_splitting:
            tiles.append(_rescale_and_normalize(_resize(image, tile, tile, config), config))
            rows.append(0)
            cols.append(0)
            continue
        image = _resize(image, *idefics3_tiled_size(image.height, image.width, config), config)
        if image.height <= tile and image.width <= tile:
            tiles.append(_rescale_and_normalize(image, config))
            rows.append(0)
            cols.append(0)
            continue
        pixels = _rescale_and_normalize(image, config)
        image_rows, image_cols = image.height // tile, image.width // tile
        for row in range(image_rows):
            for col in range(image_cols):
                tiles.append(pixels[:, row * tile : (row + 1) * tile, col * tile : (col + 1) * tile])
        tiles.append(_rescale_and_normalize(_resize(image, tile, tile, config), config))
        rows.append(image_rows)
        cols.append(image_cols)
    seq_len = config.image_seq_len
    image_tokens = [seq_len * (r * c + 1) if r else seq_len for r, c in zip(rows, cols, strict=True)]
    return ImageInputs("idefics3", np.stack(tiles), image_tokens, rows=rows, cols=cols)


def _idefics3_image_text(rows: int, cols: int, config: ImagePreprocessing) -> str:
    """One image's prompt text: a tagged run of image tokens per tile, row by row, then the global view."""
    fake, image_run = config.fake_image_token, config.image_token * config.image_seq_len
    global_view = fake + config.global_image_token + image_run + fake
    if rows == 0:
        return global_view
    row_texts = []
    for row in range(rows):
        tiles = [
            fake + config.row_col_token.format(row=row + 1, col=col + 1) + image_run for col in range(cols)
        ]
        row_texts.append("".join(tiles) + "\n")
    return "".join(row_texts) + "\n" + global_view


# --- Gemma 3: every image resized to the tower's square (no pan-and-scan), one run of soft tokens.


def _preprocess_gemma3(images: list[Image.Image], config: ImagePreprocessing) -> ImageInputs:
    size = config.image_size
    pixels = [
        _rescale_and_normalize(_resize(image, size, size, config) if config.do_resize else image, config)
        for image in images
    ]
    return ImageInputs("gemma3", np.stack(pixels), [config.image_seq_len] * len(images))


def _gemma3_image_text(config: ImagePreprocessing) -> str:
    """One image's prompt text as Gemma3Processor writes it."""
    soft = config.soft_token * config.image_seq_len
    return f"\n\n{config.image_token}{soft}{config.end_of_image_token}\n\n"


# --- A CLIP / SigLIP tower (exporter/vision_tower.py): one fixed-size image, one run of image tokens.


def llava_resized_size(height: int, width: int, config: ImagePreprocessing) -> tuple[int, int]:
    """The size the processor resizes to: the shortest edge to `shortest_edge` (the longer one truncated to
    keep the aspect ratio), or the fixed height and width."""
    edge = config.shortest_edge
    if not edge:
        return config.height, config.width
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def _center_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """The processor's center crop: the middle height x width, an image smaller than that padded with zeros
    around it first."""
    pixels = np.asarray(image)
    rows, cols = pixels.shape[:2]
    top, left = (rows - height) // 2, (cols - width) // 2
    if top < 0 or left < 0:
        padded_rows, padded_cols = max(height, rows), max(width, cols)
        top_pad, left_pad = math.ceil((padded_rows - rows) / 2), math.ceil((padded_cols - cols) / 2)
        padded = np.zeros((padded_rows, padded_cols, *pixels.shape[2:]), pixels.dtype)
        padded[top_pad : top_pad + rows, left_pad : left_pad + cols] = pixels
        pixels, top, left = padded, top + top_pad, left + left_pad
    return Image.fromarray(
        np.ascontiguousarray(pixels[max(top, 0) : top + height, max(left, 0) : left + width])
    )


def _preprocess_llava(images: list[Image.Image], config: ImagePreprocessing) -> ImageInputs:
    size = config.image_size
    pixels = []
    for image in images:
        if config.do_resize:
            image = _resize(image, *llava_resized_size(image.height, image.width, config), config)
        if config.crop_height:
            image = _center_crop(image, config.crop_height, config.crop_width)
        if image.size != (size, size):
            raise UserError(
                f"an image of {image.width}x{image.height} pixels; this model takes {size}x{size}"
            )
        pixels.append(_rescale_and_normalize(image, config))
    return ImageInputs("llava", np.stack(pixels), [config.image_seq_len] * len(images))


# --- Qwen2-VL / Qwen2.5-VL: native resolution, rounded to whole merged patches, flattened patch by patch.


def qwen2_vl_resized_size(height: int, width: int, config: ImagePreprocessing) -> tuple[int, int]:
    """The processor's `smart_resize`: edges multiples of patch x merge, pixel count within [min, max]."""
    factor = config.patch_size * config.merge_size
    if max(height, width) / min(height, width) > config.max_aspect_ratio:
        raise UserError(
            f"an image of {width}x{height} pixels is too elongated for this model "
            f"(aspect ratio over {config.max_aspect_ratio})"
        )
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        resized_height = max(factor, math.floor(height / beta / factor) * factor)
        resized_width = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_height * resized_width < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


def _preprocess_qwen2_vl(images: list[Image.Image], config: ImagePreprocessing) -> ImageInputs:
    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    patch_rows: list[np.ndarray] = []
    grids: list[tuple[int, int, int]] = []
    for image in images:
        if config.do_resize:
            image = _resize(image, *qwen2_vl_resized_size(image.height, image.width, config), config)
        pixels = _rescale_and_normalize(image, config)
        channels, height, width = pixels.shape
        grid_h, grid_w = height // patch, width // patch
        # [C, H, W] -> [blocks_h, blocks_w, merge_h, merge_w, C, patch_h, patch_w]: merged patches adjacent.
        blocks = pixels.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
        # A still image is one frame repeated over the temporal patch.
        frames = np.repeat(blocks[:, :, :, :, :, None], temporal, axis=5)
        patch_rows.append(frames.reshape(grid_h * grid_w, channels * temporal * patch * patch))
        grids.append((1, grid_h, grid_w))
    grid_thw = np.array(grids, dtype=np.int64)
    image_tokens = [int(t * h * w) // merge**2 for t, h, w in grids]
    return ImageInputs("qwen2_vl", np.concatenate(patch_rows), image_tokens, image_grid_thw=grid_thw)


def mrope_position_ids(
    input_ids: np.ndarray, image_grid_thw: np.ndarray, config: MropeSettings | ImagePreprocessing
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's decoder positions (M-RoPE) for one prompt's ids: int64 [3, tokens] of (time, row, column).

    Text counts up on all three axes; each run of image tokens takes its merged grid's coordinates, offset by
    the position reached, and moves it on by the grid's longer side. Returns the positions and the delta that
    later tokens add to their index (a decode step at index i has position i + delta on every axis).
    """
    ids = np.asarray(input_ids).reshape(-1)
    merge = config.merge_size
    is_image = ids == config.image_token_id
    run_starts = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    bounds = [0, *run_starts.tolist(), len(ids)]
    grids = iter(np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3).tolist())
    pieces: list[np.ndarray] = []
    position = 0
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if start == end:
            continue
        if not is_image[start]:
            pieces.append(np.broadcast_to(np.arange(end - start) + position, (3, end - start)))
            position += end - start
            continue
        grid_thw = next(grids, None)
        if grid_thw is None:
            raise ValueError("the prompt has more runs of image tokens than image grids")
        t, h, w = grid_thw
        grid = np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij")
        image_positions = np.stack(grid).reshape(3, -1) + position
        if image_positions.shape[1] != end - start:
            raise ValueError(f"a run of {end - start} image tokens does not match the image grid {t}x{h}x{w}")
        pieces.append(image_positions)
        position += max(h, w) // merge
    if next(grids, None) is not None:
        raise ValueError("more image grids than runs of image tokens in the prompt")
    positions = np.concatenate(pieces, axis=1).astype(np.int64) if pieces else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def mrope_batch_positions(
    prompts: list[list[int]],
    width: int,
    image_grids: np.ndarray | None,
    config: MropeSettings | ImagePreprocessing,
) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE positions of a left-padded batch: int64 [3, batch, width] (padding at 0) and each row's delta (a
    later token at index i of its row has position i + delta on every axis). `image_grids` [images, 3]: the
    images of every prompt in reading order, prompt by prompt."""
    grids = iter(np.asarray(image_grids if image_grids is not None else np.zeros((0, 3)), np.int64).tolist())
    positions = np.zeros((3, len(prompts), width), np.int64)
    deltas = np.zeros(len(prompts), np.int64)
    for row, ids in enumerate(prompts):
        ids = np.asarray(ids, dtype=np.int64)
        is_image = ids == config.image_token_id
        runs = int(is_image[0]) + int(np.count_nonzero(is_image[1:] & ~is_image[:-1])) if len(ids) else 0
        its_grids = [next(grids) for _ in range(runs)]
        positions[:, row, width - len(ids) :], deltas[row] = mrope_position_ids(
            ids, np.array(its_grids).reshape(-1, 3), config
        )
    return positions, deltas
