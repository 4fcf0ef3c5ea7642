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

import copy
import math

from pipeshard.core.errors import UserError
from pipeshard.formats.io_names import renamed_weight


def _produced(manifest: dict, layer: int) -> set[str]:
    """Tensors that layer `layer` makes: its sub-layers' outputs and its MoE combine's output."""
    made = {t["name"] for e in manifest["sub_layers"] if e["layer"] == layer for t in e["outputs"]}
    return made | {b["output"] for b in manifest.get("moe_blocks", []) if b["layer"] == layer}


def repeat_layers(manifest: dict, num_layers: int) -> dict:
    """`manifest` with `num_layers` decoder layers, layers past the traced ones copied from the last traced."""
    traced = manifest["model"]["num_layers"]
    if num_layers <= traced:
        if num_layers < traced:
            raise UserError(f"cannot shrink a manifest of {traced} layers to {num_layers}")
        return manifest
    if traced < 2:
        raise UserError("repeating layers needs a manifest of at least two traced layers")
    last = traced - 1
    template = [e for e in manifest["sub_layers"] if e["layer"] == last]
    local = _produced(manifest, last)
    reads = {t["name"] for e in template for t in e["inputs"]}
    (residual_in,) = reads & _produced(manifest, last - 1) or {None}
    end = manifest["sub_layers"].index(template[-1]) + 1
    after = manifest["sub_layers"][end:]
    (residual_out,) = {t["name"] for e in after for t in e["inputs"]} & local or {None}
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

    def copied(entry: dict, layer: int) -> dict:
        new = copy.deepcopy(entry)
        new["name"], new["layer"] = unit(entry["name"], layer), layer
        if new.get("blob"):
            new["blob"]["file"] = unit(new["blob"]["file"], layer)
        for w in new["weights"]:
            w["name"], w["file"] = weight(w["name"], layer), unit(w["file"], layer)
        for side in ("inputs", "outputs"):
            for t in new[side]:
                t["name"] = tensor(t["name"], layer)
        if new.get("kv"):
            new["kv"]["past"] = [tensor(t, layer) for t in new["kv"]["past"]]
            new["kv"]["present"] = [tensor(t, layer) for t in new["kv"]["present"]]
        return new

    result = copy.deepcopy(manifest)
    before, tail = result["sub_layers"][:end], result["sub_layers"][end:]
    repeated = [copied(e, layer) for layer in range(traced, num_layers) for e in template]
    for entry in tail:
        for t in entry["inputs"]:
            t["name"] = tensor(t["name"], num_layers - 1) if t["name"] in local else t["name"]
    result["sub_layers"] = before + repeated + tail
    blocks = result.get("moe_blocks", [])
    template_block = next((b for b in blocks if b["layer"] == last), None)
    if template_block is not None:
        for layer in range(traced, num_layers):
            blocks.append(
                {
                    "layer": layer,
                    "router": unit(template_block["router"], layer),
                    "experts": [unit(x, layer) for x in template_block["experts"]],
                    **{
                        key: tensor(template_block[key], layer)
                        for key in ("residual", "hidden", "routing", "output")
                    },
                    "expert_outputs": [tensor(t, layer) for t in template_block["expert_outputs"]],
                }
            )
    for side in ("graph_inputs", "graph_outputs"):
        kv = [
            t for t in result[side] if t["name"].startswith((f"past_key_values.{last}.", f"present.{last}."))
        ]
        result[side] += [
            {**t, "name": tensor(t["name"], layer)} for layer in range(traced, num_layers) for t in kv
        ]
    result["model"]["num_layers"] = num_layers
    result["kv_bytes_per_token"] = sum(e["kv"]["bytes_per_token"] for e in result["sub_layers"] if e["kv"])
    result["total_weight_bytes"] = sum(e["blob"]["bytes"] for e in result["sub_layers"] if e["blob"])
    return result


