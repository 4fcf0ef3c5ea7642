"""Where each unit's weights and each attention's KV are while a plan is active, in device memory charged to the
device's ledger.

`activate(plan)` makes device memory match a plan: it releases what the plan does not use before it allocates
what it needs (so device memory never passes the budget), uploads the pinned units once, moves the KV of
attentions that changed sides, and starts the prefetch. Streamed units then pass through the staging ring on
their own: `wait_for_slot` before a streamed unit runs, `release_slot` after, which starts the copy of the
streamed unit `slots` places ahead (the g-th streamed use overall takes slot g mod slots, across steps). Where a
plan streams the KV of its streamed attentions (long contexts: `plan.kv_streamed`), the host buffers are the
master: beside each staging slot a KV slot takes the KV of the unit in it, uploaded with its weights, and the rows
a step wrote are downloaded after it ran.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from pipeshard.formats.manifest import Pack
from pipeshard.formats.plans import EXPERT_SLOTS, Placement, Plan
from pipeshard.runtime.devices import Device, drop_mapped_range
from pipeshard.runtime.kv import HostKvCache
from pipeshard.runtime.splits import Layout


@dataclass
class StepStats:
    """What the runtime did, for benchmarks and tests: the step counts steps and plan switches, the residency
    (and the experts) what was copied and how long a step waited for it."""

    steps: int = 0
    plan_switches: int = 0
    streamed_bytes: int = 0
    streamed_kv_bytes: int = 0  # streamed attentions' KV uploaded with their weights, new rows downloaded
    copy_wait_s: float = 0.0
    tiers_used: dict[int, int] = field(default_factory=dict)


class Residency:
    """The device memory of the active plan: pinned units' buffers, the staging ring and its KV slots, the KV of
    the attentions on the device, MoE expert slots, the device's residual buffers, and what the device reserves
    (workspace, execution provider overhead)."""

    def __init__(self, device: Device, layout: Layout, pack: Pack, kv: HostKvCache, stats: StepStats) -> None:
        self.device, self.layout, self.pack, self.kv, self.stats = device, layout, pack, kv, stats
        self.active: Plan | None = None
        self.pinned: dict[str, object] = {}
        # The staging ring: its slots, the unit each holds and its copy; the streamed units in order of use.
        self.ring: list = []
        self.slot_unit: list[str | None] = []
        self.slot_copy: list[Future | None] = []
        self.streamed: list[str] = []
        self.ring_position = 0
        self.expert_slots: list = []
        self.activations: list = []  # the device's two residual buffers, out of the plan's workspace
        self._reserved: dict[str, int] = {}
        self._sources: dict[str, object] = {}  # streamed unit -> the host bytes it is uploaded from
        self._blobs: dict[str, np.memmap] = {}
        # The KV of attentions the device runs: in device buffers of the host buffers' size, or streamed.
        self.kv_device: dict[str, object] = {}
        self.kv_on_device: set[str] = set()
        self.kv_owner = {past: e.name for e in layout.in_line if e.kv for past in e.kv.past}
        self.kv_streamed: frozenset[str] = frozenset()
        self.kv_slots: list[list] = []
        self.slot_kv_copy: list[list] = []
        # What the step writes of a streamed KV: (first row, rows, new tokens, each row's first written column).
        self.kv_writes: tuple[int, int, int, np.ndarray] | None = None

    # -- where a unit's bytes are on the host ----------------------------------------------------------------------
    def blob(self, file: str) -> np.memmap:
        if file not in self._blobs:
            self._blobs[file] = np.memmap(self.pack.path(file), np.uint8, mode="r")
        return self._blobs[file]

    def unit_bytes(self, name: str) -> tuple[str, int, int]:
        """Where a unit's device bytes are stored: (blob file, offset, size); a row chunk's are its rows of W."""
        unit = self.layout.units[name]
        if unit.chunk is None:
            return unit.blob.file, 0, unit.blob.bytes
        chunks = unit.row_chunks
        weight = next(w for w in unit.weights if w.name == chunks.weight)
        start, stop = (
            weight.offset + row * chunks.row_bytes for row in (unit.chunk.first_row, unit.chunk.end_row)
        )
        return weight.file, start, stop - start

    def mapped_bytes(self, name: str) -> np.ndarray:
        file, offset, nbytes = self.unit_bytes(name)
        return self.blob(file)[offset : offset + nbytes]

    def source(self, name: str):
        """The host bytes a streamed unit is uploaded from, as the device keeps them (made once)."""
        if name not in self._sources:
            file, offset, nbytes = self.unit_bytes(name)
            self._sources[name] = self.device.host_source(self.pack.path(file), offset, nbytes)
        return self._sources[name]

    # -- a plan's device memory ------------------------------------------------------------------------------------
    def activate(self, plan: Plan) -> None:
        """Make device memory match `plan`: release first, then allocate and upload, then start the prefetch."""
        self.drain()
        self.free_activations()
        placements, units = plan.placements, self.layout.units
        expert_names = self.layout.expert_names
        for name in [n for n in self.pinned if placements.get(n) != Placement.PINNED]:
            self.device.free(self.pinned.pop(name), "pinned")
        streamed = [n for n in units if placements[n] == Placement.STREAMED and n not in expert_names]
        streamed_experts = [n for n in units if placements[n] == Placement.STREAMED and n in expert_names]
        expert_slot_bytes = max((self.unit_bytes(n)[2] for n in streamed_experts), default=0)
        if not streamed_experts or (self.expert_slots and self.expert_slots[0].nbytes != expert_slot_bytes):
            self._free_expert_slots()
        slot_bytes = max((self.unit_bytes(n)[2] for n in streamed), default=0)
        slots = min(plan.slots, len(streamed)) if streamed else 0
        self._free_kv_slots()
        if len(self.ring) != slots or (self.ring and self.ring[0].nbytes != slot_bytes):
            self._free_ring()
        self.kv_streamed = frozenset(plan.kv_streamed)
        wanted_attn = {
            e.name
            for e in self.layout.in_line
            if e.kind == "attn" and placements[e.name] != Placement.CPU and e.name not in self.kv_streamed
        }
        for attn in self.kv_on_device - wanted_attn:
            self._move_kv(attn, to_device=False)
        self._reserve("workspace", plan.vram.workspace)
        self._reserve("ep_overhead+reserve", plan.vram.ep_overhead + plan.vram.reserve)
        for attn in wanted_attn - self.kv_on_device:
            self._move_kv(attn, to_device=True)
        for name in units:
            if placements[name] == Placement.PINNED and name not in self.pinned:
                source = self.mapped_bytes(name)
                buffer = self.device.alloc(source.nbytes, "pinned")
                self.device.upload_now(buffer, source)
                file, offset, nbytes = self.unit_bytes(name)
                drop_mapped_range(self.blob(file), offset, nbytes)  # held once: on the device
                self.pinned[name] = buffer
        if not self.ring and slots:
            self.ring = [self.device.alloc(slot_bytes, "staging") for _ in range(slots)]
        self._alloc_kv_slots()
        if streamed_experts and not self.expert_slots:
            self.expert_slots = [
                self.device.alloc(expert_slot_bytes, "expert staging") for _ in range(EXPERT_SLOTS)
            ]
        self.streamed = streamed
        self.slot_unit = [None] * len(self.ring)
        self.slot_copy = [None] * len(self.ring)
        self.ring_position = 0
        if plan.prefetch:
            for slot in range(len(self.ring)):
                self.start_copy(slot, streamed[slot])
        self.active = plan

    def deactivate(self) -> None:
        """Release everything on the device; the KV comes back to the host."""
        self.drain()
        for buffer in self.pinned.values():
            self.device.free(buffer, "pinned")
        self.pinned.clear()
        self._free_ring()
        self._free_kv_slots()
        self._free_expert_slots()
        self.free_activations()
        for attn in list(self.kv_on_device):
            self._move_kv(attn, to_device=False)
        for purpose in list(self._reserved):
            self._reserve(purpose, 0)
        self.kv_streamed = frozenset()  # the host buffers hold every attention's KV now
        self.active = None

    def start_sequences(self, batch: int, capacity: int | None) -> None:
        """New sequences: the KV buffers are made anew, host and device (the old ones let go first)."""
        self.drain()
        for buffer in self.kv_device.values():
            self.device.free(buffer, "kv")
        self.kv_device.clear()
        self._free_kv_slots()
        self.kv.reset(batch, capacity)
        for attn in self.kv_on_device:
            for past in self.layout.entries[attn].kv.past:
                self.kv_device[past] = self._device_kv_buffer(self.kv.buffers[past])
        self._alloc_kv_slots()  # the KV slots of the units already in the ring take the new sequences' KV
        for slot, unit in enumerate(self.slot_unit if self.kv_slots else ()):
            if unit in self.kv_streamed:
                self._upload_kv(slot, unit)

    def alloc_activations(self, workspace: int, activation_bytes: int) -> list:
        """The device's two residual buffers of a batch shape, out of the plan's activation workspace."""
        self._reserve("workspace", workspace - activation_bytes)
        self.activations = [self.device.alloc(activation_bytes // 2, "activations") for _ in range(2)]
        return self.activations

    def free_activations(self) -> None:
        for buffer in self.activations:
            self.device.free(buffer, "activations")
        self.activations = []

    def drain(self) -> None:
        """Wait for every copy in flight."""
        for copy in [*self.slot_copy, *(c for copies in self.slot_kv_copy for c in copies)]:
            if copy is not None:
                copy.result()

    def _reserve(self, purpose: str, nbytes: int) -> None:
        old = self._reserved.pop(purpose, 0)
        if old:
            self.device.unreserve(old, purpose)
        if nbytes:
            self.device.reserve(nbytes, purpose)
            self._reserved[purpose] = nbytes

    def _free_ring(self) -> None:
        for buffer in self.ring:
            self.device.free(buffer, "staging")
        self.ring, self.slot_unit, self.slot_copy = [], [], []

    def _free_expert_slots(self) -> None:
        for buffer in self.expert_slots:
            self.device.free(buffer, "expert staging")
        self.expert_slots = []

    # -- the staging ring ------------------------------------------------------------------------------------------
    def start_copy(self, slot: int, name: str) -> None:
        if self.slot_unit[slot] == name:
            return  # already there (as many slots as streamed units)
        self.slot_unit[slot] = name
        source = self.source(name)
        self.slot_copy[slot] = self.device.upload(self.ring[slot], source)
        self.stats.streamed_bytes += source.nbytes
        if name in self.kv_streamed:
            self._upload_kv(slot, name)

    def wait_for_slot(self, unit: str) -> int:
        """The staging slot holding `unit`'s weights (and KV), once its copy has landed."""
        slot = self.ring_position % len(self.ring)
        if not self.active.prefetch:
            self.start_copy(slot, unit)
        if self.slot_unit[slot] != unit:
            raise RuntimeError(
                f"staging slot {slot} holds {self.slot_unit[slot]}, not {unit}: the ring is out of "
                "step with the schedule"
            )
        waited = time.perf_counter()
        self.slot_copy[slot].result()
        for copy in self.slot_kv_copy[slot] if unit in self.kv_streamed else ():
            copy.result()
        self.stats.copy_wait_s += time.perf_counter() - waited
        return slot

    def release_slot(self) -> None:
        """The slot's user has run: refill it with the streamed unit `slots` places ahead."""
        slot = self.ring_position % len(self.ring)
        self.device.released_after_compute(self.ring[slot])
        if self.slot_unit[slot] in self.kv_streamed:
            self._download_new_kv(slot, self.slot_unit[slot])
        if self.active.prefetch:
            following = (self.ring_position + len(self.ring)) % len(self.streamed)
            self.start_copy(slot, self.streamed[following])
        self.ring_position += 1

    # -- KV on the device ------------------------------------------------------------------------------------------
    def _move_kv(self, attn: str, to_device: bool) -> None:
        """Move an attention's KV buffers between host and device (a plan change moved the attention)."""
        for past in self.layout.entries[attn].kv.past:
            host = self.kv.buffers.get(past)
            if to_device:
                self.kv_device[past] = self._device_kv_buffer(host)
            else:
                buffer = self.kv_device.pop(past)
                if host is not None:
                    self.device.copy_out(host, buffer)
                self.device.free(buffer, "kv")
        (self.kv_on_device.add if to_device else self.kv_on_device.discard)(attn)

    def read_kv(self, row: int, begin: int, end: int) -> np.ndarray:
        """Columns [begin, end) of a KV row of every attention, [pasts, kv heads, end - begin, head dim] (a copy),
        from where each one's master is: a device buffer, or the host buffer (the CPU's and streamed attentions')."""
        for past, buffer in self.kv_device.items():
            self.device.copy_out_rows(self.kv.buffers[past], buffer, *self._kv_region(row, begin, end))
        return np.stack([self.kv.buffers[past][row, :, begin:end] for past in self.kv.past_names])

    def write_kv(self, row: int, begin: int, pieces: list[np.ndarray]) -> None:
        """Pieces shaped as `read_kv`'s, one after another, into a KV row from column `begin` on, wherever each
        attention's master is; the KV of streamed attentions already uploaded beside their weights is uploaded
        again."""
        end = begin
        for piece in pieces:
            for past, value in zip(self.kv.past_names, piece, strict=True):
                self.kv.buffers[past][row, :, end : end + piece.shape[2]] = value
            end += piece.shape[2]
        for past, buffer in self.kv_device.items():
            self.device.copy_in_rows(buffer, self.kv.buffers[past], *self._kv_region(row, begin, end))
        if self.kv_slots:
            self.drain()
            for slot, unit in enumerate(self.slot_unit):
                if unit in self.kv_streamed:
                    self._upload_kv(slot, unit)

    def _kv_region(self, row: int, begin: int, end: int) -> tuple[int, int, int, int]:
        """Columns [begin, end) of a KV row as byte runs of a buffer: offset, runs (one per head), width, pitch."""
        _, heads, capacity, head_dim = self.kv.shape
        element = self.kv.dtype.itemsize
        offset = ((row * heads) * capacity + begin) * head_dim * element
        return offset, heads, (end - begin) * head_dim * element, capacity * head_dim * element

    def _device_kv_buffer(self, host: np.ndarray | None):
        nbytes = host.nbytes if host is not None else 0
        buffer = self.device.alloc(nbytes, "kv")
        if nbytes:
            self.device.copy_in(buffer, host)
        return buffer

    def _alloc_kv_slots(self) -> None:
        """One KV slot beside each staging slot when the plan streams KV, sized like the host buffers."""
        if not self.kv_streamed or not self.ring:
            return
        pasts = max(len(self.layout.entries[attn].kv.past) for attn in self.kv_streamed)
        nbytes = int(np.prod(self.kv.shape)) * self.kv.dtype.itemsize
        self.kv_slots = [[self.device.alloc(nbytes, "kv staging") for _ in range(pasts)] for _ in self.ring]
        self.slot_kv_copy = [[] for _ in self.ring]

    def _free_kv_slots(self) -> None:
        for buffers in self.kv_slots:
            for buffer in buffers:
                self.device.free(buffer, "kv staging")
        self.kv_slots, self.slot_kv_copy = [], []

    def _upload_kv(self, slot: int, attn: str) -> None:
        """An attention's KV from the host buffers into the KV slot beside staging slot `slot`."""
        pasts = self.layout.entries[attn].kv.past
        self.slot_kv_copy[slot] = [
            self.device.upload_array(self.kv_slots[slot][index], self.kv.buffers[past])
            for index, past in enumerate(pasts)
        ]
        self.stats.streamed_kv_bytes += sum(self.kv.buffers[past].nbytes for past in pasts)

    def _download_new_kv(self, slot: int, attn: str) -> None:
        """The KV rows the step wrote into the KV slot, back into the host buffers (the master)."""
        first, count, tokens, write_columns = self.kv_writes
        _, heads, capacity, head_dim = self.kv.shape
        element = self.kv.dtype.itemsize
        width = tokens * head_dim * element
        pasts = self.layout.entries[attn].kv.past
        for index, past in enumerate(pasts):
            for row, column in enumerate(write_columns):
                offset = (((first + row) * heads) * capacity + int(column)) * head_dim * element
                self.device.copy_out_rows(
                    self.kv.buffers[past],
                    self.kv_slots[slot][index],
                    offset,
                    heads,
                    width,
                    capacity * head_dim * element,
                )
            self.device.released_after_compute(self.kv_slots[slot][index])
        self.stats.streamed_kv_bytes += count * heads * width * len(pasts)
