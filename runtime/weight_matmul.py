"""Products with stored weights on the CPU: MatMul / Gemm nodes swapped for `pipeshard.WeightMatMul`.

A half-precision pack (`pipeshard export --dtype fp16|bf16`) reads each product's weight through a Cast to float32
(exporter/half_weights.py). ONNX Runtime folds that Cast into a float32 copy of the weight at load — twice the
memory, and a decode step reading twice the bytes. pipeshard's CPU sessions swap `Cast(W) -> MatMul(x, .)` (and
`Gemm(x, ., transB)`) for `WeightMatMul(x, W)` (runtime/_matmul.c), which reads W's stored bytes and computes in
float32: the same sums as the graph, in another order (float rounding apart, the same greedy tokens).
For float32 weights the swap is made where asked (the chain's decode steps, whose few rows the op streams faster
than ONNX Runtime's SGEMM).

A GGUF pack (`--dtype gguf`, exporter/quantized_weights.py) stores its products as `com.microsoft::MatMulNBits` over
4-bit planes; the CPU sessions swap each for `pipeshard.BlockMatMul` (runtime/_matmul.c), which computes the same
`(code - zero point) * scale` weights in float32, faster than ONNX Runtime's kernel at a decode step. A wide format's
two planes (`low + 16 * high`: MatMulNBits, MatMulNBits, Mul by 16, Add) become one BlockMatMul over both.
The pack is not changed; a host without the ops runs its files as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeshard.formats.manifest import Weight
from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN

WEIGHT_OP = "WeightMatMul"
BLOCK_OP = "BlockMatMul"
HALF_DTYPES = frozenset({"float16", "bfloat16"})
BLOCK_SIZES = frozenset({16, 32})  # what BlockMatMul computes (a GGUF pack's blocks)
_MS_DOMAIN = "com.microsoft"
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_FLOAT_DATA, _TENSOR_NAME, _TENSOR_RAW_DATA = 1, 2, 4, 8, 9
_FLOAT = 1  # TensorProto.FLOAT, Cast's `to`
_NODE_NAME, _NODE_DOC, _NODE_METADATA = 3, 6, 9
_ATTRIBUTE_NAME, _ATTRIBUTE_INT, _ATTRIBUTE_TYPE, _ATTRIBUTE_TYPE_INT = 1, 3, 20, 2
_GEMM_DEFAULTS = {"alpha": 1.0, "beta": 1.0, "transA": 0}


def product_weights(stored: Iterable[Weight], float_weights: bool) -> set[str]:
    """The weights (manifest records) the ops may read: 2-D half-precision ones, float32 ones if asked, and the uint8
    planes and zero points of 4-bit products."""
    return {
        w.name
        for w in stored
        if w.dtype == "uint8"
        or len(w.shape) == 2
        and (w.dtype in HALF_DTYPES or float_weights and w.dtype == "float32")
    }


def scalar_constants(initializers: Iterable[bytes]) -> dict[str, float]:
    """The float32 scalars among serialized TensorProtos (inline initializers), by name: how the swap knows a Mul's
    factor."""
    found = {}
    for tensor in initializers:
        fields = wire.parse(tensor)
        if any(n == _TENSOR_DATA_TYPE and v != _FLOAT for n, _, v in fields):
            continue
        if any(n == _TENSOR_DIMS and v != 1 for n, _, v in fields):
            continue
        data = [
            v for n, kind, v in fields if n in (_TENSOR_RAW_DATA, _TENSOR_FLOAT_DATA) and kind != wire.VARINT
        ]
        names = wire.strings(fields, _TENSOR_NAME)
        if names and len(data) == 1 and len(data[0]) == 4:
            found[names[0]] = wire.fixed_float(data[0])
    return found


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


def _block_product(fields: list[wire.Field], read: set[str]) -> list[str] | None:
    """BlockMatMul's inputs (x, B, scales[, zero points]) when the node is a MatMulNBits it computes: 4 bits,
    blocks of 16 or 32, float arithmetic (accuracy_level 4 would quantize x to int8: another function), no g_idx or
    bias, B and its zero points weights the op reads."""
    if wire.node_op(fields) != (_MS_DOMAIN, "MatMulNBits"):
        return None
    attributes = wire.node_attributes(fields)
    inputs = wire.strings(fields, wire.NODE_INPUT)
    if attributes.get("bits", 4) != 4 or attributes.get("block_size") not in BLOCK_SIZES:
        return None
    if (
        attributes.get("accuracy_level", 0) == 4
        or len(inputs) < 3
        or any(inputs[4:])
        or inputs[1] not in read
    ):
        return None
    if len(inputs) > 3 and inputs[3] and inputs[3] not in read:
        return None
    return inputs[:4] if len(inputs) > 3 and inputs[3] else inputs[:3]


def _block_matmul(like: list[wire.Field], inputs: list[str], block_size: int) -> bytes:
    kept = [(n, k, v) for n, k, v in like if n in (wire.NODE_OUTPUT, _NODE_NAME, _NODE_DOC, _NODE_METADATA)]
    attribute = [
        (_ATTRIBUTE_NAME, wire.LENGTH, b"block_size"),
        (_ATTRIBUTE_INT, wire.VARINT, block_size),
        (_ATTRIBUTE_TYPE, wire.VARINT, _ATTRIBUTE_TYPE_INT),
    ]
    return wire.serialize(
        [
            *((wire.NODE_INPUT, wire.LENGTH, name.encode()) for name in inputs),
            *kept,
            (wire.NODE_OP_TYPE, wire.LENGTH, BLOCK_OP.encode()),
            (wire.NODE_DOMAIN, wire.LENGTH, CUSTOM_DOMAIN.encode()),
            (wire.NODE_ATTRIBUTE, wire.LENGTH, wire.serialize(attribute)),
        ]
    )


def _fold_high_planes(
    parsed: list[list[wire.Field]],
    blocks: dict[int, list[str]],
    graph_outputs: set[str],
    constants: dict[str, float],
) -> dict[int, tuple[list[str], list[wire.Field], list[int]]]:
    """Each `Add(low, Mul(high, 16))` of two block products of one x and one scales, the high one without zero
    points, each result read there only: the Add's index -> (BlockMatMul's inputs with the high plane, the Add's
    fields, the indices of the three nodes it replaces)."""
    producer = {
        wire.strings(f, wire.NODE_OUTPUT)[0]: i
        for i, f in enumerate(parsed)
        if wire.strings(f, wire.NODE_OUTPUT)
    }
    readers: dict[str, int] = {}
    for fields in parsed:
        for name in wire.strings(fields, wire.NODE_INPUT):
            readers[name] = readers.get(name, 0) + 1

    def only_here(name: str) -> bool:
        return readers.get(name) == 1 and name not in graph_outputs

    folds = {}
    for index, fields in enumerate(parsed):
        inputs = wire.strings(fields, wire.NODE_INPUT)
        if wire.node_op(fields) != ("", "Add") or len(inputs) != 2:
            continue
        for low_name, times_name in (inputs, inputs[::-1]):
            low, times = producer.get(low_name), producer.get(times_name)
            if low not in blocks or times is None or not (only_here(low_name) and only_here(times_name)):
                continue
            mul = wire.strings(parsed[times], wire.NODE_INPUT)
            if wire.node_op(parsed[times]) != ("", "Mul") or len(mul) != 2:
                continue
            for high_name, factor in (mul, mul[::-1]):
                high = producer.get(high_name)
                high_inputs = blocks.get(high, [])
                if (
                    constants.get(factor) == 16.0
                    and only_here(high_name)
                    and len(high_inputs) == 3
                    and high_inputs[0] == blocks[low][0]
                    and high_inputs[2] == blocks[low][2]
                    and _block_size(parsed[high]) == _block_size(parsed[low])
                ):
                    low_inputs = blocks[low] + [""] * (4 - len(blocks[low]))
                    folds[index] = ([*low_inputs, high_inputs[1]], fields, [low, times, high])
                    break
            if index in folds:
                break
    return folds


def _block_size(fields: list[wire.Field]) -> int:
    return int(wire.node_attributes(fields)["block_size"])


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
    nodes: list[bytes],
    weights: set[str],
    graph_outputs: set[str],
    constants: dict[str, float] | None = None,
) -> tuple[list[bytes | None], int]:
    """The serialized nodes with every product of a weight in `weights` (read directly, or through a Cast to
    float) as WeightMatMul, every 4-bit MatMulNBits over them as BlockMatMul (a high plane's, scaled by 16 where
    `constants` says so, folded into its low plane's), and nodes nothing reads any more as None; and how many
    products were swapped."""
    parsed = [wire.parse(node) for node in nodes]
    blocks = {
        index: inputs for index, fields in enumerate(parsed) if (inputs := _block_product(fields, weights))
    }
    folds = _fold_high_planes(parsed, blocks, graph_outputs, constants or {})
    folded = {index for _, _, replaced in folds.values() for index in replaced}
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
    for index, (node, fields) in enumerate(zip(nodes, parsed, strict=True)):
        if index in folded:
            out.append(None)
        elif index in folds:
            inputs, like, (low, _, _) = folds[index]
            out.append(_block_matmul(like, inputs, _block_size(parsed[low])))
            swapped += 1
        elif index in blocks:
            out.append(_block_matmul(fields, blocks[index], _block_size(fields)))
            swapped += 1
        else:
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
