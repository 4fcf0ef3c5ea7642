"""plans.json: one plan per token tier, per budget of a ladder (docs/plans.md). A plan is data: for every unit a
placement, the predicted seconds, the step time and the VRAM breakdown; the runtime executes it, the planner makes
it, and a host without Python runs the same file."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json, sha256_file
from pipeshard.formats.fields import Fields
from pipeshard.formats.manifest import Chunk, SubLayer


class Placement(StrEnum):
    """Where a unit's weights live and who computes it."""

    PINNED = "pinned"  # resident in device memory, computed there
    STREAMED = "streamed"  # copied into a staging slot ahead of use, computed on the device
    CPU = "cpu"  # computed on the CPU from the memory-mapped blob


PLANS_SCHEMA_VERSION = 2  # 2: the pack's digest (pack_sha256), plans as the runtime's input
DEFAULT_TIERS = (1, 4, 16, 64, 256, 1024)
MAX_TIER = 1 << 20  # more new tokens than any step could hold
MAX_TIERS = 64  # tiers per budget: the planner makes six by default
MAX_SLOTS = 64
EXPERT_SLOTS = 2  # streamed experts: copied after their router ran, two in flight per layer
# streamed experts last: their copies overlap the others' compute
EXPERT_RUN_ORDER = {Placement.PINNED: 0, Placement.CPU: 1, Placement.STREAMED: 2}
RESERVE_BYTES = 64 * 1024**2  # kept free for the driver and fragmentation
STAGING_SLOTS = 2
HOST_ONLY_KINDS = ("prologue", "embed")  # cheap, and embed reads only T rows of a large table
STRATEGIES = ("gpu-only", "static", "dynamic")
BASELINES = ("monolithic", "cpu", "layers", "offload")
# What a user may ask for by name: the planner's choice, a strategy, or a baseline; the first two kinds and the
# device baselines place sub-layers on a device.
PLAN_NAMES = ("auto", *STRATEGIES, *BASELINES)
DEVICE_PLAN_NAMES = ("auto", *STRATEGIES, "layers", "offload")


def planning_units(sub_layers: Sequence[SubLayer], output_chunks: int | None = None) -> list[SubLayer]:
    """What plans place: the pack's sub-layers, except that an output layer whose rows can be computed
    apart (manifest `row_chunks`) becomes units `final#j` of consecutive rows, each no larger than the
    largest other sub-layer (or `output_chunks` of them). A chunk can be pinned, streamed through a
    staging slot no larger than the other sub-layers need, or computed on the CPU, like any sub-layer."""
    largest_other = max(
        (e.weight_bytes for e in sub_layers if not e.row_chunks and e.kind not in HOST_ONLY_KINDS), default=0
    )
    units = []
    for entry in sub_layers:
        chunks = entry.row_chunks
        count = output_chunks or (
            math.ceil(chunks.rows * chunks.row_bytes / max(largest_other, 1)) if chunks else 1
        )
        if not chunks or count <= 1:
            units.append(entry)
            continue
        per_chunk = math.ceil(chunks.rows / count)
        for start in range(0, chunks.rows, per_chunk):
            stop = min(start + per_chunk, chunks.rows)
            chunk = Chunk(entry.name, start, stop, (stop - start) / chunks.rows)
            units.append(
                dataclasses.replace(
                    entry,
                    name=f"{entry.name}#{start // per_chunk}",
                    chunk=chunk,
                    weight_bytes=(stop - start) * chunks.row_bytes,
                )
            )
    return units


@dataclass
class VramBreakdown:
    pinned_weights: int = 0
    kv_cache: int = (
        0  # the device-resident KV: pinned attentions', and streamed ones' whose KV is not streamed
    )
    staging_slots: int = 0
    kv_staging: int = 0  # one KV slot beside each staging slot, for the streamed attentions whose KV streams
    expert_slots: int = 0
    workspace: int = 0
    ep_overhead: int = 0
    reserve: int = RESERVE_BYTES

    @property
    def total(self) -> int:
        return (
            self.pinned_weights
            + self.kv_cache
            + self.staging_slots
            + self.kv_staging
            + self.expert_slots
            + self.workspace
            + self.ep_overhead
            + self.reserve
        )


