"""A plan's step time: three resources in order (CPU, GPU, copy engine) over the chain of sub-layers.

Each sub-layer runs on the CPU or the GPU after its input is ready; an activation crossing devices
is a copy of T x hidden on the copy engine. A streamed sub-layer first needs its weights copied
into a free slot of a ring of staging slots (a slot frees when the sub-layer that used it
finishes); copies are issued in chain order as soon as engine and slot allow, so they run ahead of
compute (prefetch) — or, with `prefetch=False` (the Accelerate-style baseline), only when the
sub-layer is reached. A streamed attention whose KV streams too copies it with its weights (the
planner adds it to the unit's copy time, with the download of the step's new rows). CPU work that
overlaps a copy is slowed by the measured contention. The chain is simulated for several
consecutive steps and the steady-state step time is the spacing of the
last two, so the next step's first copies overlap this step's tail.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeshard.formats.manifest import SubLayer
from pipeshard.formats.plans import EXPERT_RUN_ORDER, EXPERT_SLOTS, Placement

STEPS = 3
COLLAPSE_AFTER = 8  # see _collapsed_runs: the contention check's window of recent intervals


class ComputeSeconds(NamedTuple):
    """A unit's compute time in one step on each device."""

    cpu: float
    gpu: float

    def on(self, device: str) -> float:
        return self.gpu if device == "gpu" else self.cpu


@dataclass
class FreeAt:
    """When each of the three resources is next free, in seconds from the simulation's start."""

    cpu: float = 0.0
    gpu: float = 0.0
    copy: float = 0.0

    def device(self, device: str) -> float:
        """When compute device `device` (cpu or gpu) is free."""
        return self.gpu if device == "gpu" else self.cpu

    def busy_until(self, device: str, end: float) -> None:
        """Compute device `device` (cpu or gpu) runs until `end`."""
        if device == "gpu":
            self.gpu = end
        else:
            self.cpu = end


def _experts_by_placement(
    sub_layers: list[SubLayer], placements: dict[str, str], gates: dict[str, str]
) -> list[SubLayer]:
    """Within each run of gated units (a MoE layer's experts), pinned first, then CPU, then streamed:
    the runtime's order, so the streamed experts' copies overlap the others' compute."""
    run_order = sorted(EXPERT_RUN_ORDER, key=EXPERT_RUN_ORDER.get)
    ordered: list[SubLayer] = []
    group: list[SubLayer] = []

    def close_group() -> None:
        by_placement: dict[str, list[SubLayer]] = {placement: [] for placement in run_order}
        for entry in group:
            by_placement[placements[entry.name]].append(entry)
        for placement in run_order:
            ordered.extend(by_placement[placement])
        group.clear()

    for entry in sub_layers:
        gate = gates.get(entry.name)
        if group and gate != gates[group[0].name]:
            close_group()
        (group if gate is not None else ordered).append(entry)
    close_group()
    return ordered


def _collapsed_runs(
    sub_layers: list[SubLayer],
    placements: dict[str, str],
    compute_s: dict[str, ComputeSeconds],
    copy_s: dict[str, float],
    gates: dict[str, str],
    device_shares_cpu: bool,
) -> list[tuple[SubLayer, list[str]]]:
    """The chain as (unit, []) steps, except that within a long run of one MoE layer's experts placed alike and
    taking the same time (and copy time, when streamed), the units after the first COLLAPSE_AFTER (for streamed
    ones, after the first) are one step (unit, [names]). Pinned or CPU ones run back to back on one device; only
    the first few can overlap a copy issued before the run (the contention check looks at the last
    COLLAPSE_AFTER intervals). Streamed ones run on the device through their own slots, and no ring copy can be
    issued during the run (ring slots free only when ring units compute), so their copies and computes follow a
    recurrence without the unit-by-unit bookkeeping, unless the device shares the CPU (the contention check then
    applies to them too). So the step time is the one the unit-by-unit loop gives, at the cost of a few steps per
    layer instead of one per expert."""
    runs: list[tuple[SubLayer, list[str]]] = []
    index = 0
    while index < len(sub_layers):
        entry = sub_layers[index]
        name = entry.name
        place = placements.get(name)
        end = index + 1
        if name in gates and (place != Placement.STREAMED or not device_shares_cpu):
            device = "cpu" if place == Placement.CPU else "gpu"
            gate, seconds, copy_seconds = gates[name], compute_s[name].on(device), copy_s[name]
            streamed = place == Placement.STREAMED
            while end < len(sub_layers):
                other = sub_layers[end].name
                if (
                    gates.get(other) != gate
                    or placements[other] != place
                    or compute_s[other].on(device) != seconds
                    or (streamed and copy_s[other] != copy_seconds)
                ):
                    break
                end += 1
        streamed_run = place == Placement.STREAMED and name in gates and not device_shares_cpu
        single = min(end, index + (1 if streamed_run else COLLAPSE_AFTER))
        runs += [(e, []) for e in sub_layers[index:single]]
        if single < end:
            runs.append((sub_layers[single], [e.name for e in sub_layers[single:end]]))
        index = end
    return runs


