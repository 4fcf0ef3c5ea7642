"""Every node of a device sub-layer graph has a CUDA kernel for its op, opset and types in the pinned
onnxruntime-gpu (tests/ort_kernels.py's table): ONNX Runtime would otherwise run it on the CPU without a word.

Nodes are matched the way ONNX Runtime's kernel registry matches them: the node's since-version at the model's
opset (its schema's), then each type constraint of the kernel against the first present argument the schema binds
to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import onnx
import pytest
from onnx import TensorProto, helper
from ort_kernels import ONNXRUNTIME_GPU, TABLE

from pipeshard.formats.manifest import load_pack
from pipeshard.formats.plans import HOST_ONLY_KINDS

OPEN_ENDED = 2**31 - 1  # a registration's since_to when no newer version of the op replaces it
KNOWN_GAP = (
    "issue 41, the gap to close next: every attention sub-layer's com.microsoft::GroupQueryAttention computes in "
    "float32 (fp16 packs too: their weights are half, their activations float32), and ONNX Runtime's CUDA "
    "GroupQueryAttention has float16/bfloat16 kernels only, so on the CUDA EP each attention would run on the CPU"
)
TINY_PACKS = [("tiny:llama", "fp32"), ("tiny:moe", "fp32"), ("tiny:llama", "fp16")]


class Missing(NamedTuple):
    """A node the CUDA EP has no kernel for, with its input types (`-` for an absent optional input)."""

    sub_layer: str
    node: str
    op: str
    types: tuple[str, ...]


class KernelTable:
    """The CUDA registrations and the operator schemas of tests/ort_kernels.py's table."""

    def __init__(self, table: dict) -> None:
        self.kernels: dict[tuple[str, str], list[tuple[int, int, dict[str, list[str]]]]] = {}
        for domain, op, since_from, since_to, constraints in table["cuda"]:
            self.kernels.setdefault((domain, op), []).append((since_from, since_to, constraints))
        self.schemas: dict[str, dict[str, list]] = table["schemas"]

    def schema(self, domain: str, op: str, opset: int) -> tuple[int, list, list] | None:
        """(since_version, inputs, outputs) of the op's newest schema at OPSET, or None where there is none."""
        versions = [v for v in self.schemas.get(domain, {}).get(op, []) if v[0] <= opset]
        return tuple(versions[-1]) if versions else None

    def has_kernel(self, node: onnx.NodeProto, domain: str, opset: int, types: dict[str, str]) -> bool:
        schema = self.schema(domain, node.op_type, opset)
        if schema is None:
            return False
        since, inputs, outputs = schema
        return any(
            _version_matches(since_from, since_to, since)
            and all(
                (bound := _first_binding(name, node, inputs, outputs, types)) is None or bound in allowed
                for name, allowed in constraints.items()
            )
            for since_from, since_to, constraints in self.kernels.get((domain, node.op_type), [])
        )


def _version_matches(since_from: int, since_to: int, since: int) -> bool:
    """ONNX Runtime's rule: an open-ended registration serves only the schema version it starts at."""
    return since_from == since or (since_from < since and since_to != OPEN_ENDED and since_to >= since)


def _formal(formals: list, index: int) -> str | None:
    """The type string of argument INDEX (a variadic last parameter takes all the rest)."""
    if index < len(formals):
        return formals[index][0]
    return formals[-1][0] if formals and formals[-1][1] == "Variadic" else None


def _first_binding(name: str, node: onnx.NodeProto, inputs: list, outputs: list, types: dict[str, str]):
    """The type of the first present input, then output, whose parameter has type string NAME."""
    for arguments, formals in ((node.input, inputs), (node.output, outputs)):
        for index, argument in enumerate(arguments):
            if argument and _formal(formals, index) == name and argument in types:
                return types[argument]
    return None


def _type_name(value: onnx.ValueInfoProto | onnx.TensorProto) -> str | None:
    element = value.data_type if isinstance(value, onnx.TensorProto) else value.type.tensor_type.elem_type
    return f"tensor({TensorProto.DataType.Name(element).lower()})" if element else None


def tensor_types(model: onnx.ModelProto, table: KernelTable) -> dict[str, str]:
    """Every value's tensor type: ONNX's type inference, with the outputs of ops it has no schema for (ONNX
    Runtime's com.microsoft ops) typed from ONNX Runtime's schema, repeated until nothing new is learned."""
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for _ in range(len(model.graph.node) + 1):  # each round types at least one more node's outputs
        inferred = onnx.shape_inference.infer_shapes(model)
        graph = inferred.graph
        types = {
            value.name: name
            for value in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)
            if (name := _type_name(value))
        }
        learned = {}
        for node in graph.node:
            domain = _domain(node.domain)
            schema = table.schema(domain, node.op_type, opsets.get(domain, 0))
            for index, output in enumerate(node.output):
                if not output or output in types:
                    continue
                formal = _formal(schema[2], index) if schema else None
                if formal and formal.startswith("tensor("):
                    learned[output] = formal
                elif formal and (bound := _first_binding(formal, node, schema[1], [], types)):
                    learned[output] = bound
        if not learned:
            break
        for name, type_name in learned.items():
            element = TensorProto.DataType.Value(type_name[len("tensor(") : -1].upper())
            model.graph.value_info.append(helper.make_tensor_value_info(name, element, None))
    return types


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def missing_kernels(model: onnx.ModelProto, sub_layer: str, table: KernelTable) -> list[Missing]:
    """The nodes of MODEL with no CUDA kernel for their op, opset and types."""
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    types = tensor_types(model, table)
    missing = []
    for node in model.graph.node:
        domain = _domain(node.domain)
        if node.op_type == "Constant" and not domain:
            continue  # ONNX Runtime makes it an initializer when it loads the graph: no kernel runs it
        if not table.has_kernel(node, domain, opsets.get(domain, 0), types):
            op = f"{domain}::{node.op_type}" if domain else node.op_type
            argument_types = tuple(types.get(a, "?")[len("tensor(") : -1] if a else "-" for a in node.input)
            missing.append(Missing(sub_layer, node.name, op, argument_types))
    return missing


