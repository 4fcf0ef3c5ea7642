"""The one executor: each step runs its tier's plan over a Device, in the few verbs of a loop.

A plan places every unit: on the CPU (a CPU-EP session over the memory-mapped blob, its weights prepacked),
pinned (weights resident in device memory) or streamed (weights copied into a staging slot ahead of use by the
prefetcher). The all-CPU chain is the plan whose placements are all `cpu`, on `CpuDevice`.

A step, top to bottom (`Step.forward`): take the tier's plan; if it is not the active one, make device memory
match it (`runtime/residency.py`) and make its CPU sessions (`runtime/stages.py`); find or make the program for
the batch shape (`runtime/program.py`: the plan's splits from `runtime/splits.py`, each one native call into ONNX
Runtime, and the host actions between them); feed it the step's inputs and run it. Between splits the program
waits for a streamed unit's weights (`_wait_for_slot`), hands values on and copies what the other side reads,
releases the staging slot and starts the next copy, and runs a MoE layer's chosen experts (`runtime/experts.py`);
the prefetcher runs ahead across splits and steps.

Switching plans (another tier, or a new budget) releases what the new plan does not use before allocating what
it needs, so device memory never passes the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.formats.export_info import NUMPY_DTYPES
from pipeshard.formats.manifest import load_pack
from pipeshard.formats.plans import Placement, Plan, planning_units
from pipeshard.runtime import capi
from pipeshard.runtime.devices import CpuDevice, Device
from pipeshard.runtime.experts import ExpertRunner
from pipeshard.runtime.kv import HostKvCache, check_step_shape, chunk_end, image_rows, mrope_settings
from pipeshard.runtime.moe import ExpertStats
from pipeshard.runtime.plansource import PlanBook
from pipeshard.runtime.program import Parts, Program, read_tables
from pipeshard.runtime.residency import Residency, StepStats
from pipeshard.runtime.splits import Layout, describe, schedule
from pipeshard.runtime.stages import Sessions, Stage


@dataclass
class StepReport:
    """What a step has done so far, for people and tools (the CLI, the bench, a server's metrics)."""

    device: str
    budget_bytes: int
    peak_device_bytes: int
    plans: dict[int, str]  # tier -> strategy, for the tiers planned so far
    predicted_step_s: dict[int, float]
    placement_counts: dict[int, dict[str, int]]  # tier -> units pinned / streamed / on the CPU
    steps: int
    plan_switches: int
    streamed_weight_bytes: int
    streamed_kv_bytes: int
    kv_streamed: dict[int, int]  # tier -> streamed attentions whose KV streams with their weights
    copy_wait_s: float  # copy time not hidden behind compute: what steps waited for
    pinned_host_bytes: int  # host memory the device holds for streamed weights (besides the mapped blobs)

    def to_json(self) -> dict:
        return {
            **self.__dict__,
            "plans": {str(t): s for t, s in self.plans.items()},
            "kv_streamed": {str(t): n for t, n in self.kv_streamed.items()},
            "streamed_kv_bytes_per_step": self.streamed_kv_bytes / self.steps if self.steps else 0.0,
            "predicted_step_s": {str(t): s for t, s in self.predicted_step_s.items()},
            "placement_counts": {str(t): c for t, c in self.placement_counts.items()},
        }


class Step:
    """A ForwardStep over a model pack: every step runs its tier's plan on the device."""

    def __init__(
        self,
        folder: Path,
        device: Device | None = None,
        book: PlanBook | None = None,
        threads: int | None = None,
        optimize: bool = True,
        prepack: bool = True,
        verify: bool = False,
        all_logits: bool = False,
        join_decode: bool = True,
        decode_attention: bool = True,
        weight_matmul: bool = True,
        fp32_weight_matmul: bool = False,
    ) -> None:
        """Without a `book` every step runs the all-CPU plan; without a `device`, on `CpuDevice`. With
        `weight_matmul` (and the C extension) CPU sessions read half-precision weights as stored
        (runtime/weight_matmul.py); with `fp32_weight_matmul` too, float32 ones (no prepacked copies)."""
        self.pack = load_pack(folder, verify=verify)
        model = self.pack.model
        self.max_context = model.max_context
        self.hidden_size = model.hidden_size
        self.vocab_size = model.vocab_size
        self.kv_heads, self.head_dim = model.num_key_value_heads, model.head_dim
        self.dtype = NUMPY_DTYPES[model.compute_dtype]  # activations; weights may be half precision
        kv_dtype = NUMPY_DTYPES[model.kv_dtype]  # the fused attention's and its cache's
        self.device = device or CpuDevice()
        # The units the plans place: the plan source's (its row chunks of the output layer), else the pack's own.
        units = book.source.units if book and book.planned else planning_units(self.pack.sub_layers)
        self.book = book or PlanBook([u.name for u in units])
        self.layout = layout = Layout(self.pack.manifest, units)
        self.moe = layout.moe
        rt = capi.runtime(threads)
        self.sessions = Sessions(
            rt,
            self.pack,
            layout,
            self.device,
            threads,
            optimize,
            prepack,
            decode_attention=decode_attention and kv_dtype == np.float32 and self.head_dim % 8 == 0,
            weight_matmul=weight_matmul,
            fp32_weight_matmul=fp32_weight_matmul,
        )
        self.join_decode = join_decode
        self.expert_stats = ExpertStats(model.num_experts)
        self._all_logits = all_logits
        self.run_options = rt.run_options()
        self._stage_timer = None
        self.stats = StepStats()
        # The KV cache: host buffers for every attention (runtime/kv.py); the attentions that run on the device
        # keep theirs in device buffers of the same size (runtime/residency.py).
        self.kv = HostKvCache(
            [past for e in layout.in_line if e.kv for past in e.kv.past],
            self.kv_heads,
            self.head_dim,
            kv_dtype,
        )
        self.residency = Residency(self.device, layout, self.pack, self.kv, self.stats)
        vision = self.pack.manifest.vision
        self.image_token_id = vision.image_token_id if vision else None
        # Gemma 3: an image's tokens attend to their whole run, which must come in one step.
        self.whole_image_runs = bool(vision and vision.bidirectional_image_runs)
        # An M-RoPE decoder (3 position rows): what its positions are computed from.
        self.mrope = mrope_settings(model.position_rows, vision and vision.preprocessing)
        self._tables = read_tables(self.pack, layout)
        self._parts = Parts(
            layout=layout,
            sessions=self.sessions,
            residency=self.residency,
            kv=self.kv,
            device=self.device,
            rt=rt,
            device_memory=self.device.memory_info(rt),
            run_options=self.run_options,
            tables=self._tables,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            mrope=self.mrope is not None,
        )
        self._experts = ExpertRunner(self._parts, self.stats, self.expert_stats)
        self._program: Program | None = None  # of the active plan and the last batch shape
        self.splits = []  # the last program's
        if not self.book.planned:  # the chain makes its sessions with the pack, decode sessions too
            self._activate(self.book.plan_for(0))
            self.decode_runs()

    # -- what the step runs -----------------------------------------------------------------------------------------
    @property
    def active(self) -> Plan | None:
        """The plan device memory matches now."""
        return self.residency.active

    @property
    def tiers(self) -> list[int]:
        return self.book.tiers

    @tiers.setter
    def tiers(self, tiers) -> None:
        self.book.tiers = sorted(tiers)

    @property
    def plans(self) -> dict[int, Plan]:
        """The plans made (or read) so far, by tier."""
        return self.book.plans

    @property
    def decode_attention(self) -> bool:
        """Whether joined decode sessions on the CPU EP run pipeshard's decode attention op."""
        return self.sessions.decode_attention

    def explain(self) -> list[str]:
        """The active plan's splits, as `pipeshard plan --explain` prints them."""
        return describe(self.splits)

    def set_budget(self, budget_bytes: int) -> None:
        """Replan for a new VRAM budget; the sequences in flight keep their KV (moved as needed). A budget below
        the minimum is refused before anything changes."""
        self.book.set_budget(budget_bytes)
        self._deactivate()
        self.device.set_budget(budget_bytes)

    def report(self) -> StepReport:
        plans = self.book.plans
        return StepReport(
            device=self.device.kind,
            budget_bytes=self.book.budget_bytes,
            peak_device_bytes=self.device.ledger.peak,
            plans={tier: plan.strategy for tier, plan in sorted(plans.items())},
            predicted_step_s={tier: plan.step_s for tier, plan in sorted(plans.items())},
            placement_counts={tier: plan.counts() for tier, plan in sorted(plans.items())},
            steps=self.stats.steps,
            plan_switches=self.stats.plan_switches,
            streamed_weight_bytes=self.stats.streamed_bytes,
            streamed_kv_bytes=self.stats.streamed_kv_bytes,
            kv_streamed={tier: len(plan.kv_streamed) for tier, plan in sorted(plans.items())},
            copy_wait_s=self.stats.copy_wait_s,
            pinned_host_bytes=self.device.host_bytes,
        )

    @property
    def stage_timer(self):
        """None, or a callable(sub-layer name, seconds) called after every run (each run then made from Python)."""
        return self._stage_timer

    @stage_timer.setter
    def stage_timer(self, timer) -> None:
        self._stage_timer = timer
        self._program = None  # remade at the next step

    @property
    def all_logits(self) -> bool:
        return self._all_logits

    @all_logits.setter
    def all_logits(self, value: bool) -> None:
        self._all_logits = value
        self._program = None

    def decode_runs(self) -> list[list[str]]:
        """The session runs of a one-token step under the active plan, per split (made now if not yet)."""
        plan = self.active or self.book.plan_for(self.book.tier_for(1))
        return [
            [stage.name for stage in self.sessions.split_stages(split, self.join_decode)]
            for split in schedule(self.layout, plan, 1)
        ]

    def sub_layer_stages(self) -> list[Stage]:
        """Every in-line sub-layer's CPU stage, in order (made now if not yet)."""
        return [self.sessions.cpu_stage(entry.name) for entry in self.layout.in_line]

    def release_device_memory(self) -> None:
        """Give back every byte the active plan holds on the device, between steps (a VLM's image encoder runs in
        it); the next step activates its plan again."""
        self._deactivate()

    # -- the step ---------------------------------------------------------------------------------------------------
    def start(self, batch_size: int, context: int | None = None) -> None:
        """New sequences. A device's KV is sized by the planner's context and batch: a larger batch or a longer
        generation is replanned first, so the budget also holds for what is really stored."""
        if self.book.needs_replan(batch_size, context or 0):
            self._deactivate()
        for stage in self.sessions.every_stage():
            stage.binding.clear()  # lets the old buffers go before the new ones are made; rebound at the next step
        self._program = None  # a decode step's values span the KV capacity: remade with the buffers
        self.residency.start_sequences(batch_size, self.book.context or context)

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        slot: int | None = None,
        last_positions: np.ndarray | None = None,
        image_features: np.ndarray | None = None,
    ) -> np.ndarray:
        """One step. `slot`: the KV cache's row of the step's first sequence (requests joining a running batch,
        `runtime/scheduler.py`); without it a step of fewer sequences than the cache has rows runs on its first
        rows. Rows may have lengths of their own (each row's mask ends at its last token; `last_positions`: the
        position whose logits each row's prompt step returns, by default the last). `image_features`: a VLM's
        rows for the step's image tokens, in reading order."""
        batch, tokens = input_ids.shape
        total = attention_mask.shape[1]
        check_step_shape(batch, tokens, total)
        first = slot or 0
        if not 0 <= first or first + batch > self.kv.batch:
            raise ValueError(
                f"a step of {batch} sequences from row {first} on a cache of {self.kv.batch} rows "
                "(start() sizes it)"
            )
        rows = (first, batch) if slot is not None or batch < self.kv.batch else None
        if total > self.kv.capacity:
            self._grow_kv(batch, total)
        largest = self.book.largest_tier
        if largest is not None and batch == 1 and tokens > largest:
            # A prompt longer than the largest tier: chunks of it (bounds activation memory too). A batch's
            # prompts go in one step: GQA on the CPU takes several new tokens after a past only for batch 1.
            past = total - tokens
            run_token = self.image_token_id if self.whole_image_runs else None
            bounds = [0]
            while bounds[-1] < tokens:
                bounds.append(chunk_end(input_ids[0], bounds[-1], largest, run_token))
            pieces = [
                np.array(
                    self.forward(
                        input_ids[:, begin:end],
                        attention_mask[:, : past + end],
                        position_ids[..., begin:end],
                        slot,
                        image_features=image_rows(
                            input_ids[0], begin, end, self.image_token_id, image_features
                        ),
                    )
                )
                for begin, end in zip(bounds[:-1], bounds[1:], strict=True)
            ]
            return np.concatenate(pieces, axis=1)
        tier = self.book.tier_for(batch * tokens)
        plan = self.book.plan_for(tier)
        if not self.pack.model.device_attention_masks_padding and not attention_mask.all():
            self._refuse_padding_on_device(plan)
        if plan is not self.residency.active:
            self._activate(plan)
        program = self._program
        if program is None or program.shape != (batch, tokens) or program.rows != rows:
            program = self._make_program((batch, tokens), rows)
        self.stats.steps += 1
        self.stats.tiers_used[tier] = self.stats.tiers_used.get(tier, 0) + 1
        program.feed(input_ids, attention_mask, position_ids, last_positions, image_features)
        try:
            # The loop touches as little as it can: after each run's weights streamed through the caches, every
            # object it reads is a cache miss.
            for operation in program.operations:
                operation()
        except BaseException:
            # Interrupted mid-step (Ctrl-C) or failed: the ring and the KV are in an unknown state. Release the
            # device; the next generation starts clean (start() resets the KV).
            self._deactivate()
            raise
        if self.moe:
            self.expert_stats.end_step(batch * tokens)
        return program.logits

    def _refuse_padding_on_device(self, plan: Plan) -> None:
        """A step with padding, and an attention the plan puts on the device, whose graph takes no padding mask
        (float16 attention: ModelFacts.device_attention_masks_padding)."""
        on_device = [
            e.name
            for e in self.layout.in_line
            if e.kv and plan.placements.get(e.name, Placement.CPU) != Placement.CPU
        ]
        if on_device:
            raise UserError(
                f"a batch of sequences of different lengths with {on_device[0]} on the device: float16 attention "
                "on a device takes no padding mask (ONNX Runtime's CUDA GroupQueryAttention refuses an attention "
                "bias); run the sequences one at a time, or plan with attention on the CPU"
            )

    def read_kv(self, row: int, begin: int, end: int) -> np.ndarray:
        """Columns [begin, end) of KV row `row` of every attention, between steps (a prompt's prefix to keep)."""
        return self.residency.read_kv(row, begin, end)

    def write_kv(self, row: int, begin: int, pieces: list[np.ndarray]) -> None:
        """Pieces of `read_kv`'s shape, one after another, into KV row `row` from column `begin` on, between steps
        (a kept prefix reused)."""
        self.residency.write_kv(row, begin, pieces)

    def _grow_kv(self, batch: int, total: int) -> None:
        """Longer than start() was told: the KV comes home, grows, and plans are made for the new context."""
        self._deactivate()
        self.kv.ensure(total)
        self.book.needs_replan(batch, self.kv.capacity)

    def _activate(self, plan: Plan) -> None:
        """Make device memory match `plan` (release first, then allocate and upload) and make its CPU sessions."""
        self._program = None
        self.residency.activate(plan)
        self.sessions.activate(plan)
        self.stats.plan_switches += 1

    def _deactivate(self) -> None:
        """Release everything on the device; the KV comes back to the host."""
        self.residency.deactivate()
        self._program = None

    def _make_program(self, shape: tuple[int, int], rows: tuple[int, int] | None) -> Program:
        """The active plan's program for a batch shape (and KV rows)."""
        self._program = None  # not the old one (its device buffers are freed) should this one fail
        self._program = Program(
            self._parts,
            self.residency.active,
            shape,
            rows,
            all_logits=self.all_logits,
            # A timed step runs every sub-layer's own session, so that each is timed apart.
            join=shape[1] == 1 and self.join_decode and self._stage_timer is None,
            stage_timer=self._stage_timer,
            wait_for_slot=self._wait_for_slot,
            run_experts=self._experts.run,
        )
        self.splits = self._program.splits
        return self._program

    def _wait_for_slot(self, stage: Stage, unit: str) -> None:
        """Before a streamed unit's split: wait for the staging slot holding its weights, then bind them."""
        self._program.bind_slot(stage, unit, self.residency.wait_for_slot(unit))

    # What tests reach for (tests/test_moe.py).
    @property
    def _expert_slots(self) -> list:
        return self.residency.expert_slots

    def _cpu_stage(self, name: str) -> Stage:
        return self.sessions.cpu_stage(name)

    def close(self) -> None:
        self._deactivate()
        self.device.close()
