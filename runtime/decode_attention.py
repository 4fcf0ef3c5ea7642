"""The attention of decode steps on the CPU: GroupQueryAttention nodes swapped for `pipeshard.DecodeAttention`.

ONNX Runtime's CPU GroupQueryAttention costs ~0.33 us per cached token per layer at one new token (SmolLM2,
9 heads: ~80 us a layer at 256 tokens, ~13 % of a decode step); `runtime/_attention.c` does the same arithmetic
in one pass over the cache. The pack is not changed: at load, each attention sub-layer whose GroupQueryAttention
the op covers gets a second session over the same file with that node swapped (same inputs, outputs and
attributes); the chain runs it for steps of one new token and the original for prompts. The two sessions share
their weights: ONNX Runtime shares prepacked weights between sessions only for initializers the caller provides,
so both get the sub-layer's stored weights as arrays mapped from its weight file, with one prepacked-weights
container; once both are made, the mapped pages are let go (the sessions use their packed copies; a weight read
unpacked, like a norm's, pages back in on first use). Results equal ONNX Runtime's kernel to
float rounding (the sums run in another order), so greedy tokens are the same.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from pipeshard.runtime.capi import CUSTOM_DOMAIN

GQA_DOMAIN, GQA_OP = "com.microsoft", "GroupQueryAttention"
DECODE_OP = "DecodeAttention"
# GroupQueryAttention's inputs the op requires absent (it takes a packed query and derives positions from
# seqlens_k), and the attributes it implements only at these values.
_ABSENT_INPUTS = (1, 2, 9)  # key, value, position_ids
_COS_CACHE, _SIN_CACHE = 7, 8
_DEFAULT_ATTRIBUTES = {"rotary_interleaved": 0, "softcap": 0.0, "local_window_size": -1, "smooth_softmax": 0}


def covered(node: onnx.NodeProto, float_inputs: set[str]) -> bool:
    """Whether DecodeAttention computes what this GroupQueryAttention node does at one new token."""
    inputs = list(node.input) + [""] * (11 - len(node.input))
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    rotary = attributes.get("do_rotary", 0) == 1
    return (len(node.input) <= 11 and len(node.output) == 3
            and all(not inputs[i] for i in _ABSENT_INPUTS)
            and rotary == bool(inputs[_COS_CACHE]) == bool(inputs[_SIN_CACHE])
            and all(attributes.get(name, default) == default for name, default in _DEFAULT_ATTRIBUTES.items())
            and inputs[3] in float_inputs)


@dataclass
class DecodeVariant:
    """A sub-layer's decode graph (serialized), and its stored weights mapped read-only, by initializer name."""

    model: bytes
    weights: dict[str, np.ndarray]
    _maps: list[mmap.mmap] = field(default_factory=list)

    def release_pages(self) -> None:
        """Let the kernel drop the mapped weights' pages (they are read again from the file if used)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped in self._maps:
                mapped.madvise(mmap.MADV_DONTNEED)


def decode_variant(path: Path) -> DecodeVariant | None:
    """The sub-layer at `path` with its GroupQueryAttention swapped for DecodeAttention, or None when it has none,
    or one the op does not cover."""
    model = onnx.load(path, load_external_data=False)
    nodes = [n for n in model.graph.node if (n.domain, n.op_type) == (GQA_DOMAIN, GQA_OP)]
    float_inputs = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    if not nodes or not all(covered(node, float_inputs) for node in nodes):
        return None
    weights, maps = _mapped_weights(model.graph, path.parent)
    for node in nodes:
        node.domain, node.op_type = CUSTOM_DOMAIN, DECODE_OP
    model.opset_import.append(onnx.helper.make_opsetid(CUSTOM_DOMAIN, 1))
    return DecodeVariant(model.SerializeToString(), weights, maps)


def _mapped_weights(graph: onnx.GraphProto, folder: Path) -> tuple[dict[str, np.ndarray], list[mmap.mmap]]:
    """The graph's external initializers as read-only arrays over their files, mapped once per file."""
    maps: dict[str, mmap.mmap] = {}
    weights = {}
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        where = {entry.key: entry.value for entry in tensor.external_data}
        if where["location"] not in maps:
            with open(folder / where["location"], "rb") as file:
                maps[where["location"]] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        count = int(np.prod(tensor.dims, dtype=np.int64))
        weights[tensor.name] = np.frombuffer(maps[where["location"]], dtype, count,
                                             int(where.get("offset", 0))).reshape(tuple(tensor.dims))
    return weights, list(maps.values())
