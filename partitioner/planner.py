"""Plans per token tier: GPU-only streaming, static pinning, the dynamic split, and the baselines.

A plan is data: for every sub-layer a placement (pinned / streamed / cpu), the predicted seconds,
the step time and the VRAM breakdown. The runtime executes plans; it never decides placement.
Policies are functions returning a plan; the estimator (seconds) and the simulator (step time)
live in their own modules.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from pipeshard.core.errors import UserError
from pipeshard.core.version import __version__
from pipeshard.formats.expert_stats import RoutingStats
from pipeshard.formats.io_names import LOW_PLANE_SUFFIXES
from pipeshard.formats.manifest import Manifest, SubLayer
from pipeshard.formats.plans import (
    BASELINES,
    DEFAULT_TIERS,
    EXPERT_SLOTS,
    HOST_ONLY_KINDS,
    PLANS_SCHEMA_VERSION,
    STAGING_SLOTS,
    Placement,
    Plan,
    VramBreakdown,
    planning_units,
)
from pipeshard.formats.profile_db import ProfileDb
from pipeshard.formats.vision_memory import VisionPlan
from pipeshard.partitioner.classes import (
    UnitClass,
    best_count,
    class_counts,
    class_placements,
    class_step_s,
    nearest_best,
    streamed_vram,
    unit_classes,
)
from pipeshard.partitioner.estimator import QUANTIZED_PARTS, Estimator
from pipeshard.partitioner.simulate import ComputeSeconds, Simulation, simulate
from pipeshard.partitioner.vision_plan import EncodeSize, VisionPlanner

log = logging.getLogger(__name__)

OP_OFFLOAD_MIN_TOKENS = 32  # llama.cpp's batch size from which CPU-resident weights are used on the GPU
# up to this many placeable units the dynamic search simulates each move (see Planner.dynamic)
EXACT_SEARCH_UNITS = 128
# The paper artifact's execution strategies (its src/llama-pipeline.h), as baselines priced by our estimator.
ARTIFACT_STRATEGIES = ("full-gpu", "full-gpu-no-output", "static-attn-prio", "shard-attn-prio", "full-shard")
SCORE_CACHE_ENTRIES = 4096  # closed-form scores remembered before the cache starts over
KV_STREAMING_SHARE = (
    0.1  # plans streaming KV are tried once all the KV passes this share of the usable budget
)


@dataclass
class Option:
    """A candidate plan before its exact simulation: placements, slots, KV mode, and its closed-form score once
    computed."""

    strategy: str
    placements: dict[str, str]
    slots: int
    kv_streaming: bool
    score: float | None = None
    vram_bytes: int | None = None
    prefix: tuple[tuple, int] | None = None  # placements that are a pinned prefix: its cache key and length
    counts: tuple[list[int], list[int]] | None = None  # (pinned, streamed) per class, once counted


class LayerOrders(NamedTuple):
    """The artifact's orders, by layer: the attentions, the other units of the layers, both (whole layers), and
    the output layer."""

    attentions: list[SubLayer]
    rest: list[SubLayer]
    everything: list[SubLayer]
    final: list[SubLayer]


class ArtifactBases(NamedTuple):
    """The placements the artifact's strategies pin over: everything on the CPU, the attentions streamed and the
    rest on the CPU, all but the output layer streamed."""

    all_cpu: dict[str, str]
    attn_streamed: dict[str, str]
    all_streamed: dict[str, str]


@dataclass(frozen=True)
class TierPlans:
    """A tier's plans within one budget: the fastest (`chosen`), the other strategies' fastest first, and the
    baselines that fit (by name)."""

    tier: int
    chosen: Plan
    alternatives: list[Plan]
    baselines: dict[str, Plan]


@dataclass(frozen=True)
class BudgetPlans:
    """Every tier's plans within one budget, and how long planning them took."""

    budget_bytes: int
    tiers: list[TierPlans]
    planning_s: float


def _device_bytes(entry: SubLayer) -> int:
    """What a unit takes on the device, which is what the runtime uploads: a row chunk's rows, else its blob as
    stored (the weights with their alignment)."""
    if entry.chunk:
        return entry.weight_bytes
    if entry.blob is not None:
        return entry.blob.bytes
    return sum(w.bytes for w in entry.weights)


