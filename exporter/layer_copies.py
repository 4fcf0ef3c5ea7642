"""Trace a decoder with as few layers as stand for all of them, then give its ONNX graph every layer.

Tracing costs time in proportion to the ops traced (torch.export, then its decompositions), and a decoder's
layers are alike. The exporter traces the first layers up to one of each kind (a kind: the layer's parameter
shapes, module classes and plain settings such as a sliding window; layer 0, which reads the embeddings, never
stands for another) and, for every later layer, copies the nodes of the traced layer of its kind: the copy reads
the previous layer's hidden states and its own past, writes its own present, and holds its own weights, put in
the form the traced layer's were (as they are, transposed, or plus one where the exporter folded that op). The
export then checks the whole graph against PyTorch running every layer, as it checks a full trace.
"""

from __future__ import annotations

import ast
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from pipeshard.exporter.fuse import stored_externally
from pipeshard.formats.io_names import PAST_PREFIX, PRESENT_PREFIX, SCOPES_KEY

_PLAIN_SETTINGS = (int, float, str, bool, type(None))
_IGNORED_SETTINGS = {"layer_idx", "training"}  # differ between layers of a kind, or say nothing of the graph


class LayerCopyError(Exception):
    """The traced graph is not one a layer can be copied from (the exporter then traces every layer)."""


@dataclass(frozen=True)
class LayerPlan:
    """Which layers are traced (a prefix of `traced`) and, for each layer, the traced layer its graph copies."""

    path: str  # the layers' module path in the model, e.g. `model.layers`
    traced: int
    template: tuple[int, ...]

    @property
    def copies(self) -> bool:
        return self.traced < len(self.template)


def _layer_kind(layer) -> tuple:
    """What decides a layer's graph apart from its weights' values and its index."""
    parts = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted(
                (key, value)
                for key, value in vars(module).items()
                if not key.startswith("_")
                and key not in _IGNORED_SETTINGS
                and isinstance(value, _PLAIN_SETTINGS)
            )
        )
        parts.append((name, type(module).__name__, settings))
    tensors = [*layer.named_parameters(), *layer.named_buffers()]
    parts += [(name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in tensors]
    return tuple(parts)


def _decoder_layers(model) -> tuple[str, object] | None:
    """The module path and ModuleList of the decoder's layers (as many as the config has), or None."""
    import torch

    count = model.config.num_hidden_layers
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return name, module
    return None


def layer_plan(model) -> LayerPlan | None:
    """The shortest prefix of layers whose kinds stand for every later layer; None when there is none to save."""
    found = _decoder_layers(model)
    if found is None:
        return None
    path, layers = found
    kinds = [_layer_kind(layer) for layer in layers]
    for traced in range(2, len(kinds)):
        last_of_kind = {kinds[j]: j for j in range(1, traced)}
        if all(kind in last_of_kind for kind in kinds[traced:]):
            template = tuple(range(traced)) + tuple(last_of_kind[kind] for kind in kinds[traced:])
            return LayerPlan(path, traced, template)
    return None


@contextmanager
def traced_prefix(model, plan: LayerPlan):
    """Within the block the model has only its first `plan.traced` layers (the same modules and weights); its
    buffers are as they were after it."""
    import torch

    parent_path, _, attribute = plan.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    layers = getattr(parent, attribute)
    configs = {id(c): c for c in (model.config, getattr(parent, "config", model.config))}.values()
    saved = [(c, c.num_hidden_layers, getattr(c, "layer_types", None)) for c in configs]
    # a forward may assign a buffer (LongRoPE picks its inverse frequencies): a trace would leave a traced tensor
    buffers = [(module, dict(module._buffers)) for module in model.modules()]
    setattr(parent, attribute, torch.nn.ModuleList(list(layers)[: plan.traced]))
    for config, _, layer_types in saved:
        config.num_hidden_layers = plan.traced
        if layer_types is not None:
            config.layer_types = list(layer_types)[: plan.traced]
    try:
        yield
    finally:
        setattr(parent, attribute, layers)
        for module, module_buffers in buffers:
            module._buffers.update(module_buffers)
        for config, count, layer_types in saved:
            config.num_hidden_layers = count
            if layer_types is not None:
                config.layer_types = layer_types


def _scopes(node) -> list[str]:
    value = node.metadata_props.get(SCOPES_KEY)
    if value is None:
        return []
    # A sliced ModuleList (`self.layers[:n]`) is sometimes recorded as `layers.slice(None, n, None).i`.
    return [re.sub(r"\.slice\([^)]*\)", "", scope) for scope in ast.literal_eval(value)]


def _layer_of(node, layer_scope: re.Pattern) -> int | None:
    for scope in _scopes(node):
        match = layer_scope.fullmatch(scope)
        if match:
            return int(match.group(1))
    return None


# The forms in which the exporter stores a layer's tensor: as it is, transposed or with 1 added (Gemma's norms
# scale by 1 + weight) where it folded that op into the constant.
_FORMS = {
    "as is": lambda tensor: tensor,
    "transposed": lambda tensor: np.ascontiguousarray(tensor.T) if tensor.ndim == 2 else None,
    "plus one": lambda tensor: tensor + np.asarray(1, tensor.dtype) if tensor.dtype.kind == "f" else None,
}


@dataclass(frozen=True)
class _WeightUse:
    """A traced layer's tensor (its name within the layer), the form the exporter stored it in (`_FORMS`) and the
    name it stored it under."""

    relative_name: str
    form: str
    stored_as: str = ""


def _tensor_values(layer) -> dict[str, np.ndarray]:
    return {
        name: tensor.detach().numpy() for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]
    }


