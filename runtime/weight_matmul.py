"""Products with stored weights on the CPU: MatMul / Gemm nodes swapped for `pipeshard.WeightMatMul`.

A half-precision pack (`pipeshard export --dtype fp16|bf16`) reads each product's weight through a Cast to float32
(exporter/half_weights.py). ONNX Runtime folds that Cast into a float32 copy of the weight at load — twice the
memory, and a decode step reading twice the bytes. pipeshard's CPU sessions swap `Cast(W) -> MatMul(x, .)` (and
`Gemm(x, ., transB)`) for `WeightMatMul(x, W)` (runtime/_matmul.c), which reads W's stored bytes and computes in
float32: the same sums as the graph, in another order (float rounding apart, the same greedy tokens).
For float32 weights the swap is made where asked (the chain's decode steps, whose few rows the op streams faster
than ONNX Runtime's SGEMM).

A GGUF pack (`--dtype gguf`, exporter/quantized_weights.py) stores its products as `com.microsoft::MatMulNBits` over
4-bit planes (2-bit ones for Q2_K); the CPU sessions swap each for `pipeshard.BlockMatMul` (runtime/_matmul.c),
which computes the same
`(code - zero point) * scale` weights in float32, faster than ONNX Runtime's kernel at a decode step. A wide format's
two planes (`low + 16 * high`: MatMulNBits, MatMulNBits, Mul by 16, Add) become one BlockMatMul over both. Scales
and minimums stored in half precision are read as stored (their Casts dropped), and a K-quant's factored ones (int8
per block times a float16 factor per super-block, multiplied in the graph) as their two stored parts (the product
dropped: the op multiplies them per call, the same exact floats), so no session holds a float32 copy.
The pack is not changed; a host without the ops runs its files as they are.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from pipeshard.formats.manifest import Weight
from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN

WEIGHT_OP = "WeightMatMul"
BLOCK_OP = "BlockMatMul"
HALF_DTYPES = frozenset({"float16", "bfloat16"})
BLOCK_SIZES = frozenset({16, 32})  # what BlockMatMul computes (a GGUF pack's blocks)
PLANE_BITS = frozenset({2, 4})  # its planes' code widths
_MS_DOMAIN = "com.microsoft"
_INT64 = 7  # TensorProto.INT64
_TENSOR_DATA_TYPE, _TENSOR_FLOAT_DATA, _TENSOR_INT64_DATA, _TENSOR_NAME, _TENSOR_RAW_DATA = 2, 4, 7, 8, 9
_FLOAT = 1  # TensorProto.FLOAT, Cast's `to`
_NODE_NAME, _NODE_DOC, _NODE_METADATA = 3, 6, 9
_ATTRIBUTE_NAME, _ATTRIBUTE_INT, _ATTRIBUTE_TYPE, _ATTRIBUTE_TYPE_INT = 1, 3, 20, 2
_GEMM_DEFAULTS = {"alpha": 1.0, "beta": 1.0, "transA": 0}


def product_weights(stored: Iterable[Weight], float_weights: bool) -> set[str]:
    """The weights (manifest records) the ops may read: 2-D half-precision ones, float32 ones if asked, the uint8
    planes and zero points of 4-bit products, and a K-quant's factored scales and minimums (int8 per block, and
    float16 per super-block: [N, supers, 1] or [supers, 1, N])."""
    return {
        w.name
        for w in stored
        if w.dtype in ("uint8", "int8")
        or len(w.shape) == 2
        and (w.dtype in HALF_DTYPES or float_weights and w.dtype == "float32")
        or len(w.shape) == 3
        and w.dtype == "float16"
        and 1 in w.shape[1:]
    }


def small_constants(initializers: Iterable[bytes]) -> dict[str, tuple[float, ...]]:
    """The float32 and int64 tensors of at most 8 values among serialized TensorProtos (inline initializers), by
    name, their values as floats: how the swap knows a Mul's factor and a Reshape's shape."""
    found = {}
    for tensor in initializers:
        fields = wire.parse(tensor)
        types = [v for n, _, v in fields if n == _TENSOR_DATA_TYPE]
        names = wire.strings(fields, _TENSOR_NAME)
        if not names or types not in ([_FLOAT], [_INT64]):
            continue
        raw = [v for n, kind, v in fields if n == _TENSOR_RAW_DATA and kind == wire.LENGTH]
        if raw:
            values = struct.unpack(
                f"<{len(raw[0]) // 4}f" if types == [_FLOAT] else f"<{len(raw[0]) // 8}q", raw[0]
            )
        elif types == [_FLOAT]:
            data = b"".join(v for n, kind, v in fields if n == _TENSOR_FLOAT_DATA and kind != wire.VARINT)
            values = struct.unpack(f"<{len(data) // 4}f", data)
        else:
            values = _varints(fields, _TENSOR_INT64_DATA)
        if len(values) <= 8:
            found[names[0]] = tuple(float(v) for v in values)
    return found


def _varints(fields: list[wire.Field], number: int) -> tuple[int, ...]:
    """A repeated int64 field's values, packed or not."""
    values: list[int] = []
    for n, kind, value in fields:
        if n != number:
            continue
        if kind == wire.VARINT:
            values.append(wire.signed(value))
        else:  # packed
            packed, shift = 0, 0
            for byte in value:
                packed |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    values.append(wire.signed(packed))
                    packed = shift = 0
    return tuple(values)


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
    """BlockMatMul's inputs (x, B, scales[, zero points]) when the node is a MatMulNBits it computes: 4 or 2 bits,
    blocks of 16 or 32, float arithmetic (accuracy_level 4 would quantize x to int8: another function), no g_idx or
    bias, B and its zero points weights the op reads."""
    if wire.node_op(fields) != (_MS_DOMAIN, "MatMulNBits"):
        return None
    attributes = wire.node_attributes(fields)
    inputs = wire.strings(fields, wire.NODE_INPUT)
    if attributes.get("bits", 4) not in PLANE_BITS or attributes.get("block_size") not in BLOCK_SIZES:
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


