"""The sessions a step runs, made on first use and shared by every tier's plan.

A `Stage` is one session run (a sub-layer's, a row chunk's, or a stretch of sub-layers joined into one) with its
boundary names sorted by how `runtime/program.py` binds them. `Sessions` makes and keeps them: at most one CPU
session (over the memory-mapped blob, its weights prepacked) and one device session (weights as inputs, bound by
pointer) per sub-layer, row chunks sharing their output layer's, and the joined decode sessions of the last few
plans (`runtime/joined.py`; docs/runtime.md sections 2 and 3).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from pipeshard.formats.io_names import IMAGE_FEATURES
from pipeshard.formats.manifest import Pack, SubLayer
from pipeshard.formats.plans import HOST_ONLY_KINDS, Placement, Plan
from pipeshard.runtime import capi
from pipeshard.runtime.devices import Device
from pipeshard.runtime.joined import JoinedGraph, join
from pipeshard.runtime.mapped_weights import MappedWeights
from pipeshard.runtime.splits import LOGITS, STEP_INPUTS, TOKEN_INPUTS, Layout, Roles, Side, Split
from pipeshard.runtime.weight_matmul import product_weights

# The most weight bytes one joined decode session takes: making it pages all of them in from the blobs at once
# (ONNX Runtime packs every weight before the pages can be let go), so this bounds what joining adds to the load
# peak (docs/plans.md).
JOINED_WEIGHT_BYTES = 64 * 2**20
# Joined decode sessions are kept while one of the last this many activated plans used them.
JOINED_KEPT_PLANS = 4
_NO_ROLES = Roles(frozenset(), frozenset(), frozenset())


def device_session(
    rt: capi.Runtime, device: Device, model: Path, name: str, threads: int | None, optimize: bool = True
) -> capi.Session:
    """A sub-layer's session on the device: its graph checked against the device's kernel table first, so a node
    the device has no kernel for is one `error:` line naming it (runtime/kernel_check.py)."""
    if device.kernel_table is not None:
        from pipeshard.runtime.kernel_check import refuse_missing_kernels

        refuse_missing_kernels(model, name, device.kernel_table)
    return rt.session(model, threads, optimize, cuda_options=device.cuda_options)


class Stage:
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


class Sessions:
    """Every stage of a pack, made on first use: CPU sessions take their sub-layers' stored weights as arrays
    mapped from the blobs, with one prepacked-weights container (ONNX Runtime shares packed weights between
    sessions only for initializers the caller provides, so a joined decode session and the sub-layers' own
    sessions hold one packed copy); device sessions carry the device's `cuda_options`."""

    def __init__(
        self,
        rt: capi.Runtime,
        pack: Pack,
        layout: Layout,
        device: Device,
        threads: int | None,
        optimize: bool,
        prepack: bool,
        decode_attention: bool,
        weight_matmul: bool,
        fp32_weight_matmul: bool,
    ) -> None:
        """`decode_attention`, `weight_matmul`, `fp32_weight_matmul`: the swaps asked for (runtime/decode_attention.py,
        runtime/weight_matmul.py), made only where the custom ops are built."""
        self.pack, self.layout, self.device = pack, layout, device
        self._rt, self._threads, self._optimize = rt, threads, optimize
        self.decode_attention = decode_attention and capi.custom_ops_available()
        self.weight_matmul = weight_matmul and capi.custom_ops_available()
        self.fp32_weight_matmul = self.weight_matmul and fp32_weight_matmul
        self._weights = MappedWeights()
        self._shared_weights = capi.SharedWeights(rt)
        self._session = partial(
            rt.session,
            threads=threads,
            optimize=optimize,
            prepack=prepack,
            shared=self._shared_weights,
            weights_folder=pack.folder,
        )
        self._joined_device_session = partial(
            rt.session, threads=threads, optimize=optimize, cuda_options=device.cuda_options
        )
        self._cpu: dict[str, Stage] = {}
        self._device: dict[str, Stage] = {}  # weights-as-inputs sessions, their weights bound by pointer
        self._host_inputs: dict[str, Stage] = {}  # weights-as-inputs on the CPU EP (row chunks)
        self._joined: dict[tuple, list[Stage]] = {}
        self._joined_used: dict[tuple, int] = {}  # stretch -> the plan activation that last used it
        self._activations = 0

    def cpu_stage(self, name: str) -> Stage:
        if name not in self._cpu:
            entry = self.layout.entries[name]
            model: Path | bytes = self.pack.path(entry.graph_file)
            if self.weight_matmul and (weights := product_weights(entry.weights, self.fp32_weight_matmul)):
                model = join([model], {o.name for o in entry.outputs}, product_weights=weights).model
            session = self._session(model, initializers=self._weights.add(self.pack.folder, entry.weights))
            self._weights.release_pages()  # the session holds packed copies; weights read unpacked page back in
            capi.release_free_heap()  # the copies packed to find shared weights: not held to the end of loading
            self._cpu[name] = self._stage_of(entry, session, on_device=False)
        return self._cpu[name]

    def device_stage(self, name: str) -> Stage:
        """A unit on the device: its sub-layer's weights-as-inputs session (a row chunk shares it, with a binding
        of its own)."""
        if name not in self._device:
            entry = self.layout.sub_layer_of(name)
            shared = next(
                (
                    s.session
                    for n, s in self._device.items()
                    if self.layout.sub_layer_of(n).name == entry.name
                ),
                None,
            )
            session = shared or device_session(
                self._rt,
                self.device,
                self.pack.path(entry.weights_as_inputs_file),
                entry.name,
                self._threads,
                self._optimize,
            )
            self._device[name] = self._stage_of(entry, session, on_device=True, name=name)
        return self._device[name]

    def host_input_stage(self, name: str) -> Stage:
        """A row chunk computed on the host: the output layer's weights-as-inputs session on the CPU EP."""
        if name not in self._host_inputs:
            entry = self.layout.sub_layer_of(name)
            shared = next(iter(self._host_inputs.values()), None)
            session = (
                shared.session
                if shared
                else self._rt.session(self.pack.path(entry.weights_as_inputs_file), threads=self._rt.threads)
            )
            self._host_inputs[name] = self._stage_of(entry, session, on_device=False, name=name)
        return self._host_inputs[name]

    def _stage_of(
        self, entry: SubLayer, session: capi.Session, on_device: bool, name: str | None = None
    ) -> Stage:
        kv = entry.kv
        roles = _NO_ROLES if entry.name in self.layout.expert_names else self.layout.roles
        return Stage(
            name or entry.name,
            session,
            [i.name for i in entry.inputs],
            [o.name for o in entry.outputs],
            list(kv.past) if kv else [],
            list(kv.present) if kv else [],
            roles,
            on_device,
        )

    def stage_for(self, unit: str, placement: str) -> Stage:
        if placement != Placement.CPU:
            return self.device_stage(unit)
        return self.host_input_stage(unit) if self.layout.is_chunk(unit) else self.cpu_stage(unit)

    def split_stages(self, split: Split, join: bool) -> list[Stage]:
        """The stages a split runs: one per unit, or a split's sub-layers joined (one-token steps)."""
        stages = [self.stage_for(unit, placement) for unit, placement in split.runs]
        if not join or any(self.layout.is_chunk(unit) for unit, _ in split.runs):
            return stages
        return self._joined_stages(stages, split.side == Side.DEVICE)

    def every_stage(self) -> list[Stage]:
        return [
            *self._cpu.values(),
            *self._device.values(),
            *self._host_inputs.values(),
            *(stage for stages in self._joined.values() for stage in stages),
        ]

    def activate(self, plan: Plan) -> None:
        """Make the plan's CPU sessions, largest weights first (a session's mapped blob is then never on top of
        the packed copies of all the others), and let go of the joined decode sessions of stretches the last few
        plans have not used: budget changes make ever new stretches, and each holds its own graph and buffers."""
        placements, chunks = plan.placements, self.layout.chunks
        on_cpu = [
            e
            for e in self.pack.sub_layers
            if placements.get(e.name) == Placement.CPU
            or e.kind in HOST_ONLY_KINDS
            or (chunks.get(e.name) and not any(placements[u.name] != Placement.CPU for u in chunks[e.name]))
        ]
        for entry in sorted(on_cpu, key=lambda e: -e.weight_bytes):
            self.cpu_stage(entry.name)
        self._activations += 1
        for key in [
            k for k, used in self._joined_used.items() if used < self._activations - JOINED_KEPT_PLANS
        ]:
            self._joined.pop(key, None)
            del self._joined_used[key]

    def _joined_stages(self, stretch: list[Stage], on_device: bool) -> list[Stage]:
        """A stretch of sub-layer stages of one side as one joined decode session (cut at 64 MiB of weights), or
        the stages themselves where joining gains nothing or their residual buffers could not be shared safely. On
        the CPU EP (the host, or a device whose memory is host memory) the attention runs pipeshard's decode op;
        a device's joined session takes its weights as inputs, bound by pointer like its sub-layers'."""
        key = (on_device, *(stage.name for stage in stretch))
        self._joined_used[key] = self._activations
        if key in self._joined:
            return self._joined[key]
        entries = self.layout.entries
        pieces: list[list[Stage]] = [[]]
        size = 0
        for stage in stretch:
            weight_bytes = entries[stage.name].weight_bytes
            if pieces[-1] and size + weight_bytes > JOINED_WEIGHT_BYTES:
                pieces.append([])
                size = 0
            pieces[-1].append(stage)
            size += weight_bytes
        read_in_python = {
            name
            for block in self.layout.moe.values()
            for name in (block.residual, block.hidden, block.routing)
        }
        float_inputs = {i.name for entry in self.layout.in_line for i in entry.inputs if i.dtype == "float32"}
        swap = self.decode_attention and (not on_device or self.device.cuda_options is None)
        variant = "weights_as_inputs" if on_device else "onnx"
        all_inputs = {e.name: {i.name for i in e.inputs} for e in self.layout.in_line}
        joined_stages: list[Stage] = []
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
                session = self._joined_device_session(joined.model)  # nodes of sub-layers checked at load
            else:
                weights: dict[str, np.ndarray] = {}
                for stage in piece:
                    weights.update(self._weights.add(self.pack.folder, entries[stage.name].weights))
                session = self._session(joined.model, initializers=weights)
                self._weights.release_pages()
                capi.release_free_heap()
            stage = Stage(
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
        self._joined[key] = joined_stages
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
