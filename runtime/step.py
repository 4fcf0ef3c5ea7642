"""The one executor: each step runs its tier's plan as splits (`runtime/schedule.py`) over a Device.

A plan places every unit: on the CPU (a CPU-EP session over the memory-mapped blob, its weights prepacked),
pinned (weights resident in device memory) or streamed (weights copied into a staging slot ahead of use by the
prefetcher). The all-CPU chain is the plan whose placements are all `cpu`, on `CpuDevice`.

Per plan and batch shape the step builds a program once: the schedule's splits, each one native call into
ONNX Runtime (`capi.Block`), and between them the host actions, as callables. A step is then, top to bottom:
wait for a split's streamed weights (sync), run it (compute), hand its values on and copy what the other side
reads (store), release its staging slot and start the next copy (load next); the prefetcher runs ahead across
splits and steps.

What makes the CPU part fast, for every plan alike. Boundary tensors move through IO binding: the residual stream
lives in two preallocated buffers per side and batch shape (each residual tensor always in the same one, so
bindings stay valid from step to step); each attention's KV cache is one buffer bound as its past and present
(appended in place); the rotary tables the manifest marks as row prefixes of a stored weight are bound whole;
the token inputs are buffers of the step. At one new token the prologue does not run (its values are kept by
the step: runtime/kv.py), and each stretch of CPU sub-layers of a split is joined into one session
(`runtime/joined.py`, up to 64 MiB of weights each) whose attention runs pipeshard's decode op
(`runtime/decode_attention.py`). Every binding a step must redo is made in a burst right after the run that
produced its value: between two runs the caches hold the last sub-layer's weights, so each call into ONNX
Runtime's binding code made there would start cold. Sessions are made through ONNX Runtime's C API
(`runtime/capi.py`), device sessions included.

Switching plans (another tier, or a new budget) releases what the new plan does not use before allocating what
it needs, so device memory never passes the budget.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from pipeshard.formats.export_info import NUMPY_DTYPES, numpy_dtype
from pipeshard.formats.io_names import IMAGE_FEATURES, MROPE_ROWS, PADDING_BIAS, SEQLENS, TOTAL
from pipeshard.formats.manifest import MoeBlock, Pack, SubLayer, load_pack
from pipeshard.formats.plans import (
    EXPERT_RUN_ORDER,
    EXPERT_SLOTS,
    HOST_ONLY_KINDS,
    Placement,
    Plan,
    planning_units,
)
from pipeshard.runtime import capi
from pipeshard.runtime.devices import CpuDevice, Device, drop_mapped_range
from pipeshard.runtime.joined import JoinedGraph, join
from pipeshard.runtime.kv import HostKvCache, check_step_shape, image_rows, mrope_settings
from pipeshard.runtime.mapped_weights import MappedWeights
from pipeshard.runtime.moe import ExpertStats, chosen_experts, combine
from pipeshard.runtime.plansource import PlanBook
from pipeshard.runtime.schedule import (
    DEVICE,
    LOGITS,
    STEP_INPUTS,
    TOKEN_INPUTS,
    Layout,
    Roles,
    Split,
    describe,
    schedule,
)
from pipeshard.runtime.weight_matmul import product_weights

# The most weight bytes one joined decode session takes: making it pages all of them in from the blobs at once
# (ONNX Runtime packs every weight before the pages can be let go), so this bounds what joining adds to the load
# peak (docs/plans.md).
JOINED_WEIGHT_BYTES = 64 * 2**20
_NO_ROLES = Roles(frozenset(), frozenset(), frozenset())
JOINED_KEPT_PLANS = (
    4  # joined decode sessions are kept while one of the last this many activated plans used them
)


@dataclass
class StepStats:
    """What the runtime did, for benchmarks and tests."""

    steps: int = 0
    plan_switches: int = 0
    streamed_bytes: int = 0
    streamed_kv_bytes: int = (
        0  # KV of streamed attentions uploaded with their weights, and new rows downloaded
    )
    copy_wait_s: float = 0.0
    tiers_used: dict[int, int] = field(default_factory=dict)


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


class _Stage:
    """One session run: a sub-layer's (or a row chunk's), or a stretch of sub-layers joined into one, with its
    boundary names sorted by how they are bound and the side whose buffers it reads and writes."""

    def __init__(
        self,
        name: str,
        session: capi.Session,
        inputs: list[str],
        outputs: list[str],
        past: list[str],
        present: list[str],
        roles: Roles,
        on_device: bool = False,
        last_sub_layer: str | None = None,
    ) -> None:
        self.name = name
        self.last_sub_layer = last_sub_layer or name
        self.session = session
        self.binding = session.binding()
        self.on_device = on_device
        self.inputs = inputs
        self.past, self.present = past, present
        outputs = [n for n in outputs if n not in roles.tables]  # consumers get whole tables
        self.token_inputs = [n for n in inputs if n in TOKEN_INPUTS]
        self.mask_inputs = [n for n in inputs if n in STEP_INPUTS and n not in TOKEN_INPUTS]
        self.feature_inputs = [n for n in inputs if n == IMAGE_FEATURES]
        self.residual_inputs = [n for n in inputs if n in roles.residual]
        self.fixed_inputs = [n for n in inputs if n in roles.fixed or n in roles.tables]
        self.shared_inputs = [
            n
            for n in inputs
            if n not in STEP_INPUTS
            and n not in roles.residual
            and n not in past
            and n not in self.fixed_inputs
            and n != IMAGE_FEATURES
        ]
        self.pointer_outputs = [n for n in outputs if n in roles.residual or n == LOGITS or n in roles.fixed]
        self.allocated_outputs = [n for n in outputs if n not in self.pointer_outputs and n not in present]
        # IO binding returns outputs in the order they were first bound: KV, pointers, the rest.
        self.bound_output_order = present + self.pointer_outputs + self.allocated_outputs
        self.takes_last_hidden = LOGITS in self.pointer_outputs and len(self.residual_inputs) == 1
        self.members = [name]  # the units it runs (several when joined)

    def run_on_arrays(self, inputs: dict[str, np.ndarray], output: str, out: np.ndarray, run_options) -> None:
        """One run with host arrays bound by pointer, writing into `out`."""
        for name, array in inputs.items():
            self.binding.bind_input(name, array)
        self.binding.bind_output(output, out)
        capi.run(self.session, self.binding, run_options)


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
        self.dtype = NUMPY_DTYPES[model.compute_dtype]  # activations and KV; the weights may be half precision
        self.device = device or CpuDevice()
        # The units the plans place: the plan source's (its row chunks of the output layer), else the pack's own.
        units = book.source.units if book and book.planned else planning_units(self.pack.sub_layers)
        self.book = book or PlanBook([u.name for u in units])
        self.layout = layout = Layout(self.pack.manifest, units)
        self.moe = layout.moe
        self._rt = rt = capi.runtime(threads)
        self._device_memory = self.device.memory_info(rt)
        # Every CPU session takes its sub-layers' stored weights as arrays mapped from the blobs, with one
        # prepacked-weights container: ONNX Runtime shares packed weights between sessions only for initializers
        # the caller provides, so a joined decode session and the sub-layers' own sessions hold one packed copy.
        self._weights = MappedWeights()
        self._shared_weights = capi.SharedWeights(rt)
        self._session = partial(
            rt.session,
            threads=threads,
            optimize=optimize,
            prepack=prepack,
            shared=self._shared_weights,
            weights_folder=self.pack.folder,
        )
        self._device_session = partial(
            rt.session, threads=threads, optimize=optimize, cuda_options=self.device.cuda_options
        )
        self._cpu_stages: dict[str, _Stage] = {}
        self._device_stages: dict[
            str, _Stage
        ] = {}  # weights-as-inputs sessions, their weights bound by pointer
        self._host_input_stages: dict[str, _Stage] = {}  # weights-as-inputs on the CPU EP (row chunks)
        self._joined_stages: dict[tuple, list[_Stage]] = {}
        self._joined_used: dict[tuple, int] = {}  # stretch -> the plan activation that last used it
        self._tables = {
            name: _stored_weight(self.pack, entry, weight) for name, (entry, weight) in layout.tables.items()
        }
        self.decode_attention = (
            decode_attention
            and capi.custom_ops_available()
            and self.dtype == np.float32
            and self.head_dim % 8 == 0
        )
        self.join_decode = join_decode
        self.weight_matmul = weight_matmul and capi.custom_ops_available()
        self.fp32_weight_matmul = self.weight_matmul and fp32_weight_matmul
        self.expert_stats = ExpertStats(model.num_experts)
        self._all_logits = all_logits
        self.run_options = rt.run_options()
        self._stage_timer = None
        self.stats = StepStats()
        # The KV cache: host buffers for every attention (runtime/kv.py); the attentions that run on the device
        # keep theirs in device buffers of the same size.
        self.kv = HostKvCache(
            [past for e in layout.in_line if e.kv for past in e.kv.past],
            self.kv_heads,
            self.head_dim,
            self.dtype,
        )
        self._kv_device: dict[str, object] = {}
        self._kv_on_device: set[str] = set()
        # Streamed attentions whose KV streams: the host buffers are the master; beside each staging slot a KV slot
        # (a device buffer per past of one attention) takes the KV of the unit in it, uploaded with its weights.
        self._kv_owner = {past: e.name for e in layout.in_line if e.kv for past in e.kv.past}
        self._kv_streamed: frozenset[str] = frozenset()
        self._kv_slots: list[list] = []
        self._slot_kv_copy: list[list] = []
        self._write_columns: np.ndarray | None = None  # per row of the step, the first KV column it writes
        self._kv_view: tuple[int, tuple] = (0, ())
        # Device memory of the active plan.
        self.active: Plan | None = None
        self._pinned: dict[str, object] = {}
        self._ring: list = []
        self._slot_unit: list[str | None] = []
        self._slot_copy: list[Future | None] = []
        self._streamed: list[str] = []
        self._ring_position = 0
        self._expert_slots: list = []
        self._reserved: dict[str, int] = {}
        self._sources: dict[str, object] = {}  # streamed unit -> the host bytes it is uploaded from
        self._blobs: dict[str, np.memmap] = {}
        # Per batch shape (and KV rows, (first, count), for a step on some rows of the cache).
        self._shape: tuple[int, int] | None = None
        self._kv_rows: tuple[int, int] | None = None
        self._last_positions: np.ndarray | None = None
        self.splits: list[Split] = []
        self._program: list = []
        self._residual: list[np.ndarray] = []
        self._device_residual: list = []
        self._logits = np.empty(0, self.dtype)
        self._last_hidden = np.empty(0, self.dtype)
        self._chunk_logits: dict[str, np.ndarray] = {}
        self._tokens: dict[str, np.ndarray] = {}
        self._fixed_buffers: dict[str, np.ndarray] = {}
        self._shared: dict[str, object] = {}
        self._device_activations = False
        self._consumers: dict[str, list[tuple]] = {}
        self._mask_inputs: list[tuple] = []
        self._feature_inputs: list[tuple] = []
        vision = self.pack.manifest.vision.facts if self.pack.manifest.vision else None  # the export's dict
        self.image_token_id = int(vision["image_token_id"]) if vision else None
        self._no_features = np.zeros((0, self.hidden_size), self.dtype)
        # An M-RoPE decoder (3 position rows): what its positions are computed from.
        self.mrope = mrope_settings(model.position_rows, vision)
        self._allocated_outputs: list[tuple] = []
        self._decoding = False
        self._bias_dtype = next(
            (
                np.dtype(o.dtype)
                for e in layout.in_line
                if e.kind == "prologue"
                for o in e.outputs
                if o.name == PADDING_BIAS
            ),
            self.dtype,
        )
        self._bias_lowest = np.finfo(self._bias_dtype).min
        self._decode_bias = np.empty(0, self._bias_dtype)
        if not self.book.planned:  # the chain makes its sessions with the pack, decode sessions too
            self._activate(self.book.plan_for(0))
            self.decode_runs()

    # -- what the step runs -----------------------------------------------------------------------------------------
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

    def explain(self) -> list[str]:
        """The active schedule, as `pipeshard plan --explain` prints it."""
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
        self._shape = None  # the program is remade at the next step

    @property
    def all_logits(self) -> bool:
        return self._all_logits

    @all_logits.setter
    def all_logits(self, value: bool) -> None:
        self._all_logits = value
        self._shape = None

    # -- sessions ---------------------------------------------------------------------------------------------------
    def _cpu_stage(self, name: str) -> _Stage:
        if name not in self._cpu_stages:
            entry = self.layout.entries[name]
            model: Path | bytes = self.pack.path(entry.files["onnx"])
            if self.weight_matmul and (weights := product_weights(entry.weights, self.fp32_weight_matmul)):
                model = join([model], {o.name for o in entry.outputs}, product_weights=weights).model
            session = self._session(model, initializers=self._weights.add(self.pack.folder, entry.weights))
            self._weights.release_pages()  # the session holds packed copies; weights read unpacked page back in
            capi.release_free_heap()  # the copies packed to find shared weights: not held to the end of loading
            self._cpu_stages[name] = self._stage_of(entry, session, on_device=False)
        return self._cpu_stages[name]

    def _device_stage(self, name: str) -> _Stage:
        """A unit on the device: its sub-layer's weights-as-inputs session (a row chunk shares it, with a binding
        of its own)."""
        if name not in self._device_stages:
            entry = self.layout.sub_layer_of(name)
            shared = next(
                (s.session for n, s in self._device_stages.items() if self.layout.sub_layer_of(n).name == entry.name),
                None,
            )
            session = shared or self._device_session(self.pack.path(entry.files["weights_as_inputs"]))
            self._device_stages[name] = self._stage_of(entry, session, on_device=True, name=name)
        return self._device_stages[name]

    def _host_input_stage(self, name: str) -> _Stage:
        """A row chunk computed on the host: the output layer's weights-as-inputs session on the CPU EP."""
        if name not in self._host_input_stages:
            entry = self.layout.sub_layer_of(name)
            shared = next(iter(self._host_input_stages.values()), None)
            session = (
                shared.session
                if shared
                else self._rt.session(
                    self.pack.path(entry.files["weights_as_inputs"]), threads=self._rt.threads
                )
            )
            self._host_input_stages[name] = self._stage_of(entry, session, on_device=False, name=name)
        return self._host_input_stages[name]

    def _stage_of(
        self, entry: SubLayer, session: capi.Session, on_device: bool, name: str | None = None
    ) -> _Stage:
        kv = entry.kv
        roles = _NO_ROLES if entry.name in self.layout.expert_names else self.layout.roles
        return _Stage(
            name or entry.name,
            session,
            [i.name for i in entry.inputs],
            [o.name for o in entry.outputs],
            list(kv.past) if kv else [],
            list(kv.present) if kv else [],
            roles,
            on_device,
        )

    def _stage_for(self, unit: str, placement: str) -> _Stage:
        if placement != Placement.CPU:
            return self._device_stage(unit)
        return self._host_input_stage(unit) if self.layout.is_chunk(unit) else self._cpu_stage(unit)

    def _split_stages(self, split: Split, join: bool) -> list[_Stage]:
        """The stages a split runs: one per unit, or a CPU split's sub-layers joined (one-token steps)."""
        stages = [self._stage_for(unit, placement) for unit, placement in split.runs]
        if not join or any(self.layout.is_chunk(unit) for unit, _ in split.runs):
            return stages
        return self._joined(stages, split.side == DEVICE)

    def decode_runs(self) -> list[list[str]]:
        """The session runs of a one-token step under the active plan, per split (made now if not yet)."""
        plan = self.active or self.book.plan_for(self.book.tier_for(1))
        return [
            [stage.name for stage in self._split_stages(split, self.join_decode)]
            for split in schedule(self.layout, plan, 1)
        ]

    def sub_layer_stages(self) -> list[_Stage]:
        """Every in-line sub-layer's CPU stage, in order (made now if not yet)."""
        return [self._cpu_stage(entry.name) for entry in self.layout.in_line]

    def _joined(self, stretch: list[_Stage], on_device: bool) -> list[_Stage]:
        """A stretch of sub-layer stages of one side as one joined decode session (cut at 64 MiB of weights), or
        the stages themselves where joining gains nothing or their residual buffers could not be shared safely. On
        the CPU EP (the host, or a device whose memory is host memory) the attention runs pipeshard's decode op;
        a device's joined session takes its weights as inputs, bound by pointer like its sub-layers'."""
        key = (on_device, *(stage.name for stage in stretch))
        self._joined_used[key] = self.stats.plan_switches
        if key in self._joined_stages:
            return self._joined_stages[key]
        entries = self.layout.entries
        pieces: list[list[_Stage]] = [[]]
        size = 0
        for stage in stretch:
            weight_bytes = entries[stage.name].weight_bytes
            if pieces[-1] and size + weight_bytes > JOINED_WEIGHT_BYTES:
                pieces.append([])
                size = 0
            pieces[-1].append(stage)
            size += weight_bytes
        read_in_python = {
            name for block in self.moe.values() for name in (block.residual, block.hidden, block.routing)
        }
        float_inputs = {i.name for entry in self.layout.in_line for i in entry.inputs if i.dtype == "float32"}
        swap = self.decode_attention and (not on_device or self.device.cuda_options is None)
        variant = "weights_as_inputs" if on_device else "onnx"
        all_inputs = {e.name: {i.name for i in e.inputs} for e in self.layout.in_line}
        joined_stages: list[_Stage] = []
        for piece in pieces:
            inside = {name for stage in piece for name in stage.bound_output_order}
            members = {stage.name for stage in piece}
            read_outside = read_in_python | {
                name
                for sub_layer, inputs in all_inputs.items()
                if sub_layer not in members
                for name in inputs
            }
            outputs = {
                name
                for name in inside
                if name in read_outside or name == LOGITS or any(name in stage.present for stage in piece)
            }
            products = (
                set().union(
                    *(
                        product_weights(entries[stage.name].weights, self.fp32_weight_matmul)
                        for stage in piece
                    )
                )
                if self.weight_matmul and not on_device
                else None
            )
            joined = join(
                [self.pack.path(entries[stage.name].files[variant]) for stage in piece],
                outputs,
                float_inputs if swap else None,
                products,
            )
            if len(piece) == 1 and not joined.decode_attention_nodes or not self._buffers_safe(joined):
                joined_stages += piece
                continue
            weight_names = {w.name for stage in piece for w in entries[stage.name].weights}
            if on_device:
                session = self._device_session(joined.model)
            else:
                weights: dict[str, np.ndarray] = {}
                for stage in piece:
                    weights.update(self._weights.add(self.pack.folder, entries[stage.name].weights))
                session = self._session(joined.model, initializers=weights)
                self._weights.release_pages()
                capi.release_free_heap()
            stage = _Stage(
                f"{piece[0].name}..{piece[-1].name}",
                session,
                [name for name in joined.inputs if name not in weight_names],
                joined.outputs,
                [n for s in piece for n in s.past],
                [n for s in piece for n in s.present],
                self.layout.roles,
                on_device,
                last_sub_layer=piece[-1].name,
            )
            stage.members = [s.name for s in piece]
            joined_stages.append(stage)
        self._joined_stages[key] = joined_stages
        return joined_stages

    def _buffers_safe(self, joined: JoinedGraph) -> bool:
        """Whether the joined graph's residual inputs and outputs may live in the two residual buffers: ONNX Runtime
        cannot know two of its tensors share memory and may order the joined nodes otherwise than the sub-layers
        ran, so an output may share an input's buffer only if it depends on every read of it."""
        buffer_of, residual = self.layout.buffer_of, self.layout.roles.residual
        inputs = [name for name in joined.inputs if name in residual]
        outputs = [name for name in joined.outputs if name in residual]
        buffers = [buffer_of[name] for name in outputs]
        return len(set(buffers)) == len(buffers) and all(
            joined.read_before_written(read, written)
            for read in inputs
            for written in outputs
            if buffer_of[read] == buffer_of[written]
        )

    # -- device memory ----------------------------------------------------------------------------------------------
    def _blob(self, file: str) -> np.memmap:
        if file not in self._blobs:
            self._blobs[file] = np.memmap(self.pack.path(file), np.uint8, mode="r")
        return self._blobs[file]

    def _unit_bytes(self, name: str) -> tuple[str, int, int]:
        """Where a unit's device bytes are stored: (blob file, offset, size); a row chunk's are its rows of W."""
        unit = self.layout.units[name]
        if unit.chunk is None:
            return unit.blob.file, 0, unit.blob.bytes
        chunks = unit.row_chunks
        weight = next(w for w in unit.weights if w.name == chunks.weight)
        start, stop = (weight.offset + row * chunks.row_bytes for row in (unit.chunk.first_row, unit.chunk.end_row))
        return weight.file, start, stop - start

    def _mapped_bytes(self, name: str) -> np.ndarray:
        file, offset, nbytes = self._unit_bytes(name)
        return self._blob(file)[offset : offset + nbytes]

    def _source(self, name: str):
        """The host bytes a streamed unit is uploaded from, as the device keeps them (made once)."""
        if name not in self._sources:
            file, offset, nbytes = self._unit_bytes(name)
            self._sources[name] = self.device.host_source(self.pack.path(file), offset, nbytes)
        return self._sources[name]

    def _reserve(self, purpose: str, nbytes: int) -> None:
        old = self._reserved.pop(purpose, 0)
        if old:
            self.device.unreserve(old, purpose)
        if nbytes:
            self.device.reserve(nbytes, purpose)
            self._reserved[purpose] = nbytes

    def _drain(self) -> None:
        for copy in [*self._slot_copy, *(c for copies in self._slot_kv_copy for c in copies)]:
            if copy is not None:
                copy.result()

    def release_device_memory(self) -> None:
        """Give back every byte the active plan holds on the device, between steps (a VLM's image encoder runs in
        it); the next step activates its plan again."""
        self._deactivate()

    def _deactivate(self) -> None:
        """Release everything on the device; the KV comes back to the host."""
        self._drain()
        for buffer in self._pinned.values():
            self.device.free(buffer, "pinned")
        self._pinned.clear()
        self._free_ring()
        self._free_kv_slots()
        self._free_expert_slots()
        self._free_device_residual()
        for attn in list(self._kv_on_device):
            self._move_kv(attn, to_device=False)
        for purpose in list(self._reserved):
            self._reserve(purpose, 0)
        self._kv_streamed = frozenset()  # the host buffers hold every attention's KV now
        self.active = None
        self._shape = None

    def _free_ring(self) -> None:
        for buffer in self._ring:
            self.device.free(buffer, "staging")
        self._ring, self._slot_unit, self._slot_copy = [], [], []

    def _free_kv_slots(self) -> None:
        for buffers in self._kv_slots:
            for buffer in buffers:
                self.device.free(buffer, "kv staging")
        self._kv_slots, self._slot_kv_copy = [], []

    def _alloc_kv_slots(self) -> None:
        """One KV slot beside each staging slot when the plan streams KV, sized like the host buffers."""
        if not self._kv_streamed or not self._ring:
            return
        pasts = max(len(self.layout.entries[attn].kv.past) for attn in self._kv_streamed)
        nbytes = int(np.prod(self.kv.shape)) * np.dtype(self.dtype).itemsize
        self._kv_slots = [[self.device.alloc(nbytes, "kv staging") for _ in range(pasts)] for _ in self._ring]
        self._slot_kv_copy = [[] for _ in self._ring]

    def _upload_kv(self, slot: int, attn: str) -> None:
        """An attention's KV from the host buffers into the KV slot beside staging slot `slot`."""
        pasts = self.layout.entries[attn].kv.past
        self._slot_kv_copy[slot] = [
            self.device.upload_array(self._kv_slots[slot][index], self.kv.buffers[past])
            for index, past in enumerate(pasts)
        ]
        self.stats.streamed_kv_bytes += sum(self.kv.buffers[past].nbytes for past in pasts)

    def _download_new_kv(self, slot: int, attn: str) -> None:
        """The KV rows the step wrote into the KV slot, back into the host buffers (the master)."""
        first, count = self._kv_rows or (0, self.kv.batch)
        _, heads, capacity, head_dim = self.kv.shape
        element = np.dtype(self.dtype).itemsize
        width = self._shape[1] * head_dim * element
        pasts = self.layout.entries[attn].kv.past
        for index, past in enumerate(pasts):
            for row, column in enumerate(self._write_columns):
                offset = (((first + row) * heads) * capacity + int(column)) * head_dim * element
                self.device.copy_out_rows(
                    self.kv.buffers[past],
                    self._kv_slots[slot][index],
                    offset,
                    heads,
                    width,
                    capacity * head_dim * element,
                )
            self.device.released_after_compute(self._kv_slots[slot][index])
        self.stats.streamed_kv_bytes += count * heads * width * len(pasts)

    def _free_expert_slots(self) -> None:
        for buffer in self._expert_slots:
            self.device.free(buffer, "expert staging")
        self._expert_slots = []

    def _free_device_residual(self) -> None:
        for buffer in self._device_residual:
            self.device.free(buffer, "activations")
        self._device_residual = []

    def _move_kv(self, attn: str, to_device: bool) -> None:
        """Move an attention's KV buffers between host and device (a plan change moved the attention)."""
        for past in self.layout.entries[attn].kv.past:
            host = self.kv.buffers.get(past)
            if to_device:
                self._kv_device[past] = self._device_kv_buffer(host)
            else:
                buffer = self._kv_device.pop(past)
                if host is not None:
                    self.device.copy_out(host, buffer)
                self.device.free(buffer, "kv")
        (self._kv_on_device.add if to_device else self._kv_on_device.discard)(attn)

    def _device_kv_buffer(self, host: np.ndarray | None):
        nbytes = host.nbytes if host is not None else 0
        buffer = self.device.alloc(nbytes, "kv")
        if nbytes:
            self.device.copy_in(buffer, host)
        return buffer

    def _activate(self, plan: Plan) -> None:
        """Make device memory match `plan` (release first, then allocate and upload) and make its CPU sessions."""
        self._drain()
        self._free_device_residual()
        placements, units = plan.placements, self.layout.units
        expert_names = self.layout.expert_names
        for name in [n for n in self._pinned if placements.get(n) != Placement.PINNED]:
            self.device.free(self._pinned.pop(name), "pinned")
        streamed = [n for n in units if placements[n] == Placement.STREAMED and n not in expert_names]
        streamed_experts = [n for n in units if placements[n] == Placement.STREAMED and n in expert_names]
        expert_slot_bytes = max((self._unit_bytes(n)[2] for n in streamed_experts), default=0)
        if not streamed_experts or (self._expert_slots and self._expert_slots[0].nbytes != expert_slot_bytes):
            self._free_expert_slots()
        slot_bytes = max((self._unit_bytes(n)[2] for n in streamed), default=0)
        slots = min(plan.slots, len(streamed)) if streamed else 0
        self._free_kv_slots()
        if len(self._ring) != slots or (self._ring and self._ring[0].nbytes != slot_bytes):
            self._free_ring()
        self._kv_streamed = frozenset(plan.kv_streamed)
        wanted_attn = {
            e.name
            for e in self.layout.in_line
            if e.kind == "attn" and placements[e.name] != Placement.CPU and e.name not in self._kv_streamed
        }
        for attn in self._kv_on_device - wanted_attn:
            self._move_kv(attn, to_device=False)
        self._reserve("workspace", plan.vram.workspace)
        self._reserve("ep_overhead+reserve", plan.vram.ep_overhead + plan.vram.reserve)
        for attn in wanted_attn - self._kv_on_device:
            self._move_kv(attn, to_device=True)
        for name in units:
            if placements[name] == Placement.PINNED and name not in self._pinned:
                source = self._mapped_bytes(name)
                buffer = self.device.alloc(source.nbytes, "pinned")
                self.device.upload_now(buffer, source)
                file, offset, nbytes = self._unit_bytes(name)
                drop_mapped_range(self._blob(file), offset, nbytes)  # held once: on the device
                self._pinned[name] = buffer
        if not self._ring and slots:
            self._ring = [self.device.alloc(slot_bytes, "staging") for _ in range(slots)]
        self._alloc_kv_slots()
        if streamed_experts and not self._expert_slots:
            self._expert_slots = [
                self.device.alloc(expert_slot_bytes, "expert staging") for _ in range(EXPERT_SLOTS)
            ]
        self._streamed = streamed
        self._slot_unit = [None] * len(self._ring)
        self._slot_copy = [None] * len(self._ring)
        self._ring_position = 0
        if plan.prefetch:
            for slot in range(len(self._ring)):
                self._start_copy(slot, streamed[slot])
        self.active = plan
        self._shape = None
        # The plan's CPU sessions, largest weights first: a session's mapped blob is then never on top of the
        # packed copies of all the others.
        on_cpu = [
            e
            for e in self.pack.sub_layers
            if placements.get(e.name) == Placement.CPU
            or e.kind in HOST_ONLY_KINDS
            or (
                self.layout.chunks.get(e.name)
                and not any(placements[u.name] != Placement.CPU for u in self.layout.chunks[e.name])
            )
        ]
        for entry in sorted(on_cpu, key=lambda e: -e.weight_bytes):
            self._cpu_stage(entry.name)
        self.stats.plan_switches += 1
        # Joined decode sessions of stretches the last few plans have not used are let go: budget changes make
        # ever new stretches, and each joined session holds its own graph and buffers.
        for key in [
            k for k, used in self._joined_used.items() if used < self.stats.plan_switches - JOINED_KEPT_PLANS
        ]:
            self._joined_stages.pop(key, None)
            del self._joined_used[key]

    def _start_copy(self, slot: int, name: str) -> None:
        if self._slot_unit[slot] == name:
            return  # already there (as many slots as streamed units)
        self._slot_unit[slot] = name
        source = self._source(name)
        self._slot_copy[slot] = self.device.upload(self._ring[slot], source)
        self.stats.streamed_bytes += source.nbytes
        if name in self._kv_streamed:
            self._upload_kv(slot, name)

    # -- the program of a plan and batch shape ----------------------------------------------------------------------
    def start(self, batch_size: int, context: int | None = None) -> None:
        """New sequences. A device's KV is sized by the planner's context and batch: a larger batch or a longer
        generation is replanned first, so the budget also holds for what is really stored."""
        if self.book.needs_replan(batch_size, context or 0):
            self._deactivate()
        for stage in self._every_stage():
            stage.binding.clear()  # lets the old buffers go before the new ones are made; rebound at the next step
        self._drain()
        for buffer in self._kv_device.values():
            self.device.free(buffer, "kv")
        self._kv_device.clear()
        self._free_kv_slots()
        self._shared.clear()
        self.kv.reset(batch_size, self.book.context or context)
        for attn in self._kv_on_device:
            for past in self.layout.entries[attn].kv.past:
                self._kv_device[past] = self._device_kv_buffer(self.kv.buffers[past])
        self._alloc_kv_slots()  # the KV slots of the units already in the ring take the new sequences' KV
        for slot, unit in enumerate(self._slot_unit if self._kv_slots else ()):
            if unit in self._kv_streamed:
                self._upload_kv(slot, unit)
        self._shape = None  # a decode step's values span the KV capacity: remade with the buffers

    def _every_stage(self) -> list[_Stage]:
        return [
            *self._cpu_stages.values(),
            *self._device_stages.values(),
            *self._host_input_stages.values(),
            *(stage for stages in self._joined_stages.values() for stage in stages),
        ]

    def _buffer(self, name: str, on_device: bool = False):
        """The host array (or device buffer) a pointer-bound tensor lives in for the current batch shape."""
        if name == LOGITS:
            return self._logits
        if name in self._tables:
            return self._tables[name]
        if name in self._tokens:
            return self._tokens[name]
        if name in self._fixed_buffers:
            return self._fixed_buffers[name]
        buffers = self._device_residual if on_device and self._device_activations else self._residual
        return buffers[self.layout.buffer_of[name]]

    def _bind_host(self, stage: _Stage, name: str, array: np.ndarray, output: bool = False) -> None:
        (stage.binding.bind_output if output else stage.binding.bind_input)(name, array)

    def _bind_device(
        self, stage: _Stage, name: str, buffer, offset: int, dtype, shape, output: bool = False
    ) -> None:
        bind = stage.binding.bind_output_at if output else stage.binding.bind_input_at
        bind(name, self._device_memory, self.device.address(buffer) + offset, dtype, shape, buffer)

    def _bind_stage(self, stage: _Stage, unit: str, placement: str) -> None:
        """(Re)bind everything of a stage that stays put for the current plan and batch shape: KV, residual
        buffers, fixed values, logits, pinned weights."""
        stage.binding.clear()
        shape = self._shape
        first, count = self._kv_rows or (0, self.kv.batch)
        row_offset, kv_shape = self._kv_view
        for past, present in zip(stage.past, stage.present, strict=True):
            if stage.on_device:
                owner = self._kv_owner[past]
                # A streamed KV is bound to a KV slot here to keep the binding's output order, and to the slot
                # holding it when its weights arrive (_wait_for_slot).
                buffer = (
                    self._kv_slots[0][self.layout.entries[owner].kv.past.index(past)]
                    if owner in self._kv_streamed
                    else self._kv_device[past]
                )
                self._bind_device(stage, past, buffer, row_offset, self.dtype, kv_shape)
                self._bind_device(stage, present, buffer, row_offset, self.dtype, kv_shape, output=True)
            else:
                host = self.kv.buffers[past][first : first + count]
                self._bind_host(stage, past, host)
                self._bind_host(stage, present, host, output=True)
        last_only = stage.takes_last_hidden and not self.all_logits and shape[1] > 1
        residual_shape = (*shape, self.hidden_size)
        device_residual = stage.on_device and self._device_activations
        for name in stage.residual_inputs:
            if last_only:
                self._bind_host(stage, name, self._last_hidden)
            elif device_residual:
                self._bind_device(stage, name, self._buffer(name, True), 0, self.dtype, residual_shape)
            else:
                self._bind_host(stage, name, self._buffer(name))
        for name in stage.fixed_inputs + stage.token_inputs:
            self._bind_host(stage, name, self._buffer(name))
        for name in stage.pointer_outputs:
            if name == LOGITS:
                self._bind_host(stage, name, self._chunk_logits.get(unit, self._logits), output=True)
            elif device_residual and name in self.layout.roles.residual:
                self._bind_device(
                    stage, name, self._buffer(name, True), 0, self.dtype, residual_shape, output=True
                )
            else:
                self._bind_host(stage, name, self._buffer(name), output=True)
        if placement == Placement.PINNED:
            self._bind_weights(stage, unit, self._pinned[unit])
        elif placement == Placement.CPU and self.layout.is_chunk(unit):
            self._bind_weights(stage, unit, None)

    def _bind_weights(self, stage: _Stage, unit: str, buffer) -> None:
        """A device unit's weights from the device buffer holding them; a row chunk's rows of W from it (or from
        the host blob when the chunk is computed on the host), the output layer's other weights from the blob."""
        spec = self.layout.units[unit]
        chunk = spec.chunk
        chunks = spec.row_chunks if chunk else None
        for weight in spec.weights:
            dtype = NUMPY_DTYPES[weight.dtype]
            if chunks and weight.name == chunks.weight:
                shape = [chunk.end_row - chunk.first_row, *weight.shape[1:]]
                if buffer is None:
                    host = self._mapped_bytes(unit)
                    stage.binding.bind_input_at(weight.name, self._rt.cpu, host.ctypes.data, dtype, shape, host)
                else:
                    self._bind_device(stage, weight.name, buffer, 0, dtype, shape)
            elif chunks:
                host = self._blob(weight.file)[weight.offset : weight.offset + weight.bytes]
                stage.binding.bind_input_at(weight.name, self._rt.cpu, host.ctypes.data, dtype, weight.shape, host)
            else:
                self._bind_device(stage, weight.name, buffer, weight.offset, dtype, weight.shape)

    def _make_program(self, shape: tuple[int, int]) -> None:
        """Buffers for a batch shape, the schedule of the active plan and what each split becomes: its stages bound,
        one native call over them, the host actions after it."""
        self._shape = shape
        # Where a device's KV buffer holds the step's rows: (byte offset, shape), for every KV binding.
        first, count = self._kv_rows or (0, self.kv.batch)
        row_bytes = int(np.prod(self.kv.shape[1:])) * np.dtype(self.dtype).itemsize
        self._kv_view = (first * row_bytes, (count, *self.kv.shape[1:]))
        plan = self.active
        one_token = shape[1] == 1
        self._decoding = one_token and self.layout.skippable_prologue is not None
        sizes = {"batch": shape[0], "sequence": shape[1]}
        self._residual = [np.empty((*shape, self.hidden_size), self.dtype) for _ in range(2)]
        self._tokens = {name: np.empty(shape, np.int64) for name in TOKEN_INPUTS}
        if self.mrope:
            self._tokens["position_ids"] = np.empty((MROPE_ROWS, *shape), np.int64)
        self._fixed_buffers = {
            name: np.empty([sizes.get(d, d) for d in o.shape], np.dtype(o.dtype))
            for name, o in self.layout.fixed.items()
        }
        logit_rows = shape[1] if self.all_logits else 1
        self._logits = np.empty((shape[0], logit_rows, self.vocab_size), self.dtype)
        self._last_hidden = np.empty((shape[0], 1, self.hidden_size), self.dtype)
        self.splits = schedule(self.layout, plan, shape[1], self.all_logits)
        self._chunk_logits = {
            unit: np.empty((shape[0], logit_rows, chunk.end_row - chunk.first_row), self.dtype)
            for split in self.splits
            for unit, _ in split.runs
            if self.layout.is_chunk(unit) and (chunk := self.layout.units[unit].chunk)
        }
        # The device's residual buffers come out of the plan's activation workspace. A step larger than the tier
        # the plan was made for (a batch's prompts beyond the largest tier) leaves the device's runs reading and
        # writing the host's buffers instead (ONNX Runtime then copies them in and out of each run).
        self._free_device_residual()
        activation_bytes = 2 * shape[0] * shape[1] * self.hidden_size * np.dtype(self.dtype).itemsize
        self._device_activations = (
            any(split.side == DEVICE for split in self.splits) and activation_bytes <= plan.vram.workspace
        )
        if self._device_activations:
            self._reserve("workspace", plan.vram.workspace - activation_bytes)
            self._device_residual = [
                self.device.alloc(activation_bytes // 2, "activations") for _ in range(2)
            ]
        # A timed step runs every sub-layer's own session, so that each is timed apart.
        join = one_token and self.join_decode and self._stage_timer is None
        program: list = []
        stages: list[_Stage] = []
        for split in self.splits:
            split_stages = self._split_stages(split, join)
            placement_of = dict(split.runs)
            for stage in split_stages:
                if stage.name in placement_of:
                    self._bind_stage(stage, stage.name, placement_of[stage.name])
                    continue
                self._bind_stage(stage, stage.name, Placement.CPU)  # a joined one: its members' pinned weights too
                for unit in stage.members:
                    if placement_of[unit] == Placement.PINNED:
                        self._bind_weights(stage, unit, self._pinned[unit])
            if split.wait is not None:
                program.append(partial(self._wait_for_slot, split_stages[0], split.wait))
            stages += split_stages
            runs = [(stage.name, stage.session, stage.binding) for stage in split_stages]
            if self._stage_timer is not None:
                program += [
                    capi.Block(self._rt, [run], self.run_options, timer=self._stage_timer) for run in runs
                ]
            else:
                program.append(capi.Block(self._rt, runs, self.run_options))
            program += [
                self._action(split_stages[-1], action, name)
                for action, name in split.after
                if self._device_activations or not action.startswith("copy")
            ]
        if self._decoding:
            self._bind_decode_values(stages)
        self._mask_inputs = [
            (stage.binding.bind_input, name) for stage in stages for name in stage.mask_inputs
        ]
        self._feature_inputs = [
            (stage.binding.bind_input, name) for stage in stages for name in stage.feature_inputs
        ]
        self._allocated_outputs = [
            (stage.binding.bind_output_to_cpu, name) for stage in stages for name in stage.allocated_outputs
        ]
        self._consumers = {}
        for stage in stages:
            for name in stage.shared_inputs:
                self._consumers.setdefault(name, []).append((stage.binding.bind_value_input, name))
        self._program = program

    def _action(self, stage: _Stage, action: str, name: str):
        """A host action of the schedule as a callable."""
        if action == "release":
            return self._release_slot
        if action == "hand on":
            return partial(self._hand_on, stage.binding, name, stage.bound_output_order.index(name))
        if action == "experts":
            return partial(self._run_experts, self.moe[name])
        if action == "last position":
            residual_input = next(
                i.name for i in self.layout.entries[name].inputs if i.name in self.layout.roles.residual
            )
            return partial(self._copy_last_positions, self._buffer(residual_input))
        if action == "join chunks":
            pieces = [self._chunk_logits[u.name] for u in self.layout.chunks[name]]
            return partial(np.concatenate, pieces, axis=-1, out=self._logits)
        host, device = self._buffer(name), self._buffer(name, True)
        if action == "copy out":
            return partial(self.device.copy_out, host, device)
        return partial(self.device.copy_in, device, host)

    def _copy_last_positions(self, residual: np.ndarray) -> None:
        """Each sequence's position the output layer reads: its last, or the step's `last_positions`."""
        if self._last_positions is None:
            np.copyto(self._last_hidden, residual[:, -1:, :])
        else:
            np.copyto(self._last_hidden[:, 0, :], residual[np.arange(len(residual)), self._last_positions])

    def _bind_decode_values(self, stages: list[_Stage]) -> None:
        """The prologue's values for one new token, over the KV capacity: the total length is the capacity (or
        the rotary tables' length, if shorter: GQA wants a row for every position up to it), the padding bias has
        its columns (those past a row's length are never read); both bound once."""
        columns = min([self.kv.capacity] + [len(table) for table in self._tables.values()])
        self._fixed_buffers[TOTAL][...] = columns
        self._decode_bias = np.zeros((self._shape[0], 1, 1, columns), self._bias_dtype)
        for stage in stages:
            if PADDING_BIAS in stage.shared_inputs:
                stage.binding.bind_input(PADDING_BIAS, self._decode_bias)

    # -- the step ---------------------------------------------------------------------------------------------------
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
        self._last_positions = last_positions
        if total > self.kv.capacity:
            self._grow_kv(batch, total)
        largest = self.book.largest_tier
        if largest is not None and batch == 1 and tokens > largest:
            # A prompt longer than the largest tier: chunks of it (bounds activation memory too). A batch's
            # prompts go in one step: GQA on the CPU takes several new tokens after a past only for batch 1.
            past = total - tokens
            pieces = [
                np.array(
                    self.forward(
                        input_ids[:, begin : begin + largest],
                        attention_mask[:, : past + min(begin + largest, tokens)],
                        position_ids[..., begin : begin + largest],
                        slot,
                        image_features=image_rows(
                            input_ids[0], begin, begin + largest, self.image_token_id, image_features
                        ),
                    )
                )
                for begin in range(0, tokens, largest)
            ]
            return np.concatenate(pieces, axis=1)
        tier = self.book.tier_for(batch * tokens)
        plan = self.book.plan_for(tier)
        if plan is not self.active:
            self._activate(plan)
        if (batch, tokens) != self._shape or rows != self._kv_rows:
            self._kv_rows = rows
            self._make_program((batch, tokens))
        self.stats.steps += 1
        self.stats.tiers_used[tier] = self.stats.tiers_used.get(tier, 0) + 1
        np.copyto(self._tokens["input_ids"], input_ids)
        np.copyto(self._tokens["position_ids"], position_ids)
        # What a step hands from run to run besides the pointer-bound buffers: the attention mask, then the
        # values ONNX Runtime allocates (the mask bias, a router's outputs).
        shared = self._shared
        shared["attention_mask"] = mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        if self._kv_streamed:  # each row writes its new tokens' KV up to its mask's last set column
            self._write_columns = total - np.argmax(mask[:, ::-1] != 0, axis=1) - tokens
        if self._decoding:  # each row's new token goes after its last one: the mask's last set column
            self._fixed_buffers[SEQLENS][:] = total - 1 - np.argmax(mask[:, ::-1] != 0, axis=1)
            np.copyto(self._decode_bias[:, 0, 0, :total], np.where(mask != 0, 0, self._bias_lowest))
        for bind, name in self._mask_inputs:
            bind(name, mask)
        if self._feature_inputs:
            features = (
                self._no_features
                if image_features is None
                else np.ascontiguousarray(image_features, self.dtype)
            )
            for bind, name in self._feature_inputs:
                bind(name, features)
        for bind, name in self._allocated_outputs:
            bind(name)
        try:
            # The loop touches as little as it can: after each run's weights streamed through the caches, every
            # object it reads is a cache miss.
            for operation in self._program:
                operation()
        except BaseException:
            # Interrupted mid-step (Ctrl-C) or failed: the ring and the KV are in an unknown state. Release the
            # device; the next generation starts clean (start() resets the KV).
            self._deactivate()
            raise
        if self.moe:
            self.expert_stats.end_step(batch * tokens)
        return self._logits

    def _grow_kv(self, batch: int, total: int) -> None:
        """Longer than start() was told: the KV comes home, grows, and plans are made for the new context."""
        self._deactivate()
        self.kv.ensure(total)
        self.book.needs_replan(batch, self.kv.capacity)

    def _hand_on(self, binding: capi.Binding, name: str, place: int) -> None:
        """A run's ORT-allocated output, bound into every run that takes it."""
        value = self._shared[name] = binding.outputs()[place]
        for bind, input_name in self._consumers.get(name, ()):
            bind(input_name, value)

    def _wait_for_slot(self, stage: _Stage, unit: str) -> None:
        """The staging slot holding `unit`'s weights, once its copy has landed, bound as the stage's weights. The
        ring runs on across steps: the g-th streamed use overall takes slot g mod slots."""
        slot = self._ring_position % len(self._ring)
        if not self.active.prefetch:
            self._start_copy(slot, unit)
        if self._slot_unit[slot] != unit:
            raise RuntimeError(
                f"staging slot {slot} holds {self._slot_unit[slot]}, not {unit}: the ring is out of "
                "step with the schedule"
            )
        waited = time.perf_counter()
        self._slot_copy[slot].result()
        for copy in self._slot_kv_copy[slot] if unit in self._kv_streamed else ():
            copy.result()
        self.stats.copy_wait_s += time.perf_counter() - waited
        self._bind_weights(stage, unit, self._ring[slot])
        if unit in self._kv_streamed:
            row_offset, kv_shape = self._kv_view
            kv = self.layout.entries[unit].kv
            for past, present, buffer in zip(kv.past, kv.present, self._kv_slots[slot], strict=True):
                self._bind_device(stage, past, buffer, row_offset, self.dtype, kv_shape)
                self._bind_device(stage, present, buffer, row_offset, self.dtype, kv_shape, output=True)

    def _release_slot(self) -> None:
        """The slot's user has run: refill it with the streamed unit `slots` places ahead."""
        slot = self._ring_position % len(self._ring)
        self.device.released_after_compute(self._ring[slot])
        if self._slot_unit[slot] in self._kv_streamed:
            self._download_new_kv(slot, self._slot_unit[slot])
        if self.active.prefetch:
            following = (self._ring_position + len(self._ring)) % len(self._streamed)
            self._start_copy(slot, self._streamed[following])
        self._ring_position += 1

    def _run_experts(self, block: MoeBlock) -> None:
        """The experts the router chose for the step's real tokens (`live`: their attention mask), each over its
        tokens: pinned ones first, then CPU ones while the streamed ones' weights are copied (two slots in flight),
        then the streamed ones; summed with the residual into the block's output buffer."""
        shared, plan = self._shared, self.active
        hidden, routing = shared[block.hidden].numpy(), shared[block.routing].numpy()
        live = shared["attention_mask"][:, -self._shape[1] :]
        chosen = chosen_experts(routing, live)
        self.expert_stats.record(block.layer, chosen, live.size)
        placement_of = {expert: plan.placements[block.experts[expert]] for expert, _ in chosen}
        chosen.sort(key=lambda pair: EXPERT_RUN_ORDER[placement_of[pair[0]]])
        streamed = [block.experts[e] for e, _ in chosen if placement_of[e] == Placement.STREAMED]
        copies: dict[str, tuple[int, object]] = {}

        def start_copy(position: int) -> None:
            if position < len(streamed):
                name, slot = streamed[position], position % len(self._expert_slots)
                source = self._source(name)
                copies[name] = (slot, self.device.upload(self._expert_slots[slot], source))
                self.stats.streamed_bytes += source.nbytes

        for position in range(min(EXPERT_SLOTS, len(streamed))):
            start_copy(position)

        def run_expert(expert: int, rows_hidden: np.ndarray, rows_routing: np.ndarray) -> np.ndarray:
            name, placement = block.experts[expert], placement_of[expert]
            stage = self._stage_for(name, placement)
            if placement == Placement.PINNED:
                self._bind_weights(stage, name, self._pinned[name])
            elif placement == Placement.STREAMED:
                slot, copied = copies.pop(name)
                waited = time.perf_counter()
                copied.result()
                self.stats.copy_wait_s += time.perf_counter() - waited
                self._bind_weights(stage, name, self._expert_slots[slot])
            out = np.empty_like(rows_hidden)
            inputs = {block.hidden: rows_hidden, block.routing: rows_routing}
            stage.run_on_arrays(
                {n: inputs[n] for n in stage.inputs}, stage.allocated_outputs[0], out, self.run_options
            )
            if placement == Placement.STREAMED:
                self.device.released_after_compute(self._expert_slots[slot])
                start_copy(streamed.index(name) + EXPERT_SLOTS)
            return out

        combine(self._buffer(block.residual), hidden, routing, chosen, run_expert, self._buffer(block.output))

    def close(self) -> None:
        self._deactivate()
        self.device.close()


def _stored_weight(pack: Pack, entry: SubLayer, name: str) -> np.ndarray:
    """A sub-layer's weight as stored in its blob."""
    weight = next(w for w in entry.weights if w.name == name)
    dtype = numpy_dtype(weight.dtype)
    return np.fromfile(pack.path(weight.file), dtype, weight.bytes // dtype.itemsize, offset=weight.offset).reshape(
        weight.shape
    )
