"""How a plan runs for one batch shape: its units cut into splits, after ggml's backend scheduler.

A split is the longest run of consecutive units on one side (the host's CPU, or the device) with no host action
between them; host actions are what Python must do between two session runs: wait for a streamed unit's
weights (before it), release its staging slot and start the next copy (after it), hand the values ONNX Runtime
allocated to their readers, run a MoE layer's chosen experts, copy the last positions for the output layer,
join the output layer's row chunks, and copy an activation to the side that reads it next. The program
(`runtime/program.py`) runs a split's sessions in one native call and the actions after it.

Everything here comes from the manifest and the plan alone (no sessions), so `pipeshard plan --explain` prints
the same schedule the runtime executes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pipeshard.formats.io_names import PADDING_BIAS, SEQLENS, TOTAL
from pipeshard.formats.manifest import Manifest, MoeBlock, SubLayer, TensorInfo
from pipeshard.formats.plans import HOST_ONLY_KINDS, Placement, Plan
from pipeshard.runtime.moe import moe_blocks_of

STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")
TOKEN_INPUTS = ("input_ids", "position_ids")  # [batch, new tokens]: buffers of the runtime, bound by pointer
LOGITS = "logits"


class Side(StrEnum):
    """The side a split runs on: the host's CPU, or the device (its pinned and streamed units alike). Not a
    placement; `cpu` is the name `plan --explain` prints."""

    HOST = "cpu"
    DEVICE = "device"


@dataclass(frozen=True)
class Roles:
    """How a boundary tensor is bound, by name: residual-stream buffers, fixed prologue values (shaped by the
    batch shape alone), whole rotary tables."""

    residual: frozenset[str]
    fixed: frozenset[str]
    tables: frozenset[str]


class Layout:
    """What the manifest says about running a pack, whatever the plan: the sub-layers run in line (a MoE
    layer's experts run from its router's action), the residual tensors and their two alternating buffers,
    the prologue's values, the MoE blocks, the output layer's row chunks."""

    def __init__(self, manifest: Manifest, units: list[SubLayer]) -> None:
        """`units`: the planning units the plans place (formats/plans.py `planning_units`)."""
        self.hidden_size = manifest.model.hidden_size
        self.moe: dict[str, MoeBlock] = moe_blocks_of(manifest)
        self.expert_names = {name for block in self.moe.values() for name in block.experts}
        self.entries: dict[str, SubLayer] = {entry.name: entry for entry in manifest.sub_layers}
        self.in_line = [e for e in manifest.sub_layers if e.name not in self.expert_names]
        self.units: dict[str, SubLayer] = {unit.name: unit for unit in units}
        self.chunks = {e.name: [u for u in units if u.chunk and u.chunk.of == e.name] for e in self.in_line}
        residual_names = []
        for entry in self.in_line:
            if entry.name in self.moe:
                residual_names.append(self.moe[entry.name].output)
            else:
                residual_names += [
                    o.name
                    for o in entry.outputs
                    if len(o.shape) == 3 and o.shape[-1] == self.hidden_size and o.name != LOGITS
                ]
        # Consecutive residual tensors alternate between two buffers: a run never reads and writes the same one.
        self.buffer_of = {name: index % 2 for index, name in enumerate(residual_names)}
        self.fixed: dict[str, TensorInfo] = {
            o.name: o
            for e in self.in_line
            if e.kind == "prologue"
            for o in e.outputs
            if all(isinstance(d, int) or d in ("batch", "sequence") for d in o.shape)
        }
        self.tables: dict[str, tuple[SubLayer, str]] = {
            o.name: (entry, o.rows_of)
            for entry in self.in_line
            if entry.kind == "prologue"
            for o in entry.outputs
            if o.rows_of is not None
        }
        self.roles = Roles(frozenset(residual_names), frozenset(self.fixed), frozenset(self.tables))
        first = self.in_line[0] if self.in_line else None
        # At one new token a prologue making only GroupQueryAttention's step values does not run: the step keeps
        # them (runtime/kv.py).
        self.skippable_prologue = (
            first.name
            if first and first.kind == "prologue" and _makes_attention_step_values(first, self.roles)
            else None
        )

    def is_chunk(self, name: str) -> bool:
        """Whether `name` is a unit that computes some rows of an output layer (a row chunk)."""
        unit = self.units.get(name)
        return unit is not None and unit.chunk is not None

    def sub_layer_of(self, name: str) -> SubLayer:
        """The sub-layer a unit computes (a row chunk's: its output layer)."""
        chunk = self.units[name].chunk
        return self.entries[chunk.of if chunk else name]

    def allocated_outputs(self, entry: SubLayer) -> list[str]:
        """The outputs of a sub-layer that ONNX Runtime allocates at each run and Python hands on (a mask bias, a
        router's routing): not residual, logits, fixed values, tables or the KV written in place."""
        present = set(entry.kv.present) if entry.kv else set()
        roles = self.roles
        return [
            o.name
            for o in entry.outputs
            if o.name not in present
            and o.name != LOGITS
            and o.name not in roles.residual
            and o.name not in roles.fixed
            and o.name not in roles.tables
        ]


@dataclass
class Split:
    """Consecutive runs on one side; `wait`: the streamed unit whose weights it waits for; `after`: the host
    actions that follow it, in order, as (action, name)."""

    side: Side
    runs: list[tuple[str, str]]  # (unit, placement)
    wait: str | None = None
    after: list[tuple[str, str]] = field(default_factory=list)


def runs_of(layout: Layout, plan: Plan, tokens: int) -> list[tuple[str, str, str]]:
    """The runs of a step, in order, as (unit, placement, sub-layer): every sub-layer in line, or the output
    layer's row chunks when any of them is on the device; without the skippable prologue at one new token."""
    runs = []
    for entry in layout.in_line:
        name = entry.name
        if tokens == 1 and name == layout.skippable_prologue:
            continue
        chunks = layout.chunks[name]
        if chunks and any(plan.placements[u.name] != Placement.CPU for u in chunks):
            runs += [(u.name, plan.placements[u.name], name) for u in chunks]
        else:
            placement = Placement.CPU if chunks or entry.kind in HOST_ONLY_KINDS else plan.placements[name]
            runs.append((name, placement, name))
    return runs


def schedule(layout: Layout, plan: Plan, tokens: int, all_logits: bool = False) -> list[Split]:
    """The splits of one step of `tokens` new tokens per sequence under `plan`."""
    runs = runs_of(layout, plan, tokens)
    side = {unit: Side.HOST if placement == Placement.CPU else Side.DEVICE for unit, placement, _ in runs}
    last_only = tokens > 1 and not all_logits
    # Who reads each residual tensor, and on which side (the host for what Python reads).
    readers: dict[str, set[str]] = {}
    for unit, _, sub_layer in runs:
        entry = layout.entries[sub_layer]
        for tensor in (i.name for i in entry.inputs):
            if tensor in layout.roles.residual:
                host_read = last_only and entry.kind == "final"
                readers.setdefault(tensor, set()).add(Side.HOST if host_read else side[unit])
    for block in layout.moe.values():
        readers.setdefault(block.residual, set()).add(Side.HOST)
    splits: list[Split] = []
    for index, (unit, placement, sub_layer) in enumerate(runs):
        entry = layout.entries[sub_layer]
        here = side[unit]
        previous = splits[-1] if splits else None
        if previous is None or previous.side != here or previous.after or placement == Placement.STREAMED:
            splits.append(Split(here, [], wait=unit if placement == Placement.STREAMED else None))
        split = splits[-1]
        split.runs.append((unit, placement))
        after = split.after
        if placement == Placement.STREAMED:
            after.append(("release", unit))
        is_last_chunk = "#" in unit and (index + 1 == len(runs) or runs[index + 1][2] != sub_layer)
        if "#" not in unit or is_last_chunk:
            produced = [o.name for o in entry.outputs if o.name in layout.roles.residual]
            for tensor in layout.allocated_outputs(entry):
                after.append(("hand on", tensor))
            if sub_layer in layout.moe:
                after.append(("experts", sub_layer))
                produced = [layout.moe[sub_layer].output]
                here = Side.HOST
            for tensor in produced:
                if here == Side.DEVICE and Side.HOST in readers.get(tensor, ()):
                    after.append(("copy out", tensor))
                if here == Side.HOST and Side.DEVICE in readers.get(tensor, ()):
                    after.append(("copy in", tensor))
            if is_last_chunk:
                after.append(("join chunks", sub_layer))
        following = runs[index + 1] if index + 1 < len(runs) else None
        if (
            following
            and last_only
            and layout.entries[following[2]].kind == "final"
            and following[2] != sub_layer
        ):
            after.append(("last position", following[2]))
    return splits


def describe(splits: list[Split]) -> list[str]:
    """The schedule as lines for people: one per split, then its host actions."""
    lines = []
    for number, split in enumerate(splits, start=1):
        names = [unit for unit, _ in split.runs]
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ... {names[-1]} ({len(names)} runs)"
        wait = f" waits for {split.wait}'s weights;" if split.wait else ""
        lines.append(f"split {number:3d} on {split.side:6s}:{wait} {shown}")
        lines += [f"             then {action} {name}" for action, name in split.after]
    return lines


def _makes_attention_step_values(prologue: SubLayer, roles: Roles) -> bool:
    """Whether a prologue makes exactly GroupQueryAttention's step values (runtime/kv.py) from the step's inputs,
    besides the rotary tables bound whole."""
    made = {o.name for o in prologue.outputs} - roles.tables
    return made == {SEQLENS, TOTAL, PADDING_BIAS} and {i.name for i in prologue.inputs} <= set(STEP_INPUTS)
