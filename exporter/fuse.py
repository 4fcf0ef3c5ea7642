"""Rewrite the exported attention into ONNX Runtime's fused GroupQueryAttention with an in-place KV cache.

The torch exporter writes each attention as: q/k/v projections -> Reshape -> Transpose ->
RotaryEmbedding -> Concat(past, new) -> Unsqueeze/Expand/Reshape (KV heads repeated to every query
head) -> Attention -> Transpose -> Reshape. Per token that copies the whole past twice (the Concat,
then the Expand to all heads) and runs a dozen small ops per layer. `com.microsoft.GroupQueryAttention`
reads K/V once per KV head and appends the new tokens in place when the past and present are bound
to one preallocated buffer of the context's length (what onnxruntime-genai does on the CPU).

After the rewrite:
- `past_key_values.N.*` inputs and `present.N.*` outputs are [batch, kv_heads, capacity, head_dim]
  buffers; a runtime binds one buffer as both and the valid length comes from the attention mask.
- Nothing reads the past length off a KV tensor's shape (it would be the capacity): it is computed
  from `attention_mask` and `input_ids` (past = total - new).
- Where q, k and v are plain projections of one input and rotary is the plain ONNX RotaryEmbedding
  (every dense decoder here but Qwen3, whose q/k norms sit between), they become one MatMul over the
  concatenated weights, and GQA rotates q and k itself (`do_rotary`) from cos/sin tables of every
  position up to the context, computed at export by the exporter's own rotary subgraph: 4 ops per
  layer fewer than projecting and rotating apart (what onnxruntime-genai's builder emits). GQA takes a
  token's position from its place in the cache; in a left-padded batch that is the HF position plus
  the row's padding, the same shift for every token of the row, so attention (which sees position
  differences only) is unchanged. Elsewhere rotary stays the RotaryEmbedding op on the
  position-derived cos/sin, applied to the [batch, seq, heads * head_dim] projections.
- GQA masks the future itself, so where the exporter's boolean mask is exactly "causal and not padding"
  (checked by running it at export) GQA's `attention_bias` is the padding alone, made from
  `attention_mask` in a few ops; any other mask becomes the bias as it is.

Limitation of the CPU kernel (checked at run time by the runtimes): more than one new token with a
past is only supported for batch 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeshard.core.errors import UserError
from pipeshard.exporter.half_weights import HALF_TYPES, store_weights_in_half
from pipeshard.exporter.quantized_weights import describe_weights_quantized, store_weights_quantized
from pipeshard.formats.io_names import (
    GQA_BIAS_INPUT,
    PADDING_BIAS,
    PAST_PREFIX,
    PRESENT_PREFIX,
    ROTARY_CACHES,
    SEQLENS,
    TOTAL,
    module_path,
)

EXTERNAL_THRESHOLD_BYTES = 1024  # onnx.save's size_threshold: larger tensors go to the data file
_REPEAT_KV_OPS = ("Reshape", "Expand", "Unsqueeze")


class _Graph:
    """Producer and consumer lookups over a graph that is being edited."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.nodes = model.graph.node
        self.widths: dict[str, int] = {}  # the 3-D tensors the rewrite made, by last dimension
        self.initializers = {i.name: i for i in model.graph.initializer}
        self.refresh()

    def refresh(self) -> None:
        self.producer = {out: node for node in self.nodes for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for tensor in node.input:
                self.consumers.setdefault(tensor, []).append(node)

    def made_by(self, tensor: str, op_type: str) -> onnx.NodeProto:
        node = self.producer.get(tensor)
        if node is None or node.op_type != op_type:
            found = node.op_type if node is not None else "a graph input"
            raise UserError(f"attention rewrite: expected {tensor} to come from {op_type}, found {found}")
        return node


def stored_externally(nbytes: int) -> bool:
    """Whether the export stores a tensor of `nbytes` in its data file (onnx.save's test: the size of the
    tensor's bytes object against the threshold)."""
    return nbytes + sys.getsizeof(b"") >= EXTERNAL_THRESHOLD_BYTES


def weight_reference(name: str, data_type: int, dims: list[int], data_file: str) -> TensorProto:
    """A weight of a shape-only export: name, type and shape, its data a reference into a file never written."""
    nbytes = int(np.prod(dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(data_type).itemsize
    reference = TensorProto(name=name, data_type=data_type, dims=dims)
    reference.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data_file), ("offset", "0"), ("length", str(nbytes))):
        reference.external_data.add(key=key, value=value)
    return reference


def _part(name: str, data_type: int, dims: list[int], data_file: str) -> TensorProto:
    """A quantized weight's part in a shape-only export: a reference where the real export stores it in its data
    file, else the small tensor it keeps in the graph (zeros: a shape-only pack never runs)."""
    dtype = helper.tensor_dtype_to_np_dtype(data_type)
    if stored_externally(int(np.prod(dims, dtype=np.int64)) * dtype.itemsize):
        return weight_reference(name, data_type, dims, data_file)
    return numpy_helper.from_array(np.zeros(dims, dtype), name)


def _is_reference(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def _concatenated(tensors: list[TensorProto], axis: int, name: str) -> TensorProto:
    """The tensors joined along `axis`; for references (a shape-only export), a reference of the joined shape."""
    if not any(_is_reference(t) for t in tensors):
        return numpy_helper.from_array(
            np.concatenate([numpy_helper.to_array(t) for t in tensors], axis=axis), name
        )
    dims = list(tensors[0].dims)
    dims[axis] = sum(t.dims[axis] for t in tensors)
    location = next(
        e.value for t in tensors if _is_reference(t) for e in t.external_data if e.key == "location"
    )
    return weight_reference(name, tensors[0].data_type, dims, location)


def _declare(model: onnx.ModelProto, name: str, elem_type: int, dims: list) -> None:
    """Value info for a tensor the rewrite made (the partitioner reads boundary shapes from it)."""
    model.graph.value_info.append(helper.make_tensor_value_info(name, elem_type, dims))


def _dims_of(model: onnx.ModelProto, name: str) -> list:
    for value in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if value.name == name:
            return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    raise UserError(f"attention rewrite: no shape recorded for {name}")


def _metadata_from(target: onnx.NodeProto, source: onnx.NodeProto) -> onnx.NodeProto:
    """New nodes keep the module scope of the node they replace (the partitioner's rules read it)."""
    for prop in source.metadata_props:
        target.metadata_props.add(key=prop.key, value=prop.value)
    return target


def _int64(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant",
        [],
        [name],
        name=name,
        value=helper.make_tensor(name + "_value", TensorProto.INT64, [len(values)], values),
    )


def derive_past_length(model: onnx.ModelProto, kv_heads: int, head_dim: int) -> int:
    """Replace every `Shape(past_key_values.N.*)` by the same shape computed from the step inputs.
    Returns how many were replaced."""
    nodes = model.graph.node
    replaced = 0
    for index, node in enumerate(list(nodes)):
        if node.op_type != "Shape" or not node.input[0].startswith(PAST_PREFIX):
            continue
        attributes = {a.name: a.i for a in node.attribute}
        prefix = f"_past_shape_{index}_"
        replacement = [
            helper.make_node("Shape", ["attention_mask"], [prefix + "total"], start=1, end=2),
            helper.make_node("Shape", ["input_ids"], [prefix + "batch"], start=0, end=1),
            helper.make_node("Shape", ["input_ids"], [prefix + "new"], start=1, end=2),
            helper.make_node("Sub", [prefix + "total", prefix + "new"], [prefix + "past"]),
            _int64(prefix + "heads", [kv_heads]),
            _int64(prefix + "head_dim", [head_dim]),
            helper.make_node(
                "Concat",
                [prefix + "batch", prefix + "heads", prefix + "past", prefix + "head_dim"],
                [prefix + "full"],
                axis=0,
            ),
            _int64(prefix + "start", [attributes.get("start", 0)]),
            _int64(prefix + "end", [attributes.get("end", 4)]),
            helper.make_node("Slice", [prefix + "full", prefix + "start", prefix + "end"], [node.output[0]]),
        ]
        for new_node in replacement:
            new_node.name = new_node.name or new_node.output[0]
            _metadata_from(new_node, node)
        position = list(nodes).index(node)
        del nodes[position]
        for offset, new_node in enumerate(replacement):
            nodes.insert(position + offset, new_node)
        replaced += 1
    return replaced


def _step_lengths(like: onnx.NodeProto) -> list[onnx.NodeProto]:
    """seqlens_k and the total sequence length, as GQA wants them (int32), from `attention_mask`: each row's
    last set column (total - 1 under left padding; a row shorter than the step, as the scheduler's decode
    steps have, ends earlier, and its new token goes there)."""
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["_gqa_mask_shape"]),
        helper.make_node("Cast", ["_gqa_mask_shape"], ["_gqa_mask_shape32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["_gqa_mask_shape32", "_gqa_one"], [TOTAL], axis=0),
        helper.make_node("Sub", [TOTAL, "_gqa_one32"], ["_gqa_last"]),
        helper.make_node(
            "Slice",
            ["attention_mask", "_gqa_minus_one_1d", "_gqa_lowest_1d", "_gqa_one_1d", "_gqa_minus_one_1d"],
            ["_gqa_mask_reversed"],
        ),
        helper.make_node("Cast", ["_gqa_mask_reversed"], ["_gqa_mask_reversed32"], to=TensorProto.INT32),
        helper.make_node("ArgMax", ["_gqa_mask_reversed32"], ["_gqa_trailing"], axis=1, keepdims=0),
        helper.make_node("Cast", ["_gqa_trailing"], ["_gqa_trailing32"], to=TensorProto.INT32),
        helper.make_node("Sub", ["_gqa_last", "_gqa_trailing32"], [SEQLENS]),
        helper.make_node("Slice", ["_gqa_mask_shape", "_gqa_zero_1d", "_gqa_one_1d"], ["_gqa_batch"]),
        _int64("_gqa_minus_one_1d", [-1]),
        _int64("_gqa_lowest_1d", [-(2**63)]),
        helper.make_node(
            "Constant", [], ["_gqa_one"], value=helper.make_tensor("v", TensorProto.INT64, [], [1])
        ),
        helper.make_node(
            "Constant", [], ["_gqa_one32"], value=helper.make_tensor("v", TensorProto.INT32, [], [1])
        ),
        _int64("_gqa_zero_1d", [0]),
        _int64("_gqa_one_1d", [1]),
        _int64("_gqa_two_1d", [2]),
        helper.make_node("Slice", ["_gqa_mask_shape", "_gqa_one_1d", "_gqa_two_1d"], ["_gqa_total_1d"]),
    ]
    for node in nodes:
        node.name = node.name or node.output[0]
        _metadata_from(node, like)
    return nodes


def _to_3d(
    graph: _Graph, transposed_input: str, added: list[onnx.NodeProto], like: onnx.NodeProto, width: int
) -> str:
    """The [batch, seq, heads * head_dim] form of a tensor that the exporter reshaped to
    [batch, seq, heads, head_dim] (and maybe normalised per head) before transposing."""
    producer = graph.producer.get(transposed_input)
    if producer is not None and producer.op_type == "Reshape":
        source = graph.producer.get(producer.input[0])
        if source is not None and source.op_type in ("MatMul", "Gemm", "Add"):
            return producer.input[0]  # the projection itself is already 3-D
    name = f"{transposed_input}_3d"
    if name not in graph.producer:
        shape = _int64(f"{name}_shape", [0, 0, -1])
        reshape = helper.make_node("Reshape", [transposed_input, shape.output[0]], [name], name=name)
        added += [_metadata_from(shape, like), _metadata_from(reshape, like)]
        graph.producer[name] = reshape
        graph.widths[name] = width
    return name


def _rotated_3d(
    graph: _Graph, rotary: onnx.NodeProto, heads: int, head_dim: int, added: list[onnx.NodeProto]
) -> str:
    transpose = graph.made_by(rotary.input[0], "Transpose")
    flat = _to_3d(graph, transpose.input[0], added, rotary, heads * head_dim)
    name = f"{rotary.output[0]}_3d"
    attributes = {a.name: helper.get_attribute_value(a) for a in rotary.attribute}
    node = helper.make_node(
        "RotaryEmbedding",
        [flat, *rotary.input[1:]],
        [name],
        name=name,
        interleaved=attributes.get("interleaved", 0),
        num_heads=heads,
        **(
            {"rotary_embedding_dim": attributes["rotary_embedding_dim"]}
            if attributes.get("rotary_embedding_dim")
            else {}
        ),
    )
    added.append(_metadata_from(node, rotary))
    graph.widths[name] = heads * head_dim
    return name


def _gqa_input(
    graph: _Graph, tensor: str, heads: int, head_dim: int, added: list[onnx.NodeProto], like: onnx.NodeProto
) -> str:
    """The [batch, seq, heads * head_dim] form of a [batch, heads, seq, head_dim] attention input:
    rotary re-applied on the 3-D projection when it is the RotaryEmbedding op, the transpose undone
    when there is one, else an explicit Transpose + Reshape (fp16 exports decompose the rotary)."""
    producer = graph.producer.get(tensor)
    if producer is not None and producer.op_type == "RotaryEmbedding":
        source = graph.producer.get(producer.input[0])
        if source is not None and source.op_type == "Transpose":
            return _rotated_3d(graph, producer, heads, head_dim, added)
    if producer is not None and producer.op_type == "Transpose":
        perm = next((list(a.ints) for a in producer.attribute if a.name == "perm"), None)
        if perm == [0, 2, 1, 3]:
            return _to_3d(graph, producer.input[0], added, like, heads * head_dim)
    name = f"{tensor}_bshd"
    transpose = helper.make_node("Transpose", [tensor], [name], name=name, perm=[0, 2, 1, 3])
    added.append(_metadata_from(transpose, like))
    graph.producer[name] = transpose
    return _to_3d(graph, name, added, like, heads * head_dim)


def _concat_of(graph: _Graph, tensor: str) -> onnx.NodeProto:
    """Walk back from Attention's K or V input over the repeat-KV ops to the Concat(past, new)."""
    node = graph.producer.get(tensor)
    while node is not None and node.op_type in _REPEAT_KV_OPS:
        node = graph.producer.get(node.input[0])
    if node is None or node.op_type != "Concat" or not node.input[0].startswith(PAST_PREFIX):
        raise UserError(f"attention rewrite: {tensor} does not come from Concat(past, new)")
    return node


def _mask_window(model: onnx.ModelProto, mask: str, sliding_window: int | None) -> int | None:
    """Which plain mask the exporter's boolean mask is, checked by running it on left-padded prompt batches and
    on steps with a past, some longer than the sliding window: -1 for "causal and not padding", the window W for
    "causal, within the last W keys and not padding" (GQA's `local_window_size`), None for anything else (kept
    as the exporter's bias)."""
    cases = [
        (np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]), 6),
        (np.ones((1, 9), np.int64), 1),
        (np.ones((1, 9), np.int64), 3),
    ]
    if sliding_window:
        longer = sliding_window + 5
        cases += [
            (np.concatenate([np.zeros((1, 3)), np.ones((1, longer))], axis=1), longer + 3),
            (np.ones((1, longer), np.int64), 1),
            (np.ones((1, longer + 4), np.int64), 2),
        ]
    found_masks = []
    position_input = next((v for v in model.graph.input if v.name == "position_ids"), None)
    rows = len(position_input.type.tensor_type.shape.dim) if position_input is not None else 2
    for attention_mask, new in cases:
        batch, total = attention_mask.shape
        positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)[:, total - new :]
        if rows == 3:  # M-RoPE position_ids [3, batch, new] (text positions: the same on every row)
            positions = np.broadcast_to(positions, (3, *positions.shape))
        feeds = {
            "input_ids": np.zeros((batch, new), np.int64),
            "attention_mask": attention_mask.astype(np.int64),
            "position_ids": positions.astype(np.int64),
        }
        try:
            (found,) = _evaluate(model, [mask], feeds)
        except Exception:  # noqa: BLE001 - the mask needs more than the step inputs: not the plain kind
            return None
        found_masks.append((found, attention_mask.astype(bool), total, new))
    for window in (-1, sliding_window) if sliding_window else (-1,):
        if all(
            _is_plain_mask(found, attend, total, new, window) for found, attend, total, new in found_masks
        ):
            return window
    return None


