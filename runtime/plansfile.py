"""A saved plans.json as the runtime's input: tier -> plan for one pack, budget, context and batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeshard.errors import UserError
from pipeshard.fsutil import sha256_file
from pipeshard.partitioner.planner import PLANS_SCHEMA_VERSION, Plan
from pipeshard.runtime.exportdir import read_json
from pipeshard.runtime.pack import MANIFEST_NAME, Pack


@dataclass
class PlanSet:
    """The chosen plan of every tier of a plans file, per budget of its ladder, and what they were made for."""

    rungs: dict[int, dict[int, Plan]]  # budget -> tier -> plan
    context: int
    batch: int
    profile: str

    def rung_for(self, budget_bytes: int) -> tuple[int, dict[int, Plan]] | None:
        """The plans of the largest budget of the ladder that fits `budget_bytes`, or None."""
        fitting = [budget for budget in self.rungs if budget <= budget_bytes]
        return (max(fitting), self.rungs[max(fitting)]) if fitting else None

    @property
    def largest(self) -> int:
        return max(self.rungs)


def read_plans(path: Path, pack: Pack, units: list[str]) -> PlanSet:
    """Read and check a plans file against the pack it is run with (`units`: the names plans place)."""
    path = Path(path)
    document = read_json(path, "plans file")
    version = document.get("schema_version")
    if version != PLANS_SCHEMA_VERSION:
        raise UserError(
            f"{path}: unsupported schema_version {version!r} (this pipeshard reads "
            f"{PLANS_SCHEMA_VERSION}: make it again with `pipeshard plan PACK --out FILE`)"
        )
    if document.get("assumed_bits_per_weight"):
        raise UserError(
            f"{path} was planned with --assume-bits {document['assumed_bits_per_weight']} (planning only: "
            "its VRAM is not the pack's); make it again without --assume-bits to run it"
        )
    digest = sha256_file(pack.folder / MANIFEST_NAME)
    if document.get("pack_sha256") != digest:
        raise UserError(
            f"{path} was made for another pack ({document.get('pack')}), not {pack.folder}: its "
            "pack_sha256 differs from this pack's manifest.json"
        )
    try:
        ladder = document.get("ladder") or [
            {"budget_bytes": document["budget_bytes"], "tiers": document["tiers"]}
        ]
        rungs = {
            int(rung["budget_bytes"]): {
                int(entry["tier"]): Plan.from_json(entry["chosen"]) for entry in rung["tiers"]
            }
            for rung in ladder
        }
        context, batch = int(document["context"]), int(document["batch"])
        profile = str(document["profile"]["name"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: malformed plans file ({type(exc).__name__}: {exc})") from None
    for budget, plans in rungs.items():
        if not plans:
            raise UserError(f"{path}: no tiers for the budget of {budget} bytes")
        for tier, plan in plans.items():
            if set(plan.placements) != set(units):
                raise UserError(f"{path}: the tier {tier} plan does not place exactly this pack's sub-layers")
            if plan.vram.total > budget:
                raise UserError(
                    f"{path}: the tier {tier} plan needs {plan.vram.total} bytes, over the file's budget "
                    f"of {budget} bytes"
                )
    return PlanSet(rungs, context, batch, profile)