class Planner:
    """Makes plans for one pack, profile, context and batch, for whatever budget each call names; replanning is
    cheap (no I/O). A plan source for the runtime (runtime/plansource.py `PlanSource`): the budget is the caller's
    (the runtime's PlanBook owns it), so one planner serves every budget of a ladder."""

    def __init__(
        self,
        manifest: Manifest,
        profile: ProfileDb,
        context: int = 4096,
        batch: int = 1,
        threads: int | None = None,
        output_chunks: int | None = None,
        expert_stats: RoutingStats | None = None,
        assume_bits: float | None = None,
    ) -> None:
        self.manifest = manifest
        self.model = manifest.model
        self.units: list[SubLayer] = planning_units(manifest.sub_layers, output_chunks)
        self.by_name = {e.name: e for e in self.units}
        self.profile = profile
        # Planning only (comparisons with quantized figures): every weight takes `assume_bits` bits instead of
        # the pack's dtype, in VRAM, copies and reads; compute rates, activations and KV stay the pack's.
        self.assume_bits = assume_bits
        self.estimator = Estimator(
            profile,
            self.model,
            threads,
            manifest.model_sha256,
            weight_bits=assume_bits,
        )
        self.context = context
        self.batch = batch
        self.ep_overhead = profile.device.ep_overhead_bytes
        self.device_memory = profile.device.memory_bytes
        # The simulated device computes on the host's cores: its sub-layers slow under copies like the CPU's.
        self.device_shares_cpu = profile.device.kind == "sim"
        owned = {}
        for entry in self.units:
            for weight in entry.weights:
                owned[(weight.file, weight.offset)] = weight.bytes
        scale = self.estimator.weight_scale
        self.weight_bytes = {e.name: round(scale * _device_bytes(e)) for e in self.units}
        self.model_bytes = round(scale * sum(owned.values()))
        self.placeable = [e for e in self.units if e.kind not in HOST_ONLY_KINDS]
        self.routing_share = expert_routing_shares(manifest, expert_stats)
        # Streamed experts can be copied only once their router has run.
        self.copy_gates = {expert: block.router for block in manifest.moe_blocks for expert in block.experts}
        # Canonical pin priority: attention (with its KV) first, then FFN in layer order, then the output
        # layer; in a MoE model the routers, the output layer, then the experts, most popular first.
        order = {"attn": 0, "router": 1, "ffn": 2, "final": 3}
        if self.routing_share:
            order.update(final=2, expert=3)
        self.priority = sorted(
            self.placeable,
            key=lambda e: (
                order.get(e.kind, 2),
                -self.routing_share.get(e.name, 0.0),
                e.layer or 0,
                e.expert or 0,
            ),
        )
        self._cost_cache: dict[tuple[int, int], tuple[dict, dict, float]] = {}
        # What the estimator reads of a unit, less its name: units with equal signatures cost the same.
        self.cost_signature = {
            e.name: (
                e.kind,
                e.nodes,
                e.cost.bytes_per_context_token,
                e.kv.bytes_per_token if e.kv else None,
                e.chunk.share if e.chunk else None,
                tuple(
                    (
                        w.shape,
                        w.dtype,
                        w.bytes,
                        w.name.endswith(tuple(LOW_PLANE_SUFFIXES.values())),
                        any(p in w.name for p in QUANTIZED_PARTS),
                    )
                    for w in e.weights
                ),
            )
            for e in self.units
        }
        largest = max(self.placeable, key=lambda e: self.weight_bytes[e.name], default=None)
        self.largest_first = [largest, *(e for e in self.priority if e is not largest)] if largest else []
        self._prefix_cache: dict[tuple, tuple] = {}  # (order, base VRAM, totals, running maxima, base)
        self._runs_cache: dict[tuple, tuple] = {}  # per prefix key and classes: (base counts, order's runs)
        self._score_cache: dict[tuple, float] = {}  # per tier, classes and counts: the closed-form step time
        self._class_cache: dict[tuple[int, bool], tuple[list[UnitClass], dict[str, int]]] = {}
        self._room_cache: dict[tuple[int, bool], int] = {}
        self._orders: dict[str, list[SubLayer]] = {}
        self._layered: LayerOrders | None = None
        self._bases: ArtifactBases | None = None
        self._warm_base: dict[int, tuple[int, bool]] = {}
        self._warm_shares: dict[tuple[int, int, bool], dict[tuple, float]] = {}
        # Small packs are searched unit by unit with the simulation; large ones over classes in closed form.
        self.at_scale = len(self.placeable) > EXACT_SEARCH_UNITS

        self._vision: VisionPlanner | None = None  # made on the first vision plan

    def vision_plan(
        self, tiles: int, patches: int, keys: int, budget_bytes: int, policy: str = "auto"
    ) -> VisionPlan | None:
        """A VLM's vision blocks placed for an encode of this size within `budget_bytes` (partitioner/vision_plan.py;
        runtime/vision.py `VisionPlans`): `policy` "auto" (the fastest found, which always fits), "streamed"
        (VLMOpt's) or "cpu"; None when that policy does not fit."""
        return self.vision_planner.plan(EncodeSize(tiles, patches, keys), budget_bytes, policy)

    @property
    def vision_planner(self) -> VisionPlanner:
        """The vision blocks' planner (a VLM's pack only), made on first use."""
        if self._vision is None:
            self._vision = VisionPlanner(self.manifest.vision, self.estimator)
        return self._vision

    # -- accounting -------------------------------------------------------------------------------------------------
    def kv_bytes(self, entry: SubLayer) -> int:
        return entry.kv.bytes_per_token * self.context * self.batch if entry.kv else 0

    def workspace_bytes(self, tier: int) -> int:
        """Activation workspace on the device for one step of `tier` tokens (the largest sub-layer's). A GPU runs
        the exported GroupQueryAttention as fused, tiled kernels (flash / memory-efficient) that keep only each
        query row's softmax statistics, never the T x C scores; the simulated device runs the CPU kernel, which
        holds every head's fp32 scores."""
        element = self.estimator.element
        hidden, inter = self.model.hidden_size, self.model.intermediate_size
        heads = self.model.num_attention_heads
        scores = 4 * heads * tier * (min(self.context, 1 << 20) if self.device_shares_cpu else 2)
        logits = 4 * min(tier, self.batch) * self.model.vocab_size  # the output layer: each sequence's last
        return tier * element * (4 * hidden + 3 * inter) + max(scores, logits)

    def vram(
        self, placements: dict[str, str], tier: int, slots: int, kv_streamed: frozenset[str] = frozenset()
    ) -> VramBreakdown:
        """What `placements` take in VRAM at `tier` with `slots` staging slots (`kv_streamed`: the streamed
        attentions whose KV streams with them), in one pass over the placeable units."""
        weights = self.weight_bytes
        pinned = kv = ring_slot = kv_slot = expert_slot = 0
        any_on_device = any_ring = False
        for entry in self.placeable:
            placement = placements[entry.name]
            if placement == Placement.CPU:
                continue
            any_on_device = True
            if entry.kv and entry.name not in kv_streamed:
                kv += self.kv_bytes(entry)
            if placement == Placement.PINNED:
                pinned += weights[entry.name]
            elif entry.kind == "expert":
                expert_slot = max(expert_slot, weights[entry.name])
            elif placement == Placement.STREAMED:
                any_ring = True
                ring_slot = max(ring_slot, weights[entry.name])
                if entry.name in kv_streamed:
                    kv_slot = max(kv_slot, self.kv_bytes(entry))
        return VramBreakdown(
            pinned_weights=pinned,
            kv_cache=kv,
            staging_slots=slots * ring_slot if any_ring else 0,
            kv_staging=slots * kv_slot,
            expert_slots=EXPERT_SLOTS * expert_slot,
            workspace=self.workspace_bytes(tier) if any_on_device else 0,
            ep_overhead=self.ep_overhead,
        )

    def kv_streaming_modes(self, budget_bytes: int) -> tuple[bool, ...]:
        """Whether plans are made with resident KV only, or also with the streamed attentions' KV streamed: the
        latter only where the KV of every attention is a real share of the budget (otherwise it frees little room
        and only adds copies) and one attention's KV fits in it."""
        kv = [self.kv_bytes(e) for e in self.placeable if e.kv]
        usable = budget_bytes - self.minimum_budget()
        # ... and where a KV slot can fit at all.
        return (
            (False, True) if kv and sum(kv) > KV_STREAMING_SHARE * usable and max(kv) < usable else (False,)
        )

    @staticmethod
    def streamed_attentions(placements: dict[str, str], units: list[SubLayer]) -> frozenset[str]:
        return frozenset(
            e.name for e in units if e.kind == "attn" and placements[e.name] == Placement.STREAMED
        )

    def minimum_budget(self) -> int:
        """The smallest plan: nothing on the device (static with nothing pinned) still needs the EP."""
        return VramBreakdown(ep_overhead=self.ep_overhead).total

    # -- evaluation -------------------------------------------------------------------------------------------------
    def evaluate(
        self,
        strategy: str,
        tier: int,
        placements: dict[str, str],
        budget_bytes: int,
        slots: int = STAGING_SLOTS,
        prefetch: bool = True,
        detail: bool = False,
        kv_streaming: bool = False,
        context: int | None = None,
    ) -> Plan:
        """The plan of these placements, made for `budget_bytes` (which it records; `fits` checks it against it);
        with `kv_streaming`, every streamed attention's KV lives in host memory and is uploaded with its weights
        (and its new rows downloaded after it ran): copies instead of VRAM. `context`: the tokens a step attends
        to, if fewer than the planned context (a prompt's earlier chunks); VRAM stays sized for the planned one."""
        full = {e.name: placements.get(e.name, Placement.CPU) for e in self.units}
        compute, copies, activation = self._costs(tier, context)
        kv_streamed = self.streamed_attentions(full, self.placeable) if kv_streaming else frozenset()
        if kv_streamed:
            copies = {
                **copies,
                **{
                    name: copies[name] + self._kv_copy_seconds(self.by_name[name], tier, context)
                    for name in kv_streamed
                },
            }
        slowdown = self._copy_slowdown(tier) if any(p == Placement.STREAMED for p in full.values()) else 1.0
        simulation: Simulation = simulate(
            self.units,
            full,
            compute,
            copies,
            activation,
            slots,
            prefetch,
            slowdown,
            detail,
            self.copy_gates,
            self.device_shares_cpu,
        )
        vram = self.vram(full, tier, slots, kv_streamed)
        streamed_bytes = sum(self.weight_bytes[n] for n, p in full.items() if p == Placement.STREAMED)
        return Plan(
            strategy,
            tier,
            full,
            simulation.per_sub_layer_s,
            simulation.step_s,
            tier / simulation.step_s,
            vram,
            budget_bytes,
            streamed_bytes,
            simulation.copy_hidden_s / simulation.copy_busy_s if simulation.copy_busy_s else 1.0,
            slots,
            prefetch,
            sorted(kv_streamed),
            simulation.timeline,
        )

    def kv_bytes_moved(self, entry: SubLayer, tier: int, context: int | None = None) -> tuple[int, int]:
        """A streamed attention's KV traffic per step when its KV streams: (its cache uploaded, the step's new rows
        downloaded)."""
        per_token = entry.kv.bytes_per_token
        return per_token * (context or self.context) * self.batch, per_token * tier

    def _kv_copy_seconds(self, entry: SubLayer, tier: int, context: int | None = None) -> float:
        return sum(
            self.estimator.copy_seconds(nbytes, under_cpu_load=True, tokens=tier)
            for nbytes in self.kv_bytes_moved(entry, tier, context)
        )

    def prompt_seconds(self, plan: Plan, prompt_tokens: int) -> float:
        """The time to prefill `prompt_tokens` in steps of the plan's tier (as llama.cpp's micro-batches do): each
        step re-priced at the context it attends to, its own tokens and those before it, not the planned context."""
        steps = range(plan.tier, math.ceil(prompt_tokens / plan.tier) * plan.tier + 1, plan.tier)
        return sum(
            self.resimulated(plan, context=min(attended, prompt_tokens, self.context)).step_s
            for attended in steps
        )

    def resimulated(self, plan: Plan, detail: bool = False, context: int | None = None) -> Plan:
        """The plan simulated again as it was made (placements, staging slots, prefetch, KV streaming): with its
        timeline (`detail`), or at a step's own context."""
        return self.evaluate(
            plan.strategy,
            plan.tier,
            plan.placements,
            plan.budget_bytes,
            plan.slots,
            plan.prefetch,
            detail=detail,
            kv_streaming=bool(plan.kv_streamed),
            context=context,
        )

    def expected_distinct_experts(self, tokens: int) -> dict[int, float]:
        """Per MoE layer, the expected number of distinct experts `tokens` tokens activate:
        sum over experts of 1-(1-p)^T (E(1-(1-k/E)^T) under uniform routing)."""
        expected: dict[int, float] = {}
        for e in self.units:
            if e.name in self.routing_share:
                chosen = 1.0 - (1.0 - self.routing_share[e.name]) ** tokens
                expected[e.layer] = expected.get(e.layer, 0.0) + chosen
        return expected

    def clear_costs(self) -> None:
        """Forget cached estimates (after context or batch changed)."""
        self._cost_cache.clear()
        self._prefix_cache.clear()
        self._runs_cache.clear()
        self._score_cache.clear()
        self._class_cache.clear()
        self._room_cache.clear()
        self._warm_shares.clear()
        self._warm_base.clear()

    def resize(self, batch: int, context: int) -> None:
        """Make later plans for `batch` sequences of `context` tokens (the device's KV is sized by them)."""
        self.batch, self.context = batch, context
        self.clear_costs()

    def _costs(self, tier: int, context: int | None = None) -> tuple[dict, dict, float]:
        """Estimator results for a tier (at the planned context unless given), computed once: (compute seconds per
        device, copy seconds, activation copy)."""
        context = context or self.context
        if (tier, context) not in self._cost_cache:
            estimator = self.estimator
            # The output layer computes only each sequence's last position (what generation reads).
            tokens = {e.name: min(tier, self.batch) if e.kind == "final" else tier for e in self.units}
            # An expert runs only in steps where some token chose it, over the tokens that did: its
            # expected time is P(chosen by any of T tokens) x its time over the tokens routed to it then.
            share = {}
            for e in self.units:
                share[e.name] = e.chunk.share if e.chunk else 1.0
                if e.name in self.routing_share:
                    p = self.routing_share[e.name]
                    share[e.name] = 1.0 - (1.0 - p) ** tier
                    tokens[e.name] = tier * p / share[e.name] if share[e.name] > 0 else 0.0
            # Alike units (a layer's experts, every layer's attention) cost the same: estimated once.
            estimates: dict[tuple, ComputeSeconds] = {}
            compute = {}
            for e in self.units:
                key = (self.cost_signature[e.name], tokens[e.name], share[e.name])
                if key not in estimates:
                    estimates[key] = ComputeSeconds(
                        *(
                            share[e.name] * estimator.compute_seconds(e, tokens[e.name], context, on_gpu)
                            for on_gpu in (False, True)
                        )
                    )
                compute[e.name] = estimates[key]
            # A row chunk's bytes are its own (its share is of the layer's compute); an expert is copied only in
            # the steps that chose it.
            copies = {
                e.name: (share[e.name] if e.name in self.routing_share else 1.0)
                * estimator.copy_seconds(self.weight_bytes[e.name], under_cpu_load=True, tokens=tier)
                for e in self.units
            }
            activation = estimator.copy_seconds(tier * self.model.hidden_size * estimator.element)
            self._cost_cache[tier, context] = (compute, copies, activation)
        return self._cost_cache[tier, context]

    def _copy_slowdown(self, tier: int) -> float:
        """How much slower CPU work runs beside a copy at `tier` (the profile's contention factor)."""
        factors = self.profile.contention.cpu_matmul_slowdown_under_copy.get(self.estimator.threads)
        return _nearest_tier_factor(factors.by_tier if factors else {}, tier)

    @staticmethod
    def fits(plan: Plan) -> bool:
        """Whether a plan's VRAM is within the budget it was made for."""
        return plan.vram.total <= plan.budget_bytes

    # -- policies ---------------------------------------------------------------------------------------------------
    def _pinned(
        self,
        tier: int,
        base: dict[str, str],
        slots: int,
        budget_bytes: int,
        priority: list[SubLayer] | None = None,
        kv_streaming: bool = False,
        room_bytes: int = 0,
    ) -> tuple[dict[str, str], int, tuple[tuple, int]]:
        """Pin in priority order while the plan still fits `budget_bytes` with `room_bytes` to spare (placements
        not pinned keep `base`): the longest prefix whose running-maximum VRAM (`_prefix_vram`, cached per base,
        order and slots) is within the budget, found by bisection, so a budget change costs no walk over the
        units; with the VRAM the plan takes and the prefix (cache key, length) for `_prefix_counts`."""
        order = priority or self.priority
        key = (tuple(base.values()), id(order), slots, kv_streaming)
        if key not in self._prefix_cache:
            kv_streamed = self.streamed_attentions(base, self.placeable) if kv_streaming else frozenset()
            unpinned = self.vram(base, 1, slots, kv_streamed)
            prefix_vram = self._prefix_vram(base, slots, order, kv_streaming)
            self._prefix_cache[key] = (order, unpinned, *prefix_vram, base)
        _, unpinned, totals, running_max, _ = self._prefix_cache[key]
        workspace = self.workspace_bytes(tier)
        count = bisect.bisect_right(running_max, budget_bytes - workspace - room_bytes)
        placements = {**base, **dict.fromkeys((e.name for e in order[:count]), Placement.PINNED)}
        if count:
            return placements, totals[count - 1] + workspace, (key, count)
        vram_bytes = unpinned.total + (workspace - unpinned.workspace if unpinned.workspace else 0)
        return placements, vram_bytes, (key, count)

    def _prefix_counts(
        self, prefix: tuple[tuple, int], tier: int, kv_streaming: bool
    ) -> tuple[list[int], list[int]]:
        """`class_counts` of a pinned prefix (from `_pinned`) without a pass over the units: the base's counts
        and the order's runs of units of one class and one base placement, made once per prefix cache key and
        tier, then per length a pass over the runs it covers."""
        key, count = prefix
        runs_key = (key, tier, kv_streaming)
        if runs_key not in self._runs_cache:
            order, _, _, _, base = self._prefix_cache[key]
            classes, class_of = self._classes(tier, kv_streaming)
            runs: list[list] = []  # [class index, base placement, units]
            for entry in order:
                run = (class_of[entry.name], base[entry.name])
                if runs and (runs[-1][0], runs[-1][1]) == run:
                    runs[-1][2] += 1
                else:
                    runs.append([*run, 1])
            self._runs_cache[runs_key] = (class_counts(classes, base, class_of), runs)
        (base_pinned, base_streamed), runs = self._runs_cache[runs_key]
        pinned, streamed = list(base_pinned), list(base_streamed)
        left = count
        for index, placement, units in runs:
            if not left:
                break
            taken = min(units, left)
            left -= taken
            if placement != Placement.PINNED:
                pinned[index] += taken
            if placement == Placement.STREAMED:
                streamed[index] -= taken
        return pinned, streamed

    def _prefix_vram(
        self, base: dict[str, str], slots: int, order: list[SubLayer], kv_streaming: bool
    ) -> tuple[list[int], list[int]]:
        """For each prefix length n >= 1 of `order` pinned over `base`, the VRAM it takes and the most any of the
        prefixes up to n takes, less the tier's workspace (what `vram` would add up anew; the latter
        non-decreasing, so bisectable). With
        `kv_streaming`, streamed attentions keep their KV in host memory (one KV slot beside each staging slot
        while any is left); a pinned attention's KV is resident."""
        placements = dict(base)
        in_order = {e.name for e in order}
        weights = self.weight_bytes
        kv_streamed = self.streamed_attentions(base, self.placeable) if kv_streaming else frozenset()
        vram = self.vram(base, 1, slots, kv_streamed)
        pinned, kv = vram.pinned_weights, vram.kv_cache
        kv_slot = slots * max((self.kv_bytes(self.by_name[name]) for name in kv_streamed), default=0)
        kv_streams_left = len(kv_streamed)
        # The staging slots are as large as the largest unit still streamed: the largest outside `order`, or the
        # largest of those after the prefix (suffix maxima over `order`), for ring units and experts apart.
        streamed_left = {False: 0, True: 0}
        largest_outside = {False: 0, True: 0}
        for e in self.placeable:
            if base[e.name] == Placement.STREAMED:
                is_expert = e.kind == "expert"
                streamed_left[is_expert] += 1
                if e.name not in in_order:
                    largest_outside[is_expert] = max(largest_outside[is_expert], weights[e.name])
        suffix = {False: [0] * (len(order) + 1), True: [0] * (len(order) + 1)}
        for index in range(len(order) - 1, -1, -1):
            entry = order[index]
            for is_expert in (False, True):
                own = (
                    weights[entry.name]
                    if base[entry.name] == Placement.STREAMED and (entry.kind == "expert") == is_expert
                    else 0
                )
                suffix[is_expert][index] = max(suffix[is_expert][index + 1], own)
        fixed = vram.ep_overhead + vram.reserve
        totals, running_max = [], []
        most = 0
        for index, entry in enumerate(order):
            name = entry.name
            was = placements[name]
            is_expert = entry.kind == "expert"
            if was == Placement.STREAMED:
                streamed_left[is_expert] -= 1
            pinned += weights[name] - (weights[name] if was == Placement.PINNED else 0)
            kv += self.kv_bytes(entry) if was == Placement.CPU or name in kv_streamed else 0
            kv_streams_left -= 1 if name in kv_streamed else 0
            total = pinned + kv + fixed + (kv_slot if kv_streams_left else 0)
            if streamed_left[False]:
                total += slots * max(largest_outside[False], suffix[False][index + 1])
            if streamed_left[True]:
                total += EXPERT_SLOTS * max(largest_outside[True], suffix[True][index + 1])
            most = max(most, total)
            totals.append(total)
            running_max.append(most)
        return totals, running_max

    def _gpu_only_options(self, tier: int, budget_bytes: int) -> list[Option]:
        """Everything on the GPU: pin by priority, stream the rest through 2 slots (1 if 2 do not fit), their KV
        resident or (where that cannot fit) streamed with them. Every staging slot is as large as the largest
        streamed sub-layer, so pinning that one first (a big output layer) can free more memory than it takes:
        both orders are tried."""
        streamed_all = {e.name: Placement.STREAMED for e in self.placeable}
        options = []
        for kv_streaming in self.kv_streaming_modes(budget_bytes):
            for priority in (self.priority, self.largest_first):
                for slots in (STAGING_SLOTS, 1):
                    placements, vram_bytes, prefix = self._pinned(
                        tier, streamed_all, slots, budget_bytes, priority, kv_streaming
                    )
                    if vram_bytes <= budget_bytes:
                        options.append(Option("gpu-only", placements, slots, kv_streaming, prefix=prefix))
                        break
        return options

    def gpu_only(self, tier: int, budget_bytes: int, detail: bool = False) -> Plan | None:
        return self._best_of(tier, budget_bytes, self._gpu_only_options(tier, budget_bytes), detail)

    def static(self, tier: int, budget_bytes: int, detail: bool = False) -> Plan:
        return self._best_of(tier, budget_bytes, self._static_options(tier, budget_bytes), detail)

    def _static_options(self, tier: int, budget_bytes: int) -> list[Option]:
        all_cpu = {e.name: Placement.CPU for e in self.placeable}
        placements, _, prefix = self._pinned(tier, all_cpu, 0, budget_bytes)
        return [Option("static", placements, 0, False, prefix=prefix)]

    def _best_of(
        self, tier: int, budget_bytes: int, options: list[Option], detail: bool = False
    ) -> Plan | None:
        """The fastest of `options`: each simulated, or at scale the best closed-form score simulated alone
        (`detail`: with its timeline)."""
        if not options:
            return None
        if self.at_scale and len(options) > 1:
            options = [min(options, key=lambda o: self._option_score(tier, o))]
        plans = [
            self.evaluate(
                o.strategy,
                tier,
                o.placements,
                budget_bytes,
                o.slots,
                detail=detail,
                kv_streaming=o.kv_streaming,
            )
            for o in options
        ]
        best = min(plans, key=lambda p: p.step_s)
        return best if self.fits(best) else None

    def _streaming_room(self, slots: int, kv_streaming: bool) -> int:
        """What moving units to streaming needs on top of the pinned ones: the staging slots (as large as the
        largest ring unit), the experts' slots, and with `kv_streaming` the KV slots."""
        key = (slots, kv_streaming)
        if key not in self._room_cache:
            ring = [e for e in self.placeable if e.kind != "expert"]
            experts = [e for e in self.placeable if e.kind == "expert"]
            attentions = [e for e in self.placeable if e.kind == "attn"]
            self._room_cache[key] = (
                slots * max((self.weight_bytes[e.name] for e in ring), default=0)
                + EXPERT_SLOTS * max((self.weight_bytes[e.name] for e in experts), default=0)
                + (slots * max((self.kv_bytes(e) for e in attentions), default=0) if kv_streaming else 0)
            )
        return self._room_cache[key]

    def dynamic(self, tier: int, budget_bytes: int, detail: bool = False) -> Plan | None:
        """Pin as static, leaving room for the slots; then, in order of the time they would save on the GPU, move
        the remaining sub-layers from the CPU to streaming (their KV resident, or streamed where the budget calls
        for it), keeping each move that helps. Up to EXACT_SEARCH_UNITS placeable units each move is one
        sub-layer judged by the simulation; beyond (MoE packs of thousands of experts) the moves are over classes
        of alike units, judged in closed form (`_class_moves`), and only the winner is simulated."""
        if self.at_scale:
            return self._best_of(tier, budget_bytes, self._dynamic_options(tier, budget_bytes), detail)
        best_plan = None
        compute, copies, _ = self._costs(tier)
        for placements, slots, kv_streaming, _, _ in self._dynamic_bases(tier, budget_bytes):
            plan = self._dynamic_moves(tier, placements, budget_bytes, slots, kv_streaming, compute, copies)
            if plan is not None and (best_plan is None or plan.step_s < best_plan.step_s):
                best_plan = plan
        return self.detailed(best_plan) if detail and best_plan else best_plan

    def _dynamic_bases(
        self, tier: int, budget_bytes: int
    ) -> list[tuple[dict[str, str], int, bool, int, tuple]]:
        """Where the dynamic search starts: the static pins with room left for the slots, per KV mode and slot
        count, with the VRAM each takes and its pinned prefix."""
        all_cpu = {e.name: Placement.CPU for e in self.placeable}
        bases = []
        for kv_streaming in self.kv_streaming_modes(budget_bytes):
            for slots in (STAGING_SLOTS, 1):
                room = self._streaming_room(slots, kv_streaming)
                placements, vram_bytes, prefix = self._pinned(
                    tier, all_cpu, slots, budget_bytes, kv_streaming=kv_streaming, room_bytes=room
                )
                bases.append((placements, slots, kv_streaming, vram_bytes, prefix))
        return bases

    def _dynamic_options(self, tier: int, budget_bytes: int, warm: bool = False) -> list[Option]:
        """The class search's best plan over the starting points; `warm`: only from the starting point the last
        choice at this tier took (when it is still one), each group from the share it chose."""
        bases = self._dynamic_bases(tier, budget_bytes)
        last = self._warm_base.get(tier)
        if warm and any((slots, kv) == last for _, slots, kv, _, _ in bases):
            bases = [b for b in bases if (b[1], b[2]) == last]
        best = None
        for placements, slots, kv_streaming, vram_bytes, prefix in bases:
            pinned, _ = self._prefix_counts(prefix, tier, kv_streaming)
            score, streamed = self._class_moves(
                tier, pinned, budget_bytes - vram_bytes, slots, kv_streaming, warm
            )
            if streamed is not None and (best is None or score < best[0]):
                best = (score, placements, pinned, streamed, slots, kv_streaming)
        if best is None:
            return []
        score, placements, pinned, streamed, slots, kv_streaming = best
        self._warm_base[tier] = (slots, kv_streaming)
        classes, _ = self._classes(tier, kv_streaming)
        moved = {**placements, **class_placements(classes, pinned, streamed)}
        return [Option("dynamic", moved, slots, kv_streaming, score, counts=(pinned, streamed))]

    def _option_counts(self, tier: int, option: Option) -> tuple[list[int], list[int]]:
        """An option's (pinned, streamed) per class: from its pinned prefix where it is one, else counted."""
        if option.counts is None:
            if option.prefix is not None:
                option.counts = self._prefix_counts(option.prefix, tier, option.kv_streaming)
            else:
                classes, class_of = self._classes(tier, option.kv_streaming)
                option.counts = class_counts(classes, option.placements, class_of)
        return option.counts

    def _option_score(self, tier: int, option: Option) -> float:
        """An option's closed-form step time (`class_step_s`), computed once."""
        if option.score is None:
            classes, _ = self._classes(tier, option.kv_streaming)
            pinned, streamed = self._option_counts(tier, option)
            option.score = self._score_counts(tier, classes, pinned, streamed, option.slots)
        return option.score

    def choose(self, tier: int, budget_bytes: int) -> Plan:
        """The plan to run at `tier` within `budget_bytes`: the fastest of the three strategies and the artifact's
        placements (at scale the best closed-form score, the one simulated exactly), without the baselines and
        timelines `plan_tier` adds. What the runtime asks for after a budget change."""
        if not self.at_scale:
            return self.strategies(tier, budget_bytes)[0]
        self.check_budget(budget_bytes)
        options = [
            *self._gpu_only_options(tier, budget_bytes),
            *self._static_options(tier, budget_bytes),
            *self._dynamic_options(tier, budget_bytes, warm=True),
            *self._seed_options(tier, budget_bytes),
        ]
        options.sort(key=lambda o: self._option_score(tier, o))
        for option in options:
            plan = self._best_of(tier, budget_bytes, [option])
            if plan is not None:
                return plan
        return self.static(tier, budget_bytes)

    def _classes(self, tier: int, kv_streaming: bool) -> tuple[list[UnitClass], dict[str, int]]:
        """The chain's classes of alike units at `tier` (a streamed attention's copy with its KV's, when it
        streams), and each unit's class index; made once per tier."""
        key = (tier, kv_streaming)
        if key not in self._class_cache:
            compute, copies, _ = self._costs(tier)
            if kv_streaming:
                copies = {
                    **copies,
                    **{
                        e.name: copies[e.name] + self._kv_copy_seconds(e, tier)
                        for e in self.placeable
                        if e.kind == "attn"
                    },
                }
            classes = unit_classes(
                self.units,
                compute,
                copies,
                self.copy_gates,
                {e.name for e in self.placeable},
                self.kv_bytes,
                self.weight_bytes,
            )
            class_of = {name: index for index, c in enumerate(classes) for name in c.names}
            self._class_cache[key] = (classes, class_of)
        return self._class_cache[key]

    def _score_counts(
        self, tier: int, classes: list[UnitClass], pinned: list[int], streamed: list[int], slots: int
    ) -> float:
        """`class_step_s` of class counts, remembered (searches and budget changes score the same counts again)."""
        key = (tier, id(classes), tuple(pinned), tuple(streamed), slots)
        if key not in self._score_cache:
            if len(self._score_cache) >= SCORE_CACHE_ENTRIES:
                self._score_cache.clear()
            _, _, activation = self._costs(tier)
            slowdown = self._copy_slowdown(tier) if any(streamed) else 1.0
            self._score_cache[key] = class_step_s(
                classes, pinned, streamed, slots, activation, slowdown, self.device_shares_cpu
            )
        return self._score_cache[key]

    def _class_moves(
        self,
        tier: int,
        pinned: list[int],
        room_bytes: int,
        slots: int,
        kv_streaming: bool,
        warm: bool = False,
    ) -> tuple[float, list[int] | None]:
        """The dynamic split over classes from `pinned` units per class (the rest on the CPU): the CPU units of
        alike classes (the same costs and pinned count: every unpinned MoE layer's experts, every CPU attention)
        form a group; in order of the time a unit would save on the GPU, each group takes the count to stream (per
        class for experts, a most-popular prefix; evenly spaced classes for ring units) that minimises the
        closed-form step time, kept where it helps, within `room_bytes` of VRAM beside the pinned units for what
        streaming takes (`streamed_vram`). With `warm`, each group's search starts from the share the last search
        at this tier chose (a budget change moves it little). Returns (score, streamed count per class), the counts
        None when streaming nothing is best."""
        classes, _ = self._classes(tier, kv_streaming)
        streamed = [0] * len(classes)
        groups: dict[tuple, list[int]] = {}
        for index, unit_class in enumerate(classes):
            free = len(unit_class.names) - pinned[index]
            if unit_class.placeable and free > 0:
                key = (unit_class.gate is None, unit_class.cpu_s, unit_class.gpu_s, unit_class.copy_s, free)
                groups.setdefault(key, []).append(index)
        best = self._score_counts(tier, classes, pinned, streamed, slots)
        shares = self._warm_shares.setdefault((tier, slots, kv_streaming), {})
        for key in sorted(groups, key=lambda k: k[2] + k[3] - k[1]):
            members = groups[key]
            is_ring, free = key[0], key[4]

            def fits(count: int, members=members, is_ring=is_ring, base=streamed) -> bool:
                trial = _with_streamed(base, members, is_ring, count)
                return streamed_vram(classes, trial, slots, kv_streaming) <= room_bytes

            # More streamed units take more VRAM (resident KV, larger slots): the counts that fit are a prefix.
            most = _last_true(0, len(members) if is_ring else free, fits)

            def score_of(count: int, members=members, is_ring=is_ring, base=streamed) -> float:
                return self._score_counts(
                    tier, classes, pinned, _with_streamed(base, members, is_ring, count), slots
                )

            share = shares.get(key[:4]) if warm else None
            count, score = (
                best_count(0, most, score_of)
                if share is None
                else nearest_best(round(share * most), 0, most, score_of)
            )
            shares[key[:4]] = count / most if most else 0.0
            if count and score < best * (1 - 1e-9):
                best, streamed = score, _with_streamed(streamed, members, is_ring, count)
        return best, streamed if any(streamed) else None

    def _dynamic_moves(
        self,
        tier: int,
        placements: dict[str, str],
        budget_bytes: int,
        slots: int,
        kv_streaming: bool,
        compute: dict,
        copies: dict,
    ) -> Plan | None:
        candidates = [n for n, p in placements.items() if p == Placement.CPU]
        candidates.sort(key=lambda n: compute[n].gpu + copies[n] - compute[n].cpu)
        best = self.evaluate(
            "dynamic", tier, placements, budget_bytes, slots=slots, kv_streaming=kv_streaming
        )
        for name in candidates:
            trial = {**best.placements, name: Placement.STREAMED}
            plan = self.evaluate("dynamic", tier, trial, budget_bytes, slots=slots, kv_streaming=kv_streaming)
            if self.fits(plan) and plan.step_s < best.step_s * (1 - 1e-9):
                best = plan
        return (
            best
            if any(p == Placement.STREAMED for p in best.placements.values()) and self.fits(best)
            else None
        )

    def exhaustive_dynamic(self, tier: int, budget_bytes: int, slots: int = STAGING_SLOTS) -> Plan:
        """The true optimum of the dynamic split under the same estimator (2^n: small packs only)."""
        base = self._pinned(tier, {e.name: Placement.CPU for e in self.placeable}, slots, budget_bytes)[0]
        free = [n for n, p in base.items() if p == Placement.CPU]
        best = self.evaluate("dynamic", tier, base, budget_bytes, slots=slots)
        for choice in itertools.product((Placement.CPU, Placement.STREAMED), repeat=len(free)):
            trial = dict(base)
            trial.update(zip(free, choice, strict=True))
            plan = self.evaluate("dynamic", tier, trial, budget_bytes, slots=slots)
            if self.fits(plan) and plan.step_s < best.step_s:
                best = plan
        return best

    # -- baselines --------------------------------------------------------------------------------------------------
    def baseline(self, name: str, tier: int, budget_bytes: int, detail: bool = False) -> Plan | None:
        if name in ("monolithic", "cpu"):
            return self.evaluate(
                name,
                tier,
                {e.name: Placement.CPU for e in self.placeable},
                budget_bytes,
                slots=0,
                detail=detail,
            )
        if name == "layers":
            # Whole layers in order, then the rest (the output layer) once every layer is in: with nothing
            # streamed, a prefix's VRAM is its weights and KV plus what every plan with a unit on the device needs.
            # From OP_OFFLOAD_MIN_TOKENS tokens on, llama.cpp computes the CPU layers' products on the GPU, copying
            # their weights over when used (its operation offload): streamed without prefetch through one slot.
            offload = tier >= OP_OFFLOAD_MIN_TOKENS
            by_layer: dict[int | None, list[SubLayer]] = {}
            for e in self.placeable:
                by_layer.setdefault(e.layer, []).append(e)
            slots = self._streaming_room(1, False) if offload else 0
            fixed = self.workspace_bytes(tier) + slots + VramBreakdown(ep_overhead=self.ep_overhead).total
            left = Placement.STREAMED if offload else Placement.CPU
            # (the attention of a CPU layer stays with its KV, in host memory)
            placements = {e.name: Placement.CPU if e.kind == "attn" else left for e in self.placeable}
            used = fixed
            layers = sorted(layer for layer in by_layer if layer is not None)
            for layer in [*layers, None]:
                units = by_layer.get(layer, [])
                used += sum(self.weight_bytes[e.name] + self.kv_bytes(e) for e in units)
                if used > budget_bytes:
                    break
                placements.update({e.name: Placement.PINNED for e in units})
            plan = self.evaluate(
                "layers",
                tier,
                placements,
                budget_bytes,
                slots=int(offload),
                prefetch=not offload,
                detail=detail,
            )
            if offload and not self.fits(plan):  # no room for the copies: the CPU layers compute on the CPU
                placements = {n: Placement.CPU if p == left else p for n, p in placements.items()}
                plan = self.evaluate("layers", tier, placements, budget_bytes, slots=0, detail=detail)
            return plan
        if name == "offload":
            streamed_all = {e.name: Placement.STREAMED for e in self.placeable}
            if self.vram(streamed_all, tier, 1).total > budget_bytes:
                return None
            placements = self._pinned(tier, streamed_all, 1, budget_bytes, self.placeable)[
                0
            ]  # manifest order
            return self.evaluate(
                "offload", tier, placements, budget_bytes, slots=1, prefetch=False, detail=detail
            )
        raise UserError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")

    # -- the paper artifact's strategies ------------------------------------------------------------------------
    def _artifact_options(self, name: str, tier: int, budget_bytes: int) -> list[Option]:
        """The placements one of the artifact's strategies makes (fitting or not), layer by layer as its plan
        builder does. The output layer stays on the CPU unless a strategy pins it (FULL_GPU; a MoE model's, once
        every attention is pinned)."""
        cpu = Placement.CPU
        attentions, rest, everything, final = self._layer_orders()
        bases = self._artifact_bases()
        output_first = final if self.routing_share else []  # a MoE model: the output layer before the FFN
        options: list[Option] = []
        if name in ("full-gpu", "full-gpu-no-output"):
            if self.model_bytes > budget_bytes:
                return []  # the weights alone exceed the budget
            placements = {e.name: Placement.PINNED for e in self.placeable}
            if name == "full-gpu-no-output":
                placements.update(dict.fromkeys((e.name for e in final), cpu))
            options = [Option(name, placements, 0, False, vram_bytes=self.vram(placements, tier, 0).total)]
        elif name == "static-attn-prio":
            order = self._order(name, [*attentions, *output_first, *rest])
            placements, vram_bytes, prefix = self._pinned(tier, bases.all_cpu, 0, budget_bytes, order)
            options = [Option(name, placements, 0, False, vram_bytes=vram_bytes, prefix=prefix)]
        elif name == "shard-attn-prio":
            for kv_streaming in self.kv_streaming_modes(budget_bytes):
                placements, vram_bytes, prefix = self._pinned(
                    tier, bases.attn_streamed, 1, budget_bytes, attentions, kv_streaming
                )
                if all(placements[e.name] == Placement.PINNED for e in attentions):
                    # every attention pinned: the FFN streamed through the slot, whole layers pinned in order
                    base = {e.name: Placement.STREAMED for e in self.placeable}
                    base.update(dict.fromkeys((e.name for e in final), cpu))
                    base.update({n: p for n, p in placements.items() if p == Placement.PINNED})
                    placements, vram_bytes, prefix = self._pinned(
                        tier, base, 1, budget_bytes, self._order(name, [*output_first, *rest])
                    )
                options.append(
                    Option(name, placements, 1, kv_streaming, vram_bytes=vram_bytes, prefix=prefix)
                )
        elif name == "full-shard":
            for kv_streaming in self.kv_streaming_modes(budget_bytes):
                placements, vram_bytes, prefix = self._pinned(
                    tier, bases.all_streamed, 2, budget_bytes, everything, kv_streaming
                )
                options.append(
                    Option(name, placements, 2, kv_streaming, vram_bytes=vram_bytes, prefix=prefix)
                )
        else:
            raise UserError(f"unknown artifact strategy {name!r}; known: {', '.join(ARTIFACT_STRATEGIES)}")
        return options

    def artifact_plan(self, name: str, tier: int, budget_bytes: int) -> Plan | None:
        """The plan one of the paper artifact's strategies (ARTIFACT_STRATEGIES) would make here, placed layer by
        layer as its plan builder does and priced by our estimator, so plan quality compares apart from
        calibration; None where it is not viable."""
        plans = [
            self.evaluate(name, tier, o.placements, budget_bytes, o.slots, kv_streaming=o.kv_streaming)
            for o in self._artifact_options(name, tier, budget_bytes)
        ]
        viable = [p for p in plans if self.fits(p)]
        return min(viable, key=lambda p: p.step_s) if viable else None

    def _seed_options(self, tier: int, budget_bytes: int) -> list[Option]:
        """The artifact's placements that fit, as candidates of our own strategies (named by what they are: no
        unit streamed is static, none on the CPU gpu-only, else dynamic): our choice is never slower than the
        artifact's under the same estimator."""
        seeds = []
        for name in ARTIFACT_STRATEGIES:
            for option in self._artifact_options(name, tier, budget_bytes):
                if option.vram_bytes > budget_bytes:
                    continue
                classes, _ = self._classes(tier, option.kv_streaming)
                pinned, streamed = self._option_counts(tier, option)
                on_cpu = any(
                    c.placeable and len(c.names) > pins + streams
                    for c, pins, streams in zip(classes, pinned, streamed, strict=True)
                )
                option.strategy = "static" if not any(streamed) else "dynamic" if on_cpu else "gpu-only"
                seeds.append(option)
        return seeds

    def _layer_orders(self) -> LayerOrders:
        """The artifact's orders, by layer (made once)."""
        if self._layered is None:
            by_layer = sorted(
                (e for e in self.placeable if e.layer is not None), key=lambda e: (e.layer, e.kind != "attn")
            )
            self._layered = LayerOrders(
                attentions=[e for e in by_layer if e.kind == "attn"],
                rest=[e for e in by_layer if e.kind != "attn"],
                everything=by_layer,
                final=[e for e in self.placeable if e.kind == "final"],
            )
        return self._layered

    def _artifact_bases(self) -> ArtifactBases:
        """The placements the artifact's strategies pin over (made once; `_pinned` copies what it changes):
        everything on the CPU, the attentions streamed and the rest on the CPU, all but the output layer
        streamed."""
        if self._bases is None:
            cpu, streamed = Placement.CPU, Placement.STREAMED
            self._bases = ArtifactBases(
                all_cpu={e.name: cpu for e in self.placeable},
                attn_streamed={e.name: streamed if e.kind == "attn" else cpu for e in self.placeable},
                all_streamed={e.name: cpu if e.kind == "final" else streamed for e in self.placeable},
            )
        return self._bases

    def _order(self, name: str, units: list[SubLayer]) -> list[SubLayer]:
        """`units` kept under `name`, so that the pin-prefix cache sees one list per order."""
        return self._orders.setdefault(name, units)

    # -- per tier ---------------------------------------------------------------------------------------------------
    def check_budget(self, budget_bytes: int) -> None:
        """Raise UserError naming the minimum when no plan fits `budget_bytes`."""
        if budget_bytes < self.minimum_budget():
            raise UserError(
                f"VRAM budget {budget_bytes / 1024**2:.0f} MiB is below the minimum of any plan: "
                f"{self.minimum_budget() / 1024**2:.0f} MiB (EP overhead + reserve)"
            )

    def strategies(self, tier: int, budget_bytes: int, detail: bool = False) -> list[Plan]:
        """The viable plans of the three strategies at `tier` within `budget_bytes`, fastest first (`detail`: with
        their timelines)."""
        self.check_budget(budget_bytes)
        plans = [policy(tier, budget_bytes, detail) for policy in (self.gpu_only, self.static, self.dynamic)]
        best = {p.strategy: p for p in plans if p is not None}
        for seed in self._seed_options(tier, budget_bytes):
            current = best.get(seed.strategy)
            if current is not None and self.at_scale and self._option_score(tier, seed) >= current.step_s:
                continue  # at scale a seed is simulated only where its closed-form score beats the plan
            plan = self._best_of(tier, budget_bytes, [seed], detail)
            if plan is not None and (current is None or plan.step_s < current.step_s * (1 - 1e-9)):
                best[seed.strategy] = plan
        return sorted(best.values(), key=lambda p: p.step_s)

    def plan_tier(self, tier: int, budget_bytes: int) -> TierPlans:
        """Every strategy's plan at `tier` within `budget_bytes`, fastest first (`chosen`), and the baselines."""
        candidates = self.strategies(tier, budget_bytes, detail=True)
        baselines = {
            name: self.baseline(name, tier, budget_bytes, detail=True) for name in ("layers", "offload")
        }
        return TierPlans(
            tier=tier,
            chosen=candidates[0],
            alternatives=candidates[1:],
            baselines={k: v for k, v in baselines.items() if v is not None},
        )

    def plan_for(self, strategy: str, tier: int, budget_bytes: int) -> Plan:
        """The plan of `strategy` ("auto": the best) at `tier` within `budget_bytes` (PlanSource); the best plan,
        with a warning, when that strategy is not viable there."""
        self.check_budget(budget_bytes)
        policies = {
            "gpu-only": self.gpu_only,
            "static": self.static,
            "dynamic": self.dynamic,
            "layers": lambda t, b: self.baseline("layers", t, b),
            "offload": lambda t, b: self.baseline("offload", t, b),
        }
        plan = policies[strategy](tier, budget_bytes) if strategy in policies else None
        if plan is None:
            if strategy != "auto":
                log.warning(
                    "warning: plan %s is not viable (or equals static) at tier %d within %.0f MiB: "
                    "using the planner's choice",
                    strategy,
                    tier,
                    budget_bytes / 1024**2,
                )
            plan = self.choose(tier, budget_bytes)
        return plan

    def detailed(self, plan: Plan) -> Plan:
        """The same plan re-simulated with its timeline and copy overlap (for reports and plans.json)."""
        return self.resimulated(plan, detail=True)

    def plan(self, budget_bytes: int, tiers: tuple[int, ...] = DEFAULT_TIERS) -> BudgetPlans:
        """`plan_tier` of every tier within `budget_bytes`."""
        started = time.perf_counter()
        per_tier = [self.plan_tier(t, budget_bytes) for t in tiers]
        return BudgetPlans(budget_bytes, per_tier, time.perf_counter() - started)