def _int_attribute(name: bytes, value: int) -> wire.Field:
    attribute = [
        (_ATTRIBUTE_NAME, wire.LENGTH, name),
        (_ATTRIBUTE_INT, wire.VARINT, value),
        (_ATTRIBUTE_TYPE, wire.VARINT, _ATTRIBUTE_TYPE_INT),
    ]
    return (wire.NODE_ATTRIBUTE, wire.LENGTH, wire.serialize(attribute))


def _block_matmul(like: list[wire.Field], inputs: list[str], block_size: int, bits: int) -> bytes:
    kept = [(n, k, v) for n, k, v in like if n in (wire.NODE_OUTPUT, _NODE_NAME, _NODE_DOC, _NODE_METADATA)]
    return wire.serialize(
        [
            *((wire.NODE_INPUT, wire.LENGTH, name.encode()) for name in inputs),
            *kept,
            (wire.NODE_OP_TYPE, wire.LENGTH, BLOCK_OP.encode()),
            (wire.NODE_DOMAIN, wire.LENGTH, CUSTOM_DOMAIN.encode()),
            _int_attribute(b"block_size", block_size),
            *([_int_attribute(b"bits", bits)] if bits != 4 else []),  # 4: the op's default
        ]
    )


@dataclass
class _Fused:
    """One BlockMatMul that takes the place of several nodes: its inputs, the node whose place and output (name,
    metadata) it takes (`at`), its block size, the other nodes it replaces, and its plane's bits."""

    inputs: list[str]
    at: int
    block_size: int
    replaced: list[int]
    bits: int


class _Graph:
    """Who produces and how many nodes read each tensor of a node list."""

    def __init__(self, parsed: list[list[wire.Field]], graph_outputs: set[str]) -> None:
        self.parsed = parsed
        self.producer = {
            outputs[0]: index
            for index, fields in enumerate(parsed)
            if (outputs := wire.strings(fields, wire.NODE_OUTPUT))
        }
        self.readers: dict[str, int] = {}
        for fields in parsed:
            for name in wire.strings(fields, wire.NODE_INPUT):
                self.readers[name] = self.readers.get(name, 0) + 1
        self.graph_outputs = graph_outputs

    def only_here(self, name: str) -> bool:
        """Whether one node reads `name`, and the graph does not return it."""
        return self.readers.get(name) == 1 and name not in self.graph_outputs

    def made_by(self, name: str, op: str, inputs: int) -> tuple[int, list[str]] | None:
        """(index, inputs) of the plain ONNX node `op` with `inputs` inputs that makes `name`, read only by one node."""
        index = self.producer.get(name)
        if index is None or not self.only_here(name) or wire.node_op(self.parsed[index]) != ("", op):
            return None
        names = wire.strings(self.parsed[index], wire.NODE_INPUT)
        return (index, names) if len(names) == inputs else None


