"""Products with stored weights on the CPU: MatMul / Gemm nodes swapped for `pipeshard.WeightMatMul`.

A half-precision pack (`pipeshard export --dtype fp16|bf16`) reads each product's weight through a Cast to float32
(exporter/half_weights.py). ONNX Runtime folds that Cast into a float32 copy of the weight at load — twice the
memory, and a decode step reading twice the bytes. pipeshard's CPU sessions swap `Cast(W) -> MatMul(x, .)` (and
`Gemm(x, ., transB)`) for `WeightMatMul(x, W)` (runtime/_matmul.c), which reads W's stored bytes and computes in
float32: the same sums as the graph, in another order (float rounding apart, the same greedy tokens).
For float32 weights the swap is made where asked (the chain's decode steps, whose few rows the op streams faster
than ONNX Runtime's SGEMM). The pack is not changed; a host without the op runs its files as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeshard.formats.manifest import Weight
from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN

WEIGHT_OP = "WeightMatMul"
HALF_DTYPES = frozenset({"float16", "bfloat16"})
_FLOAT = 1  # TensorProto.FLOAT, Cast's `to`
_NODE_NAME, _NODE_DOC, _NODE_METADATA = 3, 6, 9
_ATTRIBUTE_NAME, _ATTRIBUTE_INT, _ATTRIBUTE_TYPE, _ATTRIBUTE_TYPE_INT = 1, 3, 20, 2
_GEMM_DEFAULTS = {"alpha": 1.0, "beta": 1.0, "transA": 0}


def product_weights(stored: Iterable[Weight], float_weights: bool) -> set[str]:
    """The 2-D weights (manifest records) the op may read: half-precision ones, and float32 ones if asked."""
    return {
        w.name
        for w in stored
        if len(w.shape) == 2 and (w.dtype in HALF_DTYPES or float_weights and w.dtype == "float32")
    }


def _product(fields: list[wire.Field], read: dict[str, str]) -> tuple[str, str, int] | None:
    """(x, W, trans_b) when the node is a MatMul or plain Gemm of x and a weight W the op reads."""
    op = wire.node_op(fields)
    inputs = wire.strings(fields, wire.NODE_INPUT)
    if op == ("", "MatMul") and len(inputs) == 2 and inputs[1] in read:
        return inputs[0], read[inputs[1]], 0
    if op == ("", "Gemm") and len(inputs) == 2 and inputs[1] in read:
        attributes = wire.node_attributes(fields)
        if all(attributes.get(name, default) == default for name, default in _GEMM_DEFAULTS.items()):
            return inputs[0], read[inputs[1]], int(attributes.get("transB", 0))
    return None


def _weight_matmul(fields: list[wire.Field], x: str, weight: str, trans_b: int) -> bytes:
    kept = [(n, k, v) for n, k, v in fields if n in (wire.NODE_OUTPUT, _NODE_NAME, _NODE_DOC, _NODE_METADATA)]
    node = [
        (wire.NODE_INPUT, wire.LENGTH, x.encode()),
        (wire.NODE_INPUT, wire.LENGTH, weight.encode()),
        *kept,
        (wire.NODE_OP_TYPE, wire.LENGTH, WEIGHT_OP.encode()),
        (wire.NODE_DOMAIN, wire.LENGTH, CUSTOM_DOMAIN.encode()),
    ]
    if trans_b:
        node.append(
            (
                wire.NODE_ATTRIBUTE,
                wire.LENGTH,
                wire.serialize(
                    [
                        (_ATTRIBUTE_NAME, wire.LENGTH, b"trans_b"),
                        (_ATTRIBUTE_INT, wire.VARINT, 1),
                        (_ATTRIBUTE_TYPE, wire.VARINT, _ATTRIBUTE_TYPE_INT),
                    ]
                ),
            )
        )
    return wire.serialize(node)


def swap_products(
    nodes: list[bytes], weights: set[str], graph_outputs: set[str]
) -> tuple[list[bytes | None], int]:
    """The serialized nodes with every product of a weight in `weights` (read directly, or through a Cast to
    float) as WeightMatMul, and Casts nothing reads any more as None; and how many products were swapped."""
    parsed = [wire.parse(node) for node in nodes]
    read = {weight: weight for weight in weights}  # tensor -> the stored weight it is
    for fields in parsed:
        inputs = wire.strings(fields, wire.NODE_INPUT)
        if (
            wire.node_op(fields) == ("", "Cast")
            and inputs
            and inputs[0] in weights
            and wire.node_attributes(fields).get("to") == _FLOAT
        ):
            read[wire.strings(fields, wire.NODE_OUTPUT)[0]] = inputs[0]
    out: list[bytes | None] = []
    swapped = 0
    for node, fields in zip(nodes, parsed, strict=True):
        product = _product(fields, read)
        out.append(node if product is None else _weight_matmul(fields, *product))
        swapped += product is not None
    still_read = graph_outputs | {
        name for node in out if node is not None for name in wire.strings(wire.parse(node), wire.NODE_INPUT)
    }
    for index, fields in enumerate(parsed):
        outputs = wire.strings(fields, wire.NODE_OUTPUT)
        if wire.node_op(fields) == ("", "Cast") and outputs[0] in read and outputs[0] not in still_read:
            out[index] = None
    return out, swapped