def _is_plain_mask(found: np.ndarray, attend: np.ndarray, total: int, new: int, window: int) -> bool:
    query = np.arange(total - new, total)[:, None]
    keys = np.arange(total)[None, :]
    visible = (keys <= query) & ((keys > query - window) if window > 0 else True)
    expected = visible[None, None] & attend[:, None, None, :]
    return found.shape == expected.shape and bool(np.array_equal(found, expected))


def _padding_bias(float_type: int, like: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]]:
    """The additive bias of the padding alone, [batch, 1, new, total], from `attention_mask`: 9 small ops
    where the exporter's causal mask took some 40 (GQA masks the future itself)."""
    lowest = float(np.finfo(helper.tensor_dtype_to_np_dtype(float_type)).min)
    bias = PADDING_BIAS
    nodes = [
        helper.make_node(
            "Constant", [], [bias + "_zero"], value=helper.make_tensor("v", float_type, [], [0.0])
        ),
        helper.make_node(
            "Constant", [], [bias + "_lowest"], value=helper.make_tensor("v", float_type, [], [lowest])
        ),
        helper.make_node("Cast", ["attention_mask"], [bias + "_attend"], to=TensorProto.BOOL),
        helper.make_node("Where", [bias + "_attend", bias + "_zero", bias + "_lowest"], [bias + "_rows"]),
        _int64(bias + "_axes", [1, 2]),
        helper.make_node("Unsqueeze", [bias + "_rows", bias + "_axes"], [bias + "_4d"]),
        helper.make_node("Shape", ["input_ids"], [bias + "_new"], start=1, end=2),
        helper.make_node(
            "Concat", ["_gqa_batch", "_gqa_one_1d", bias + "_new", "_gqa_total_1d"], [bias + "_shape"], axis=0
        ),
        helper.make_node("Expand", [bias + "_4d", bias + "_shape"], [bias]),
    ]
    for node in nodes:
        node.name = node.output[0]
        _metadata_from(node, like)
    return bias, nodes


