"""The KV cache as the exported attention wants it: per layer, one preallocated host buffer
[batch, kv_heads, capacity, head_dim] bound as both the past input and the present output, so
GroupQueryAttention appends the new tokens in place (nothing is copied per step)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.formats.image_preprocessing import ImagePreprocessing
from pipeshard.formats.io_names import MROPE_ROWS

DEFAULT_CAPACITY = 2048


def check_step_shape(batch: int, tokens: int, total: int) -> None:
    """ONNX Runtime's CPU GroupQueryAttention runs several new tokens on top of a past only for one
    sequence; the runtimes never ask for that (a batch's prompt is one step), a caller might."""
    if batch > 1 and tokens > 1 and total > tokens:
        raise UserError(
            f"a step of {tokens} new tokens on top of a cached past is only supported for batch 1 "
            f"(got batch {batch}): prefill a batch's prompts in one step"
        )


class HostKvCache:
    """Host KV buffers for a set of past names; grows (copying) when a step needs more room."""

    def __init__(self, past_names: list[str], kv_heads: int, head_dim: int, dtype) -> None:
        self.past_names = list(past_names)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, np.dtype(dtype)
        self.buffers: dict[str, np.ndarray] = {}
        self.batch = 0
        self.capacity = 0

    def reset(self, batch: int, capacity: int | None) -> None:
        """Fresh, zeroed buffers for new sequences (the old ones are let go first, not held beside them)."""
        self.buffers = {}
        self.batch, self.capacity = batch, max(1, capacity or DEFAULT_CAPACITY)
        self.buffers = {name: np.zeros(self.shape, self.dtype) for name in self.past_names}

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.kv_heads, self.capacity, self.head_dim

    def ensure(self, total: int) -> bool:
        """Room for `total` tokens; True when the buffers were reallocated (bindings must be redone)."""
        if total <= self.capacity:
            return False
        capacity = max(total, 2 * self.capacity)
        for name, old in self.buffers.items():
            grown = np.zeros((self.batch, self.kv_heads, capacity, self.head_dim), self.dtype)
            grown[:, :, : self.capacity] = old
            self.buffers[name] = grown
        self.capacity = capacity
        return True


class MropeSettings(NamedTuple):
    """What an M-RoPE decoder's positions are computed from: the vision tower's merge size and image token."""

    merge_size: int
    image_token_id: int


def mrope_settings(position_rows: int, preprocessing: ImagePreprocessing | None) -> MropeSettings | None:
    """An M-RoPE decoder's settings (from its vision tower's image preprocessing), or None for a decoder of plain
    positions ([batch, new tokens])."""
    if position_rows == 1:
        return None
    if position_rows != MROPE_ROWS or preprocessing is None:
        raise ValueError(f"position ids of {position_rows} rows without a vision tower are not known")
    return MropeSettings(preprocessing.merge_size, preprocessing.image_token_id)


def image_rows(token_ids, begin: int, end: int, image_token_id: int | None, features):
    """The rows of `features` (one per image token of `token_ids`, in order) that belong to the image tokens of
    token_ids[begin:end]: what a step feeding that part of a prompt takes; None without features."""
    if features is None or image_token_id is None:
        return None
    ids = np.asarray(token_ids)
    first = int(np.count_nonzero(ids[:begin] == image_token_id))
    return features[first : first + int(np.count_nonzero(ids[begin:end] == image_token_id))]


def chunk_end(token_ids, begin: int, limit: int, run_token_id: int | None) -> int:
    """Where the prefill chunk from `begin` of at most `limit` tokens ends. With `run_token_id` (a decoder whose
    image tokens attend to their whole run within one step: Gemma 3) no chunk ends inside a run of that token;
    a run longer than a chunk is a UserError."""
    ids = np.asarray(token_ids).reshape(-1)
    end = min(len(ids), begin + limit)
    if run_token_id is None or end == len(ids) or ids[end - 1] != run_token_id or ids[end] != run_token_id:
        return end
    start = end - 1
    while start > begin and ids[start - 1] == run_token_id:
        start -= 1
    if start == begin:
        length = int(np.argmin(np.append(ids[begin:], -1) == run_token_id))
        raise UserError(
            f"an image's run of {length} tokens does not fit a prefill chunk of {limit} tokens (this model "
            "attends within an image's run in one step); plan with a token tier of at least that many"
        )
    return start
