"""A plan's step for one batch shape, made once and run every step: the plan's splits (`runtime/splits.py`), each
one native call into ONNX Runtime over its stages (`capi.Block`), and the host actions between them, as a list
of callables; and the IO binding that lets a step run with so little Python.

What makes the CPU part fast, for every plan alike. Boundary tensors move through IO binding: the residual stream
lives in two preallocated buffers per side and batch shape (each residual tensor always in the same one, so
bindings stay valid from step to step); each attention's KV cache is one buffer bound as its past and present
(appended in place); the rotary tables the manifest marks as row prefixes of a stored weight are bound whole;
the token inputs are buffers of the program. At one new token the prologue does not run (its values are kept by
the program: runtime/kv.py), and each stretch of CPU sub-layers of a split is joined into one session
(`runtime/joined.py`) whose attention runs pipeshard's decode op (`runtime/decode_attention.py`). Every binding a
step must redo is made in a burst right after the run that produced its value: between two runs the caches hold
the last sub-layer's weights, so each call into ONNX Runtime's binding code made there would start cold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from pipeshard.formats.export_info import numpy_dtype
from pipeshard.formats.io_names import MROPE_ROWS, PADDING_BIAS, SEQLENS, TOTAL
from pipeshard.formats.manifest import MoeBlock, Pack, SubLayer
from pipeshard.formats.plans import Placement, Plan
from pipeshard.runtime import capi
from pipeshard.runtime.devices import Device
from pipeshard.runtime.kv import HostKvCache
from pipeshard.runtime.residency import Residency
from pipeshard.runtime.splits import LOGITS, TOKEN_INPUTS, Layout, Side, schedule
from pipeshard.runtime.stages import Sessions, Stage


@dataclass(frozen=True)
class Parts:
    """What every program of a step is made from and binds into, made once by the step."""

    layout: Layout
    sessions: Sessions
    residency: Residency
    kv: HostKvCache
    device: Device
    rt: capi.Runtime
    device_memory: object  # the ONNX Runtime memory info device buffers are bound with
    run_options: object
    tables: dict[str, np.ndarray]  # the rotary tables, bound whole
    dtype: np.dtype  # activations (the KV's is kv.dtype)
    vocab_size: int
    mrope: bool  # position ids of 3 rows

    def bind_device(
        self, stage: Stage, name: str, buffer, offset: int, dtype, shape, output: bool = False
    ) -> None:
        bind = stage.binding.bind_output_at if output else stage.binding.bind_input_at
        bind(name, self.device_memory, self.device.address(buffer) + offset, dtype, shape, buffer)

    def bind_weights(self, stage: Stage, unit: str, buffer) -> None:
        """A device unit's weights from the device buffer holding them; a row chunk's rows of W from it (or from
        the host blob when the chunk is computed on the host), the output layer's other weights from the blob."""
        spec = self.layout.units[unit]
        chunk = spec.chunk
        chunks = spec.row_chunks if chunk else None
        for weight in spec.weights:
            dtype = numpy_dtype(weight.dtype)
            if chunks and weight.name == chunks.weight:
                shape = [chunk.end_row - chunk.first_row, *weight.shape[1:]]
                if buffer is None:
                    host = self.residency.mapped_bytes(unit)
                    stage.binding.bind_input_at(
                        weight.name, self.rt.cpu, host.ctypes.data, dtype, shape, host
                    )
                else:
                    self.bind_device(stage, weight.name, buffer, 0, dtype, shape)
            elif chunks:
                host = self.residency.blob(weight.file)[weight.offset : weight.offset + weight.bytes]
                stage.binding.bind_input_at(
                    weight.name, self.rt.cpu, host.ctypes.data, dtype, weight.shape, host
                )
            else:
                self.bind_device(stage, weight.name, buffer, weight.offset, dtype, weight.shape)


def read_tables(pack: Pack, layout: Layout) -> dict[str, np.ndarray]:
    """The rotary tables the prologue's outputs are row prefixes of, as stored in its blob (bound whole)."""
    return {name: _stored_weight(pack, entry, weight) for name, (entry, weight) in layout.tables.items()}


