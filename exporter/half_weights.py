"""Half-precision weights in a float32 graph: what `pipeshard export --dtype fp16|bf16` writes.

The model is loaded in the half-precision type (a bf16 or fp16 checkpoint keeps its bits; an fp32 one is rounded once)
and traced in float32, so every weight holds values the half type represents exactly. Here each weight of a product
or an embedding goes back to that type in storage, read through a Cast to float32: the graph computes in float32, as
PyTorch does over the same weights cast to float32 (the reference the export is checked against), and stores half
the bytes. ONNX Runtime alone folds each Cast into a float32 copy at load; pipeshard's CPU sessions read the stored
bytes with `pipeshard.WeightMatMul` instead (runtime/weight_matmul.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HALF_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
# Where a weight may be read through a Cast: (op, input position)
_CAST_USES = {("MatMul", 1), ("Gemm", 1), ("Transpose", 0)}
_GATHER_DATA = ("Gather", 0)
CAST_SUFFIX, STORED_SUFFIX = "_as_float", "_stored"


def _half_bytes(values: np.ndarray, dtype: str) -> bytes | None:
    """The values in the half type's bytes, or None where that type does not hold them exactly."""
    if dtype == "fp16":
        half = values.astype(np.float16)
        return half.tobytes() if np.array_equal(half.astype(np.float32), values) else None
    bits = np.ascontiguousarray(values).view(np.uint32)
    return (bits >> 16).astype("<u2").tobytes() if not np.any(bits & 0xFFFF) else None


def _with_metadata(node: onnx.NodeProto, like: onnx.NodeProto) -> onnx.NodeProto:
    """`node` with the module path of `like`, so the partitioner puts it in the same sub-layer."""
    node.metadata_props.extend(like.metadata_props)
    return node


def store_weights_in_half(model: onnx.ModelProto, dtype: str) -> int:
    """Store the float32 weights of products (MatMul, Gemm, directly or transposed) and embeddings (Gather) in
    `dtype`, in place: a product reads its weight through one Cast to float32, a Gather gathers the stored rows and
    casts them. Returns how many weights changed; a weight the type does not hold exactly stays float32."""
    target = HALF_TYPES[dtype]
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            uses[name].append((node, position))
    before: dict[int, list[onnx.NodeProto]] = defaultdict(
        list
    )  # nodes to insert before / after a node (by id)
    after: dict[int, list[onnx.NodeProto]] = defaultdict(list)
    halved: set[str] = set()
    for initializer in model.graph.initializer:
        users = uses.get(initializer.name, [])
        if (
            initializer.data_type != TensorProto.FLOAT
            or len(initializer.dims) < 2
            or not users
            or not all(
                (node.op_type, position) in _CAST_USES or (node.op_type, position) == _GATHER_DATA
                for node, position in users
            )
        ):
            continue
        stored = _half_bytes(numpy_helper.to_array(initializer), dtype)
        if stored is None:
            continue
        name = initializer.name
        initializer.CopyFrom(helper.make_tensor(name, target, list(initializer.dims), stored, raw=True))
        products = [(node, position) for node, position in users if (node.op_type, position) in _CAST_USES]
        if products:
            first = products[0][0]
            before[id(first)].append(
                _with_metadata(
                    helper.make_node(
                        "Cast", [name], [name + CAST_SUFFIX], name=name + CAST_SUFFIX, to=TensorProto.FLOAT
                    ),
                    first,
                )
            )
            for node, position in products:
                node.input[position] = name + CAST_SUFFIX
        for node, _ in users:
            if node.op_type == "Gather":
                gathered = node.output[0]
                node.output[0] = gathered + STORED_SUFFIX
                after[id(node)].append(
                    _with_metadata(
                        helper.make_node(
                            "Cast",
                            [gathered + STORED_SUFFIX],
                            [gathered],
                            name=gathered + STORED_SUFFIX,
                            to=TensorProto.FLOAT,
                        ),
                        node,
                    )
                )
        halved.add(name)
    for info in (*model.graph.value_info, *model.graph.input):  # declared types of the changed weights
        if info.name in halved:
            info.type.tensor_type.elem_type = target
    nodes = [
        inserted for node in model.graph.node for inserted in (*before[id(node)], node, *after[id(node)])
    ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(halved)