def _additive_bias(graph: _Graph, mask: str, float_type: int) -> tuple[str, list[onnx.NodeProto]]:
    """GQA takes an additive float bias; the exporter's mask is boolean (True = attend). Masked
    positions get the type's lowest value, not -inf, so a fully masked row (a pad) stays finite."""
    lowest = float(np.finfo(helper.tensor_dtype_to_np_dtype(float_type)).min)
    bias = f"{mask}_bias"
    nodes = [
        helper.make_node(
            "Constant", [], [bias + "_zero"], value=helper.make_tensor("v", float_type, [], [0.0])
        ),
        helper.make_node(
            "Constant", [], [bias + "_lowest"], value=helper.make_tensor("v", float_type, [], [lowest])
        ),
        helper.make_node("Where", [mask, bias + "_zero", bias + "_lowest"], [bias]),
    ]
    like = graph.producer.get(mask)
    for node in nodes:
        node.name = node.output[0]
        if like is not None:
            _metadata_from(node, like)
    return bias, nodes


def _projection(graph: _Graph, tensor: str) -> tuple[onnx.NodeProto, str | None] | None:
    """The MatMul (by an initializer weight) and the bias added after it, if any (Qwen2's q/k/v), that became
    `tensor` through Reshape and Transpose(0, 2, 1, 3)."""
    transpose = graph.producer.get(tensor)
    if (
        transpose is None
        or transpose.op_type != "Transpose"
        or next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None) != [0, 2, 1, 3]
    ):
        return None
    reshape = graph.producer.get(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    matmul, bias = graph.producer.get(reshape.input[0]), None
    if matmul is not None and matmul.op_type == "Add":
        biases = [t for t in matmul.input if t in graph.initializers and len(graph.initializers[t].dims) == 1]
        made = [graph.producer.get(t) for t in matmul.input if t not in biases]
        if len(biases) != 1 or len(made) != 1:
            return None
        matmul, bias = made[0], biases[0]
    if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in graph.initializers:
        return None
    return matmul, bias


def _plain_rotary(node: onnx.NodeProto | None, head_dim: int) -> bool:
    if node is None or node.op_type != "RotaryEmbedding" or (len(node.input) > 3 and node.input[3]):
        return False
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return not attributes.get("interleaved") and attributes.get("rotary_embedding_dim", 0) in (0, head_dim)


def _packed_qkv(
    graph: _Graph,
    q: str,
    k: str,
    v: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    added: list[onnx.NodeProto],
) -> tuple[str, list[tuple[str, str]]] | None:
    """One MatMul over [Wq | Wk | Wv] (plus [bq | bk | bv] where all three have biases) when q and k are plainly
    rotated projections of the same input as v;
    returns the packed qkv and the (cos, sin) pairs q and k were rotated with, or None where the pattern
    does not hold."""
    rotate_q, rotate_k = graph.producer.get(q), graph.producer.get(k)
    if not (_plain_rotary(rotate_q, head_dim) and _plain_rotary(rotate_k, head_dim)):
        return None
    found = [_projection(graph, t) for t in (rotate_q.input[0], rotate_k.input[0], v)]
    if any(f is None for f in found):
        return None
    projections, biases = [f[0] for f in found], [f[1] for f in found]
    if len({p.input[0] for p in projections}) != 1 or len({b is None for b in biases}) != 1:
        return None
    weights = [graph.initializers[p.input[1]] for p in projections]
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if [w.dims[-1] for w in weights] != widths or any(len(w.dims) != 2 for w in weights):
        return None
    name = f"{projections[0].output[0]}_qkv"
    packed = _concatenated(weights, 1, f"{name}_weight")
    graph.model.graph.initializer.append(packed)
    graph.initializers[packed.name] = packed
    product = name if biases[0] is None else f"{name}_product"
    matmul = helper.make_node("MatMul", [projections[0].input[0], packed.name], [product], name=product)
    added.append(_metadata_from(matmul, projections[0]))
    if biases[0] is not None:
        bias = _concatenated([graph.initializers[b] for b in biases], 0, f"{name}_bias")
        graph.model.graph.initializer.append(bias)
        graph.initializers[bias.name] = bias
        added.append(
            _metadata_from(helper.make_node("Add", [product, bias.name], [name], name=name), projections[0])
        )
        graph.widths[product] = sum(widths)
    graph.widths[name] = sum(widths)
    return name, [tuple(rotate_q.input[1:3]), tuple(rotate_k.input[1:3])]


def _evaluate(model: onnx.ModelProto, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run the part of the graph that computes `outputs` from the graph inputs in `feeds`."""
    import onnxruntime

    producer = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name: i for i in model.graph.initializer}
    needed, pending, inputs = set(), list(outputs), set()
    while pending:
        tensor = pending.pop()
        node = producer.get(tensor)
        if node is None:
            if tensor in feeds:
                inputs.add(tensor)
            continue
        if id(node) not in needed:
            needed.add(id(node))
            pending += [t for t in node.input if t]
    nodes = [n for n in model.graph.node if id(n) in needed]
    used = {t for n in nodes for t in n.input}
    graph = helper.make_graph(
        nodes,
        "evaluate",
        [v for v in model.graph.input if v.name in inputs],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        [initializers[name] for name in used if name in initializers],
    )
    sub_model = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(
        sub_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(outputs, {name: feeds[name] for name in inputs})


def _rotary_caches(
    graph: _Graph, sources: list[tuple[str, str]], max_context: int, float_type: int, like: onnx.NodeProto
) -> list[onnx.NodeProto]:
    """Tables of the exporter's rotary cos/sin for positions 0 .. max_context - 1 (its own subgraphs run on
    those positions, so any rope scaling it applies is in them; the exporter computes them once per use,
    and every use must agree), and per step their first `total` rows, in the scope of `like` (the mask's)."""
    positions = np.arange(max_context, dtype=np.int64)[None]
    feeds = {
        "position_ids": positions,
        "input_ids": np.zeros_like(positions),
        "attention_mask": np.ones_like(positions),
    }
    values = _evaluate(graph.model, [name for pair in sources for name in pair], feeds)
    tables = values[:2]
    for index, value in enumerate(values):
        if not np.array_equal(value, tables[index % 2]):
            raise UserError(
                f"attention rewrite: the rotary tables of {sources[index // 2]} differ from those of "
                f"{sources[0]}"
            )
    nodes = []
    numpy_type = helper.tensor_dtype_to_np_dtype(float_type)
    for table, step_name in zip(tables, ROTARY_CACHES, strict=True):
        table_name = f"{step_name}_table"
        graph.model.graph.initializer.append(
            numpy_helper.from_array(table.reshape(max_context, -1).astype(numpy_type), table_name)
        )
        nodes.append(
            helper.make_node(
                "Slice", [table_name, "_gqa_zero_1d", "_gqa_total_1d", "_gqa_zero_1d"], [step_name]
            )
        )
    for node in nodes:
        node.name = node.name or node.output[0]
        _metadata_from(node, like)
    return nodes


def fuse_attention(
    model: onnx.ModelProto,
    heads: int,
    kv_heads: int,
    head_dim: int,
    float_type: int = TensorProto.FLOAT,
    max_context: int | None = None,
    sliding_window: int | None = None,
    mask_as_bias: bool = False,
) -> int:
    """Rewrite every exported attention into GroupQueryAttention; returns how many were rewritten.
    With `max_context`, plainly rotated attentions get packed q/k/v and GQA's own rotary. An attention whose
    mask is the sliding window of the model's config gets GQA's local window over the whole in-place cache.
    `mask_as_bias`: every mask is kept whole as the bias of a non-causal GQA (a mask that lets a query see later
    keys, as Gemma 3's within an image, which the plain-mask check feeds no such input to see)."""
    derive_past_length(model, kv_heads, head_dim)
    graph = _Graph(model)
    attentions = [n for n in graph.nodes if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not attentions:
        return 0
    added: list[onnx.NodeProto] = []
    removed: list[onnx.NodeProto] = []
    biases: dict[str, str] = {}
    windows: dict[str, int | None] = {}
    prologue: list[onnx.NodeProto] = []
    rotary_sources: list[tuple[str, str]] = []
    for attention in attentions:
        q, k, v, mask = (list(attention.input) + ["", "", "", ""])[:4]
        if not mask:
            raise UserError(f"attention rewrite: {attention.name} has no mask input")
        if mask not in biases:
            windows[mask] = None if mask_as_bias else _mask_window(model, mask, sliding_window)
            if windows[mask] is None:
                biases[mask], nodes = _additive_bias(graph, mask, float_type)
                prologue += nodes
            elif (
                PADDING_BIAS in biases.values()
            ):  # another mask of the same kind: one padding bias serves all
                biases[mask] = PADDING_BIAS
            else:
                biases[mask], nodes = _padding_bias(float_type, graph.producer.get(mask) or attention)
                prologue += nodes
        k_concat, v_concat = _concat_of(graph, k), _concat_of(graph, v)
        attention_output = attention.output[0]
        (out_transpose,) = graph.consumers[attention_output]
        if out_transpose.op_type == "Reshape" and _dims_of(model, out_transpose.output[0]) == _dims_of(
            model, attention_output
        ):  # a reshape to the same shape (Phi-3's): nothing to keep
            removed.append(out_transpose)
            (out_transpose,) = graph.consumers[out_transpose.output[0]]
        if out_transpose.op_type != "Transpose":
            raise UserError(f"attention rewrite: {attention.name} output goes to {out_transpose.op_type}")
        (out_reshape,) = graph.consumers[out_transpose.output[0]]
        attributes = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
        if attributes.get("is_causal") or attributes.get("qk_matmul_output_mode"):
            raise UserError(f"attention rewrite: {attention.name} has attributes GQA does not take")
        packed = (
            _packed_qkv(graph, q, k_concat.input[1], v_concat.input[1], heads, kv_heads, head_dim, added)
            if max_context
            else None
        )
        if packed:
            qkv, pairs = packed
            rotary_sources += [pair for pair in pairs if pair not in rotary_sources]
            new_inputs, rotary = [qkv, "", ""], ROTARY_CACHES
        else:
            new_inputs, rotary = (
                [
                    _gqa_input(graph, q, heads, head_dim, added, attention),
                    _gqa_input(graph, k_concat.input[1], kv_heads, head_dim, added, attention),
                    _gqa_input(graph, v_concat.input[1], kv_heads, head_dim, added, attention),
                ],
                ("", ""),
            )
        gqa = helper.make_node(
            "GroupQueryAttention",
            [*new_inputs, k_concat.input[0], v_concat.input[0], SEQLENS, TOTAL, *rotary, "", biases[mask]],
            [out_reshape.output[0], k_concat.output[0], v_concat.output[0]],
            name=f"{attention.name or attention.output[0]}_gqa",
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            **({"do_rotary": 1} if packed else {}),
            **({"scale": float(attributes["scale"])} if "scale" in attributes else {}),
            **({"softcap": float(attributes["softcap"])} if attributes.get("softcap") else {}),
            **({"local_window_size": windows[mask]} if (windows[mask] or 0) > 0 else {}),
            **({"causal": 0} if mask_as_bias else {}),
        )
        added.append(_metadata_from(gqa, attention))
        removed += [attention, out_transpose, out_reshape, k_concat, v_concat]
    batch, sequence = _dims_of(model, "input_ids")
    _declare(model, SEQLENS, TensorProto.INT32, [batch])
    _declare(model, TOTAL, TensorProto.INT32, [])
    for mask, bias in biases.items():
        _declare(model, bias, float_type, _dims_of(model, mask))
    mask_maker = graph.producer.get(attentions[0].input[3]) or attentions[0]
    if rotary_sources:
        prologue += _rotary_caches(graph, rotary_sources, max_context, float_type, mask_maker)
        for name in ROTARY_CACHES:
            _declare(model, name, float_type, [_dims_of(model, "attention_mask")[1], head_dim // 2])
    for name, width in graph.widths.items():
        _declare(model, name, float_type, [batch, sequence, width])
    first_user = min(list(graph.nodes).index(n) for n in attentions)
    step_lengths = _step_lengths(mask_maker)
    kept = [n for n in graph.nodes if not any(n is r for r in removed)]
    ordered = kept[:first_user] + step_lengths + prologue + kept[first_user:] + added
    del graph.nodes[:]
    graph.nodes.extend(ordered)
    _remove_dead_nodes(model)
    _declare_kv_buffers(model)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_operatorsetid("com.microsoft", 1))
    return len(attentions)


_HALF_LOWEST = float(np.finfo(np.float16).min)  # a bias's "masked" in float16: finite, as in float32
_GQA_TABLES = (
    7,
    8,
    GQA_BIAS_INPUT,
)  # cos cache, sin cache, attention bias: made once per step, read by every attention


def attention_in_half(model: onnx.ModelProto) -> int:
    """Every GroupQueryAttention computes in float16 (ONNX Runtime's CUDA kernels are float16 / bfloat16 only; its
    CPU EP has float16 ones too): q, k and v cast to float16 before it and its output back to float32 after it, the
    past and present KV declared float16 (half the bytes to pin, stream and read), and the rotary tables and the
    bias cast once where every attention reads them (the bias raised to float16's lowest first: float32's would
    become -inf, and a padding row masked everywhere would turn to NaN). The rest of the model computes as before.
    Returns how many attentions."""
    graph = _Graph(model)
    halves: dict[str, str] = {}  # a table or bias -> its float16 copy
    ordered: list[onnx.NodeProto] = []
    attentions = 0
    for node in list(graph.nodes):
        if node.op_type != "GroupQueryAttention":
            ordered.append(node)
            continue
        attentions += 1
        for index, name in enumerate(node.input):
            shared = index in _GQA_TABLES
            if not name or not (index <= 2 or shared):
                continue
            if name in halves:
                node.input[index] = halves[name]
                continue
            source = (
                graph.producer.get(name, node) if shared else node
            )  # a table's cast belongs where it is made
            half = f"{name}_half"
            casts = _half_casts(name, half, index == GQA_BIAS_INPUT)
            ordered += [_metadata_from(cast, source) for cast in casts]
            if shared:
                _declare(model, half, TensorProto.FLOAT16, _dims_of(model, name))
                halves[name] = half
            node.input[index] = half
        output = node.output[0]
        node.output[0] = f"{output}_half"
        back = helper.make_node(
            "Cast", [node.output[0]], [output], name=f"{output}_float", to=TensorProto.FLOAT
        )
        ordered += [node, _metadata_from(back, node)]
    del graph.nodes[:]
    graph.nodes.extend(ordered)
    for value in (*model.graph.input, *model.graph.output):
        if value.name.startswith((PAST_PREFIX, PRESENT_PREFIX)):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return attentions


def _half_casts(name: str, half: str, bias: bool) -> list[onnx.NodeProto]:
    """NAME cast to float16 as HALF; a bias first raised to float16's lowest value."""
    if not bias:
        return [helper.make_node("Cast", [name], [half], name=half, to=TensorProto.FLOAT16)]
    lowest = f"{half}_lowest"
    return [
        helper.make_node(
            "Constant",
            [],
            [lowest],
            name=lowest,
            value=helper.make_tensor("v", TensorProto.FLOAT, [], [_HALF_LOWEST]),
        ),
        helper.make_node("Max", [name, lowest], [f"{half}_raised"], name=f"{half}_raised"),
        helper.make_node("Cast", [f"{half}_raised"], [half], name=half, to=TensorProto.FLOAT16),
    ]


def _remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drop nodes whose outputs nothing uses, then initializers nothing reads; in place (rebuilding the lists
    would copy every weight)."""
    graph_outputs = {o.name for o in model.graph.output}
    nodes = model.graph.node
    while True:
        used = {t for node in nodes for t in node.input} | graph_outputs
        dead = [i for i, node in enumerate(nodes) if not any(out in used for out in node.output)]
        if not dead:
            break
        for i in reversed(dead):
            del nodes[i]
    used = {t for node in nodes for t in node.input}
    initializers = model.graph.initializer
    for i in reversed([i for i, tensor in enumerate(initializers) if tensor.name not in used]):
        del initializers[i]


def _declare_kv_buffers(model: onnx.ModelProto) -> None:
    """Past and present KV are one buffer of the cache's capacity."""
    for value in model.graph.input:
        if value.name.startswith(PAST_PREFIX):
            value.type.tensor_type.shape.dim[2].dim_param = "kv_capacity"
    for value in model.graph.output:  # the capacity when shared; past + new when given a past of its own
        if value.name.startswith(PRESENT_PREFIX):
            value.type.tensor_type.shape.dim[2].dim_param = "present_length"


def pack_sibling_projections(model: onnx.ModelProto) -> int:
    """Projections of one input by constant weights in named sibling modules (an MLP's gate_proj and
    up_proj; a Qwen3 attention's q, k and v, whose per-head norms keep them from the GQA packing) become
    one MatMul over the concatenated weights and a Split back into the tensors they made: one weight
    stream and one op instead of several, bitwise the same values (each output column is the same dot
    product). Entries of a module list (MoE experts) are never packed together: each is a sub-layer of its
    own. Returns how many groups were packed."""
    graph = _Graph(model)
    groups: dict[tuple[str, str], list[onnx.NodeProto]] = {}
    for node in graph.nodes:
        weight = graph.initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        parent, _, own = (module_path(node) or "").rpartition(".")
        if weight is not None and len(weight.dims) == 2 and parent and not own.isdigit():
            groups.setdefault((node.input[0], parent), []).append(node)
    packed = 0
    for (activation, _parent), members in groups.items():
        if len(members) < 2:
            continue
        weights = [graph.initializers[n.input[1]] for n in members]
        widths = [int(w.dims[1]) for w in weights]
        name = f"{members[0].output[0]}_packed"
        weight = _concatenated(weights, 1, f"{name}_weight")
        graph.model.graph.initializer.extend(
            [weight, numpy_helper.from_array(np.array(widths, np.int64), f"{name}_widths")]
        )
        matmul = _metadata_from(
            helper.make_node("MatMul", [activation, weight.name], [name], name=name), members[0]
        )
        split = _metadata_from(
            helper.make_node(
                "Split",
                [name, f"{name}_widths"],
                [n.output[0] for n in members],
                name=f"{name}_split",
                axis=-1,
            ),
            members[0],
        )
        *leading, _ = _dims_of(model, members[0].output[0])
        _declare(model, name, weight.data_type, [*leading, sum(widths)])
        at = min(list(graph.nodes).index(n) for n in members)
        for node in members:
            graph.nodes.remove(node)
        graph.nodes.insert(at, split)
        graph.nodes.insert(at, matmul)
        packed += 1
    _remove_dead_nodes(model)
    return packed


_ELEMENTWISE_AFTER_HEAD = (
    "Cast",
    "Mul",
    "Div",
    "Tanh",
)  # a softcap or a cast between the head and the logits


def store_output_layer_by_rows(model: onnx.ModelProto) -> bool:
    """An untied output layer `MatMul(x, W)` over W [hidden, vocab] is stored as its rows W^T [vocab, hidden]
    and read through a Transpose, as a tied head already is: the partitioner turns both into
    `Gemm(x, rows, transB=1)`, whose row ranges are ranges of the logits (row chunks a device can stream). The
    values are the same; for a shape-only export the reference's dimensions swap. Returns whether it did."""
    graph = _Graph(model)
    node = graph.producer.get(model.graph.output[0].name)
    while node is not None and node.op_type in _ELEMENTWISE_AFTER_HEAD:
        node = graph.producer.get(node.input[0])
    weight = graph.initializers.get(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    if weight is None or len(weight.dims) != 2 or len(graph.consumers.get(weight.name, [])) != 1:
        return False
    rows = [int(weight.dims[1]), int(weight.dims[0])]
    if _is_reference(weight):
        location = next(e.value for e in weight.external_data if e.key == "location")
        stored = weight_reference(weight.name, weight.data_type, rows, location)
    else:
        stored = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), weight.name)
    weight.CopyFrom(stored)
    transposed = f"{weight.name}_by_columns"
    transpose = _metadata_from(
        helper.make_node("Transpose", [weight.name], [transposed], name=transposed, perm=[1, 0]), node
    )
    graph.nodes.insert(list(graph.nodes).index(node), transpose)
    node.input[1] = transposed
    infos = model.graph.value_info
    for info in [i for i in infos if i.name == weight.name]:
        infos.remove(info)
    _declare(model, transposed, weight.data_type, rows[::-1])
    return True


def fuse_exported_model(
    onnx_path: Path,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    max_context: int | None,
    sliding_window: int | None = None,
    shape_only: bool = False,
    stored_dtype: str = "fp32",
    stored_rows=None,
    attention_dtype: str = "fp32",
    mask_as_bias: bool = False,
    shape_format: str | None = None,
) -> int:
    """Apply the rewrites to an exported model file in place (its external data file rewritten); with a
    half-precision `stored_dtype`, the product and embedding weights are then stored in it (half_weights.py).
    `shape_only`: the file's weights are references (onnx_export's shape-only trace), and what the rewrites
    compute (the rotary tables) becomes references too: no data file is written. No `max_context`: rotary is
    never moved into GQA (M-RoPE positions are not the cache's). `stored_rows`: a GGUF's quantized rows, whose
    blocks the weights made of them are stored as (quantized_weights.py); `shape_format` (a shape-only export):
    the weights described as stored in that GGUF format (describe_weights_quantized). `attention_dtype` fp16: every
    attention and its KV cache in float16 (`attention_in_half`). `mask_as_bias`: see `fuse_attention`."""
    model = onnx.load(str(onnx_path), load_external_data=not shape_only)
    float_type = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[dtype]
    fused = fuse_attention(
        model, heads, kv_heads, head_dim, float_type, max_context, sliding_window, mask_as_bias
    )
    if attention_dtype == "fp16":
        attention_in_half(model)
    pack_sibling_projections(model)
    store_output_layer_by_rows(model)
    if stored_dtype in HALF_TYPES:
        store_weights_in_half(model, stored_dtype)
    if stored_rows is not None:
        store_weights_quantized(model, stored_rows)
    data = onnx_path.with_name(onnx_path.name + ".data")
    if shape_format is not None:
        describe_weights_quantized(
            model, shape_format, lambda name, kind, dims: _part(name, kind, dims, data.name)
        )
    if shape_only:
        initializers = model.graph.initializer
        for index, tensor in enumerate(initializers):
            if not _is_reference(tensor) and stored_externally(len(tensor.raw_data)):
                initializers[index].CopyFrom(
                    weight_reference(tensor.name, tensor.data_type, list(tensor.dims), data.name)
                )
        onnx.save(model, str(onnx_path))
        return fused
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save(
        model,
        str(onnx_path),
        save_as_external_data=True,
        location=data.name,
        size_threshold=EXTERNAL_THRESHOLD_BYTES,
    )
    return fused