class Program:
    """The operations of one step of `shape` (batch, new tokens) on KV `rows` ((first, count), or None for every
    row of the cache) under `plan`, with the buffers they bind: made once, run every step of that shape."""

    def __init__(
        self,
        parts: Parts,
        plan: Plan,
        shape: tuple[int, int],
        rows: tuple[int, int] | None,
        all_logits: bool,
        join: bool,
        stage_timer: Callable[[str, float], None] | None,
        wait_for_slot: Callable[[Stage, str], None],
        run_experts: Callable[[MoeBlock, Program], None],
    ) -> None:
        """`join`: run each split's sub-layers as joined decode sessions; `stage_timer`: every run its own call,
        timed; `wait_for_slot` and `run_experts`: the step's host actions for streamed units and MoE layers."""
        self.parts, self.plan, self.shape, self.rows = parts, plan, shape, rows
        layout, kv, dtype, residency = parts.layout, parts.kv, parts.dtype, parts.residency
        hidden_size = layout.hidden_size
        # Where a device's KV buffer holds the step's rows: (byte offset, shape), for every KV binding.
        self.first_row, self.row_count = rows or (0, kv.batch)
        row_bytes = int(np.prod(kv.shape[1:])) * kv.dtype.itemsize
        self.kv_view = (self.first_row * row_bytes, (self.row_count, *kv.shape[1:]))
        self.all_logits = all_logits
        self.decoding = shape[1] == 1 and layout.skippable_prologue is not None
        sizes = {"batch": shape[0], "sequence": shape[1]}
        self.residual = [np.empty((*shape, hidden_size), dtype) for _ in range(2)]
        self.tokens = {name: np.empty(shape, np.int64) for name in TOKEN_INPUTS}
        if parts.mrope:
            self.tokens["position_ids"] = np.empty((MROPE_ROWS, *shape), np.int64)
        self.fixed = {
            name: np.empty([sizes.get(d, d) for d in o.shape], np.dtype(o.dtype))
            for name, o in layout.fixed.items()
        }
        logit_rows = shape[1] if all_logits else 1
        self.logits = np.empty((shape[0], logit_rows, parts.vocab_size), dtype)
        self.last_hidden = np.empty((shape[0], 1, hidden_size), dtype)
        self.last_positions: np.ndarray | None = None
        self.splits = schedule(layout, plan, shape[1], all_logits)
        self.chunk_logits = {
            unit: np.empty((shape[0], logit_rows, chunk.end_row - chunk.first_row), dtype)
            for split in self.splits
            for unit, _ in split.runs
            if layout.is_chunk(unit) and (chunk := layout.units[unit].chunk)
        }
        # The device's residual buffers come out of the plan's activation workspace. A step larger than the tier
        # the plan was made for (a batch's prompts beyond the largest tier) leaves the device's runs reading and
        # writing the host's buffers instead (ONNX Runtime then copies them in and out of each run).
        residency.free_activations()
        activation_bytes = 2 * shape[0] * shape[1] * hidden_size * np.dtype(dtype).itemsize
        self.device_activations = (
            any(split.side == Side.DEVICE for split in self.splits)
            and activation_bytes <= plan.vram.workspace
        )
        self.device_residual = (
            residency.alloc_activations(plan.vram.workspace, activation_bytes)
            if self.device_activations
            else []
        )
        # What a step hands from run to run besides the pointer-bound buffers: the attention mask, then the values
        # ONNX Runtime allocates (the mask bias, a router's outputs).
        self.shared: dict[str, object] = {}
        self._run_experts = run_experts
        stages: list[Stage] = []
        self.operations = self._operations(stages, join, stage_timer, wait_for_slot)
        if self.decoding:
            self._bind_decode_values(stages)
        # The bindings every step redoes, in a burst (`feed`; a handed-on value's readers in `_hand_on`).
        self._mask_inputs = [
            (stage.binding.bind_input, name) for stage in stages for name in stage.mask_inputs
        ]
        self._feature_inputs = [
            (stage.binding.bind_input, name) for stage in stages for name in stage.feature_inputs
        ]
        self._allocated_outputs = [
            (stage.binding.bind_output_to_cpu, name) for stage in stages for name in stage.allocated_outputs
        ]
        self._no_features = np.zeros((0, hidden_size), dtype)
        self._consumers: dict[str, list[tuple]] = {}
        for stage in stages:
            for name in stage.shared_inputs:
                self._consumers.setdefault(name, []).append((stage.binding.bind_value_input, name))

    def _operations(
        self,
        stages: list[Stage],
        join: bool,
        stage_timer: Callable[[str, float], None] | None,
        wait_for_slot: Callable[[Stage, str], None],
    ) -> list[Callable[[], object]]:
        """What each split becomes: its stages bound, a wait for its streamed unit's slot, one native call over
        its runs (one per run when timed), the host actions after it. Appends the stages to `stages`."""
        parts, residency, layout = self.parts, self.parts.residency, self.parts.layout
        operations: list[Callable[[], object]] = []
        for split in self.splits:
            split_stages = parts.sessions.split_stages(split, join)
            placement_of = dict(split.runs)
            for stage in split_stages:
                self._bind_stage(stage)
                # Its units' weights (several when joined): pinned ones from their buffers, a row chunk computed
                # on the host from the blob; a streamed unit's once its slot is waited for.
                for unit in stage.members:
                    if placement_of[unit] == Placement.PINNED:
                        parts.bind_weights(stage, unit, residency.pinned[unit])
                    elif placement_of[unit] == Placement.CPU and layout.is_chunk(unit):
                        parts.bind_weights(stage, unit, None)
            if split.wait is not None:
                operations.append(partial(wait_for_slot, split_stages[0], split.wait))
            stages += split_stages
            runs = [(stage.name, stage.session, stage.binding) for stage in split_stages]
            if stage_timer is not None:
                operations += [
                    capi.Block(parts.rt, [run], parts.run_options, timer=stage_timer) for run in runs
                ]
            else:
                operations.append(capi.Block(parts.rt, runs, parts.run_options))
            operations += [
                self._action(split_stages[-1], action, name)
                for action, name in split.after
                if self.device_activations or not action.startswith("copy")
            ]
        return operations

    def __iter__(self):
        """The operations, in order: what a step runs."""
        return iter(self.operations)

    def feed(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        last_positions: np.ndarray | None,
        image_features: np.ndarray | None,
    ) -> None:
        """A step's inputs into the buffers and bindings the operations read."""
        np.copyto(self.tokens["input_ids"], input_ids)
        np.copyto(self.tokens["position_ids"], position_ids)
        self.last_positions = last_positions
        self.shared["attention_mask"] = mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        total, tokens = mask.shape[1], self.shape[1]
        if self.parts.residency.kv_streamed:  # each row writes its new tokens' KV up to its last mask column
            columns = total - np.argmax(mask[:, ::-1] != 0, axis=1) - tokens
            self.parts.residency.kv_writes = (self.first_row, self.row_count, tokens, columns)
        if self.decoding:  # each row's new token goes after its last one: the mask's last set column
            self.fixed[SEQLENS][:] = total - 1 - np.argmax(mask[:, ::-1] != 0, axis=1)
            np.copyto(self._decode_bias[:, 0, 0, :total], np.where(mask != 0, 0, self._bias_lowest))
        for bind, name in self._mask_inputs:
            bind(name, mask)
        if self._feature_inputs:
            features = (
                self._no_features
                if image_features is None
                else np.ascontiguousarray(image_features, self.parts.dtype)
            )
            for bind, name in self._feature_inputs:
                bind(name, features)
        for bind, name in self._allocated_outputs:
            bind(name)

    def buffer(self, name: str, on_device: bool = False):
        """The host array (or device buffer) a pointer-bound tensor lives in."""
        if name == LOGITS:
            return self.logits
        if name in self.parts.tables:
            return self.parts.tables[name]
        if name in self.tokens:
            return self.tokens[name]
        if name in self.fixed:
            return self.fixed[name]
        buffers = self.device_residual if on_device and self.device_activations else self.residual
        return buffers[self.parts.layout.buffer_of[name]]

    def bind_slot(self, stage: Stage, unit: str, slot: int) -> None:
        """A streamed unit's weights (and KV, when it streams) from the staging slot holding them."""
        parts, residency = self.parts, self.parts.residency
        parts.bind_weights(stage, unit, residency.ring[slot])
        if unit in residency.kv_streamed:
            row_offset, kv_shape = self.kv_view
            kv = parts.layout.entries[unit].kv
            for past, present, buffer in zip(kv.past, kv.present, residency.kv_slots[slot], strict=True):
                parts.bind_device(stage, past, buffer, row_offset, parts.kv.dtype, kv_shape)
                parts.bind_device(stage, present, buffer, row_offset, parts.kv.dtype, kv_shape, output=True)

    def _bind_stage(self, stage: Stage) -> None:
        """(Re)bind everything of a stage that stays put for the plan and batch shape: KV, residual buffers, fixed
        values, logits (its weights are bound apart)."""
        parts, residency, dtype = self.parts, self.parts.residency, self.parts.dtype
        layout, binding = parts.layout, stage.binding
        binding.clear()
        row_offset, kv_shape = self.kv_view
        for past, present in zip(stage.past, stage.present, strict=True):
            if stage.on_device:
                owner = residency.kv_owner[past]
                # A streamed KV is bound to a KV slot here to keep the binding's output order, and to the slot
                # holding it when its weights arrive (bind_slot).
                buffer = (
                    residency.kv_slots[0][layout.entries[owner].kv.past.index(past)]
                    if owner in residency.kv_streamed
                    else residency.kv_device[past]
                )
                parts.bind_device(stage, past, buffer, row_offset, parts.kv.dtype, kv_shape)
                parts.bind_device(stage, present, buffer, row_offset, parts.kv.dtype, kv_shape, output=True)
            else:
                host = parts.kv.buffers[past][self.first_row : self.first_row + self.row_count]
                binding.bind_input(past, host)
                binding.bind_output(present, host)
        last_only = stage.takes_last_hidden and not self.all_logits and self.shape[1] > 1
        residual_shape = (*self.shape, layout.hidden_size)
        device_residual = stage.on_device and self.device_activations
        for name in stage.residual_inputs:
            if last_only:
                binding.bind_input(name, self.last_hidden)
            elif device_residual:
                parts.bind_device(stage, name, self.buffer(name, True), 0, dtype, residual_shape)
            else:
                binding.bind_input(name, self.buffer(name))
        for name in stage.fixed_inputs + stage.token_inputs:
            binding.bind_input(name, self.buffer(name))
        for name in stage.pointer_outputs:
            if name == LOGITS:
                binding.bind_output(name, self.chunk_logits.get(stage.name, self.logits))
            elif device_residual and name in layout.roles.residual:
                parts.bind_device(stage, name, self.buffer(name, True), 0, dtype, residual_shape, output=True)
            else:
                binding.bind_output(name, self.buffer(name))

    def _bind_decode_values(self, stages: list[Stage]) -> None:
        """The prologue's values for one new token, over the KV capacity: the total length is the capacity (or
        the rotary tables' length, if shorter: GQA wants a row for every position up to it), the padding bias has
        its columns (those past a row's length are never read); both bound once."""
        columns = min([self.parts.kv.capacity] + [len(table) for table in self.parts.tables.values()])
        self.fixed[TOTAL][...] = columns
        bias_dtype = next(
            (
                np.dtype(o.dtype)
                for e in self.parts.layout.in_line
                if e.kind == "prologue"
                for o in e.outputs
                if o.name == PADDING_BIAS
            ),
            self.parts.dtype,
        )
        self._bias_lowest = np.finfo(bias_dtype).min
        self._decode_bias = np.zeros((self.shape[0], 1, 1, columns), bias_dtype)
        for stage in stages:
            if PADDING_BIAS in stage.shared_inputs:
                stage.binding.bind_input(PADDING_BIAS, self._decode_bias)

    def _action(self, stage: Stage, action: str, name: str) -> Callable[[], object]:
        """A host action of the splits as a callable."""
        if action == "release":
            return self.parts.residency.release_slot
        if action == "hand on":
            return partial(self._hand_on, stage.binding, name, stage.bound_output_order.index(name))
        if action == "experts":
            return partial(self._run_experts, self.parts.layout.moe[name], self)
        if action == "last position":
            residual = self.parts.layout.roles.residual
            residual_input = next(
                i.name for i in self.parts.layout.entries[name].inputs if i.name in residual
            )
            return partial(self._copy_last_positions, self.buffer(residual_input))
        if action == "join chunks":
            pieces = [self.chunk_logits[u.name] for u in self.parts.layout.chunks[name]]
            return partial(np.concatenate, pieces, axis=-1, out=self.logits)
        host, device = self.buffer(name), self.buffer(name, True)
        if action == "copy out":
            return partial(self.parts.device.copy_out, host, device)
        return partial(self.parts.device.copy_in, device, host)

    def _hand_on(self, binding: capi.Binding, name: str, place: int) -> None:
        """A run's ORT-allocated output, bound into every run that takes it."""
        value = self.shared[name] = binding.outputs()[place]
        for bind, input_name in self._consumers.get(name, ()):
            bind(input_name, value)

    def _copy_last_positions(self, residual: np.ndarray) -> None:
        """Each sequence's position the output layer reads: its last, or the step's `last_positions`."""
        if self.last_positions is None:
            np.copyto(self.last_hidden, residual[:, -1:, :])
        else:
            np.copyto(self.last_hidden[:, 0, :], residual[np.arange(len(residual)), self.last_positions])


def _stored_weight(pack: Pack, entry: SubLayer, name: str) -> np.ndarray:
    """A sub-layer's weight as stored in its blob."""
    weight = next(w for w in entry.weights if w.name == name)
    dtype = numpy_dtype(weight.dtype)
    return np.fromfile(
        pack.path(weight.file), dtype, weight.bytes // dtype.itemsize, offset=weight.offset
    ).reshape(weight.shape)