def _weight_use(stored: np.ndarray, consumer_scope: str, tensors: dict[str, np.ndarray]) -> _WeightUse | None:
    """The layer tensor `stored` holds, in one of `_FORMS`; the one under the consumer's module first."""
    matches = []
    for name, tensor in tensors.items():
        if tensor.dtype != stored.dtype or tensor.size != stored.size:
            continue
        for form, make in _FORMS.items():
            made = make(tensor)
            if made is not None and made.shape == stored.shape and np.array_equal(made, stored):
                matches.append(_WeightUse(name, form))
                break
    own = [m for m in matches if consumer_scope.startswith(m.relative_name.rpartition(".")[0])]
    for candidates in (own, matches):
        if len({(m.relative_name, m.form) for m in candidates}) == 1:
            return candidates[0]
    if matches:
        names = sorted({m.relative_name for m in matches})
        raise LayerCopyError(f"a weight of the traced layer matches several of its tensors: {names}")
    return None


def _layer_members(graph, layer_scope: re.Pattern) -> dict[int, int]:
    """id(node) -> its layer: by its module scope, or, for a node the optimizer made without one, the layer of
    every node it reads from and writes to."""
    members = {}
    for node in graph:
        index = _layer_of(node, layer_scope)
        if index is not None:
            members[id(node)] = index
    changed = True
    while changed:
        changed = False
        for node in graph:
            if id(node) in members:
                continue
            producers = {members.get(id(v.producer())) for v in node.inputs if v is not None and v.producer()}
            consumers = {members.get(id(use.node)) for v in node.outputs for use in v.uses()}
            if len(producers) == 1 and None not in producers and consumers == producers:
                members[id(node)] = producers.pop()
                changed = True
    return members


_SIZE_OPS = {"Shape", "Size"}


def _layer_independent(graph, layer_weight: re.Pattern) -> set[int]:
    """ids of values that are the same in every layer: made from the attention mask, the positions, constants and
    tensors' sizes only (not from token ids, hidden states, a past or a weight), wherever the exporter put them."""

    dependent: set[int] = set()
    for value in graph.inputs:
        if value.name == "input_ids" or value.name.startswith(PAST_PREFIX) or value.name == "image_features":
            dependent.add(id(value))
    for value in graph.initializers.values():
        large = value.const_value is not None and stored_externally(value.const_value.nbytes)
        if large or layer_weight.match(value.name):
            dependent.add(id(value))
    independent = set()
    for node in graph:  # in topological order
        reads = [] if node.op_type in _SIZE_OPS else [v for v in node.inputs if v is not None]
        outputs_dependent = any(id(v) in dependent for v in reads)
        for value in node.outputs:
            (dependent if outputs_dependent else independent).add(id(value))
    return independent


def _copied_shape(shape):
    import onnx_ir as ir

    return None if shape is None else ir.Shape(list(shape.dims))


@dataclass(frozen=True)
class _Past:
    """A template's read of its own past (`key` or `value`): the copy reads its own."""

    kind: str


_HIDDEN = "hidden states"  # a template's read of the previous layer's hidden states


