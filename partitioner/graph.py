"""The exported decoder as a networkx graph, cut into sub-layers by the rule table.

Nodes of the DiGraph are node indices of the ONNX graph (in its topological order); an edge
u -> v carries the tensor names u produces and v consumes, with their element counts per token
where the shapes say so. Every node gets exactly one sub-layer; the cut is then checked to be
the residual stream plus each layer's KV.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import networkx as nx
import onnx
from onnx import helper

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import PAST_PREFIX, PRESENT_PREFIX, module_path
from pipeshard.formats.manifest import MoeBlock
from pipeshard.partitioner.rules import GLUE, classify

PROLOGUE = "prologue"
# A vision tower's first and last sub-layers, and its prologue's name in a pack (beside the decoder's).
VISION_EMBED, PROJECTOR, VISION_PROLOGUE = "vision_embed", "projector", "vision_prologue"
SMALL_CONSTANT_ELEMENTS = 65536  # inline constants up to this size may follow a value into the prologue
GRAPH_INPUT = "<input>"


class CutError(UserError):
    """The graph cannot be cut as the rules say (names the nodes or tensors at fault)."""


@dataclass
class SubLayer:
    """One unit of placement: a connected slice of the decoder with its boundary tensors."""

    name: str
    kind: str
    layer: int | None
    nodes: list[int] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    initializers: list[str] = field(default_factory=list)


def sub_layer_kind(name: str) -> tuple[str, int | None]:
    """('attn', 3) for 'L3.attn' (and a vision block's 'V3.attn'), ('expert', 3) for 'L3.expert5', ('embed', None)
    for 'embed'."""
    match = re.fullmatch(r"[LV](\d+)\.([a-z_]+)\d*", name)
    return (match.group(2), int(match.group(1))) if match else (name, None)


def expert_index(name: str) -> int | None:
    """5 for 'L3.expert5', None for anything else."""
    match = re.fullmatch(r"L\d+\.expert(\d+)", name)
    return int(match.group(1)) if match else None


def execution_order(names: set[str]) -> list[str]:
    """prologue, embed, L0.attn, L0.ffn (or L0.router, L0.expert0..., L0.combine), L1.attn, ..., final; a vision
    tower's prologue, vision_embed, V0.attn, V0.ffn, ..., projector."""
    part_rank = {"attn": 0, "router": 1, "ffn": 2, "expert": 2, "combine": 3}

    def key(name: str):
        kind, layer = sub_layer_kind(name)
        if name == PROLOGUE:
            return (0, 0, 0, 0)
        if name in ("embed", VISION_EMBED):
            return (1, 0, 0, 0)
        if layer is not None:
            return (2, layer, part_rank.get(kind, 4), expert_index(name) or 0)
        return (3, 0, 0, 0)

    return sorted(names, key=key)


def build_graph(model: onnx.ModelProto) -> nx.DiGraph:
    """Nodes = ONNX node indices, edges = tensors from producer to consumer."""
    graph = nx.DiGraph()
    producer: dict[str, int] = {}
    for index, node in enumerate(model.graph.node):
        graph.add_node(index, op_type=node.op_type, name=node.name, path=module_path(node))
        for output in node.output:
            producer[output] = index
    for index, node in enumerate(model.graph.node):
        for tensor in node.input:
            if tensor in producer:
                source = producer[tensor]
                if graph.has_edge(source, index):
                    graph.edges[source, index]["tensors"].add(tensor)
                else:
                    graph.add_edge(source, index, tensors={tensor})
    graph.graph["producer"] = producer
    return graph


def assign_sub_layers(model: onnx.ModelProto, graph: nx.DiGraph, rules) -> dict[int, str]:
    """Sub-layer of every node: by rule, residual glue by data flow, unscoped shape work to the prologue."""
    assignment: dict[int, str] = {}
    unmatched: list[int] = []
    for index in nx.topological_sort(graph):
        path = graph.nodes[index]["path"]
        sub_layer = classify(path, rules) if path is not None else None
        if sub_layer is None:
            # Exporter-made nodes with no module: shape arithmetic over graph inputs and prologue
            # values goes to the prologue; a node the optimizer split off one sub-layer's op (a
            # Split of a chunked projection) stays with that sub-layer; anything else has no home.
            sources = {assignment.get(p) for p in graph.predecessors(index)}
            if sources <= {PROLOGUE}:
                sub_layer = PROLOGUE
            elif path is None and len(sources - {PROLOGUE}) == 1 and None not in sources:
                sub_layer = (sources - {PROLOGUE}).pop()
            else:
                unmatched.append(index)
                continue
        elif sub_layer == PROLOGUE:
            # Work in the model's own forward on a sub-layer's output (Gemma's final logit softcapping after
            # lm_head) belongs to that sub-layer: the prologue reads only the step's inputs.
            computed_from = {assignment.get(p) for p in graph.predecessors(index)} - {PROLOGUE}
            if len(computed_from) == 1 and None not in computed_from:
                sub_layer = computed_from.pop()
            elif computed_from:
                unmatched.append(index)
                continue
        elif sub_layer.endswith("." + GLUE):
            layer_prefix = sub_layer[: -len(GLUE)]
            owners = [
                assignment[p]
                for p in graph.predecessors(index)
                if assignment.get(p, "").startswith(layer_prefix)
            ]
            if not owners:
                unmatched.append(index)
                continue
            sub_layer = execution_order(set(owners))[-1]
        assignment[index] = sub_layer
    if unmatched:
        described = ", ".join(
            f"{graph.nodes[i]['name']} ({graph.nodes[i]['op_type']} at {graph.nodes[i]['path']!r})"
            for i in unmatched[:5]
        )
        raise CutError(f"{len(unmatched)} node(s) match no sub-layer rule: {described}")
    return assignment


def _int_constant(name: str, values: list[int]) -> onnx.NodeProto:
    """A Constant node holding an int64 vector."""
    tensor = helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    return helper.make_node("Constant", [], [name], value=tensor)


def hoist_step_invariants(
    model: onnx.ModelProto,
    graph: nx.DiGraph,
    assignment: dict[int, str],
    step_inputs: frozenset[str] = frozenset({"input_ids", "attention_mask", "position_ids"}),
) -> None:
    """Move into the prologue every node of a compute sub-layer that reads nothing but the step's
    inputs, prologue values and inline constants (in topological order, so whole chains move): no
    weights, no KV, nothing of the residual stream. Such a value is the same in every layer. The
    exporter computes some once and lets later layers read them (a reshape target built in layer 0,
    in fp16 the rotary cos/sin cast once): cut as-is, that would tie every attention to layer 0. Others
    each layer computes again (the rotary cos/sin of every attention, twice: once for q, once for k):
    `merge_duplicate_prologue_nodes` then computes them once per step instead of 60 times. A vision tower's
    `step_inputs` are its index inputs (Qwen2.5-VL's window order, rotary ids and attention groups)."""
    inline = {
        i.name
        for i in model.graph.initializer
        if i.data_location != onnx.TensorProto.EXTERNAL and math.prod(i.dims) <= SMALL_CONSTANT_ELEMENTS
    }
    producer_of = graph.graph["producer"]
    for index in nx.topological_sort(graph):
        node = model.graph.node[index]
        # The embedding stays whole: a VLM's image merge reads the token ids, but its values are per step.
        if assignment[index] in (PROLOGUE, "embed") or not node.input:
            continue
        if all(
            not t or t in step_inputs or t in inline or assignment.get(producer_of.get(t)) == PROLOGUE
            for t in node.input
        ):
            assignment[index] = PROLOGUE
    # A node of constants alone that one sub-layer reads stays with it (a quantized weight's small scale factors
    # read through a Cast): in the prologue it would be a step value that sub-layer takes as an input.
    graph_outputs = {o.name for o in model.graph.output}
    for index in reversed(list(nx.topological_sort(graph))):
        node = model.graph.node[index]
        if (
            assignment[index] != PROLOGUE
            or not node.input
            or not all(not t or t in inline for t in node.input)
        ):
            continue
        readers = {assignment[successor] for successor in graph.successors(index)}
        if len(readers) == 1 and PROLOGUE not in readers and not graph_outputs & set(node.output):
            assignment[index] = readers.pop()


def keep_embedding_whole(model: onnx.ModelProto, graph: nx.DiGraph, assignment: dict[int, str]) -> None:
    """Prologue nodes whose values only the embedding reads (the sizes a VLM's image merge takes from its inputs)
    move into the embedding: the prologue keeps to the attention's step values, which a one-token step does not
    recompute."""
    graph_outputs = {o.name for o in model.graph.output}
    for index in reversed(list(nx.topological_sort(graph))):
        if assignment[index] != PROLOGUE:
            continue
        readers = {assignment[successor] for successor in graph.successors(index)}
        if readers == {"embed"} and not graph_outputs & set(model.graph.node[index].output):
            assignment[index] = "embed"


def merge_duplicate_prologue_nodes(model: onnx.ModelProto, assignment: dict[int, str]) -> None:
    """Prologue nodes with the same op, attributes and inputs compute the same value: keep the first and
    point the others' readers at it (common subexpression elimination, in topological order)."""
    nodes = model.graph.node
    renamed: dict[str, str] = {}
    first: dict[tuple, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for index in range(len(nodes)):
        node = nodes[index]
        for position, tensor in enumerate(node.input):
            if tensor in renamed:
                node.input[position] = renamed[tensor]
        if assignment[index] != PROLOGUE:
            continue
        key = (
            node.domain,
            node.op_type,
            tuple(node.input),
            tuple(a.SerializeToString(deterministic=True) for a in node.attribute),
        )
        if key in first:
            renamed.update(zip(node.output, first[key].output, strict=True))
            dropped.add(index)
        else:
            first[key] = node
    graph_outputs = {o.name for o in model.graph.output}
    _drop_nodes(model, assignment, {i for i in dropped if not graph_outputs & set(nodes[i].output)})


def _drop_nodes(model: onnx.ModelProto, assignment: dict[int, str], dropped: set[int]) -> None:
    """Remove nodes by index, renumbering the assignment of the others."""
    if not dropped:
        return
    nodes = model.graph.node
    kept = [i for i in range(len(nodes)) if i not in dropped]
    remaining = [nodes[i] for i in kept]
    moved = {new: assignment[old] for new, old in enumerate(kept)}
    del nodes[:]
    nodes.extend(remaining)
    assignment.clear()
    assignment.update(moved)


def _stored_weight_of(nodes, producer: dict[str, int], tensor: str) -> str:
    """The weight a tensor reads: itself, or the initializer a Cast to float reads (half-precision weights,
    exporter/half_weights.py)."""
    cast = nodes[producer[tensor]] if tensor in producer else None
    return cast.input[0] if cast is not None and cast.op_type == "Cast" else tensor


def untranspose_tied_weights(model: onnx.ModelProto, assignment: dict[int, str]) -> None:
    """`MatMul(x, Transpose(W))` over a weight W (or a Cast of a half-precision one): ONNX Runtime folds the
    Transpose into a second, transposed copy of W at load (108 MiB for SmolLM2's tied lm_head). Rewrite it as
    Reshape -> Gemm(transB=1) -> Reshape, which reads W (through its Cast) in place."""
    initializers = {i.name: i for i in model.graph.initializer}
    nodes = model.graph.node
    producer = {out: index for index, node in enumerate(nodes) for out in node.output}
    unused: set[int] = set()
    for index, node in enumerate(list(nodes)):
        if node.op_type != "MatMul" or node.input[1] not in producer:
            continue
        transpose = nodes[producer[node.input[1]]]
        perm = [a.ints for a in transpose.attribute if a.name == "perm"]
        weight = initializers.get(_stored_weight_of(nodes, producer, transpose.input[0]))
        if (
            transpose.op_type != "Transpose"
            or weight is None
            or len(weight.dims) != 2
            or (perm and list(perm[0]) != [1, 0])
        ):
            continue
        rows, columns = weight.dims  # W is [out_features, in_features]
        prefix = f"_gemm_{index}_"
        replacement = [
            helper.make_node("Shape", [node.input[0]], [prefix + "lead"], start=0, end=-1),
            _int_constant(prefix + "out_features", [-1]),  # any number of rows of W (row chunks)
            helper.make_node(
                "Concat", [prefix + "lead", prefix + "out_features"], [prefix + "out_shape"], axis=0
            ),
            _int_constant(prefix + "flat", [-1, columns]),
            helper.make_node("Reshape", [node.input[0], prefix + "flat"], [prefix + "x2d"]),
            helper.make_node("Gemm", [prefix + "x2d", transpose.input[0]], [prefix + "y2d"], transB=1),
            helper.make_node("Reshape", [prefix + "y2d", prefix + "out_shape"], [node.output[0]]),
        ]
        for new_node in replacement:
            new_node.name = new_node.output[0]
            new_node.metadata_props.extend(node.metadata_props)
        nodes[index].CopyFrom(replacement[-1])
        for extra in replacement[:-1]:
            nodes.append(extra)
            assignment[len(nodes) - 1] = assignment[index]
        if not any(transpose.output[0] in n.input for n in nodes):
            unused.add(producer[transpose.output[0]])
    _drop_nodes(model, assignment, unused)


def fused_transposed_products(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """NODES with each product `untranspose_tied_weights` wrote (Shape, Concat, Reshape, Gemm(transB=1), Reshape)
    as one `com.microsoft::FusedMatMul(x, W, transB=1)`: for a device session. ONNX Runtime's CUDA EP hands the
    Shape -> Concat of the output's shape to the CPU EP, which a session without CPU fallback refuses; FusedMatMul
    keeps x's leading dimensions itself and reads W in place (CUDA and CPU kernels)."""
    by_output = {node.output[0]: node for node in nodes}
    replaced: dict[str, onnx.NodeProto] = {}  # the output of a product's last Reshape -> its FusedMatMul
    dropped: set[str] = set()
    for node in nodes:
        if node.op_type != "Gemm" or not (match := re.fullmatch(r"(_gemm_\d+_)y2d", node.output[0])):
            continue
        prefix = match.group(1)
        flatten = by_output[prefix + "x2d"]
        (unflatten,) = [n for n in nodes if n.input and n.input[0] == node.output[0]]
        fused = helper.make_node(
            "FusedMatMul",
            [flatten.input[0], node.input[1]],
            [unflatten.output[0]],
            name=prefix + "fused",
            domain="com.microsoft",
            transB=1,
        )
        fused.metadata_props.extend(node.metadata_props)
        replaced[unflatten.output[0]] = fused
        dropped |= {prefix + part for part in ("lead", "out_features", "out_shape", "flat", "x2d", "y2d")}
    return [replaced.get(node.output[0], node) for node in nodes if node.output[0] not in dropped]


def topologically_sorted(
    model: onnx.ModelProto, assignment: dict[int, str]
) -> tuple[onnx.ModelProto, dict[int, str]]:
    """Reorder nodes topologically (after rewrites appended helpers), carrying the assignment along."""
    graph = build_graph(model)
    order = list(nx.lexicographical_topological_sort(graph))
    reordered = [model.graph.node[i] for i in order]
    new_assignment = {new: assignment[old] for new, old in enumerate(order)}
    del model.graph.node[:]
    model.graph.node.extend(reordered)
    return model, new_assignment


def cut(model: onnx.ModelProto, assignment: dict[int, str]) -> list[SubLayer]:
    """Group nodes into sub-layers in execution order and find each one's boundary tensors."""
    graph_inputs = [i.name for i in model.graph.input]
    graph_outputs = {o.name for o in model.graph.output}
    initializer_names = {i.name for i in model.graph.initializer}
    owner_of_tensor: dict[str, str] = {}
    sub_layers = {name: SubLayer(name, *sub_layer_kind(name)) for name in set(assignment.values())}
    for index, node in enumerate(model.graph.node):
        sub_layer = sub_layers[assignment[index]]
        sub_layer.nodes.append(index)
        for output in node.output:
            owner_of_tensor[output] = sub_layer.name
    consumers: dict[str, set[str]] = {}
    for index, node in enumerate(model.graph.node):
        sub_layer = sub_layers[assignment[index]]
        for tensor in node.input:
            if not tensor:
                continue
            if tensor in initializer_names:
                if tensor not in sub_layer.initializers:
                    sub_layer.initializers.append(tensor)
            elif owner_of_tensor.get(tensor) != sub_layer.name and tensor not in sub_layer.inputs:
                sub_layer.inputs.append(tensor)
                consumers.setdefault(tensor, set()).add(sub_layer.name)
    for tensor, owner in owner_of_tensor.items():
        if tensor in consumers or tensor in graph_outputs:
            sub_layers[owner].outputs.append(tensor)
    for tensor in consumers:
        if tensor not in owner_of_tensor and tensor not in graph_inputs:
            raise CutError(f"tensor {tensor} is consumed but neither produced nor a graph input")
    return [sub_layers[name] for name in execution_order(set(sub_layers))]


def moe_blocks(
    sub_layers: list[SubLayer], model: onnx.ModelProto, shapes: dict[str, list], hidden_size: int
) -> list[MoeBlock]:
    """Each MoE layer's router, experts and combine, checked to be what the runtime does itself: the
    combine adds every expert's (already routing-weighted) output to the residual the router read.
    The router gives two tensors to every expert: the normed hidden states and the routing weights."""
    by_name = {s.name: s for s in sub_layers}
    blocks = []
    for combine in (s for s in sub_layers if s.kind == "combine"):
        layer = combine.layer
        router = by_name.get(f"L{layer}.router")
        experts = sorted(
            (s for s in sub_layers if s.kind == "expert" and s.layer == layer),
            key=lambda s: expert_index(s.name),
        )
        problems = []
        if router is None or not experts:
            problems.append("no router or no experts")
        ops = {model.graph.node[i].op_type for i in combine.nodes}
        if ops != {"Add"}:
            problems.append(f"combine ops {sorted(ops)} (expected only Add)")
        expert_outputs = [s.outputs for s in experts]
        if any(len(outputs) != 1 for outputs in expert_outputs):
            problems.append("an expert with other than one output")
        residual = [t for t in combine.inputs if t not in {o for outputs in expert_outputs for o in outputs}]
        if router is not None and (len(residual) != 1 or router.inputs != residual):
            problems.append(f"combine reads {residual} besides the experts; the router reads {router.inputs}")
        if router is not None and any(sorted(s.inputs) != sorted(router.outputs) for s in experts):
            problems.append("experts do not read exactly the router's outputs")
        if len(combine.outputs) != 1:
            problems.append(f"combine writes {combine.outputs}")
        if problems:
            raise CutError(f"MoE layer {layer} is not in the per-expert form: " + "; ".join(problems))
        hidden = [t for t in router.outputs if (shapes.get(t) or [None])[-1] == hidden_size]
        routing = [t for t in router.outputs if t not in hidden]
        if len(hidden) != 1 or len(routing) != 1:
            raise CutError(
                f"MoE layer {layer}: the router's outputs {router.outputs} are not hidden states + routing"
            )
        blocks.append(
            MoeBlock(
                layer=layer,
                router=router.name,
                experts=[s.name for s in experts],
                hidden=hidden[0],
                routing=routing[0],
                residual=residual[0],
                expert_outputs=[o[0] for o in expert_outputs],
                output=combine.outputs[0],
            )
        )
    return blocks


def moe_internal_tensors(blocks: list[MoeBlock], sub_layers: list[SubLayer]) -> set[str]:
    """Tensors that cross sub-layers inside MoE blocks (router -> experts -> combine, residual -> combine)."""
    by_name = {s.name: s for s in sub_layers}
    internal = set()
    for block in blocks:
        internal |= set(by_name[block.router].outputs) | set(block.expert_outputs) | {block.residual}
    return internal


def verify_cut(
    sub_layers: list[SubLayer],
    shapes: dict[str, list],
    hidden_size: int,
    moe_internal: frozenset[str] = frozenset(),
) -> None:
    """Between compute sub-layers only the residual stream [batch, tokens, hidden] may cross, plus
    each attention's own KV, the prologue's shared values, and inside a MoE block the router's
    outputs and the experts' outputs; anything else is an error."""
    produced_by = {tensor: s.name for s in sub_layers for tensor in s.outputs}
    wide: list[str] = []
    for sub_layer in sub_layers:
        for tensor in sub_layer.inputs:
            if tensor in moe_internal:
                continue
            source = produced_by.get(tensor, GRAPH_INPUT)
            if source in (GRAPH_INPUT, PROLOGUE):
                if source == GRAPH_INPUT and tensor.startswith(PAST_PREFIX):
                    layer = int(tensor.split(".")[1])
                    if (sub_layer.kind, sub_layer.layer) != ("attn", layer):
                        wide.append(f"{tensor} (read by {sub_layer.name})")
                continue
            shape = shapes.get(tensor)
            if not (shape and len(shape) == 3 and shape[-1] == hidden_size):
                wide.append(f"{tensor} {shape} ({source} -> {sub_layer.name})")
        for tensor in sub_layer.outputs:
            if tensor.startswith(PRESENT_PREFIX) and (sub_layer.kind, sub_layer.layer) != (
                "attn",
                int(tensor.split(".")[1]),
            ):
                wide.append(f"{tensor} (written by {sub_layer.name})")
    residual_readers: dict[str, list[str]] = {}
    for sub_layer in sub_layers:
        for tensor in sub_layer.inputs:
            if produced_by.get(tensor, PROLOGUE) != PROLOGUE and tensor not in moe_internal:
                residual_readers.setdefault(tensor, []).append(sub_layer.name)
    for tensor, readers in residual_readers.items():
        if len(readers) > 1:
            wide.append(f"{tensor} (read by {', '.join(readers)}: a skip connection across sub-layers)")
    if wide:
        raise CutError("the cut is wider than the residual stream plus KV: " + "; ".join(wide))