PAIRWISE_OVERLAP_LIMIT = 256  # compute intervals summed pair by pair; more through sorted prefix sums


def _overlap_with(intervals: list[tuple[float, float]]):
    """f(a, b) = the sum over `intervals` of their overlap with [a, b]: pair by pair for few intervals; for many
    (thousands of experts) as F(b) - F(a), F(x) = sum of (x - start) over starts before x less the same over ends."""
    if len(intervals) <= PAIRWISE_OVERLAP_LIMIT:
        return lambda a, b: sum(max(0.0, min(b, e) - max(a, s)) for s, e in intervals)
    starts, ends = sorted(s for s, _ in intervals), sorted(e for _, e in intervals)
    start_sums, end_sums = [0.0, *itertools.accumulate(starts)], [0.0, *itertools.accumulate(ends)]

    def covered_until(x: float) -> float:
        opened, closed = bisect.bisect_left(starts, x), bisect.bisect_left(ends, x)
        return opened * x - start_sums[opened] - (closed * x - end_sums[closed])

    return lambda a, b: max(0.0, covered_until(b) - covered_until(a))


@dataclass
class Interval:
    """One busy period of one resource, for timelines."""

    resource: str
    sub_layer: str
    start_s: float
    end_s: float


@dataclass
class Simulation:
    step_s: float
    per_sub_layer_s: dict[str, float]
    timeline: list[Interval] = field(default_factory=list)
    copy_busy_s: float = 0.0
    copy_hidden_s: float = 0.0


def simulate(
    sub_layers: list[SubLayer],
    placements: dict[str, str],
    compute_s: dict[str, ComputeSeconds],
    copy_s: dict[str, float],
    activation_copy_s: float,
    slots: int = 2,
    prefetch: bool = True,
    cpu_slowdown_under_copy: float = 1.0,
    detail: bool = True,
    copy_gates: dict[str, str] | None = None,
    device_shares_cpu: bool = False,
) -> Simulation:
    """Steady-state step time of one plan (with `detail`, also its timeline and hidden copy time).

    compute_s[name]: its seconds on the CPU and on the GPU; copy_s[name] = seconds to stream its weights.
    copy_gates[name] = the sub-layer that must finish before `name`'s weights can be copied (a MoE
    expert's router): such units do not use the ring but their own EXPERT_SLOTS slots, their copies
    issued once the gate ran; a MoE layer runs its pinned experts, then CPU ones, then streamed ones.
    `device_shares_cpu`: the device computes on the host's cores (the simulated device), so its sub-layers slow
    under a copy as the CPU's do.
    """
    gates = copy_gates or {}
    sub_layers = _experts_by_placement(sub_layers, placements, gates)
    free = FreeAt()
    timeline: list[Interval] = []
    streamed = [
        e.name for e in sub_layers if placements[e.name] == Placement.STREAMED and e.name not in gates
    ]
    gated_streamed: dict[str, list[str]] = {gate: [] for gate in set(gates.values())}
    for entry in sub_layers:
        if placements[entry.name] == Placement.STREAMED and entry.name in gates:
            gated_streamed[gates[entry.name]].append(entry.name)
    position_in_group = {name: i for group in gated_streamed.values() for i, name in enumerate(group)}
    runs = _collapsed_runs(sub_layers, placements, compute_s, copy_s, gates, device_shares_cpu)
    gated_copy_end: dict[str, float] = {}
    gated_compute_end: dict[str, float] = {}
    ended: dict[str, float] = {}
    slots = max(slots, 1)
    copy_end: list[float] = []  # per global streamed index (over all steps)
    compute_end: list[float] = []  # per global streamed index
    total_streamed = len(streamed) * STEPS

    def copy(label: str, start: float, seconds: float) -> float:
        begin = max(free.copy, start)
        free.copy = begin + seconds
        timeline.append(Interval("copy", label, begin, free.copy))
        return free.copy

    def issue_ready_copies(now: float | None) -> None:
        """Issue streamed copies whose slot is known to be free (prefetch), or the next one at `now`."""
        while len(copy_end) < total_streamed:
            index = len(copy_end)
            if index >= slots and index - slots >= len(compute_end):
                return  # its slot's previous user has not run yet
            slot_released = compute_end[index - slots] if index >= slots else 0.0
            if not prefetch and now is None:
                return
            name = streamed[index % len(streamed)]
            copy_end.append(copy(name, max(slot_released, now or 0.0), copy_s[name]))
            if not prefetch:
                return

    ready = 0.0
    previous_device = "cpu"  # tokens enter on the host
    step_ends: list[float] = []
    per_sub_layer: dict[str, float] = {}
    for _ in range(STEPS):
        for entry, repeats in runs:
            name = entry.name
            place = placements[name]
            device = "cpu" if place == Placement.CPU else "gpu"
            if repeats and place == Placement.STREAMED:  # more streamed experts like the one before
                ready = _streamed_expert_run(
                    repeats,
                    gated_streamed[gates[name]],
                    position_in_group,
                    gated_copy_end,
                    gated_compute_end,
                    ended[gates[name]],
                    copy_s[name],
                    compute_s[name].gpu,
                    free,
                    timeline,
                    name,
                )
                for other in repeats:
                    per_sub_layer[other] = compute_s[name].gpu
                    ended[other] = gated_compute_end[other]
                continue
            if (
                repeats
            ):  # more units like the one before, on the same device: back to back, nothing to wait for
                start = free.device(device)
                for other in repeats:
                    per_sub_layer[other] = compute_s[other].on(device)
                end = start + compute_s[name].on(device) * len(repeats)
                free.busy_until(device, end)
                ready = end
                timeline.append(Interval(device, name, start, end))
                continue
            if device != previous_device:
                ready = copy(f"{name} input", ready, activation_copy_s)
            if prefetch:
                issue_ready_copies(None)
            start = max(free.device(device), ready)
            if place == Placement.STREAMED and name in gates:
                group = gated_streamed[gates[name]]
                position = position_in_group[name]
                for ahead in group[position : position + EXPERT_SLOTS]:
                    if ahead not in gated_copy_end:
                        behind = position_in_group[ahead] - EXPERT_SLOTS
                        slot_free = gated_compute_end[group[behind]] if behind >= 0 else 0.0
                        gated_copy_end[ahead] = copy(ahead, max(ended[gates[name]], slot_free), copy_s[ahead])
                start = max(start, gated_copy_end[name])
            elif place == Placement.STREAMED:
                index = len(compute_end)
                if index >= len(copy_end):
                    issue_ready_copies(start)
                start = max(start, copy_end[index])
            duration = compute_s[name].on(device)
            slowed = device == "cpu" or device_shares_cpu
            if slowed and any(
                i.resource == "copy" and i.start_s < start + duration and i.end_s > start
                for i in timeline[-COLLAPSE_AFTER:]
            ):
                duration *= cpu_slowdown_under_copy
            end = start + duration
            ended[name] = end
            if place == Placement.STREAMED and name in gates:
                gated_compute_end[name] = end
            elif place == Placement.STREAMED:
                compute_end.append(end)
            free.busy_until(device, end)
            ready = end
            previous_device = device
            per_sub_layer[name] = duration
            timeline.append(Interval(device, name, start, end))
        gated_copy_end.clear()
        if previous_device != "cpu":  # logits come back to the host
            ready = copy("logits", ready, activation_copy_s)
            previous_device = "cpu"
        step_ends.append(ready)
    window_start, window_end = step_ends[-2], step_ends[-1]
    if not detail:  # the plan search needs only the step time
        return Simulation(window_end - window_start, per_sub_layer)
    in_window = [i for i in timeline if i.end_s > window_start and i.start_s < window_end]
    compute_busy = [(i.start_s, i.end_s) for i in in_window if i.resource != "copy"]
    overlap = _overlap_with(compute_busy)
    copy_busy = hidden = 0.0
    for i in in_window:
        if i.resource == "copy":
            start, end = max(i.start_s, window_start), min(i.end_s, window_end)
            copy_busy += end - start
            hidden += overlap(start, end)
    shifted = [
        Interval(i.resource, i.sub_layer, i.start_s - window_start, i.end_s - window_start) for i in in_window
    ]
    return Simulation(window_end - window_start, per_sub_layer, shifted, copy_busy, min(hidden, copy_busy))