def device_graphs(pack: Path) -> dict[str, onnx.ModelProto]:
    """The graphs a pack's sub-layers run on the device with: their weights-as-inputs files."""
    loaded = load_pack(pack)
    return {
        entry.name: onnx.load(loaded.path(entry.files["weights_as_inputs"]), load_external_data=False)
        for entry in loaded.manifest.sub_layers
        if entry.kind not in HOST_ONLY_KINDS
    }


@pytest.fixture(scope="module")
def table() -> KernelTable:
    if not TABLE.is_file():
        pytest.skip(
            f"no CUDA kernel table for onnxruntime-gpu {ONNXRUNTIME_GPU} at {TABLE}: `make install` fetches it "
            "(tests/ort_kernels.py needs PyPI, a C compiler and binutils)"
        )
    return KernelTable(json.loads(TABLE.read_text()))


def _planted(
    node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto], opsets: dict[str, int]
) -> onnx.ModelProto:
    """A one-node graph whose outputs carry no declared type (as an exporter leaves com.microsoft ops)."""
    graph = helper.make_graph(
        [node], "planted", inputs, [helper.make_value_info(node.output[0], onnx.TypeProto())]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])


def _group_query_attention(element: int) -> onnx.ModelProto:
    tensors = [helper.make_tensor_value_info(n, element, None) for n in ("q", "k", "v", "past_k", "past_v")]
    lengths = [helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("seqlens_k", "total")]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
        ["out", "present_k", "present_v"],
        name="layers.0.attn",
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    )
    return _planted(node, tensors + lengths, {"": 21, "com.microsoft": 1})


def test_a_float32_matmul_has_a_cuda_kernel(table):
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"]
    model = _planted(helper.make_node("MatMul", ["a", "b"], ["y"], name="product"), inputs, {"": 21})
    assert missing_kernels(model, "planted", table) == []


def test_a_float32_group_query_attention_is_named(table):
    assert missing_kernels(_group_query_attention(TensorProto.FLOAT), "planted", table) == [
        Missing(
            "planted", "layers.0.attn", "com.microsoft::GroupQueryAttention", ("float",) * 5 + ("int32",) * 2
        )
    ]


def test_a_float16_group_query_attention_has_a_cuda_kernel(table):
    assert missing_kernels(_group_query_attention(TensorProto.FLOAT16), "planted", table) == []


def _one_hot(opset: int) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("indices", TensorProto.INT64, [3]),
        helper.make_tensor_value_info("depth", TensorProto.INT64, []),
        helper.make_tensor_value_info("values", TensorProto.FLOAT, [2]),
    ]
    node = helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], name="one_hot")
    return _planted(node, inputs, {"": opset})


def test_a_kernel_serves_only_the_schema_versions_it_registers(table):
    """CUDA's OneHot kernels start at the opset-11 schema: at opset 10 the node runs opset 9's, which has none."""
    assert missing_kernels(_one_hot(11), "planted", table) == []
    assert missing_kernels(_one_hot(10), "planted", table) == [
        Missing("planted", "one_hot", "OneHot", ("int64", "int64", "float"))
    ]


def test_an_op_of_a_domain_without_cuda_kernels_is_named(table):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    node = helper.make_node("Unknown", ["x"], ["y"], name="custom", domain="pipeshard.test")
    missing = missing_kernels(_planted(node, inputs, {"": 21, "pipeshard.test": 1}), "planted", table)
    assert missing == [Missing("planted", "custom", "pipeshard.test::Unknown", ("float",))]


@pytest.fixture(scope="module", params=TINY_PACKS, ids=["-".join(p) for p in TINY_PACKS])
def tiny_pack_gaps(request, models, table) -> list[Missing]:
    """The nodes of a tiny pack's device graphs with no CUDA kernel."""
    graphs = device_graphs(models.pack(*request.param))
    return [missing for name, graph in graphs.items() for missing in missing_kernels(graph, name, table)]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
def test_every_device_node_of_a_tiny_pack_has_a_cuda_kernel(tiny_pack_gaps):
    assert tiny_pack_gaps == [], "\n".join(map(str, tiny_pack_gaps))


def test_a_tiny_pack_lacks_no_cuda_kernel_beyond_the_known_gap(tiny_pack_gaps):
    assert {(gap.op, gap.types[0]) for gap in tiny_pack_gaps} <= {
        ("com.microsoft::GroupQueryAttention", "float")
    }
