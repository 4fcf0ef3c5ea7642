"""The attention of decode steps on the CPU: GroupQueryAttention nodes swapped for `pipeshard.DecodeAttention`.

ONNX Runtime's CPU GroupQueryAttention is slow at one new token (two small SGEMMs per head, each packing its
operand: on SmolLM2, hot, 42 us a layer at 256 cached tokens, 176 us at 1024); `runtime/_attention.c` does the
same arithmetic in one pass over the cache, split across the intra-op threads (24 and 84 us).

The pack is not changed: at load, each attention sub-layer whose GroupQueryAttention the op covers gets a second
session over the same file with that node swapped (same inputs, outputs and attributes; renamed on protobuf's
wire format, `runtime/protowire.py`); the chain runs it for steps of one new token and the original for prompts.
The two sessions share their weights: ONNX Runtime shares prepacked weights between sessions only for
initializers the caller provides, so both get the sub-layer's stored weights as arrays mapped from its weight
file, with one prepacked-weights container; once both are made, the mapped pages are let go (the sessions use
their packed copies; a weight read unpacked, like a norm's, pages back in on first use). Results equal ONNX
Runtime's kernel to float rounding (the sums run in another order), so greedy tokens are the same.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN

GQA_DOMAIN, GQA_OP = "com.microsoft", "GroupQueryAttention"
DECODE_OP = "DecodeAttention"
# GroupQueryAttention's inputs the op requires absent (it takes a packed query and derives positions from
# seqlens_k), and the attributes it implements only at these values.
_ABSENT_INPUTS = (1, 2, 9)  # key, value, position_ids
_COS_CACHE, _SIN_CACHE, _PAST_KEY = 7, 8, 3
_DEFAULT_ATTRIBUTES = {"do_rotary": 0, "rotary_interleaved": 0, "softcap": 0.0, "local_window_size": -1,
                       "smooth_softmax": 0}
# ONNX's field numbers (onnx.proto): ModelProto.graph / opset_import, GraphProto.node, NodeProto.input / output /
# op_type / attribute / domain, AttributeProto.name / f / i, OperatorSetIdProto.domain / version.
_MODEL_GRAPH, _MODEL_OPSET_IMPORT, _GRAPH_NODE = 7, 8, 1
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 4, 5, 7
_ATTRIBUTE_NAME, _ATTRIBUTE_FLOAT, _ATTRIBUTE_INT = 1, 2, 3
_OPSET_DOMAIN, _OPSET_VERSION = 1, 2


def _attributes(node: list[wire.Field]) -> dict[str, float | int]:
    """A node's float and int attributes by name."""
    found = {}
    for number, _, value in node:
        if number == _NODE_ATTRIBUTE:
            attribute = wire.parse(value)
            name = wire.strings(attribute, _ATTRIBUTE_NAME)[0]
            for n, kind, v in attribute:
                if n == _ATTRIBUTE_FLOAT and kind == wire.FIXED32:
                    found[name] = wire.fixed_float(v)
                elif n == _ATTRIBUTE_INT and kind == wire.VARINT:
                    found[name] = wire.signed(v)
    return found


def _is_attention(node: list[wire.Field]) -> bool:
    return (wire.strings(node, _NODE_DOMAIN), wire.strings(node, _NODE_OP_TYPE)) == ([GQA_DOMAIN], [GQA_OP])


def covered(node: bytes, float_inputs: set[str]) -> bool:
    """Whether DecodeAttention computes what this serialized GroupQueryAttention node does at one new token."""
    fields = wire.parse(node)
    inputs = wire.strings(fields, _NODE_INPUT)
    inputs += [""] * (11 - len(inputs))
    attributes = _attributes(fields)
    rotary = attributes.get("do_rotary", 0) == 1
    return (len(inputs) == 11 and len(wire.strings(fields, _NODE_OUTPUT)) == 3
            and all(not inputs[i] for i in _ABSENT_INPUTS)
            and rotary == bool(inputs[_COS_CACHE]) == bool(inputs[_SIN_CACHE])
            and all(attributes.get(name, default) == default for name, default in _DEFAULT_ATTRIBUTES.items()
                    if name != "do_rotary")
            and inputs[_PAST_KEY] in float_inputs)


@dataclass
class DecodeVariant:
    """A sub-layer's decode graph (serialized), and its stored weights mapped read-only, by initializer name."""

    model: bytes
    weights: dict[str, np.ndarray]
    maps: list[mmap.mmap]

    def release_pages(self) -> None:
        """Let the kernel drop the mapped weights' pages (they are read again from the file if used)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped in self.maps:
                mapped.madvise(mmap.MADV_DONTNEED)


def decode_variant(path: Path, entry: dict) -> DecodeVariant | None:
    """The sub-layer at `path` (its manifest `entry`) with its GroupQueryAttention swapped for DecodeAttention, or
    None when it has none, or one the op does not cover."""
    model = wire.parse(path.read_bytes())
    graph_at = next(i for i, (number, _, _) in enumerate(model) if number == _MODEL_GRAPH)
    graph = wire.parse(model[graph_at][2])
    float_inputs = {i["name"] for i in entry["inputs"] if i["dtype"] == "float32"}
    swapped = 0
    for index, (number, kind, value) in enumerate(graph):
        if number != _GRAPH_NODE or not _is_attention(node := wire.parse(value)):
            continue
        if not covered(value, float_inputs):
            return None
        node = [(n, k, (DECODE_OP if n == _NODE_OP_TYPE else CUSTOM_DOMAIN).encode()
                 if n in (_NODE_OP_TYPE, _NODE_DOMAIN) else v) for n, k, v in node]
        graph[index] = (number, kind, wire.serialize(node))
        swapped += 1
    if not swapped:
        return None
    model[graph_at] = (_MODEL_GRAPH, wire.LENGTH, wire.serialize(graph))
    model.append((_MODEL_OPSET_IMPORT, wire.LENGTH, wire.serialize(
        [(_OPSET_DOMAIN, wire.LENGTH, CUSTOM_DOMAIN.encode()), (_OPSET_VERSION, wire.VARINT, 1)])))
    weights, maps = _mapped_weights(entry["weights"], path.parent)
    return DecodeVariant(wire.serialize(model), weights, maps)


def _mapped_weights(stored: list[dict], folder: Path) -> tuple[dict[str, np.ndarray], list[mmap.mmap]]:
    """The sub-layer's stored weights (its manifest entries) as read-only arrays over their files, mapped once per
    file."""
    maps: dict[str, mmap.mmap] = {}
    weights = {}
    for weight in stored:
        if weight["file"] not in maps:
            with open(folder / weight["file"], "rb") as file:
                maps[weight["file"]] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(weight["dtype"])
        weights[weight["name"]] = np.frombuffer(maps[weight["file"]], dtype, weight["bytes"] // dtype.itemsize,
                                                weight["offset"]).reshape(weight["shape"])
    return weights, list(maps.values())
