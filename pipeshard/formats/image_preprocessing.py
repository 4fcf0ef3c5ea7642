"""A VLM's image preprocessing (export.json's and the manifest's `vision.preprocessing`, docs/vlm.md) as a typed
record: what the exporter read from the model's image processor, and what the runtime needs to turn images into the
vision graph's inputs and a prompt's image tokens. Each family has its own fields; a missing, mistyped or unknown
field is one UserError naming the file and the field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from pipeshard.formats.fields import Fields
from pipeshard.formats.vision_inputs import PREPROCESSING_SCHEMA_VERSION

RESAMPLING_FILTERS = ("NEAREST", "BOX", "BILINEAR", "HAMMING", "BICUBIC", "LANCZOS")  # PIL's Image.Resampling
# The steps every family shares: which are on, the filter's PIL name, the rescale and normalize constants.
COMMON_FIELDS = (
    "do_resize",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
)
# Each family's fields in the order the exporter writes them (exporter/image_processing.py).
FAMILY_FIELDS = {
    "idefics3": ("longest_edge", "max_resolution", "do_image_splitting", "max_image_size", "image_size", "patch_size",
                 "scale_factor", "image_seq_len", "image_token", "fake_image_token", "global_image_token",
                 "row_col_token", "max_tile_grid", "image_token_id"),
    "qwen2_vl": ("min_pixels", "max_pixels", "max_aspect_ratio", "patch_size", "temporal_patch_size", "merge_size",
                 "window_size", "fullatt_block_indexes", "image_token", "vision_start_token", "vision_end_token",
                 "image_token_id", "vision_start_token_id", "vision_end_token_id"),
    "llava": ("shortest_edge", "height", "width", "crop_height", "crop_width", "image_size", "image_seq_len",
              "image_token", "image_token_id"),
    "gemma3": ("image_size", "image_seq_len", "image_token", "end_of_image_token", "soft_token", "image_token_id"),
}  # fmt: skip
# Fields that may be null: an unbounded tile grid, no window attention, a size given another way, no center crop.
NULLABLE_FIELDS = (
    "max_tile_grid",
    "window_size",
    "shortest_edge",
    "height",
    "width",
    "crop_height",
    "crop_width",
)


@dataclass(frozen=True)
class ImagePreprocessing:
    """How one family's image processor turns images into pixels and prompt text (the fields of other families are
    left at their defaults)."""

    family: str  # idefics3 | qwen2_vl | llava | gemma3
    do_resize: bool
    resample: str  # a PIL resampling filter's name
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_token: str  # what a prompt holds for an image before expansion (gemma3: the start-of-image token)
    image_token_id: int  # the token whose rows the image features fill
    image_size: int = 0  # a tile's (an image's) side in pixels
    image_seq_len: int = 0  # image tokens per tile (per image)
    patch_size: int = 0
    # idefics3: resized to the longest edge (capped), cut into tiles of max_image_size, plus a global view
    longest_edge: int = 0
    max_resolution: int = 0
    do_image_splitting: bool = False
    max_image_size: int = 0
    scale_factor: int = 0
    fake_image_token: str = ""
    global_image_token: str = ""
    row_col_token: str = ""  # a format string of `row` and `col`
    max_tile_grid: int | None = None  # the most tile rows (or columns) an image takes
    # qwen2_vl: native resolution within [min_pixels, max_pixels], flattened patch by patch
    min_pixels: int = 0
    max_pixels: int = 0
    max_aspect_ratio: float = 0.0
    temporal_patch_size: int = 0
    merge_size: int = 1
    window_size: int | None = None  # Qwen2.5-VL's attention windows, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()
    vision_start_token: str = ""
    vision_end_token: str = ""
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    # llava: the shortest edge resized to `shortest_edge`, else to height x width; then a center crop
    shortest_edge: int | None = None
    height: int | None = None
    width: int | None = None
    crop_height: int | None = None
    crop_width: int | None = None
    # gemma3: the prompt's run around the soft tokens
    end_of_image_token: str = ""
    soft_token: str = ""
    # the image tokens' ids in the tokenizer (checked single tokens), when the export had a tokenizer
    token_ids: dict[str, int] | None = None

    @classmethod
    def from_json(cls, fields: Fields) -> ImagePreprocessing:
        version = fields.raw("schema_version", None)
        if version != PREPROCESSING_SCHEMA_VERSION:
            fields.fail(
                f"has schema_version {version}; this pipeshard reads {PREPROCESSING_SCHEMA_VERSION} "
                "(export the model again)"
            )
        family = fields.str("family", choices=tuple(FAMILY_FIELDS))
        kinds = {f.name: f.type for f in dataclass_fields(cls)}
        values: dict[str, Any] = {"family": family}
        for name in (*COMMON_FIELDS, *FAMILY_FIELDS[family]):
            values[name] = _read(fields, name, kinds[name])
        token_ids = fields.raw("token_ids", None)
        if token_ids is not None:
            if not isinstance(token_ids, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in token_ids.values()
            ):
                fields.fail("must map tokens to their ids", "token_ids")
            values["token_ids"] = dict(token_ids)
        if values["resample"] not in RESAMPLING_FILTERS:
            fields.fail(f"is {values['resample']!r}, not one of {', '.join(RESAMPLING_FILTERS)}", "resample")
        fields.done()
        return cls(**values)

    def to_json(self) -> dict:
        """The section as the exporter writes it."""
        names = (*COMMON_FIELDS, *FAMILY_FIELDS[self.family])
        values = {name: getattr(self, name) for name in names}
        document = {"schema_version": PREPROCESSING_SCHEMA_VERSION, "family": self.family}
        document |= {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}
        return document | ({"token_ids": dict(self.token_ids)} if self.token_ids is not None else {})


def _read(fields: Fields, name: str, kind: str) -> Any:
    """Field `name` as its annotation says (`kind`, a string under `from __future__ import annotations`)."""
    default = None if name in NULLABLE_FIELDS else ...
    if kind in ("int", "int | None"):
        return fields.int(name, default, minimum=0 if name.endswith("_id") else 1)
    if kind == "bool":
        return fields.bool(name)
    if kind == "str":
        return fields.str(name)
    if kind == "float":  # kept as written (an integer stays one, so the section writes back the same)
        value = fields.raw(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            fields.fail(f"must be a positive number, not {value!r}"[:200], name)
        return value
    if kind == "tuple[float, ...]":
        values = fields.list(name)
        if len(values) != 3 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            fields.fail("must be three numbers (one per channel)", name)
        return tuple(values)
    if kind == "tuple[int, ...]":
        return tuple(fields.int_list(name, minimum=0))
    raise AssertionError(f"no reader for {name}: {kind}")


def read_image_preprocessing(document: Any, where: str, path: str = "") -> ImagePreprocessing:
    """A preprocessing section as written (export.json's, the manifest's, or exporter/image_processing.py's
    `preprocessing_config`), checked field by field; an error names `where` (the file) and `path` (the section)."""
    return ImagePreprocessing.from_json(Fields(document, where, path))
