"""Plans over classes of alike units, scored in closed form: what lets the planner search packs of thousands of
experts between two steps.

A class is a run of consecutive units that cost the same and are gated by the same router (one MoE layer's
experts under uniform routing), or one unit alone. A plan at class level is, per class, how many of its units
are pinned and how many streamed (the rest compute on the CPU; the units are taken in the class's order, most
popular first). `class_step_s` scores it with the event model of simulate.py applied to whole blocks of alike
units (a block's time and its copies in closed form), so one score costs a pass over the classes, not the units;
the planner simulates only the winner exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pipeshard.formats.manifest import SubLayer
from pipeshard.formats.plans import EXPERT_SLOTS, Placement
from pipeshard.partitioner.simulate import ComputeSeconds, FreeAt

STEPS = 3  # as simulate.STEPS: the steady state is the spacing of the last two steps
CONTENDED_UNITS = 8  # as simulate.COLLAPSE_AFTER: how many units of a run a copy issued before it can slow


@dataclass(frozen=True)
class UnitClass:
    """Alike units next to each other in the chain, with their per-unit costs."""

    names: tuple[str, ...]
    gate: str | None  # the router their copies wait for (experts); None for a unit streamed through the ring
    cpu_s: float
    gpu_s: float
    copy_s: float
    kv_bytes: int  # per unit: what a streamed attention keeps resident unless its KV streams
    weight_bytes: int  # per unit: what its staging slot must hold
    placeable: bool


def unit_classes(
    units: list[SubLayer],
    compute_s: dict[str, ComputeSeconds],
    copy_s: dict[str, float],
    gates: dict[str, str],
    placeable: set[str],
    kv_bytes: Callable[[SubLayer], int],
    weight_bytes: dict[str, int],
) -> list[UnitClass]:
    """The chain cut into classes: consecutive units under one gate with equal costs form one class."""
    classes: list[UnitClass] = []
    run: list[SubLayer] = []

    def close() -> None:
        if run:
            first = run[0].name
            classes.append(
                UnitClass(
                    tuple(e.name for e in run),
                    gates.get(first),
                    compute_s[first].cpu,
                    compute_s[first].gpu,
                    copy_s[first],
                    kv_bytes(run[0]),
                    max(weight_bytes[e.name] for e in run),
                    first in placeable,
                )
            )
            run.clear()

    for entry in units:
        name = entry.name
        if run and not (
            gates.get(name) is not None
            and gates.get(name) == gates.get(run[0].name)
            and compute_s[name] == compute_s[run[0].name]
            and copy_s[name] == copy_s[run[0].name]
        ):
            close()
        run.append(entry)
    close()
    return classes


def streamed_vram(classes: list[UnitClass], streamed: list[int], slots: int, kv_streaming: bool) -> int:
    """The VRAM that streaming `streamed` units per class takes beside the pinned ones: staging slots as large as
    the largest streamed ring unit, EXPERT_SLOTS as large as the largest streamed expert, and the streamed
    attentions' KV (resident, or with `kv_streaming` one KV slot beside each staging slot)."""
    ring_slot = expert_slot = kv_slot = resident_kv = 0
    for unit_class, count in zip(classes, streamed, strict=True):
        if not count:
            continue
        if unit_class.gate is not None:
            expert_slot = max(expert_slot, unit_class.weight_bytes)
            continue
        ring_slot = max(ring_slot, unit_class.weight_bytes)
        kv_slot = max(kv_slot, unit_class.kv_bytes)
        resident_kv += count * unit_class.kv_bytes
    kv = slots * kv_slot if kv_streaming else resident_kv
    return slots * ring_slot + EXPERT_SLOTS * expert_slot + kv


def class_counts(
    classes: list[UnitClass], placements: dict[str, str], class_of: dict[str, int]
) -> tuple[list[int], list[int]]:
    """(pinned, streamed) per class of unit-level placements (`class_of`: each unit's class index)."""
    counts = {Placement.PINNED: [0] * len(classes), Placement.STREAMED: [0] * len(classes)}
    for name, placement in placements.items():
        if placement in counts:
            counts[placement][class_of[name]] += 1
    return counts[Placement.PINNED], counts[Placement.STREAMED]


def class_placements(classes: list[UnitClass], pinned: list[int], streamed: list[int]) -> dict[str, str]:
    """Unit-level placements of class counts: in each class the first units pinned, the next streamed."""
    placements: dict[str, str] = {}
    for unit_class, pins, streams in zip(classes, pinned, streamed, strict=True):
        if not unit_class.placeable:
            continue
        for index, name in enumerate(unit_class.names):
            placements[name] = (
                Placement.PINNED
                if index < pins
                else Placement.STREAMED
                if index < pins + streams
                else Placement.CPU
            )
    return placements


