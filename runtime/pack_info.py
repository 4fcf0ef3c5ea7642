"""`pipeshard inspect`: what a pack holds and what each sub-layer costs."""

from __future__ import annotations

from dataclasses import asdict

from pipeshard.formats.manifest import ModelFacts, Pack, SubLayer, VisionSection, evaluate_cost

TIERS_SHOWN = (1, 64)
MiB = 1024**2


def expected_step_cost(
    entry: SubLayer, coefficients: dict[str, float], tokens: int, context: int, model: ModelFacts
) -> float:
    """A sub-layer's cost (`coefficients`: its cost's flops or bytes terms) in a step of `tokens` new tokens. An
    expert's manifest cost is per tokens routed to it; in a step it runs with probability 1-(1-k/E)^T (uniform
    routing), then over T·(k/E)/that tokens."""
    if entry.kind != "expert":
        return evaluate_cost(coefficients, tokens, context)
    share = model.experts_per_token / model.num_experts
    chosen = 1.0 - (1.0 - share) ** tokens
    return chosen * evaluate_cost(coefficients, tokens * share / chosen, context)


def pack_summary(pack: Pack, context: int) -> dict:
    """Per sub-layer: kind, weight bytes, FLOPs and bytes at T=1 and T=64 (for an expert: T tokens routed
    to it), KV bytes/token, boundaries; totals per step of T tokens (experts by their expected use)."""
    rows = []
    step = {f"{kind}_T{t}": 0.0 for kind in ("flops", "bytes") for t in TIERS_SHOWN}
    for entry in pack.sub_layers:
        cost = entry.cost
        own_blob = entry.blob.file if entry.blob else None
        rows.append(
            {
                "name": entry.name,
                "kind": entry.kind,
                "layer": entry.layer,
                "weight_bytes": sum(w.bytes for w in entry.weights if w.file == own_blob),
                "shared_weight_bytes": sum(w.bytes for w in entry.weights if w.file != own_blob),
                **{f"flops_T{t}": cost.flops_at(t, context) for t in TIERS_SHOWN},
                **{f"bytes_T{t}": cost.bytes_at(t, context) for t in TIERS_SHOWN},
                "kv_bytes_per_token": entry.kv.bytes_per_token if entry.kv else 0,
                "inputs": [i.name for i in entry.inputs],
                "outputs": [o.name for o in entry.outputs],
            }
        )
        for kind, terms in (("flops", cost.flops), ("bytes", cost.bytes)):
            for t in TIERS_SHOWN:
                step[f"{kind}_T{t}"] += expected_step_cost(entry, terms, t, context, pack.model)
    totals = {
        key: sum(row[key] for row in rows) for key in rows[0] if key.startswith(("weight", "shared", "kv"))
    }
    totals.update(step)
    return {"model": asdict(pack.model), "context": context, "sub_layers": rows, "totals": totals}


def pack_table(pack: Pack, context: int) -> str:
    """The summary as a fixed-width table with totals at the bottom."""
    summary = pack_summary(pack, context)
    header = (
        f"{'sub-layer':<12} {'kind':<9} {'weights MiB':>11} {'GFLOP T=1':>10} {'GFLOP T=64':>11} "
        f"{'MiB T=1':>9} {'MiB T=64':>9} {'KV B/tok':>9}  boundary (in -> out)"
    )
    model = pack.model
    lines = [
        f"{pack.folder}: {model.architecture} {model.dtype}, {model.num_layers} layers, "
        f"costs at context C={context}",
        header,
        "-" * len(header),
    ]

    def row_text(name: str, kind: str, row: dict) -> str:
        return (
            f"{name:<12} {kind:<9} {row['weight_bytes'] / MiB:>11.2f} {row['flops_T1'] / 1e9:>10.4f} "
            f"{row['flops_T64'] / 1e9:>11.3f} {row['bytes_T1'] / MiB:>9.2f} {row['bytes_T64'] / MiB:>9.2f} "
            f"{row['kv_bytes_per_token']:>9}"
        )

    for row in summary["sub_layers"]:
        boundary = f"{len(row['inputs'])} -> {len(row['outputs'])}: " + ", ".join(row["outputs"][:3])
        if row["shared_weight_bytes"]:
            boundary += f"  (reads {row['shared_weight_bytes'] / MiB:.2f} MiB of weights stored with another sub-layer)"
        lines.append(row_text(row["name"], row["kind"], row) + "  " + boundary)
    lines.append("-" * len(header))
    lines.append(row_text("total", "", summary["totals"]))
    if model.num_experts:
        lines.append(
            f"MoE: {model.num_experts} experts per layer, {model.experts_per_token} per token; an "
            "expert's row is at T tokens routed to it, the total counts each expert by its expected use "
            "in a step of T tokens (uniform routing)"
        )
    if pack.manifest.vision is not None:
        lines += ["", vision_table(pack.manifest.vision)]
    return "\n".join(lines)


def vision_table(vision: VisionSection) -> str:
    """A VLM's vision blocks: weights, GFLOP and MiB moved per tile (T = C = the patches of one tile; no KV
    cache, so the bytes have no context term)."""
    facts = vision.facts  # the export's description of the tower (a dict)
    patches = int(facts["patches_per_tile"])
    lines = [
        f"vision tower ({facts.get('model', facts['family'])}): {facts['num_layers']} blocks over "
        f"{facts['image_size']} px tiles, "
        f"{patches} patches and {facts['tokens_per_tile']} image tokens per tile; per tile:",
        f"{'block':<16} {'weights MiB':>11} {'GFLOP':>9} {'MiB moved':>10}",
    ]
    for entry in vision.sub_layers:
        flops = entry.cost.flops_at(patches, patches)
        moved = entry.cost.bytes_at(patches, 0)
        lines.append(
            f"{entry.name:<16} {entry.weight_bytes / MiB:>11.2f} {flops / 1e9:>9.3f} {moved / MiB:>10.2f}"
        )
    lines.append(f"{'total':<16} {vision.total_weight_bytes / MiB:>11.2f}")
    return "\n".join(lines)
