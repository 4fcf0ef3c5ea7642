"""A pack's manifest for more layers than were traced: the last traced layer repeated.

Shape-only packs (exporter/shape_only.py) trace a model with two of its layers: layer 0, and one that stands
for every later one (alike in sub-layers, weights, shapes, KV and costs). Layer i of the result is a copy
of that layer under the names layer i has: its sub-layers `L{i}.*`, weights `model.layers.{i}.*`, KV
`past_key_values.{i}.*` / `present.{i}.*`; tensors the exporter numbered (`add_961`) get the suffix `@L{i}`,
and the residual stream into layer i is the one out of layer i - 1. A vision tower's blocks are repeated alike
(repeat_vision_blocks): its probe has one windowed-attention block and one full-attention block, and each block
of the result is a copy of the probe's block of its kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import renamed_weight
from pipeshard.formats.manifest import (
    WEIGHT_ALIGNMENT,
    WEIGHT_ELEMENT_BYTES,
    Cost,
    Manifest,
    ModelFacts,
    SubLayer,
    TensorInfo,
    VisionSection,
)


def _produced(manifest: Manifest, layer: int) -> set[str]:
    """Tensors that layer `layer` makes: its sub-layers' outputs and its MoE combine's output."""
    made = {t.name for e in manifest.sub_layers if e.layer == layer for t in e.outputs}
    return made | {b.output for b in manifest.moe_blocks if b.layer == layer}


def _renamed(tensors: tuple[TensorInfo, ...], rename: Callable[[str], str]) -> tuple[TensorInfo, ...]:
    return tuple(replace(t, name=rename(t.name)) for t in tensors)


def _copied(
    entry: SubLayer,
    layer: int,
    unit: Callable[[str], str],
    weight: Callable[[str], str],
    tensor: Callable[[str], str],
) -> SubLayer:
    """`entry` as layer (block) `layer`: its name, blob, weights and tensors renamed."""
    return replace(
        entry,
        name=unit(entry.name),
        layer=layer,
        blob=entry.blob and replace(entry.blob, file=unit(entry.blob.file)),
        weights=tuple(replace(w, name=weight(w.name), file=unit(w.file)) for w in entry.weights),
        inputs=_renamed(entry.inputs, tensor),
        outputs=_renamed(entry.outputs, tensor),
        kv=entry.kv
        and replace(
            entry.kv, past=[tensor(t) for t in entry.kv.past], present=[tensor(t) for t in entry.kv.present]
        ),
    )


def repeat_layers(manifest: Manifest, num_layers: int) -> Manifest:
    """`manifest` with `num_layers` decoder layers, layers past the traced ones copied from the last traced."""
    traced = manifest.model.num_layers
    if num_layers <= traced:
        if num_layers < traced:
            raise UserError(f"cannot shrink a manifest of {traced} layers to {num_layers}")
        return manifest
    if traced < 2:
        raise UserError("repeating layers needs a manifest of at least two traced layers")
    last = traced - 1
    template = [e for e in manifest.sub_layers if e.layer == last]
    local = _produced(manifest, last)
    reads = {t.name for e in template for t in e.inputs}
    (residual_in,) = reads & _produced(manifest, last - 1) or {None}
    end = manifest.sub_layers.index(template[-1]) + 1
    after = manifest.sub_layers[end:]
    (residual_out,) = {t.name for e in after for t in e.inputs} & local or {None}
    if residual_in is None or residual_out is None:
        raise UserError("the traced layers are not joined by one residual stream; cannot repeat them")

    def tensor(name: str, layer: int) -> str:
        for prefix in ("past_key_values.", "present."):
            if name.startswith(f"{prefix}{last}."):
                return f"{prefix}{layer}." + name[len(f"{prefix}{last}.") :]
        if name == residual_in:
            return tensor(residual_out, layer - 1)
        if name in local and layer != last:
            return f"{name}@L{layer}"
        return name

    def weight(name: str, layer: int) -> str:
        marker = f"layers.{last}."
        return (
            name.replace(marker, f"layers.{layer}.", 1)
            if marker in name
            else renamed_weight(name, f"@L{layer}")
        )

    def unit(name: str, layer: int) -> str:
        return f"L{layer}." + name[len(f"L{last}.") :] if name.startswith(f"L{last}.") else name

    repeated = [
        _copied(
            e,
            layer,
            lambda name, layer=layer: unit(name, layer),
            lambda name, layer=layer: weight(name, layer),
            lambda name, layer=layer: tensor(name, layer),
        )
        for layer in range(traced, num_layers)
        for e in template
    ]
    tail = [
        replace(
            e, inputs=_renamed(e.inputs, lambda name: tensor(name, num_layers - 1) if name in local else name)
        )
        for e in after
    ]
    entries = (*manifest.sub_layers[:end], *repeated, *tail)
    blocks = list(manifest.moe_blocks)
    template_block = next((b for b in blocks if b.layer == last), None)
    if template_block is not None:
        blocks += [
            replace(
                template_block,
                layer=layer,
                router=unit(template_block.router, layer),
                experts=[unit(x, layer) for x in template_block.experts],
                residual=tensor(template_block.residual, layer),
                hidden=tensor(template_block.hidden, layer),
                routing=tensor(template_block.routing, layer),
                output=tensor(template_block.output, layer),
                expert_outputs=[tensor(t, layer) for t in template_block.expert_outputs],
            )
            for layer in range(traced, num_layers)
        ]

    def with_kv_of_every_layer(tensors: tuple[TensorInfo, ...]) -> tuple[TensorInfo, ...]:
        kv = [t for t in tensors if t.name.startswith((f"past_key_values.{last}.", f"present.{last}."))]
        return (
            *tensors,
            *(replace(t, name=tensor(t.name, layer)) for layer in range(traced, num_layers) for t in kv),
        )

    return replace(
        manifest,
        model=replace(manifest.model, num_layers=num_layers),
        sub_layers=entries,
        moe_blocks=tuple(blocks),
        graph_inputs=with_kv_of_every_layer(manifest.graph_inputs),
        graph_outputs=with_kv_of_every_layer(manifest.graph_outputs),
        kv_bytes_per_token=sum(e.kv.bytes_per_token for e in entries if e.kv),
        total_weight_bytes=sum(e.blob.bytes for e in entries if e.blob),
    )


def repeat_vision_blocks(
    vision: VisionSection, num_layers: int, fullatt_block_indexes: list[int]
) -> VisionSection:
    """`vision` with `num_layers` blocks, those in `fullatt_block_indexes` full-attention: block i is a copy of the
    traced block of its kind (windowed or full) under block i's names: sub-layers `V{i}.*`, weights `blocks.{i}.*`,
    numbered tensors and weights with the suffix `@V{i}` (block i keeps the traced names where it is the traced
    block it copies), its residual stream in the one out of block i - 1."""
    traced, traced_full = vision.num_layers, set(vision.fullatt_block_indexes)
    full = set(fullatt_block_indexes)
    if (num_layers, full) == (traced, traced_full):
        return vision
    entries = vision.sub_layers
    blocks = {b: [e for e in entries if e.layer == b] for b in range(traced)}
    template = {}
    for is_full in {b in full for b in range(num_layers)}:
        template[is_full] = next((b for b in range(traced) if (b in traced_full) == is_full), None)
        if template[is_full] is None:
            kind = "full-attention" if is_full else "windowed"
            raise UserError(f"the traced vision tower has no {kind} block to repeat")
    first, end = entries.index(blocks[0][0]), entries.index(blocks[traced - 1][-1]) + 1
    made = {b: {t.name for e in blocks[b] for t in e.outputs} for b in range(traced)}
    after = {b: entries[entries.index(blocks[b][-1]) + 1] for b in range(traced)}
    residual_out = {}
    for b in range(traced):
        (residual_out[b],) = {t.name for t in after[b].inputs} & made[b] or {None}
    residual_in = {b: residual_out[b - 1] for b in range(1, traced)}
    (residual_in[0],) = {t.name for t in blocks[0][0].inputs} & {
        t.name for t in entries[first - 1].outputs
    } or {None}
    if None in residual_in.values() or None in residual_out.values():
        raise UserError("the traced vision blocks are not joined by one residual stream; cannot repeat them")

    def residual(block: int) -> str:
        """The residual stream out of block `block` of the result (block -1: the stream into block 0)."""
        if block < 0:
            return residual_in[0]
        source = template[block in full]
        return tensor(residual_out[source], source, block)

    def tensor(name: str, source: int, block: int) -> str:
        if name == residual_in[source]:
            return residual(block - 1)
        if name in made[source] and block != source:
            return f"{name}@V{block}"
        return name

    def weight(name: str, source: int, block: int) -> str:
        marker = f"blocks.{source}."
        if marker in name:
            return name.replace(marker, f"blocks.{block}.", 1)
        return name if block == source else renamed_weight(name, f"@V{block}")

    def unit(name: str, source: int, block: int) -> str:
        prefix = f"V{source}."
        return f"V{block}." + name[len(prefix) :] if name.startswith(prefix) else name

    def copied(entry: SubLayer, block: int) -> SubLayer:
        source = entry.layer
        return _copied(
            entry,
            block,
            lambda name: unit(name, source, block),
            lambda name: weight(name, source, block),
            lambda name: tensor(name, source, block),
        )

    repeated = [copied(e, block) for block in range(num_layers) for e in blocks[template[block in full]]]
    last_out = residual_out[traced - 1]
    tail = [
        replace(
            e, inputs=_renamed(e.inputs, lambda name: residual(num_layers - 1) if name == last_out else name)
        )
        for e in entries[end:]
    ]
    return vision.with_blocks((*entries[:first], *repeated, *tail), num_layers, sorted(full))


def _resized(shape: list, traced: int, wanted: int) -> list:
    return [wanted if dim == traced else dim for dim in shape]


def repeat_experts(manifest: Manifest, num_experts: int) -> Manifest:
    """`manifest` with `num_experts` experts per MoE layer, those past the traced ones copied from the last traced
    (`L{i}.expert{j}`, weights `...experts.{j}.*`, numbered tensors with the suffix `@E{j}`). The router's gate and
    the routing weights widen to the new count (the probe's expert count is chosen unlike any other dimension),
    and the router's and experts' costs are counted again for it."""
    model = manifest.model
    traced = model.num_experts
    if num_experts <= traced:
        return manifest
    dims = replace(model, num_experts=num_experts)
    index = traced - 1
    added: dict[str, list[SubLayer]] = {}
    blocks = []
    for block in manifest.moe_blocks:
        last = manifest.by_name[block.experts[-1]]
        own = {t.name for t in last.outputs}
        new_experts = []
        for j in range(traced, num_experts):
            name, marker = f"L{block.layer}.expert{j}", f".experts.{index}."
            new_experts.append(
                replace(
                    last,
                    name=name,
                    expert=j,
                    blob=last.blob and replace(last.blob, file=f"{name}.weights"),
                    weights=tuple(
                        replace(
                            w,
                            name=w.name.replace(marker, f".experts.{j}.", 1)
                            if marker in w.name
                            else renamed_weight(w.name, f"@E{j}"),
                            file=f"{name}.weights" if w.file == f"{last.name}.weights" else w.file,
                        )
                        for w in last.weights
                    ),
                    outputs=_renamed(last.outputs, lambda t, j=j, own=own: f"{t}@E{j}" if t in own else t),
                )
            )
        added[last.name] = new_experts
        blocks.append(
            replace(
                block,
                experts=[*block.experts, *(e.name for e in new_experts)],
                expert_outputs=[*block.expert_outputs, *(e.outputs[0].name for e in new_experts)],
            )
        )
    entries = []
    for entry in manifest.sub_layers:
        for e in (entry, *added.get(entry.name, ())):
            entries.append(
                _widened(e, traced, num_experts, dims, model.compute_dtype)
                if e.kind in ("router", "expert")
                else e
            )
    return replace(
        manifest,
        model=replace(model, num_experts=num_experts),
        sub_layers=tuple(entries),
        moe_blocks=tuple(blocks),
        total_weight_bytes=sum(e.blob.bytes for e in entries if e.blob),
    )


def _widened(
    entry: SubLayer, traced: int, num_experts: int, dims: ModelFacts, compute_dtype: str
) -> SubLayer:
    """A router or expert with `num_experts` experts: its shapes, its blob's layout and its cost counted again."""
    from pipeshard.partitioner.costs import analytic_flops, bytes_moved

    weights, offset = [], 0
    for w in entry.weights:
        if entry.blob is None or w.file != entry.blob.file:
            weights.append(w)
            continue
        shape = tuple(_resized(list(w.shape), traced, num_experts))
        offset += (-offset) % WEIGHT_ALIGNMENT
        size = math.prod(shape) * WEIGHT_ELEMENT_BYTES[w.dtype]
        weights.append(replace(w, shape=shape, offset=offset, bytes=size))
        offset += size
    weight_bytes = sum(w.bytes for w in weights)

    def resized(tensors: tuple[TensorInfo, ...]) -> tuple[TensorInfo, ...]:
        return tuple(replace(t, shape=_resized(t.shape, traced, num_experts)) for t in tensors)

    return replace(
        entry,
        inputs=resized(entry.inputs),
        outputs=resized(entry.outputs),
        weights=tuple(weights),
        blob=entry.blob and replace(entry.blob, bytes=offset),
        weight_bytes=weight_bytes,
        cost=Cost(
            flops=analytic_flops(entry.kind, dims),
            bytes=bytes_moved(None, entry.kind, dims, compute_dtype, weight_bytes),
        ),
    )