class _TracedLayers:
    """The traced graph seen layer by layer: which nodes each traced layer has and what each hands on."""

    def __init__(self, graph, plan: LayerPlan, wrapper_prefix: str) -> None:
        self.graph, self.plan = graph, plan
        # the exporter records scopes with or without the wrapper's attribute in front
        self.scope_prefix = f"(?:{re.escape(wrapper_prefix)}\\.)?{re.escape(plan.path)}"
        self.members = _layer_members(graph, re.compile(self.scope_prefix + r"\.(\d+)"))
        self.nodes: dict[int, list] = {j: [] for j in range(plan.traced)}
        for node in graph:
            if id(node) in self.members:
                self.nodes[self.members[id(node)]].append(node)
        self.graph_outputs = {id(value) for value in graph.outputs}
        self.independent = _layer_independent(graph, re.compile(self.scope_prefix + r"\."))
        self.hidden_out = {j: self._hidden_out(j) for j in range(plan.traced)}

    def _hidden_out(self, j: int):
        """Layer j's hidden states for the next layer: its one output read outside it that is not a present."""
        layer_nodes = self.nodes[j]
        if not layer_nodes:
            raise LayerCopyError(f"no node is recorded in layer {j}")
        outputs = [value for node in layer_nodes for value in node.outputs]
        handed = [
            value
            for value in outputs
            if id(value) not in self.graph_outputs
            and id(value) not in self.independent
            and any(self.members.get(id(use.node)) != j for use in value.uses())
        ]
        presents = {value.name for value in outputs if id(value) in self.graph_outputs}
        if len(handed) != 1 or presents != {f"{PRESENT_PREFIX}{j}.key", f"{PRESENT_PREFIX}{j}.value"}:
            raise LayerCopyError(f"layer {j} hands on {len(handed)} values and writes {sorted(presents)}")
        readers = {self.members.get(id(use.node)) for use in handed[0].uses()} - {j}
        if readers != ({j + 1} if j + 1 < self.plan.traced else {None}):
            raise LayerCopyError(f"layer {j}'s hidden states are read by layers {readers}")
        return handed[0]

    def template_reads(self, j: int, layer) -> dict[tuple[int, int], object]:
        """(node position, input slot) -> what template j reads there that it did not make: `_HIDDEN`, a `_Past`,
        a `_WeightUse` of its module `layer`, or a value every copy shares (sizes, rotary terms, the mask)."""
        import onnx_ir as ir

        tensors = _tensor_values(layer)
        own_scope = re.compile(rf"^{self.scope_prefix}\.{j}\.?")
        initializers = {id(value) for value in self.graph.initializers.values()}
        reads = {}
        for position, node in enumerate(self.nodes[j]):
            if any(
                a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()
            ):
                raise LayerCopyError(f"layer {j} has a node with a subgraph ({node.op_type})")
            for slot, value in enumerate(node.inputs):
                maker = None if value is None else self.members.get(id(value.producer()))
                if value is None or maker == j:
                    continue
                if value is self.hidden_out[j - 1]:
                    read = _HIDDEN
                elif value.name in (f"{PAST_PREFIX}{j}.key", f"{PAST_PREFIX}{j}.value"):
                    read = _Past(value.name.rsplit(".", 1)[1])
                elif id(value) in initializers and value.const_value is not None:
                    scopes = _scopes(node)
                    module = own_scope.sub("", scopes[-2] if len(scopes) >= 2 else "", count=1)
                    constant = value.const_value.numpy()
                    use = _weight_use(constant, module, tensors)
                    if use is None and constant.dtype.kind == "f" and constant.size > 1:
                        raise LayerCopyError(f"layer {j} reads {value.name}, which is no tensor of the layer")
                    read = value if use is None else replace(use, stored_as=value.name)  # a constant: shared
                elif id(value) in self.independent:
                    read = value
                elif maker is not None or value.name.startswith(PAST_PREFIX):
                    raise LayerCopyError(f"layer {j} reads {value.name}, a value of another layer")
                else:
                    read = value  # made outside the layers: shared
                reads[(position, slot)] = read
        return reads

    def add_copy(self, i: int, reads: dict, hidden, layer):
        """Append layer i, a copy of its template reading `hidden` and the weights of its module `layer`; return
        its hidden states."""
        import onnx_ir as ir

        j = self.plan.template[i]
        pasts = {}
        for kind in ("key", "value"):
            like = next(v for v in self.graph.inputs if v.name == f"{PAST_PREFIX}{j}.{kind}")
            pasts[kind] = ir.Value(
                name=f"{PAST_PREFIX}{i}.{kind}", shape=_copied_shape(like.shape), type=like.type
            )
            self.graph.inputs.append(pasts[kind])
        weights, presents = {}, {}
        made: dict[int, object] = {}  # id of a template value -> its copy's
        for position, node in enumerate(self.nodes[j]):
            inputs = []
            for slot, value in enumerate(node.inputs):
                read = reads.get((position, slot))
                if value is None or read is None:
                    inputs.append(None if value is None else made[id(value)])
                elif read is _HIDDEN:
                    inputs.append(hidden)
                elif isinstance(read, _Past):
                    inputs.append(pasts[read.kind])
                elif isinstance(read, _WeightUse):
                    if read not in weights:
                        weights[read] = self._weight(i, read, layer)
                    inputs.append(weights[read])
                else:
                    inputs.append(read)
            copy = ir.Node(
                node.domain,
                node.op_type,
                inputs,
                [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                overload=node.overload,
                num_outputs=len(node.outputs),
                version=node.version,
                name=f"{node.name}.layer{i}" if node.name else None,
                metadata_props=self._copied_metadata(node, j, i),
            )
            for template_value, value in zip(node.outputs, copy.outputs, strict=True):
                if id(template_value) in self.graph_outputs:
                    kind = template_value.name.rsplit(".", 1)[1]
                    value.name = f"{PRESENT_PREFIX}{i}.{kind}"
                    presents[kind] = value
                else:
                    value.name = f"{template_value.name}.layer{i}"
                value.shape = _copied_shape(template_value.shape)
                value.type = template_value.type
                made[id(template_value)] = value
            self.graph.append(copy)
        self.graph.outputs.extend([presents["key"], presents["value"]])
        return made[id(self.hidden_out[j])]

    def _weight(self, i: int, use: _WeightUse, layer):
        """Layer i's own tensor in the form its template's was stored, as a new initializer."""
        import onnx_ir as ir

        array = _FORMS[use.form](_tensor(layer, use.relative_name))
        # named as a trace names it: a tensor stored as it is by its module path, a folded one by a new name
        plain = use.form == "as is"
        name = f"{self.plan.path}.{i}.{use.relative_name}" if plain else f"{use.stored_as}.layer{i}"
        while name in self.graph.initializers:  # one folded tensor the trace shared between two uses
            name += "_"
        weight = ir.Value(
            name=name,
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
            const_value=ir.tensor(array, name=name),
        )
        self.graph.register_initializer(weight)
        return weight

    def _copied_metadata(self, node, template: int, index: int) -> dict[str, str]:
        metadata = dict(node.metadata_props)
        if SCOPES_KEY in metadata:
            metadata[SCOPES_KEY] = repr(
                [
                    re.sub(rf"^({self.scope_prefix})\.{template}(?=\.|$)", rf"\g<1>.{index}", scope)
                    for scope in _scopes(node)
                ]
            )
        return metadata


def copy_layers(graph, model, plan: LayerPlan, wrapper_prefix: str) -> None:
    """Give `graph` (traced with `plan.traced` layers) every layer of `model`: each later layer a copy of its
    template's nodes with its own past, present and weights. Raises LayerCopyError, leaving the graph as it was,
    when the traced graph does not have the shape this relies on."""
    traced = _TracedLayers(graph, plan, wrapper_prefix)
    layers = model.get_submodule(plan.path)
    reads = {j: traced.template_reads(j, layers[j]) for j in set(plan.template[plan.traced :])}
    hidden = traced.hidden_out[plan.traced - 1]
    final_readers = [(use.node, use.idx) for use in hidden.uses() if traced.members.get(id(use.node)) is None]
    for i in range(plan.traced, len(plan.template)):  # only now is the graph changed
        hidden = traced.add_copy(i, reads[plan.template[i]], hidden, layers[i])
    for node, slot in final_readers:
        node.replace_input_with(slot, hidden)
    graph.sort()


def _tensor(layer, relative_name: str) -> np.ndarray:
    module_path, _, attribute = relative_name.rpartition(".")
    return getattr(layer.get_submodule(module_path), attribute).detach().numpy()