def _last_true(low: int, high: int, holds) -> int:
    """The largest x in [low, high] where `holds(x)`, for a predicate true up to some x and false after (low
    when it holds nowhere above low)."""
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _with_streamed(streamed: list[int], members: list[int], is_ring: bool, count: int) -> list[int]:
    """Class counts with `count` more streamed in the group `members`: per expert class `count` of its units;
    of ring classes `count` classes spread evenly over the group."""
    counts = list(streamed)
    if is_ring:
        for j in range(count):
            counts[members[j * len(members) // count]] = 1
    else:
        for index in members:
            counts[index] = count
    return counts


def expert_routing_shares(manifest: Manifest, stats: RoutingStats | None) -> dict[str, float]:
    """Per expert sub-layer, the share of a layer's tokens routed to it: k/E (uniform), or from a stats
    file of measured activations (runtime ExpertStats.to_json) when given, with one pseudo-token per
    expert so an expert the stats never saw chosen is still expected now and then."""
    num_experts, top_k = manifest.model.num_experts, manifest.model.experts_per_token
    shares: dict[str, float] = {}
    for block in manifest.moe_blocks:
        measured = stats.tokens.get(block.layer) if stats else None
        routed = sum(measured) if measured else 0
        for index, name in enumerate(block.experts):
            # Each token goes to top_k experts: measured token counts sum to top_k x tokens.
            shares[name] = (
                top_k * (measured[index] + 1) / (routed + num_experts) if routed else top_k / num_experts
            )
    return shares


def _nearest_tier_factor(factors: dict[int, float], tier: int) -> float:
    if not factors:
        return 1.0
    return max(1.0, factors[min(factors, key=lambda t: abs(t - tier))])


def plans_document(
    planner: Planner,
    planned: BudgetPlans,
    pack: str,
    profile_name: str,
    pack_sha256: str,
    budget_bytes: int,
    ladder: list[tuple[int, BudgetPlans]] | None = None,
) -> dict:
    """plans.json (schema 2, docs/plans.md) of `planned`, the plans made within `budget_bytes`. `ladder`:
    (budget, planned) of every budget planned, largest first; the top-level tiers are the first's (the largest
    budget)."""

    def tier_json(entry: TierPlans) -> dict:
        return {
            "tier": entry.tier,
            "chosen": entry.chosen.to_json(),
            "alternatives": [p.to_json() for p in entry.alternatives],
            "baselines": {k: v.to_json() for k, v in entry.baselines.items()},
        }

    return {
        "schema_version": PLANS_SCHEMA_VERSION,
        "pipeshard_version": __version__,
        "pack": pack,
        "pack_sha256": pack_sha256,
        "profile": {
            "name": profile_name,
            "source": planner.profile.source,
            "fingerprint_id": planner.profile.fingerprint_id,
        },
        "budget_bytes": budget_bytes,
        "context": planner.context,
        "batch": planner.batch,
        "threads": planner.estimator.threads,
        "model_bytes": planner.model_bytes,
        **({"assumed_bits_per_weight": planner.assume_bits} if planner.assume_bits else {}),
        "minimum_budget_bytes": planner.minimum_budget(),
        "tiers": [tier_json(e) for e in planned.tiers],
        "ladder": [
            {"budget_bytes": budget, "tiers": [tier_json(e) for e in rung.tiers]}
            for budget, rung in (ladder or [(budget_bytes, planned)])
        ],
    }