def _streamed_expert_run(
    run: list[str],
    group: list[str],
    position_in_group: dict[str, int],
    copy_end: dict[str, float],
    compute_end: dict[str, float],
    gate_end_s: float,
    copy_s: float,
    compute_s: float,
    free: FreeAt,
    timeline: list[Interval],
    label: str,
) -> float:
    """The unit loop's recurrence for a run of alike streamed experts (each copied into one of EXPERT_SLOTS slots
    once its router ran and the slot's previous expert finished, then computed on the device), without an
    interval per unit: one copy and one device interval for the run. Returns when the last one ends."""
    copy_began = copy_free = free.copy
    began = end = free.gpu
    first = position_in_group[run[0]]
    # ends[j]: when the expert at position first - EXPERT_SLOTS + j finished (0 before the group's start)
    ends = [compute_end[group[first - k]] if first - k >= 0 else 0.0 for k in range(EXPERT_SLOTS, 0, -1)]
    reach = len(group)
    for offset, name in enumerate(run):
        position = first + offset
        # copies up to EXPERT_SLOTS ahead: the first expert's all, each later one's only the one newly in reach
        nearest = position if offset == 0 else position + EXPERT_SLOTS - 1
        for ahead in range(nearest, min(position + EXPERT_SLOTS, reach)):
            if group[ahead] not in copy_end:
                slot_free = ends[ahead - first]  # the slot's previous expert, EXPERT_SLOTS before it
                copy_free = max(copy_free, gate_end_s, slot_free) + copy_s
                copy_end[group[ahead]] = copy_free
        end = max(end, copy_end[name]) + compute_s
        compute_end[name] = end
        ends.append(end)
    free.gpu = end
    if copy_free > copy_began:
        timeline.append(Interval("copy", label, copy_began, copy_free))
        free.copy = copy_free
    timeline.append(Interval("gpu", label, began, free.gpu))
    return free.gpu