def _fuse_planes(
    graph: _Graph, blocks: dict[int, list[str]], read: dict[str, str], constants: dict[str, tuple[float, ...]]
) -> dict[int, _Fused]:
    """The exporter's sums around its 4-bit products (exporter/quantized_weights.py), each as one BlockMatMul at
    the index of its last Add: `Add(low, Mul(high, 16))` (two block products of one x and one scales, the high one
    without zero points), then `Add(product, MatMul(ReduceSum(Reshape(x, [0, 0, -1, block]), [-1]), minimums))`
    (the minimum term; `minimums` read as stored where a Cast to float reads a stored weight)."""
    parsed = graph.parsed
    products = {
        wire.strings(parsed[index], wire.NODE_OUTPUT)[0]: _Fused(
            [*inputs, *[""] * (4 - len(inputs))], index, _block_size(parsed[index]), [], _bits(parsed[index])
        )
        for index, inputs in blocks.items()
    }
    fused: dict[int, _Fused] = {}
    for index, fields in enumerate(
        parsed
    ):  # the exporter's Adds come in order: the high plane's, then the minimum's
        inputs = wire.strings(fields, wire.NODE_INPUT)
        if wire.node_op(fields) != ("", "Add") or len(inputs) != 2:
            continue
        for first, second in (inputs, inputs[::-1]):
            product = products.get(first)
            if product is None or not graph.only_here(first) or len(product.inputs) > 5:
                continue
            if len(product.inputs) == 4 and (high := _high_plane(graph, blocks, product, second, constants)):
                plane, terms = high
            elif minimum := _minimum_term(graph, product, second, read, constants):
                plane, terms = minimum
                product.inputs += [""] * (5 - len(product.inputs))
            else:
                continue
            fused.pop(product.at, None)
            made = _Fused(
                [*product.inputs, plane],
                index,
                product.block_size,
                [*product.replaced, product.at, *terms],
                product.bits,
            )
            fused[index] = products[wire.strings(fields, wire.NODE_OUTPUT)[0]] = made
            break
    return fused


def _high_plane(
    graph: _Graph,
    blocks: dict[int, list[str]],
    low: _Fused,
    term: str,
    constants: dict[str, tuple[float, ...]],
) -> tuple[str, list[int]] | None:
    """(the high plane, the nodes of its term) where `term` is Mul(high product, 16) over `low`'s x and scales."""
    mul = graph.made_by(term, "Mul", 2)
    if mul is None:
        return None
    for high_name, factor in (mul[1], mul[1][::-1]):
        high = graph.producer.get(high_name)
        high_inputs = blocks.get(high, [])
        if (
            constants.get(factor) == (16.0,)
            and graph.only_here(high_name)
            and len(high_inputs) == 3
            and high_inputs[0] == low.inputs[0]
            and high_inputs[2] == low.inputs[2]
            and _block_size(graph.parsed[high]) == low.block_size
            and _bits(graph.parsed[high]) == low.bits == 4
        ):
            return high_inputs[1], [mul[0], high]
    return None


def _minimum_term(
    graph: _Graph, product: _Fused, term: str, read: dict[str, str], constants: dict[str, tuple[float, ...]]
) -> tuple[str, list[int]] | None:
    """(the minimums, the nodes of their term) where `term` is the minimum term of `product`'s x."""
    matmul = graph.made_by(term, "MatMul", 2)
    sums = matmul and graph.made_by(matmul[1][0], "ReduceSum", 2)
    blocks = sums and graph.made_by(sums[1][0], "Reshape", 2)
    if not (matmul and sums and blocks):
        return None
    if (
        constants.get(sums[1][1]) != (-1.0,)
        or wire.node_attributes(graph.parsed[sums[0]]).get("keepdims") != 0
        or blocks[1][0] != product.inputs[0]
        or constants.get(blocks[1][1]) != (0.0, 0.0, -1.0, float(product.block_size))
    ):
        return None
    minimums = matmul[1][1]
    return read.get(minimums, minimums), [matmul[0], sums[0], blocks[0]]


