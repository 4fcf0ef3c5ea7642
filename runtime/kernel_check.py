"""Whether every node of a device graph has a kernel in an execution provider for its op, opset and types.

ONNX Runtime places a node that its EP has no kernel for on the CPU EP without a word (the CUDA GroupQueryAttention
is float16/bfloat16 only); device sessions refuse that fallback, and this check says beforehand which node it is,
so the refusal is one line naming the node, op and types. A kernel table is ONNX Runtime's own registry: read from
the onnxruntime loaded in this process (`kernel_table`), or from tests/ort_kernels.py's JSON of the pinned
onnxruntime-gpu (read offline, without a GPU).

Nodes are matched the way ONNX Runtime's kernel registry matches them: the node's since-version at the model's
opset (its schema's), then each type constraint of the kernel against the first present argument the schema binds
to it. Only the CUDA path imports this module (it loads onnx).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import onnx
from onnx import TensorProto, helper

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import GQA_BIAS_INPUT

CUDA_PROVIDER = "CUDAExecutionProvider"
OPEN_ENDED = 2**31 - 1  # a registration's since_to when no newer version of the op replaces it


NO_KERNEL = "no kernel"
SHAPE_ON_CPU = "shape computation"
BIAS_REFUSED = "attention bias"  # the CUDA GroupQueryAttention kernel fails a run given an attention_bias
# What ONNX Runtime's CUDA EP places on the CPU EP by itself (GetCpuPreferredNodes): a node all of whose inputs are
# constants, graph inputs or CPU tensors — the outputs of these ops, and of nodes placed so — and none of them a CPU
# tensor its kernel takes on the CPU anyway (these ops' inputs at these places).
CPU_OUTPUT_OPS = frozenset({"Shape", "Size"})
CPU_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "Slice": {1, 2, 3, 4},
    "Split": {1},
    "Squeeze": {1},
    "Unsqueeze": {1},
    "Tile": {1},
    "ConstantOfShape": {0},
    "Range": {0, 1, 2},
    "TopK": {1},
    "ReduceSum": {1},
    "ReduceMean": {1},
    "ReduceMax": {1},
    "Pad": {1, 2},
    "Resize": {1, 2, 3},
    "OneHot": {1},
    "GroupQueryAttention": {6},
}
_HALF_TYPES = ("tensor(float16)", "tensor(bfloat16)")


class Missing(NamedTuple):
    """A node the EP would not run, with its input types (`-` for an absent optional input): it has no kernel for
    them, or ONNX Runtime places it on the CPU EP as a shape computation."""

    sub_layer: str
    node: str
    op: str
    types: tuple[str, ...]
    why: str = NO_KERNEL

    def __str__(self) -> str:
        return f"{self.sub_layer}: node {self.node!r}, {self.op}({', '.join(self.types)})"


class KernelTable:
    """One EP's kernel registrations and the operator schemas of their domains, as tests/ort_kernels.py writes
    them: {"onnxruntime_gpu": version, "cuda": [[domain, op, since_from, since_to, {constraint: [types]}], ...],
    "schemas": {domain: {op: [[since_version, inputs, outputs], ...]}}}."""

    def __init__(self, table: dict, provider: str = CUDA_PROVIDER) -> None:
        self.version: str = table["onnxruntime_gpu"]
        self.provider = provider
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


def registrations(onnxruntime_module, provider: str = CUDA_PROVIDER) -> dict:
    """The kernel registrations of PROVIDER in the onnxruntime loaded in this process, with the schemas of their
    domains, as the table file holds them (ONNX Runtime builds them in code: none are written in the wheel)."""
    state = onnxruntime_module.capi._pybind_state
    kernels = sorted(
        (
            [
                k.domain,
                k.op_name,
                *k.version_range,
                {name: sorted(t) for name, t in k.type_constraints.items()},
            ]
            for k in state.get_all_opkernel_def()
            if k.provider == provider
        ),
        key=json.dumps,
    )
    domains = {kernel[0] for kernel in kernels}
    schemas: dict[str, dict[str, list]] = {}
    for schema in state.get_all_operator_schema():
        if schema.domain in domains:
            schemas.setdefault(schema.domain, {}).setdefault(schema.name, []).append(
                [
                    schema.since_version,
                    [[p.typeStr, p.option.name] for p in schema.inputs],
                    [[p.typeStr, p.option.name] for p in schema.outputs],
                ]
            )
    for versions in (v for ops in schemas.values() for v in ops.values()):
        versions.sort(key=lambda version: version[0])
    return {"onnxruntime_gpu": onnxruntime_module.__version__, "cuda": kernels, "schemas": schemas}


def kernel_table(onnxruntime_module, provider: str = CUDA_PROVIDER) -> KernelTable:
    """The kernel table of PROVIDER in the onnxruntime loaded in this process."""
    return KernelTable(registrations(onnxruntime_module, provider), provider)


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


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def tensor_types(model: onnx.ModelProto, table: KernelTable) -> dict[str, str]:
    """Every value's tensor type: ONNX's type inference, with the outputs of ops it has no schema for (ONNX
    Runtime's com.microsoft ops) typed from ONNX Runtime's schema, repeated until nothing new is learned."""
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    model = onnx.ModelProto.FromString(model.SerializeToString())
    types: dict[str, str] = {}
    for _ in range(len(model.graph.node) + 1):  # each round types at least one more node's outputs
        graph = onnx.shape_inference.infer_shapes(model).graph
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


def missing_kernels(model: onnx.ModelProto, sub_layer: str, table: KernelTable) -> list[Missing]:
    """The nodes of MODEL with no kernel in the table for their op, opset and types."""
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    types = tensor_types(model, table)
    on_cpu = cpu_preferred_nodes(model, types)
    missing = []
    for node in model.graph.node:
        domain = _domain(node.domain)
        if node.op_type == "Constant" and not domain:
            continue  # ONNX Runtime makes it an initializer when it loads the graph: no kernel runs it
        has_kernel = table.has_kernel(node, domain, opsets.get(domain, 0), types)
        biased = (
            table.provider == CUDA_PROVIDER
            and node.op_type == "GroupQueryAttention"
            and len(node.input) > GQA_BIAS_INPUT
            and bool(node.input[GQA_BIAS_INPUT])
        )
        if not has_kernel or node.name in on_cpu or biased:
            op = f"{domain}::{node.op_type}" if domain else node.op_type
            argument_types = tuple(types.get(a, "?")[len("tensor(") : -1] if a else "-" for a in node.input)
            why = NO_KERNEL if not has_kernel else SHAPE_ON_CPU if node.name in on_cpu else BIAS_REFUSED
            missing.append(Missing(sub_layer, node.name, op, argument_types, why))
    return missing


def cpu_preferred_nodes(model: onnx.ModelProto, types: dict[str, str]) -> set[str]:
    """The names of the nodes ONNX Runtime's CUDA EP would hand to the CPU EP as shape computations
    (`CPU_OUTPUT_OPS`), which a session without CPU fallback refuses."""
    graph = model.graph
    constants = {i.name for i in graph.initializer} | {
        n.output[0] for n in graph.node if n.op_type == "Constant" and not n.domain
    }
    graph_inputs = {i.name for i in graph.input}
    cpu_tensors = {out for n in graph.node if n.op_type in CPU_OUTPUT_OPS for out in n.output}
    placed: set[str] = set()
    for node in graph.node:  # in topological order, as exported
        if node.op_type in CPU_OUTPUT_OPS or not any(name in cpu_tensors for name in node.input):
            continue
        takes_on_cpu = CPU_INPUTS.get(node.op_type, set())
        if all(
            not name
            or types.get(name) not in _HALF_TYPES
            and (
                name in constants or name in graph_inputs or name in cpu_tensors and index not in takes_on_cpu
            )
            for index, name in enumerate(node.input)
        ):
            placed.add(node.name)
            cpu_tensors.update(node.output)
    return placed


def refuse_missing_kernels(model: Path | bytes, sub_layer: str, table: KernelTable) -> None:
    """Raise one UserError line naming the first node of MODEL (a file or a serialized graph) the table's EP has no
    kernel for, and how many more there are."""
    graph = (
        onnx.load(model, load_external_data=False)
        if isinstance(model, Path)
        else onnx.ModelProto.FromString(model)
    )
    missing = missing_kernels(graph, sub_layer, table)
    if missing:
        first = missing[0]
        more = f" (and {len(missing) - 1} more nodes)" if len(missing) > 1 else ""
        advice = (
            "; export with `--attention-dtype fp16` (docs/precision.md)"
            if first.op.endswith("GroupQueryAttention") and first.types[0] == "float"
            else ""
        )
        problem = {
            NO_KERNEL: f"has no {table.provider} kernel in onnxruntime {table.version}{more}: the device session "
            "would run it on the CPU",
            SHAPE_ON_CPU: f"is a shape computation ONNX Runtime's {table.provider} hands to the CPU{more}: the "
            "device session would run it there",
            BIAS_REFUSED: f"takes an attention bias, which ONNX Runtime's CUDA kernel refuses at run time{more}",
        }[first.why]
        raise UserError(f"{first} {problem}{advice}")
