"""A VLM's image preprocessing as plain data, so a deployment host needs neither torch nor transformers.

`preprocessing_config` reads transformers' image processor and the model config into the dict that
export.json carries and runtime/images.py executes (resize rules, the resampling filter, rescale and
normalize constants, tiling or patching, the prompt's image tokens).
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from pipeshard.exporter import vision_tower
from pipeshard.formats.vision_inputs import PREPROCESSING_SCHEMA_VERSION

IDEFICS3_MODEL_TYPES = ("idefics3", "smolvlm")
QWEN2_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
GEMMA3_MODEL_TYPES = ("gemma3",)
# Constants of the transformers processors, recorded so the runtime need not know them.
IDEFICS3_MAX_RESOLUTION = 4096  # the longest edge Idefics3 processing ever resizes to
QWEN2_VL_MAX_ASPECT_RATIO = 200  # Qwen2-VL's smart_resize refuses more elongated images
# Qwen2.5-VL checkpoints ship these pixel bounds (the processor class defaults to a lower maximum).
QWEN2_5_VL_MIN_PIXELS = 56 * 56
QWEN2_5_VL_MAX_PIXELS = 16384 * 28 * 28


def preprocessing_config(image_processor, model_config, tokenizer=None) -> dict[str, Any]:
    """The JSON-able preprocessing of a VLM: `image_processor` (Idefics3 / SmolVLM, or Qwen2-VL's for
    Qwen2-VL and Qwen2.5-VL) read with `model_config`. With `tokenizer`, the image tokens are checked to be
    single tokens of its vocabulary and their ids recorded."""
    model_type = model_config.model_type
    if model_type in IDEFICS3_MODEL_TYPES:
        config = _idefics3_config(image_processor, model_config)
    elif model_type in QWEN2_VL_MODEL_TYPES:
        config = _qwen2_vl_config(image_processor, model_config)
    elif model_type in GEMMA3_MODEL_TYPES:
        config = _gemma3_config(image_processor, model_config)
    elif (
        getattr(getattr(model_config, "vision_config", None), "model_type", None) in vision_tower.TOWER_TYPES
    ):
        config = _llava_config(image_processor, model_config)
    else:
        raise ValueError(f"no image preprocessing for model type {model_type!r}")
    if tokenizer is not None:
        config["token_ids"] = _special_token_ids(tokenizer, _special_tokens(config))
        tokenizer_id = config["token_ids"][config.get("soft_token", config["image_token"])]
        if tokenizer_id != config["image_token_id"]:
            raise ValueError(
                f"the tokenizer's {config['image_token']} is id {tokenizer_id} but the model's "
                f"image_token_id is {config['image_token_id']}"
            )
    return config


def qwen2_vl_image_processor(
    model_config, min_pixels: int = QWEN2_5_VL_MIN_PIXELS, max_pixels: int = QWEN2_5_VL_MAX_PIXELS
):
    """transformers' Qwen2-VL image processor (the PIL one) for a Qwen2(.5)-VL config: patching from its
    vision config, pixel bounds as Qwen2.5-VL checkpoints ship them unless given (small ones for tests)."""
    from transformers import Qwen2VLImageProcessorPil

    vision = model_config.vision_config
    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
    )


def _common(image_processor) -> dict[str, Any]:
    """The steps both families share: which are on, the filter's PIL name, the rescale and normalize constants."""
    return {
        "do_resize": bool(image_processor.do_resize),
        "resample": Image.Resampling(int(image_processor.resample)).name,
        "do_rescale": bool(image_processor.do_rescale),
        "rescale_factor": float(image_processor.rescale_factor),
        "do_normalize": bool(image_processor.do_normalize),
        "image_mean": [float(value) for value in _per_channel(image_processor.image_mean)],
        "image_std": [float(value) for value in _per_channel(image_processor.image_std)],
    }


def _per_channel(value) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * 3


