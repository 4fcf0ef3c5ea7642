"""The human side of planning: the per-tier table and the timeline picture."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeshard.core.errors import UserError
from pipeshard.formats.plans import Placement, Plan

if TYPE_CHECKING:
    from pipeshard.partitioner.planner import BudgetPlans

MiB = 1024**2


def _counts(plan: Plan, placeable: set[str]) -> str:
    counts = dict.fromkeys(Placement, 0)
    for name, place in plan.placements.items():
        if name in placeable:
            counts[Placement(place)] += 1
    kv = f" kv{len(plan.kv_streamed)}" if plan.kv_streamed else ""
    return f"{counts[Placement.PINNED]}/{counts[Placement.STREAMED]}/{counts[Placement.CPU]}{kv}"


def plan_table(planner, planned: BudgetPlans, device_kind: str) -> str:
    """One row per tier: the chosen plan, the others, and the predicted speedup over the baselines (`planned`:
    what `Planner.plan` returned, with the budget it was planned within)."""
    budget_bytes = planned.budget_bytes
    placeable = {e.name for e in planner.placeable}
    header = (
        f"{'tier':>5} {'plan':<9} {'ms/step':>9} {'tok/s':>9} {'VRAM MiB':>15} {'pin/str/cpu':>16}  "
        f"{'other plans (ms)':<28} {'vs layers':>9} {'vs offload':>10}"
    )
    lines = [
        f"budget {budget_bytes / MiB:.0f} MiB (minimum {planner.minimum_budget() / MiB:.0f} MiB), "
        f"context {planner.context}, batch {planner.batch}, {planner.estimator.threads} CPU threads, "
        f"device {device_kind}, model {planner.model_bytes / MiB:.0f} MiB"
        + (f" (weights sized at {planner.assume_bits:g} bits: planning only)" if planner.assume_bits else ""),
        header,
        "-" * len(header),
    ]
    for entry in planned.tiers:
        chosen: Plan = entry.chosen
        others = ", ".join(f"{p.strategy} {p.step_s * 1e3:.2f}" for p in entry.alternatives) or "-"
        ratios = [
            f"{entry.baselines[b].step_s / chosen.step_s:.2f}x" if b in entry.baselines else "n/a"
            for b in ("layers", "offload")
        ]
        lines.append(
            f"{entry.tier:>5} {chosen.strategy:<9} {chosen.step_s * 1e3:>9.2f} {chosen.tokens_per_s:>9.1f} "
            f"{chosen.vram.total / MiB:>6.0f} of {budget_bytes / MiB:<6.0f} "
            f"{_counts(chosen, placeable):>16}  {others:<28} {ratios[0]:>9} {ratios[1]:>10}"
        )
    lines.append(
        f"predicted times (roofline estimator + 3-resource simulation) with every attention reading the full "
        f"context of {planner.context} tokens; 'vs' = baseline step / chosen step; kvN: N streamed "
        "attentions' KV streams with their weights"
    )
    if planner.routing_share:
        lines += expert_placement_lines(planner, planned)
    return "\n".join(lines)


def expert_placement_lines(planner, planned: BudgetPlans) -> list[str]:
    """Per tier, each MoE layer's experts as pinned/streamed/cpu, and the distinct experts T tokens are
    expected to activate per layer."""
    experts = [e for e in planner.units if e.name in planner.routing_share]
    layers = sorted({e.layer for e in experts})
    lines = ["experts per MoE layer, pinned/streamed/cpu (expected distinct experts per step):"]
    for entry in planned.tiers:
        placements = entry.chosen.placements
        expected = planner.expected_distinct_experts(entry.tier)
        per_layer = []
        for layer in layers:
            mine = [placements[e.name] for e in experts if e.layer == layer]
            counts = "/".join(
                str(mine.count(p)) for p in (Placement.PINNED, Placement.STREAMED, Placement.CPU)
            )
            per_layer.append(f"L{layer} {counts}")
        mean_expected = sum(expected.values()) / len(expected)
        lines.append(f"{entry.tier:>5}  {'  '.join(per_layer)}  ({mean_expected:.2f})")
    return lines


def plot_timelines(planned: BudgetPlans, tiers: list[int], path: Path, title: str) -> None:
    """Gantt chart of CPU, GPU and copy engine over one steady-state step, one panel per tier."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'pipeshard[plot]'") from None
    chosen = {entry.tier: entry.chosen for entry in planned.tiers}
    missing = [t for t in tiers if t not in chosen]
    if missing:
        raise UserError(f"--plot tiers {missing} are not among the planned tiers {sorted(chosen)}")
    # a compute interval's color by its sub-layer's kind, with the legend's words for it
    kind_colors = (
        ("attn", "tab:blue", "attention (+ its KV)"),
        ("ffn", "tab:orange", "FFN"),
        ("final", "tab:green", "output layer"),
    )
    colors = {kind: color for kind, color, _ in kind_colors}
    other_color = "tab:gray"
    figure, axes = plt.subplots(len(tiers), 1, figsize=(12, 2.2 * len(tiers)), squeeze=False)
    for axis, tier in zip(axes[:, 0], tiers, strict=True):
        plan = chosen[tier]
        rows = {"cpu": 2, "gpu": 1, "copy": 0}
        for interval in plan.timeline:
            kind = interval.sub_layer.split(".")[-1].split(" ")[0].split("#")[0]
            color = (
                colors.get(kind, other_color)
                if interval.resource != "copy"
                else (
                    "tab:red"
                    if " input" not in interval.sub_layer and interval.sub_layer != "logits"
                    else "tab:pink"
                )
            )
            axis.barh(
                rows[interval.resource],
                (interval.end_s - interval.start_s) * 1e3,
                left=interval.start_s * 1e3,
                color=color,
                edgecolor="black",
                linewidth=0.2,
            )
        axis.set_yticks([0, 1, 2], ["copy", "GPU", "CPU"])
        axis.set_title(
            f"T={tier}: {plan.strategy}, {plan.step_s * 1e3:.2f} ms/step predicted, "
            f"{plan.copy_hidden_fraction:.0%} of copy time overlaps compute",
            fontsize=9,
        )
        axis.set_xlabel("ms")
    from matplotlib.patches import Patch

    labels = [
        *((color, label) for _, color, label in kind_colors),
        (other_color, "other sub-layers (embed, experts)"),
        ("tab:red", "copy engine: weights streamed to the GPU"),
        ("tab:pink", "copy engine: activations / logits crossing devices"),
    ]
    legend = [Patch(facecolor=color, label=label) for color, label in labels]
    figure.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    figure.suptitle(
        title + "\nrows: CPU and GPU compute, the copy engine's transfers (predicted steady-state step)",
        fontsize=10,
    )
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
