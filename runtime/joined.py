"""Consecutive sub-layers joined into one graph, for the steps that run them back to back.

A decode step runs every sub-layer once, in order. Each session run costs more than its kernels: it starts cold,
the caches full of the last sub-layer's weights (ONNX Runtime's executor state, the binding, the thread pool's
hand-off), so fewer, larger sessions decode faster (docs/cli.md). The step runs each split's sub-layers, which
nothing outside ONNX Runtime interrupts, as one session over their joined graphs (on the CPU in the sub-layer
sessions' packed weights, one prepacked-weights container; on a device with the weights as inputs).

The join is done on protobuf's wire format (`runtime/protowire.py`): nodes, initializers and value infos
concatenated in order (an initializer stored by two sub-layers, like a tied embedding, kept once), the graph's
inputs those no joined node produces, its outputs the ones asked for; a GroupQueryAttention that pipeshard's
decode op covers is swapped for it (`runtime/decode_attention.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeshard.runtime import protowire as wire
from pipeshard.runtime.capi import CUSTOM_DOMAIN
from pipeshard.runtime.decode_attention import decode_attention_node
from pipeshard.runtime.weight_matmul import small_constants, swap_products

# ONNX's field numbers (onnx.proto): ModelProto.opset_import / graph; GraphProto.node / initializer / input /
# output / value_info; NodeProto.output; TensorProto.name; ValueInfoProto.name; OperatorSetIdProto.domain / version.
_MODEL_OPSET_IMPORT, _MODEL_GRAPH = 8, 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO = 1, 5, 11, 12, 13
_NODE_INPUT, _NODE_OUTPUT, _TENSOR_NAME, _VALUE_INFO_NAME = wire.NODE_INPUT, wire.NODE_OUTPUT, 8, 1
_OPSET_DOMAIN, _OPSET_VERSION = 1, 2


@dataclass
class JoinedGraph:
    """A serialized model of several sub-layers, its input and output names in order, and how many attention
    nodes run pipeshard's decode op."""

    model: bytes
    inputs: list[str]
    outputs: list[str]
    decode_attention_nodes: int
    nodes: list[tuple[list[str], list[str]]]  # each node's input and output names, in order
    weight_matmul_nodes: int = 0

    def read_before_written(self, read: str, written: str) -> bool:
        """Whether every node reading tensor `read` comes before the node writing `written` in any order ONNX
        Runtime may run them (each is that node or one it depends on): then both may share one buffer."""
        producer = {output: index for index, (_, outputs) in enumerate(self.nodes) for output in outputs}
        ancestors, todo = set(), [producer[written]]
        while todo:
            index = todo.pop()
            if index not in ancestors:
                ancestors.add(index)
                todo += [producer[name] for name in self.nodes[index][0] if name in producer]
        return all(index in ancestors for index, (inputs, _) in enumerate(self.nodes) if read in inputs)


