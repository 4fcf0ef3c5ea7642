"""The vision graph's index inputs, computed on the host from the images' patch grids (Qwen2.5-VL's window order,
2-D rotary ids and attention groups): the exporter traces the tower with them and the runtime binds them, so both
read this one definition. Also the version of export.json's `vision.preprocessing` section."""

from __future__ import annotations

import numpy as np

PREPROCESSING_SCHEMA_VERSION = 1


def cu_seqlens(grid_thw: np.ndarray) -> np.ndarray:
    """int32 [frames + 1]: where each frame's patches start and end in the packed sequence (full attention)."""
    grid_thw = np.asarray(grid_thw, dtype=np.int64)
    frame_lengths = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return np.concatenate([[0], np.cumsum(frame_lengths)]).astype(np.int32)


def rotary_position_ids(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """int64 [patches, 2]: each patch's (row, column) in its image, in the merged-block order of pixel_values."""
    per_image = []
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        row_ids, col_ids = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block_shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        row_ids = row_ids.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
        col_ids = col_ids.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
        per_image.append(np.tile(np.stack([row_ids, col_ids], axis=-1), (t, 1)))
    return np.concatenate(per_image).astype(np.int64)


def vision_window_index(grid_thw: np.ndarray, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window attention: the order merged patches take so each window is contiguous
    (int64 [merged patches]) and the windows' bounds in patches (int32 [windows + 1])."""
    if not config.get("window_size"):
        raise ValueError("this model's vision tower has no window attention (no window_size)")
    merge = config["merge_size"]
    window = config["window_size"] // merge // config["patch_size"]  # in merged patches
    window_index: list[np.ndarray] = []
    bounds = [0]
    first_index = 0
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        merged_h, merged_w = h // merge, w // merge
        index = np.arange(t * merged_h * merged_w).reshape(t, merged_h, merged_w)
        # Pad up to whole windows (a full window more where the grid divides evenly, as transformers does;
        # those windows are empty and drop out below).
        pad_h, pad_w = window - merged_h % window, window - merged_w % window
        windows_h, windows_w = (merged_h + pad_h) // window, (merged_w + pad_w) // window
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        padded = padded.reshape(t, windows_h, window, windows_w, window).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t * windows_h * windows_w, window * window)
        window_lengths = (padded >= 0).sum(axis=1)
        flat = padded.reshape(-1)
        window_index.append(flat[flat >= 0] + first_index)
        bounds.extend((bounds[-1] + np.cumsum(window_lengths) * merge * merge).tolist())
        first_index += t * merged_h * merged_w
    bounds_array = np.array(bounds, dtype=np.int32)
    keep = np.concatenate([[True], np.diff(bounds_array) != 0])
    return np.concatenate(window_index).astype(np.int64), bounds_array[keep]


def attention_groups(bounds: np.ndarray, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Groups of patches that attend together (group g: rows bounds[g] .. bounds[g + 1]), padded to one length
    (`length`, else the longest group): rows int64 [groups, length], each slot's patch or -1 for padding, and
    slots int64 [patches], each patch's place in the flattened groups (where its output is gathered from)."""
    bounds = np.asarray(bounds, dtype=np.int64)
    lengths = np.diff(bounds)
    width = int(length or lengths.max())
    if lengths.max() > width:
        raise ValueError(f"a group of {lengths.max()} patches is longer than the padded length {width}")
    offsets = np.arange(width)
    rows = np.where(offsets[None, :] < lengths[:, None], bounds[:-1, None] + offsets[None, :], -1)
    group_of = np.repeat(np.arange(len(lengths)), lengths)
    slots = group_of * width + np.arange(bounds[-1]) - bounds[:-1][group_of]
    return rows.astype(np.int64), slots.astype(np.int64)


def qwen2_5_vl_vision_inputs(grid_thw: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """Everything Qwen2.5-VL's vision graph takes besides the pixels, for images of these grids: the window
    order of the merged patches and its inverse, each patch's 2-D rotary position (in pixel_values' order), and
    the attention groups in window order: windows padded to the window's size, whole images (full attention)
    padded to the largest."""
    grid_thw = np.asarray(grid_thw, dtype=np.int64)
    window_index, window_bounds = vision_window_index(grid_thw, config)
    window_side = config["window_size"] // config["patch_size"]
    window_rows, window_slots = attention_groups(window_bounds, window_side * window_side)
    image_rows, image_slots = attention_groups(cu_seqlens(grid_thw))
    return {
        "window_index": window_index,
        "reverse_index": np.argsort(window_index).astype(np.int64),
        "rotary_ids": rotary_position_ids(grid_thw, config["merge_size"]),
        "window_rows": window_rows,
        "window_slots": window_slots,
        "image_rows": image_rows,
        "image_slots": image_slots,
    }