def _factored(graph: _Graph, name: str, read: dict[str, str]) -> tuple[str, str, list[int]] | None:
    """(int8 per block, float16 factor, the Reshape and Mul) where `name` is the exporter's factored scales or
    minimums, `Reshape(Mul(Cast(factor), Cast(int8)), shape)` over stored weights (exporter/quantized_weights.py);
    they are dropped once nothing reads them."""
    reshape = graph.producer.get(name)  # read by the product's low and high planes, which become one op
    if reshape is None or wire.node_op(graph.parsed[reshape]) != ("", "Reshape"):
        return None
    product = graph.made_by(wire.strings(graph.parsed[reshape], wire.NODE_INPUT)[0], "Mul", 2)
    if product is None or not all(read.get(cast, cast) != cast for cast in product[1]):
        return None
    factor, per_block = product[1]
    return read[per_block], read[factor], [reshape, product[0]]


def _block_size(fields: list[wire.Field]) -> int:
    return int(wire.node_attributes(fields)["block_size"])


def _bits(fields: list[wire.Field]) -> int:
    return int(wire.node_attributes(fields).get("bits", 4))


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
    constants: dict[str, tuple[float, ...]] | None = None,
) -> tuple[list[bytes | None], int]:
    """The serialized nodes with every product of a weight in `weights` (read directly, or through a Cast to
    float) as WeightMatMul, every 4-bit MatMulNBits over them as BlockMatMul (with the high plane and minimum terms
    around it where `constants`, the graph's small constants, show the exporter's sums), and nodes nothing reads any
    more as None; and how many products were swapped."""
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
    blocks = {
        index: inputs for index, fields in enumerate(parsed) if (inputs := _block_product(fields, weights))
    }
    graph = _Graph(parsed, graph_outputs)
    fused = _fuse_planes(graph, blocks, read, constants or {})
    folded = {index for made in fused.values() for index in made.replaced}
    multiplied: set[int] = set()  # the factored scales' products the op now makes itself
    out: list[bytes | None] = []
    swapped = 0
    for index, (node, fields) in enumerate(zip(nodes, parsed, strict=True)):
        if index in folded:
            out.append(None)
        elif index in fused or index in blocks:
            inputs = [*(fused[index].inputs if index in fused else blocks[index]), *[""] * 8][:8]
            inputs[2] = read.get(inputs[2], inputs[2])  # scales as stored
            for at, factor_at in ((2, 6), (5, 7)):  # a K-quant's scales, minimums: int8 and their factors
                if inputs[at] and (factored := _factored(graph, inputs[at], read)):
                    inputs[at], inputs[factor_at], replaced = factored
                    multiplied.update(replaced)
            while not inputs[-1]:
                inputs = inputs[:-1]
            if index in fused:
                block_size, bits = fused[index].block_size, fused[index].bits
            else:
                block_size, bits = _block_size(fields), _bits(fields)
            out.append(_block_matmul(fields, inputs, block_size, bits))
            swapped += 1
        else:
            product = _product(fields, read)
            out.append(node if product is None else _weight_matmul(fields, *product))
            swapped += product is not None
    unread = multiplied | {  # and the Casts of stored weights: dropped once nothing reads them
        index
        for index, fields in enumerate(parsed)
        if wire.node_op(fields) == ("", "Cast") and wire.strings(fields, wire.NODE_OUTPUT)[0] in read
    }
    reads = [[] if node is None else wire.strings(wire.parse(node), wire.NODE_INPUT) for node in out]
    while True:
        still_read = graph_outputs | {
            name for node, names in zip(out, reads, strict=True) if node is not None for name in names
        }
        dropped = [
            index
            for index in unread
            if out[index] is not None and not set(wire.strings(parsed[index], wire.NODE_OUTPUT)) & still_read
        ]
        if not dropped:
            return out, swapped
        for index in dropped:
            out[index] = None