def join(
    paths: Iterable[Path],
    outputs: set[str],
    float_inputs: set[str] | None = None,
    product_weights: set[str] | None = None,
) -> JoinedGraph:
    """The sub-layer models at `paths`, in that order, as one: graph outputs are the sub-layers' outputs named in
    `outputs`. With `float_inputs` (the float32 tensors among the sub-layers' inputs), covered GroupQueryAttention
    nodes are swapped for DecodeAttention; products of the weights in `product_weights` for WeightMatMul
    (runtime/weight_matmul.py)."""
    models = [wire.parse(Path(path).read_bytes()) for path in paths]
    graphs = [wire.parse(_only(model, _MODEL_GRAPH)) for model in models]
    produced = {
        output
        for graph in graphs
        for number, _, value in graph
        if number == _GRAPH_NODE
        for output in wire.strings(wire.parse(value), _NODE_OUTPUT)
    }
    first = graphs[0]
    joined: list[wire.Field] = [
        field
        for field in first
        if field[0] not in (_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO)
    ]
    seen: dict[int, set[str]] = {
        _GRAPH_INITIALIZER: set(),
        _GRAPH_INPUT: set(),
        _GRAPH_OUTPUT: set(),
        _GRAPH_VALUE_INFO: set(),
    }
    swapped = 0
    for graph in graphs:
        for number, kind, value in graph:
            if number == _GRAPH_NODE:
                if (
                    float_inputs is not None
                    and (decode := decode_attention_node(value, float_inputs)) is not None
                ):
                    value, swapped = decode, swapped + 1
                joined.append((number, kind, value))
                continue
            if number not in seen:
                continue
            name_field = _TENSOR_NAME if number == _GRAPH_INITIALIZER else _VALUE_INFO_NAME
            name = wire.strings(wire.parse(value), name_field)[0]
            wanted = {_GRAPH_INPUT: name not in produced, _GRAPH_OUTPUT: name in outputs}.get(number, True)
            if wanted and name not in seen[number]:
                seen[number].add(name)
                joined.append((number, kind, value))
    products = 0
    if product_weights:
        joined, products = _swap_products(joined, product_weights, outputs)
    nodes = [(wire.strings(f, _NODE_INPUT), wire.strings(f, _NODE_OUTPUT)) for f in _nodes(joined)]
    inputs, kept_outputs = _names(joined, _GRAPH_INPUT), _names(joined, _GRAPH_OUTPUT)
    if missing := outputs - set(kept_outputs):
        raise ValueError(f"no joined sub-layer outputs {sorted(missing)}")
    model = [field for field in models[0] if field[0] not in (_MODEL_GRAPH, _MODEL_OPSET_IMPORT)]
    model.append((_MODEL_GRAPH, wire.LENGTH, wire.serialize(joined)))
    opsets = _opsets(models)
    if swapped or products:
        opsets[CUSTOM_DOMAIN] = 1
    model += [
        (
            _MODEL_OPSET_IMPORT,
            wire.LENGTH,
            wire.serialize(
                [(_OPSET_DOMAIN, wire.LENGTH, domain.encode()), (_OPSET_VERSION, wire.VARINT, version)]
            ),
        )
        for domain, version in opsets.items()
    ]
    return JoinedGraph(wire.serialize(model), inputs, kept_outputs, swapped, nodes, products)


def _swap_products(
    graph: list[wire.Field], weights: set[str], outputs: set[str]
) -> tuple[list[wire.Field], int]:
    """The graph's fields with its products of `weights` swapped for WeightMatMul or BlockMatMul (their Casts, and
    folded planes' nodes, dropped)."""
    at = [index for index, (number, _, _) in enumerate(graph) if number == _GRAPH_NODE]
    constants = small_constants(value for number, _, value in graph if number == _GRAPH_INITIALIZER)
    nodes, swapped = swap_products([graph[index][2] for index in at], weights, outputs, constants)
    replaced = dict(zip(at, nodes, strict=True))
    return [
        field if index not in replaced else (_GRAPH_NODE, wire.LENGTH, replaced[index])
        for index, field in enumerate(graph)
        if index not in replaced or replaced[index] is not None
    ], swapped


def _nodes(graph: list[wire.Field]) -> list[list[wire.Field]]:
    return [wire.parse(value) for number, _, value in graph if number == _GRAPH_NODE]


def _names(graph: list[wire.Field], number: int) -> list[str]:
    """The names of a graph's inputs or outputs, in order."""
    return [wire.strings(wire.parse(value), _VALUE_INFO_NAME)[0] for n, _, value in graph if n == number]


def _only(fields: list[wire.Field], number: int) -> bytes:
    values = [value for n, _, value in fields if n == number]
    if len(values) != 1:
        raise ValueError(f"expected one field {number}, found {len(values)}")
    return values[0]


def _opsets(models: list[list[wire.Field]]) -> dict[str, int]:
    """Every opset the models import, at the highest version any of them does."""
    opsets: dict[str, int] = {}
    for model in models:
        for number, _, value in model:
            if number == _MODEL_OPSET_IMPORT:
                fields = wire.parse(value)
                domain = (wire.strings(fields, _OPSET_DOMAIN) or [""])[0]
                version = next((v for n, k, v in fields if n == _OPSET_VERSION and k == wire.VARINT), 1)
                opsets[domain] = max(opsets.get(domain, 0), version)
    return opsets