def _idefics3_config(image_processor, model_config) -> dict[str, Any]:
    vision = model_config.vision_config
    longest_edge = image_processor.size["longest_edge"]
    if not longest_edge:
        raise ValueError(f"Idefics3 preprocessing needs size['longest_edge'], got {image_processor.size}")
    tile = image_processor.max_image_size["longest_edge"]
    if tile != vision.image_size:
        raise ValueError(
            f"the processor's tiles are {tile} px but the vision tower takes {vision.image_size} px"
        )
    if not getattr(image_processor, "do_convert_rgb", True):
        raise ValueError("the runtime always converts images to RGB; this processor does not")
    scale_factor = model_config.scale_factor
    image_seq_len = int((vision.image_size // vision.patch_size) ** 2 / scale_factor**2)
    return {
        "schema_version": PREPROCESSING_SCHEMA_VERSION,
        "family": "idefics3",
        **_common(image_processor),
        "longest_edge": int(longest_edge),
        "max_resolution": IDEFICS3_MAX_RESOLUTION,
        "do_image_splitting": bool(image_processor.do_image_splitting),
        "max_image_size": int(tile),
        "image_size": int(vision.image_size),
        "patch_size": int(vision.patch_size),
        "scale_factor": int(scale_factor),
        "image_seq_len": image_seq_len,
        "image_token": "<image>",
        "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>",
        "row_col_token": "<row_{row}_col_{col}>",
        # The most tile rows (or columns) an image takes; unbounded when images keep their own size.
        "max_tile_grid": -(-min(int(longest_edge), IDEFICS3_MAX_RESOLUTION) // int(tile))
        if image_processor.do_resize
        else None,
        "image_token_id": int(model_config.image_token_id),
    }


def _qwen2_vl_config(image_processor, model_config) -> dict[str, Any]:
    vision = model_config.vision_config
    patching = {
        "patch_size": (image_processor.patch_size, vision.patch_size),
        "temporal_patch_size": (image_processor.temporal_patch_size, vision.temporal_patch_size),
        "merge_size": (image_processor.merge_size, vision.spatial_merge_size),
    }
    for name, (processor_value, model_value) in patching.items():
        if processor_value != model_value:
            raise ValueError(
                f"the processor's {name} is {processor_value} but the vision tower's is {model_value}"
            )
    if not getattr(image_processor, "do_convert_rgb", True):
        raise ValueError("the runtime always converts images to RGB; this processor does not")
    window_size = getattr(vision, "window_size", None)  # Qwen2.5-VL only
    return {
        "schema_version": PREPROCESSING_SCHEMA_VERSION,
        "family": "qwen2_vl",
        **_common(image_processor),
        "min_pixels": int(image_processor.size["shortest_edge"]),
        "max_pixels": int(image_processor.size["longest_edge"]),
        "max_aspect_ratio": QWEN2_VL_MAX_ASPECT_RATIO,
        "patch_size": int(vision.patch_size),
        "temporal_patch_size": int(vision.temporal_patch_size),
        "merge_size": int(vision.spatial_merge_size),
        "window_size": int(window_size) if window_size else None,
        "fullatt_block_indexes": [int(i) for i in getattr(vision, "fullatt_block_indexes", ())],
        "image_token": "<|image_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "image_token_id": int(model_config.image_token_id),
        "vision_start_token_id": int(model_config.vision_start_token_id),
        "vision_end_token_id": int(model_config.vision_end_token_id),
    }


def _llava_config(image_processor, model_config) -> dict[str, Any]:
    """A CLIP / SigLIP image processor (exporter/vision_tower.py): resize by the shortest edge or to a height and
    width, an optional center crop; each image one run of `image_seq_len` image tokens."""
    size = dict(image_processor.size)
    if set(size) - {"shortest_edge", "height", "width"} or not (
        size.get("shortest_edge") or (size.get("height") and size.get("width"))
    ):
        raise ValueError(f"the image processor's size {size} is not a shortest edge or a height and width")
    if getattr(image_processor, "do_pad", None):
        raise ValueError("the image processor pads images; the generic vision path does not")
    if not getattr(image_processor, "do_convert_rgb", True):
        raise ValueError("the runtime always converts images to RGB; this processor does not")
    crop = dict(image_processor.crop_size) if getattr(image_processor, "do_center_crop", False) else {}
    return {
        "schema_version": PREPROCESSING_SCHEMA_VERSION,
        "family": vision_tower.FAMILY,
        **_common(image_processor),
        "shortest_edge": size.get("shortest_edge"),
        "height": size.get("height"),
        "width": size.get("width"),
        "crop_height": crop.get("height"),
        "crop_width": crop.get("width"),
        "image_size": int(model_config.vision_config.image_size),
        "image_seq_len": vision_tower.tokens_per_image(model_config),
        "image_token": vision_tower.IMAGE_TOKEN,
        "image_token_id": int(model_config.image_token_id),
    }


def _gemma3_config(image_processor, model_config) -> dict[str, Any]:
    """Gemma 3 (no pan-and-scan): each image resized to the tower's square, one run of soft tokens. As in
    Gemma3Processor, `image_token` is what a prompt holds for an image (the start-of-image token), expanded into
    blank lines, itself, `mm_tokens_per_image` soft tokens (`image_token_id`, the rows of features), the end-of-image
    token and blank lines."""
    from pipeshard.exporter.gemma3_vl import IMAGE_TOKENS

    size = image_processor.size
    height, width = size.get("height"), size.get("width")
    image_size = model_config.vision_config.image_size
    if image_processor.do_resize and (height, width) != (image_size, image_size):
        raise ValueError(f"the processor resizes to {size} but the vision tower takes {image_size} px")
    if getattr(image_processor, "do_pan_and_scan", False):
        raise ValueError("Gemma 3's pan-and-scan crops (do_pan_and_scan) are not supported")
    if not getattr(image_processor, "do_convert_rgb", True):
        raise ValueError("the runtime always converts images to RGB; this processor does not")
    return {
        "schema_version": PREPROCESSING_SCHEMA_VERSION,
        "family": "gemma3",
        **_common(image_processor),
        "image_size": int(image_size),
        "image_seq_len": int(model_config.mm_tokens_per_image),
        "image_token": IMAGE_TOKENS["boi_token"],
        "end_of_image_token": IMAGE_TOKENS["eoi_token"],
        "soft_token": IMAGE_TOKENS["image_token"],
        "image_token_id": int(model_config.image_token_id),
    }


def _special_tokens(config: dict[str, Any]) -> list[str]:
    if config["family"] == "gemma3":
        return [config["image_token"], config["end_of_image_token"], config["soft_token"]]
    if config["family"] == "idefics3":
        grid = range(1, (config["max_tile_grid"] or 0) + 1)
        tiles = [config["row_col_token"].format(row=row, col=col) for row in grid for col in grid]
        return [config["image_token"], config["fake_image_token"], config["global_image_token"], *tiles]
    if config["family"] == vision_tower.FAMILY:
        return [config["image_token"]]
    return [config["image_token"], config["vision_start_token"], config["vision_end_token"]]


def _special_token_ids(tokenizer, tokens: list[str]) -> dict[str, int]:
    """Each token's id, checking the tokenizer keeps it whole (else the expanded prompt would not line up)."""
    ids = {}
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"the tokenizer splits the image token {token!r} into {len(encoded)} tokens")
        ids[token] = int(encoded[0])
    return ids