def repeat_vision_blocks(manifest: dict, num_layers: int, fullatt_block_indexes: list[int]) -> dict:
    """`manifest` with a vision tower of `num_layers` blocks, those in `fullatt_block_indexes` full-attention:
    block i is a copy of the traced block of its kind (windowed or full) under block i's names: sub-layers
    `V{i}.*`, weights `blocks.{i}.*`, numbered tensors and weights with the suffix `@V{i}` (block i keeps the
    traced names where it is the traced block it copies), its residual stream in the one out of block i - 1."""
    vision = manifest["vision"]
    traced, traced_full = vision["num_layers"], set(vision["fullatt_block_indexes"])
    full = set(fullatt_block_indexes)
    if (num_layers, full) == (traced, traced_full):
        return manifest
    entries = vision["sub_layers"]
    blocks = {b: [e for e in entries if e["layer"] == b] for b in range(traced)}
    template = {}
    for is_full in {b in full for b in range(num_layers)}:
        template[is_full] = next((b for b in range(traced) if (b in traced_full) == is_full), None)
        if template[is_full] is None:
            kind = "full-attention" if is_full else "windowed"
            raise UserError(f"the traced vision tower has no {kind} block to repeat")
    first, end = entries.index(blocks[0][0]), entries.index(blocks[traced - 1][-1]) + 1
    made = {b: {t["name"] for e in blocks[b] for t in e["outputs"]} for b in range(traced)}
    after = {b: entries[entries.index(blocks[b][-1]) + 1] for b in range(traced)}
    residual_out = {}
    for b in range(traced):
        (residual_out[b],) = {t["name"] for t in after[b]["inputs"]} & made[b] or {None}
    residual_in = {b: residual_out[b - 1] for b in range(1, traced)}
    (residual_in[0],) = {t["name"] for t in blocks[0][0]["inputs"]} & {
        t["name"] for t in entries[first - 1]["outputs"]
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

    def copied(entry: dict, block: int) -> dict:
        source = entry["layer"]
        new = copy.deepcopy(entry)
        new["name"], new["layer"] = unit(entry["name"], source, block), block
        if new.get("blob"):
            new["blob"]["file"] = unit(new["blob"]["file"], source, block)
        for w in new["weights"]:
            w["name"], w["file"] = weight(w["name"], source, block), unit(w["file"], source, block)
        for side in ("inputs", "outputs"):
            for t in new[side]:
                t["name"] = tensor(t["name"], source, block)
        return new

    result = copy.deepcopy(manifest)
    head, tail = result["vision"]["sub_layers"][:first], result["vision"]["sub_layers"][end:]
    repeated = [copied(e, block) for block in range(num_layers) for e in blocks[template[block in full]]]
    for entry in tail:
        for t in entry["inputs"]:
            t["name"] = residual(num_layers - 1) if t["name"] == residual_out[traced - 1] else t["name"]
    result["vision"]["sub_layers"] = head + repeated + tail
    result["vision"]["num_layers"] = num_layers
    result["vision"]["fullatt_block_indexes"] = sorted(full)
    if "fullatt_block_indexes" in result["vision"].get("preprocessing", {}):  # the host's attention groups
        result["vision"]["preprocessing"]["fullatt_block_indexes"] = sorted(full)
    result["vision"]["total_weight_bytes"] = sum(
        e["blob"]["bytes"] for e in result["vision"]["sub_layers"] if e["blob"]
    )
    return result


def _resized(shape: list, traced: int, wanted: int) -> list:
    return [wanted if dim == traced else dim for dim in shape]


def repeat_experts(manifest: dict, num_experts: int) -> dict:
    """`manifest` with `num_experts` experts per MoE layer, those past the traced ones copied from the last traced
    (`L{i}.expert{j}`, weights `...experts.{j}.*`, numbered tensors with the suffix `@E{j}`). The router's gate and
    the routing weights widen to the new count (the probe's expert count is chosen unlike any other dimension),
    and the router's and experts' costs are counted again for it."""
    from pipeshard.formats.manifest import WEIGHT_ALIGNMENT
    from pipeshard.partitioner.costs import analytic_flops, bytes_moved

    model = manifest["model"]
    traced = model["num_experts"]
    if num_experts <= traced:
        return manifest
    result = copy.deepcopy(manifest)
    dims = {**result["model"], "num_experts": num_experts}
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1}  # (u)int8: a GGUF format's parts
    by_name = {e["name"]: e for e in result["sub_layers"]}
    added: dict[str, list[dict]] = {}
    for block in result["moe_blocks"]:
        last = by_name[block["experts"][-1]]
        own = {t["name"] for t in last["outputs"]}
        index = traced - 1
        new_experts = []
        for j in range(traced, num_experts):
            expert = copy.deepcopy(last)
            expert["name"], expert["expert"] = f"L{block['layer']}.expert{j}", j
            if expert.get("blob"):
                expert["blob"]["file"] = f"{expert['name']}.weights"
            marker = f".experts.{index}."
            for w in expert["weights"]:
                w["name"] = (
                    w["name"].replace(marker, f".experts.{j}.", 1)
                    if marker in w["name"]
                    else renamed_weight(w["name"], f"@E{j}")
                )
                w["file"] = (
                    f"{expert['name']}.weights" if w["file"] == f"{last['name']}.weights" else w["file"]
                )
            for t in expert["outputs"]:
                t["name"] = f"{t['name']}@E{j}" if t["name"] in own else t["name"]
            new_experts.append(expert)
        added[last["name"]] = new_experts
        block["experts"] += [e["name"] for e in new_experts]
        block["expert_outputs"] += [e["outputs"][0]["name"] for e in new_experts]
    entries = []
    for entry in result["sub_layers"]:
        entries.append(entry)
        entries += added.get(entry["name"], [])
    for entry in entries:
        if entry["kind"] not in ("router", "expert"):
            continue
        for t in entry["inputs"] + entry["outputs"]:
            t["shape"] = _resized(t["shape"], traced, num_experts)
        offset = 0
        for w in entry["weights"]:
            if w["file"] != (entry["blob"] or {}).get("file"):
                continue
            w["shape"] = _resized(w["shape"], traced, num_experts)
            offset += (-offset) % WEIGHT_ALIGNMENT
            w["offset"], w["bytes"] = offset, math.prod(w["shape"]) * itemsize[w["dtype"]]
            offset += w["bytes"]
        if entry["blob"]:
            entry["blob"]["bytes"] = offset
        entry["weight_bytes"] = sum(w["bytes"] for w in entry["weights"])
        entry["cost"] = {
            "flops": analytic_flops(entry["kind"], dims),
            "bytes": bytes_moved(
                None, entry["kind"], dims, model.get("compute_dtype", model["dtype"]), entry["weight_bytes"]
            ),
        }
    result["sub_layers"] = entries
    result["model"]["num_experts"] = num_experts
    result["total_weight_bytes"] = sum(e["blob"]["bytes"] for e in entries if e["blob"])
    return result