@dataclass
class Plan:
    strategy: str
    tier: int
    placements: dict[str, str]
    predicted_s: dict[str, float]
    step_s: float
    tokens_per_s: float
    vram: VramBreakdown
    budget_bytes: int
    streamed_bytes: int = 0
    copy_hidden_fraction: float = 1.0
    slots: int = STAGING_SLOTS
    prefetch: bool = True
    kv_streamed: list[str] = field(
        default_factory=list
    )  # streamed attentions whose KV streams with their weights
    timeline: list = field(default_factory=list, repr=False)

    def counts(self) -> dict[str, int]:
        return {kind.value: sum(1 for p in self.placements.values() if p == kind) for kind in Placement}

    def to_json(self) -> dict:
        document = asdict(self)
        document.pop("timeline")
        document["vram"]["total"] = self.vram.total
        document["counts"] = self.counts()
        return document

    @classmethod
    def from_json(cls, fields: Fields, units: set[str] | None = None) -> Plan:
        """A plan as `to_json` wrote it; the derived fields (counts, vram total) are recomputed. `units`: the
        names the plan must place exactly (the pack's planning units)."""
        placements = fields.raw("placements")
        if not isinstance(placements, dict) or not all(
            p in Placement.__members__.values() for p in placements.values()
        ):
            fields.fail(f"must map unit names to one of {', '.join(Placement)}", "placements")
        if units is not None and set(placements) != units:
            missing, extra = sorted(units - set(placements)), sorted(set(placements) - units)
            fields.fail(
                f"does not place exactly the pack's units (missing {missing[:3]}, unknown {extra[:3]})",
                "placements",
            )
        vram = fields.object("vram")
        breakdown = VramBreakdown(**{name: vram.int(name, 0) for name in VramBreakdown.__dataclass_fields__})
        total = vram.int("total", breakdown.total)
        if total != breakdown.total:
            vram.fail(f"is {total}, not the sum of its parts ({breakdown.total})", "total")
        vram.done()
        kv_streamed = fields.str_list("kv_streamed", [])
        if not set(kv_streamed) <= set(placements):
            fields.fail("names units the plan does not place", "kv_streamed")
        plan = cls(
            strategy=fields.str("strategy", choices=(*STRATEGIES, *BASELINES)),
            tier=fields.int("tier", minimum=0, maximum=MAX_TIER),
            placements={name: Placement(p) for name, p in placements.items()},
            predicted_s=fields.number_map("predicted_s", minimum=0.0),
            step_s=fields.float("step_s"),
            tokens_per_s=fields.float("tokens_per_s"),
            vram=breakdown,
            budget_bytes=fields.int("budget_bytes"),
            streamed_bytes=fields.int("streamed_bytes", 0),
            copy_hidden_fraction=fields.float("copy_hidden_fraction", 1.0),
            slots=fields.int("slots", STAGING_SLOTS, maximum=MAX_SLOTS),
            prefetch=fields.bool("prefetch", True),
            kv_streamed=kv_streamed,
        )
        if plan.counts() != fields.raw("counts", plan.counts()):
            fields.fail("does not count the placements", "counts")
        if any(p == Placement.STREAMED for p in plan.placements.values()) and plan.slots < 1:
            fields.fail("must be at least 1 when units are streamed", "slots")
        fields.done()
        return plan


def all_cpu_plan(units: list[str]) -> Plan:
    """Every unit on the CPU: the chain, with nothing on a device and nothing predicted."""
    return Plan(
        "cpu",
        0,
        {name: Placement.CPU for name in units},
        {},
        0.0,
        0.0,
        VramBreakdown(reserve=0),
        0,
        slots=0,
        prefetch=False,
    )


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


def read_plans(path: Path, manifest_path: Path, units: list[str], max_context: int | None = None) -> PlanSet:
    """Read and check a plans file against the pack it is run with (its manifest's path; `units`: the names plans
    place; `max_context`: the model's longest context)."""
    path = Path(path)
    fields = Fields(read_json(path, "plans file"), str(path))
    fields.schema(PLANS_SCHEMA_VERSION, "make it again with `pipeshard plan PACK --out FILE`")
    if fields.has("assumed_bits_per_weight"):
        raise UserError(
            f"{path} was planned with --assume-bits {fields.raw('assumed_bits_per_weight')} (planning only: "
            "its VRAM is not the pack's); make it again without --assume-bits to run it"
        )
    if fields.raw("pack_sha256", None) != sha256_file(manifest_path):
        raise UserError(
            f"{path} was made for another pack ({fields.raw('pack', '?')}), not {manifest_path.parent}: its "
            "pack_sha256 differs from this pack's manifest.json"
        )
    context = fields.int("context", minimum=1, maximum=max_context or MAX_TIER * 64)
    batch = fields.int("batch", minimum=1, maximum=4096)
    profile = fields.object("profile")
    profile_name = profile.str("name")
    profile.str("source", "")
    profile.str("fingerprint_id", "")
    profile.done()
    unit_names = set(units)
    top_budget = fields.int("budget_bytes")
    top_tiers = fields.list("tiers")
    ladder = fields.objects("ladder", [{"budget_bytes": top_budget, "tiers": top_tiers}])
    if not ladder:
        fields.fail("is empty", "ladder")
    rungs: dict[int, dict[int, Plan]] = {}
    for rung in ladder:
        budget = rung.int("budget_bytes")
        plans: dict[int, Plan] = {}
        tiers = rung.objects("tiers")
        if len(tiers) > MAX_TIERS:
            rung.fail(f"has {len(tiers)} tiers; a plans file has at most {MAX_TIERS} per budget", "tiers")
        for entry in tiers:
            tier = entry.int("tier", minimum=1, maximum=MAX_TIER)
            if tier in plans:
                entry.fail(f"{tier} is planned twice in one budget", "tier")
            plan = Plan.from_json(entry.object("chosen"), unit_names)
            entry.list("alternatives", [])
            entry.raw("baselines", {})
            entry.done()
            if plan.vram.total > budget:
                rung.fail(
                    f"has a tier {tier} plan needing {plan.vram.total} bytes, over its budget of {budget}"
                )
            plans[tier] = plan
        if not plans:
            rung.fail("has no tiers")
        rung.done()
        rungs[budget] = plans
    for name in ("pipeshard_version", "pack", "threads", "model_bytes", "minimum_budget_bytes"):
        fields.raw(name, None)
    fields.done()
    return PlanSet(rungs, context, batch, profile_name)