def class_step_s(
    classes: list[UnitClass],
    pinned: list[int],
    streamed: list[int],
    slots: int,
    activation_s: float,
    cpu_slowdown_under_copy: float,
    device_shares_cpu: bool,
) -> float:
    """Steady-state step time of class counts: simulate.py's three resources over blocks of alike units.

    A block of k units of t seconds on one device takes k·t, its first units slowed where a copy is still running
    when it starts. Ring units stream through `slots` slots, each copy issued once its slot's previous unit ran. A
    class's m streamed experts (copy c, compute g, EXPERT_SLOTS slots, copies from when the router ran, f0) end at
    max(start + m·g, f0 + c + g + (m-1)·max(c, g)): the two-stage pipeline of alike jobs."""
    free = FreeAt()
    ring = [i for i, c in enumerate(classes) if c.gate is None and streamed[i]]
    ring_copy_end: list[float] = []
    ring_compute_end: list[float] = []
    total_ring = len(ring) * STEPS
    slots = max(slots, 1)
    ended: dict[str, float] = {}

    def issue_ring_copies() -> None:
        while len(ring_copy_end) < total_ring:
            index = len(ring_copy_end)
            if index >= slots and index - slots >= len(ring_compute_end):
                return
            released = ring_compute_end[index - slots] if index >= slots else 0.0
            free.copy = max(free.copy, released) + classes[ring[index % len(ring)]].copy_s
            ring_copy_end.append(free.copy)

    def run_block(device: str, count: int, seconds: float, ready: float) -> float:
        start = max(free.device(device), ready)
        duration = count * seconds
        if (device == "cpu" or device_shares_cpu) and free.copy > start and cpu_slowdown_under_copy > 1.0:
            slowed = min(
                count,
                CONTENDED_UNITS,
                math.ceil((free.copy - start) / (seconds * cpu_slowdown_under_copy)),
            )
            duration += slowed * seconds * (cpu_slowdown_under_copy - 1.0)
        free.busy_until(device, start + duration)
        return start + duration

    # per class, its non-empty blocks in the order they run: pinned, on the CPU, streamed
    blocks_of = []
    for unit_class, pins, streams in zip(classes, pinned, streamed, strict=True):
        blocks = (
            ("gpu", pins, False),
            ("cpu", len(unit_class.names) - pins - streams, False),
            ("gpu", streams, True),
        )
        blocks_of.append([block for block in blocks if block[1]])
    ready = 0.0
    previous = "cpu"
    step_ends = []
    for _ in range(STEPS):
        for unit_class, blocks in zip(classes, blocks_of, strict=True):
            for device, units, is_streamed in blocks:
                if device != previous:
                    free.copy = max(free.copy, ready) + activation_s
                    ready = free.copy
                    previous = device
                if len(ring_copy_end) < total_ring:
                    issue_ring_copies()
                if not is_streamed:
                    seconds = unit_class.cpu_s if device == "cpu" else unit_class.gpu_s
                    ready = run_block(device, units, seconds, ready)
                elif unit_class.gate is None:
                    ready = run_block(
                        "gpu", 1, unit_class.gpu_s, max(ready, ring_copy_end[len(ring_compute_end)])
                    )
                    ring_compute_end.append(ready)
                else:
                    copy, compute = unit_class.copy_s, unit_class.gpu_s
                    first_copy = max(free.copy, ended.get(unit_class.gate, 0.0))
                    start = max(free.gpu, ready)
                    end = max(
                        start + units * compute,
                        first_copy + copy + compute + (units - 1) * max(copy, compute),
                    )
                    free.copy = max(free.copy, first_copy + units * copy)
                    free.gpu = ready = end
            ended[unit_class.names[-1]] = ready
            if unit_class.gate is None and len(unit_class.names) == 1:
                ended[unit_class.names[0]] = ready
        if previous != "cpu":
            free.copy = max(free.copy, ready) + activation_s
            ready = free.copy
            previous = "cpu"
        step_ends.append(ready)
    return step_ends[-1] - step_ends[-2]


def best_count(low: int, high: int, cost: Callable[[int], float]) -> tuple[int, float]:
    """The integer in [low, high] of least `cost`, by ternary search (the step time is taken as unimodal in how
    many alike units stream: fewer leave compute on the CPU, more queue copies), then a scan of the last few."""
    seen: dict[int, float] = {}

    def value(x: int) -> float:
        if x not in seen:
            seen[x] = cost(x)
        return seen[x]

    while high - low > 3:
        third = (high - low) // 3
        left, right = low + third, high - third
        if value(left) <= value(right):
            high = right
        else:
            low = left
    best = min(range(low, high + 1), key=value)
    return best, value(best)


def nearest_best(start: int, low: int, high: int, cost: Callable[[int], float]) -> tuple[int, float]:
    """A local minimum of `cost` on [low, high] reached from `start` by steps that double while they help: the
    warm start of a search whose optimum moved little (a budget change)."""
    best, best_cost = start, cost(start)
    for direction in (1, -1):
        step = 1
        while low <= best + direction * step <= high:
            trial = best + direction * step
            trial_cost = cost(trial)
            if trial_cost >= best_cost:
                break
            best, best_cost = trial, trial_cost
            step *= 2
    return best, best_cost
