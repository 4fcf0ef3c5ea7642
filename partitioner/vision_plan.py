"""Placing a VLM's vision blocks: per block pinned, streamed or on the CPU, for images of one patch count (the tier).

The estimator prices each block on the CPU and on the device at the run's patch count and each copy over the
link; `encode_seconds` plays an encode as the runtime runs it (runtime/vision.py): passes of tiles over the blocks
in order, each device block waiting for its weights, the copies in one queue in the order the blocks need them
(pinned blocks once per encode, streamed ones every pass, each into the slot the streamed block two before it
freed). `VisionPlanner.plan` returns the fastest placement found within the budget, starting from VLMOpt's all-streamed,
the all-CPU encoder and the CPU prefixes before streamed blocks, improved one block at a time. Every byte is the
encoder's alone: the decoder's memory is released before it runs (VLMOpt's rule), so the budget is all its.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeshard.formats.manifest import SubLayer, VisionSection
from pipeshard.formats.vision_memory import (
    CPU,
    PIN,
    STREAM,
    VisionPlan,
    VisionShape,
    copy_ready,
    copy_sequence,
    lay_out_plan,
)
from pipeshard.partitioner.estimator import Estimator

POLICIES = ("auto", "streamed", "cpu")  # the planner's choice, VLMOpt's, the CPU encoder


@dataclass(frozen=True)
class EncodeSize:
    """The tier: what one encode runs through the blocks."""

    tiles: int  # idefics3: tiles (global view included); qwen2_vl: images
    patches: int
    keys: int  # the patches of the widest group that attends together


class VisionPlanner:
    """Vision plans for one pack and profile: priced per block and run size once, searched per tier and budget."""

    def __init__(self, vision: VisionSection, estimator: Estimator) -> None:
        self.vision = vision
        self.entries = vision.sub_layers
        self.estimator = estimator
        self.shape = VisionShape.from_pack(vision)
        self.full_attention = set(vision.fullatt_block_indexes)
        self.device_is_sim = estimator.profile.device.kind == "sim"
        self._seconds: dict[tuple, float] = {}
        self._plans: dict[tuple, VisionPlan | None] = {}
        self._itemsize = self.shape.itemsize

    def _context(self, entry: SubLayer, size: EncodeSize) -> int:
        """The patches each of `entry`'s queries attends to: a Qwen2.5-VL window's in its windowed blocks."""
        if self.shape.family == "qwen2_vl" and entry.layer not in self.full_attention:
            return min(self.shape.window_patches**2, size.keys)
        return size.keys

    def block_seconds(
        self, index: int, tokens: int, size: EncodeSize, on_device: bool, under_copy: bool
    ) -> float:
        key = (index, tokens, size.keys, on_device, under_copy)
        if key not in self._seconds:
            entry = self.entries[index]
            self._seconds[key] = self.estimator.vision_seconds(
                entry, tokens, self._context(entry, size), on_device, under_copy
            )
        return self._seconds[key]

    def _compute_seconds(
        self, index: int, tokens: int, size: EncodeSize, on_device: bool, copying_s: float
    ) -> float:
        """A block's seconds while copies run for `copying_s` more: the share of its work done beside them at the
        rate under copy load (a CPU's, and the simulated device's, which computes on the same cores)."""
        idle = self.block_seconds(index, tokens, size, on_device, False)
        if copying_s <= 0 or (on_device and not self.device_is_sim):
            return idle
        loaded = self.block_seconds(index, tokens, size, on_device, True)
        if copying_s >= loaded:
            return loaded
        return copying_s + idle * (1 - copying_s / loaded)

    def _crossing_seconds(self, tokens: int) -> float:
        """A device block's activations in and out over the link (the runtime reads every block's output back to
        the host); nothing on the simulated device, whose memory is the host's."""
        if self.device_is_sim:
            return 0.0
        return 2 * self.estimator.link_seconds(tokens * self.shape.hidden_size * self._itemsize)

    def pass_tokens(self, plan: VisionPlan, size: EncodeSize) -> list[int]:
        """Patches through the blocks in each pass."""
        per_tile = size.patches // max(size.tiles, 1)
        return (
            [
                min(plan.tiles_per_run, size.tiles - first) * per_tile
                for first in range(0, max(size.tiles, 1), plan.tiles_per_run)
            ]
            if self.shape.family != "qwen2_vl"
            else [size.patches]
        )

    def encode_seconds(self, plan: VisionPlan, size: EncodeSize) -> float:
        """The encode played as the runtime runs it: compute in block order, copies in one queue."""
        entries, placements = self.entries, plan.placements
        passes = self.pass_tokens(plan, size)
        sequence = copy_sequence(entries, placements, len(passes))
        waits = copy_ready(sequence, placements, entries)
        position_of = {copy: position for position, copy in enumerate(sequence)}
        first_copy = {index: position for position, (run, index) in enumerate(sequence) if run == 0}
        copy_end: list[float] = []
        computed: dict[int, float] = {}  # copy position -> when its block's compute ended
        copy_free = now = 0.0

        def issue_through(position: int) -> None:
            nonlocal copy_free
            while len(copy_end) <= position:
                at = len(copy_end)
                ready = computed[waits[at]] if waits[at] is not None else 0.0
                start = max(copy_free, ready)
                nbytes = entries[sequence[at][1]].blob.bytes
                copy_free = start + self.estimator.copy_seconds(nbytes, under_cpu_load=True, tokens=passes[0])
                copy_end.append(copy_free)

        for run, tokens in enumerate(passes):
            for index, entry in enumerate(entries):
                placement = placements[entry.name]
                on_device = placement != CPU
                position = None
                if on_device and entry.blob:
                    position = position_of.get((run, index), first_copy.get(index))
                    issue_through(position)
                    now = max(now, copy_end[position])
                # Copies still running beside this block slow a CPU's compute (the simulated device's too).
                now += self._compute_seconds(index, tokens, size, on_device, copy_free - now)
                if on_device:
                    now += self._crossing_seconds(tokens)
                if position is not None:
                    computed[position] = now
                    # What the runtime issues once this block is done: every copy up to the next one it can.
                    while len(copy_end) < len(sequence) and (
                        waits[len(copy_end)] is None or waits[len(copy_end)] in computed
                    ):
                        issue_through(len(copy_end))
        return now

    def lay_out(self, placements: dict[str, str], size: EncodeSize, budget_bytes: int, policy: str):
        plan = lay_out_plan(
            self.vision, placements, size.tiles, size.patches, size.keys, budget_bytes, policy, self.shape
        )
        return None if plan is None else replace(plan, predicted_s=self.encode_seconds(plan, size))

    def plan(self, size: EncodeSize, budget_bytes: int, policy: str = "auto") -> VisionPlan | None:
        """The plan of `policy` for `size` within `budget_bytes` (None: it does not fit), made once per key."""
        key = (size, budget_bytes, policy)
        if key not in self._plans:
            names = [e.name for e in self.entries]
            if policy == "cpu":
                self._plans[key] = self.lay_out(dict.fromkeys(names, CPU), size, budget_bytes, policy)
            elif policy == "streamed":
                self._plans[key] = self.lay_out(dict.fromkeys(names, STREAM), size, budget_bytes, policy)
            else:
                self._plans[key] = self._search(size, budget_bytes)
        return self._plans[key]

    def _search(self, size: EncodeSize, budget_bytes: int) -> VisionPlan:
        """The fastest placement found: the best of the seeds, then the best single-block change while one helps."""
        names = [e.name for e in self.entries]
        seeds = [dict.fromkeys(names, CPU), dict.fromkeys(names, STREAM), dict.fromkeys(names, PIN)]
        seeds += [{n: CPU if i < k else STREAM for i, n in enumerate(names)} for k in range(1, len(names))]
        candidates = [p for p in (self.lay_out(s, size, budget_bytes, "auto") for s in seeds) if p]
        best = min(candidates, key=lambda p: p.predicted_s)
        choices = {e.name: (CPU, STREAM, PIN) if e.blob else (CPU, STREAM) for e in self.entries}
        for _ in range(2 * len(names)):
            moves = [
                self.lay_out({**best.placements, name: choice}, size, budget_bytes, "auto")
                for name in names
                for choice in choices[name]
                if choice != best.placements[name]
            ]
            better = min((m for m in moves if m), key=lambda p: p.predicted_s, default=None)
            if better is None or better.predicted_s >= best.predicted_s * (1 - 1e-6):
                break
            best = better
        return best

    def mixed(self, size: EncodeSize, budget_bytes: int) -> VisionPlan | None:
        """Pinned, streamed and CPU blocks in turns, the last pinned ones streamed instead until it fits: every
        placement at once, for checking the estimator and the runtime against each other (None: nothing fits)."""
        kinds = (PIN, STREAM, CPU)
        placements = {e.name: kinds[i % 3] if e.blob else CPU for i, e in enumerate(self.entries)}
        pinned = [name for name, placement in placements.items() if placement == PIN]
        while (plan := self.lay_out(placements, size, budget_bytes, "mixed")) is None and pinned:
            placements[pinned.pop()] = STREAM
        return plan
