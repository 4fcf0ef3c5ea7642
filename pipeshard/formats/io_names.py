"""The names in the exported graphs that the stages agree on: KV inputs and outputs, the attention's per-step
inputs, a VLM decoder's image rows, and the module scope the exporter records on every node."""

from __future__ import annotations

import ast
import re

PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."
IMAGE_FEATURES = "image_features"  # a VLM decoder's rows for the step's image tokens (none on most steps)
# GroupQueryAttention's per-step inputs besides the KV buffers, made by the exported graph (a pack's prologue)
# from `attention_mask`: each row's length - 1 (int32 [batch]), the total length (int32 scalar), and the
# additive bias of the padding alone ([batch, 1, new, total]: 0 where the mask is set, the dtype's lowest
# value elsewhere). GQA reads each row's length from seqlens_k alone; the total length only has to match the
# bias's last dimension, so at one new token both may be the KV capacity.
SEQLENS = "_gqa_seqlens_k"
TOTAL = "_gqa_total_sequence_length"
PADDING_BIAS = "_gqa_padding_bias"
GQA_BIAS_INPUT = 10  # com.microsoft::GroupQueryAttention's attention_bias: its input at this index
ROTARY_CACHES = ("_gqa_cos_cache", "_gqa_sin_cache")  # the tables' rows 0 .. total - 1, per step
MROPE_ROWS = 3  # an M-RoPE decoder's position_ids are [3, batch, new tokens]: time, row, column
# A GGUF's quantized product as the exporter stores it (exporter/quantized_weights.py): the MatMulNBits node of the
# low plane (4-bit, or 2-bit where every code is 0..3) computes the product; a high plane's node and a minimum term's
# MatMul are parts of the same product.
LOW_PLANE_SUFFIXES = {4: "_q4_low", 2: "_q2_low"}  # by the plane's bits
HIGH_PLANE_SUFFIX = "_q4_high"
MINIMUM_TERM_SUFFIX = "_minimum_term"
# The tails of a quantized weight's stored parts (WEIGHT + tail: quantized_weights.Layout.parts); a repeated layer's
# copy names the weight, not the part (`W@L5_q4_low`), so the estimator still finds a product's parts by its name.
QUANTIZED_PART_TAILS = (
    *(
        low + tail
        for low in LOW_PLANE_SUFFIXES.values()
        for tail in ("", "_scales", "_scales_sub", "_scales_super", "_zero_points")
    ),
    "_low_gather_zero_points",
    HIGH_PLANE_SUFFIX,
    "_minimums",
    "_minimums_sub",
    "_minimums_super",
)
# The torch exporter's record of a node's module scopes (`metadata_props`), which sub-layers are cut by.
SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def present_name(past: str) -> str:
    return PRESENT_PREFIX + past[len(PAST_PREFIX) :]


def module_path(node) -> str | None:
    """The innermost module scope recorded on an ONNX `node`, or None when the exporter recorded none."""
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            scopes = ast.literal_eval(prop.value)
            # The last entry is the op's own name; the one before it is its module. A sliced ModuleList
            # (`self.layers[:n]`) is sometimes recorded as `layers.slice(None, n, None).i`.
            return re.sub(r"\.slice\([^)]*\)", "", scopes[-2]) if len(scopes) >= 2 else ""
    return None


def renamed_weight(name: str, suffix: str) -> str:
    """`name` + `suffix`, or for a quantized weight's part the part of the weight so renamed."""
    tail = next((t for t in QUANTIZED_PART_TAILS if name.endswith(t)), "")
    return name[: len(name) - len(tail)] + suffix + tail
