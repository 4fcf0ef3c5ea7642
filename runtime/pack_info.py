"""`pipeshard inspect`: what a pack holds and what each sub-layer costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class SummaryRow:
    """A sub-layer's line of `inspect` (or the totals'): its weights, FLOPs and bytes at each tier shown (for an
    expert: tokens routed to it), KV bytes per token, and its boundary."""

    name: str
    kind: str
    layer: int | None
    weight_bytes: int
    shared_weight_bytes: int  # read from another sub-layer's blob
    flops: dict[int, float]  # by tier shown
    moved_bytes: dict[int, float]  # by tier shown
    kv_bytes_per_token: int
    inputs: list[str]
    outputs: list[str]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "layer": self.layer,
            "weight_bytes": self.weight_bytes,
            "shared_weight_bytes": self.shared_weight_bytes,
            **{f"flops_T{t}": self.flops[t] for t in TIERS_SHOWN},
            **{f"bytes_T{t}": self.moved_bytes[t] for t in TIERS_SHOWN},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "inputs": self.inputs,
            "outputs": self.outputs,
        }


def summary_rows(pack: Pack, context: int) -> tuple[list[SummaryRow], SummaryRow]:
    """Per sub-layer: kind, weight bytes, FLOPs and bytes at T=1 and T=64 (for an expert: T tokens routed
    to it), KV bytes/token, boundaries; and the totals per step of T tokens (experts by their expected use)."""
    rows = []
    step_flops, step_bytes = dict.fromkeys(TIERS_SHOWN, 0.0), dict.fromkeys(TIERS_SHOWN, 0.0)
    for entry in pack.sub_layers:
        cost = entry.cost
        own_blob = entry.blob.file if entry.blob else None
        rows.append(
            SummaryRow(
                name=entry.name,
                kind=entry.kind,
                layer=entry.layer,
                weight_bytes=sum(w.bytes for w in entry.weights if w.file == own_blob),
                shared_weight_bytes=sum(w.bytes for w in entry.weights if w.file != own_blob),
                flops={t: cost.flops_at(t, context) for t in TIERS_SHOWN},
                moved_bytes={t: cost.bytes_at(t, context) for t in TIERS_SHOWN},
                kv_bytes_per_token=entry.kv.bytes_per_token if entry.kv else 0,
                inputs=[i.name for i in entry.inputs],
                outputs=[o.name for o in entry.outputs],
            )
        )
        for t in TIERS_SHOWN:
            step_flops[t] += expected_step_cost(entry, cost.flops, t, context, pack.model)
            step_bytes[t] += expected_step_cost(entry, cost.bytes, t, context, pack.model)
    totals = SummaryRow(
        name="total",
        kind="",
        layer=None,
        weight_bytes=sum(r.weight_bytes for r in rows),
        shared_weight_bytes=sum(r.shared_weight_bytes for r in rows),
        flops=step_flops,
        moved_bytes=step_bytes,
        kv_bytes_per_token=sum(r.kv_bytes_per_token for r in rows),
        inputs=[],
        outputs=[],
    )
    return rows, totals


def pack_summary(pack: Pack, context: int) -> dict:
    """`inspect --json`: the model, the context, summary_rows' rows and totals."""
    rows, totals = summary_rows(pack, context)
    return {
        "model": asdict(pack.model),
        "context": context,
        "sub_layers": [row.to_json() for row in rows],
        "totals": {
            "weight_bytes": totals.weight_bytes,
            "shared_weight_bytes": totals.shared_weight_bytes,
            "kv_bytes_per_token": totals.kv_bytes_per_token,
            **{f"flops_T{t}": totals.flops[t] for t in TIERS_SHOWN},
            **{f"bytes_T{t}": totals.moved_bytes[t] for t in TIERS_SHOWN},
        },
    }


def pack_table(pack: Pack, context: int) -> str:
    """The summary as a fixed-width table with totals at the bottom."""
    rows, totals = summary_rows(pack, context)
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

    def row_text(row: SummaryRow) -> str:
        return (
            f"{row.name:<12} {row.kind:<9} {row.weight_bytes / MiB:>11.2f} {row.flops[1] / 1e9:>10.4f} "
            f"{row.flops[64] / 1e9:>11.3f} {row.moved_bytes[1] / MiB:>9.2f} {row.moved_bytes[64] / MiB:>9.2f} "
            f"{row.kv_bytes_per_token:>9}"
        )

    for row in rows:
        boundary = f"{len(row.inputs)} -> {len(row.outputs)}: " + ", ".join(row.outputs[:3])
        if row.shared_weight_bytes:
            boundary += (
                f"  (reads {row.shared_weight_bytes / MiB:.2f} MiB of weights stored with another sub-layer)"
            )
        lines.append(row_text(row) + "  " + boundary)
    lines.append("-" * len(header))
    lines.append(row_text(totals))
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
    cache, so the bytes have no context term); weights alone where a family's tiles have no fixed size."""
    tower = vision.summary
    patches = tower.patches_per_tile
    tiles = (
        f"{tower.image_size} px tiles, {patches} patches and {tower.tokens_per_tile} image tokens per tile; per tile:"
        if patches
        else "images of varying size; weights:"
    )
    lines = [
        f"vision tower ({tower.name}): {tower.num_layers} blocks over {tiles}",
        f"{'block':<16} {'weights MiB':>11} {'GFLOP':>9} {'MiB moved':>10}",
    ]
    for entry in vision.sub_layers:
        if patches:
            flops = f"{entry.cost.flops_at(patches, patches) / 1e9:>9.3f}"
            moved = f"{entry.cost.bytes_at(patches, 0) / MiB:>10.2f}"
        else:
            flops, moved = f"{'-':>9}", f"{'-':>10}"
        lines.append(f"{entry.name:<16} {entry.weight_bytes / MiB:>11.2f} {flops} {moved}")
    lines.append(f"{'total':<16} {vision.total_weight_bytes / MiB:>11.2f}")
    return "\n".join(lines)
