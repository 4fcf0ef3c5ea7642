"""`pipeshard inspect`: what a pack holds and what each sub-layer costs."""

from __future__ import annotations

from pipeshard.runtime.pack import Pack, evaluate_cost

TIERS_SHOWN = (1, 64)
MiB = 1024**2


def pack_summary(pack: Pack, context: int) -> dict:
    """Per sub-layer: kind, weight bytes, FLOPs and bytes at T=1 and T=64, KV bytes/token, boundaries."""
    rows = []
    for entry in pack.sub_layers:
        cost = entry["cost"]
        own_blob = entry["blob"]["file"] if entry["blob"] else None
        rows.append({
            "name": entry["name"], "kind": entry["kind"], "layer": entry["layer"],
            "weight_bytes": sum(w["bytes"] for w in entry["weights"] if w["file"] == own_blob),
            "shared_weight_bytes": sum(w["bytes"] for w in entry["weights"] if w["file"] != own_blob),
            **{f"flops_T{t}": evaluate_cost(cost["flops"], t, context) for t in TIERS_SHOWN},
            **{f"bytes_T{t}": evaluate_cost(cost["bytes"], t, context) for t in TIERS_SHOWN},
            "kv_bytes_per_token": entry["kv"]["bytes_per_token"] if entry["kv"] else 0,
            "inputs": [i["name"] for i in entry["inputs"]],
            "outputs": [o["name"] for o in entry["outputs"]],
        })
    totals = {key: sum(row[key] for row in rows) for key in rows[0]
              if key.startswith(("weight", "shared", "flops", "bytes", "kv"))}
    return {"model": pack.model, "context": context, "sub_layers": rows, "totals": totals}


def pack_table(pack: Pack, context: int) -> str:
    """The summary as a fixed-width table with totals at the bottom."""
    summary = pack_summary(pack, context)
    header = (f"{'sub-layer':<12} {'kind':<9} {'weights MiB':>11} {'GFLOP T=1':>10} {'GFLOP T=64':>11} "
              f"{'MiB T=1':>9} {'MiB T=64':>9} {'KV B/tok':>9}  boundary (in -> out)")
    lines = [f"{pack.folder}: {pack.model['architecture']} {pack.model['dtype']}, {pack.model['num_layers']} layers, "
             f"costs at context C={context}", header, "-" * len(header)]

    def row_text(name: str, kind: str, row: dict) -> str:
        return (f"{name:<12} {kind:<9} {row['weight_bytes'] / MiB:>11.2f} {row['flops_T1'] / 1e9:>10.4f} "
                f"{row['flops_T64'] / 1e9:>11.3f} {row['bytes_T1'] / MiB:>9.2f} {row['bytes_T64'] / MiB:>9.2f} "
                f"{row['kv_bytes_per_token']:>9}")

    for row in summary["sub_layers"]:
        boundary = f"{len(row['inputs'])} -> {len(row['outputs'])}: " + ", ".join(row["outputs"][:3])
        if row["shared_weight_bytes"]:
            boundary += f"  (reads {row['shared_weight_bytes'] / MiB:.2f} MiB of weights stored with another sub-layer)"
        lines.append(row_text(row["name"], row["kind"], row) + "  " + boundary)
    lines.append("-" * len(header))
    lines.append(row_text("total", "", summary["totals"]))
    return "\n".join(lines)
