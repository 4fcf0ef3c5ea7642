"""The all-CPU chain: every sub-layer of a pack in manifest order, one CPU-EP session each.

Boundary tensors move through IO binding. The residual stream lives in two preallocated buffers per
batch shape (each residual tensor always in the same one, so a stage's pointer bindings stay valid
from step to step and are only redone when the batch shape changes); each attention's KV cache is
one host buffer bound as its past and present (appended in place), bound once per generation; the
prologue's shared values (mask, rotary angles, lengths) are ORT-allocated values handed on without
touching numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.runtime.exportdir import NUMPY_DTYPES
from pipeshard.runtime.kv import HostKvCache, check_step_shape
from pipeshard.runtime.moe import ExpertStats, MoeBlock, chosen_experts, combine, moe_blocks_of, run_on_arrays
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime
from pipeshard.runtime.pack import Pack, load_pack

STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")
LOGITS = "logits"


class _Stage:
    """One sub-layer's session and binding, with its boundary names sorted by how they are bound."""

    def __init__(self, ort, pack: Pack, entry: dict, options, residual: set[str]) -> None:
        self.name = entry["name"]
        self.session = ort.InferenceSession(str(pack.path(entry["files"]["onnx"])), options,
                                            providers=["CPUExecutionProvider"])
        # The raw pybind objects: the Python wrappers validate and wrap on every call, which over
        # dozens of sub-layers per token costs more than the binding itself.
        self.binding = self.session.io_binding()._iobinding
        self.run = self.session._sess.run_with_iobinding
        kv = entry["kv"] or {}
        self.past = kv.get("past", [])
        self.present = kv.get("present", [])
        inputs = [i["name"] for i in entry["inputs"]]
        outputs = [o["name"] for o in entry["outputs"]]
        self.step_inputs = [n for n in inputs if n in STEP_INPUTS]
        self.residual_inputs = [n for n in inputs if n in residual]
        self.shared_inputs = [n for n in inputs if n not in STEP_INPUTS and n not in residual and n not in self.past]
        self.pointer_outputs = [n for n in outputs if n in residual or n == LOGITS]
        self.allocated_outputs = [n for n in outputs if n not in self.pointer_outputs and n not in self.present]
        # IO binding returns outputs in the order they were first bound: KV (at start), pointers, the rest.
        self.bound_output_order = self.present + self.pointer_outputs + self.allocated_outputs
        self.bound_shape: tuple[int, int] | None = None
        self.takes_last_hidden = LOGITS in self.pointer_outputs and len(self.residual_inputs) == 1


class ChainStep:
    """A ForwardStep over a model pack, all on the CPU EP."""

    def __init__(self, folder: Path, threads: int | None = None, optimize: bool = True, prepack: bool = True,
                 verify: bool = False, all_logits: bool = False) -> None:
        ort = import_onnxruntime()
        self._ort = ort
        self.pack = load_pack(folder, verify=verify)
        model = self.pack.model
        self.max_context = int(model["max_context"])
        self.hidden_size = int(model["hidden_size"])
        self.vocab_size = int(model["vocab_size"])
        self.kv_heads = int(model["num_key_value_heads"])
        self.head_dim = int(model["head_dim"])
        self.dtype = NUMPY_DTYPES[model["dtype"]]
        options = cpu_session_options(threads, optimize)
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        # A MoE layer is its router stage, then the routed experts and the combine (runtime/moe.py).
        self.moe = moe_blocks_of(self.pack.manifest)
        expert_names = {name for block in self.moe.values() for name in block.experts}
        in_line = [e for e in self.pack.sub_layers if e["name"] not in expert_names]
        residual_names = []
        for entry in in_line:
            if entry["name"] in self.moe:
                residual_names.append(self.moe[entry["name"]].output)
            else:
                residual_names += [o["name"] for o in entry["outputs"] if len(o["shape"]) == 3 and
                                   o["shape"][-1] == self.hidden_size and o["name"] != LOGITS]
        # Consecutive residual tensors alternate between two buffers: a stage never reads and
        # writes the same one.
        self._buffer_of = {name: index % 2 for index, name in enumerate(residual_names)}
        self.stages = [_Stage(ort, self.pack, entry, options, set(residual_names)) for entry in in_line]
        self.experts = {entry["name"]: _Stage(ort, self.pack, entry, options, set())
                        for entry in self.pack.sub_layers if entry["name"] in expert_names}
        self.num_experts = int(model.get("num_experts") or 0)
        self.expert_stats = ExpertStats()
        # Generation reads only the last token's logits: unless asked for all, the output layer gets the
        # last position only (a 256-token prefill then skips 255 lm_head rows and their logits memory).
        self._all_logits = all_logits
        self._last_hidden = np.empty(0, self.dtype)
        self.run_options = ort.RunOptions()
        self._cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()
        self.kv = HostKvCache([name for stage in self.stages for name in stage.past], self.kv_heads, self.head_dim,
                              self.dtype)
        self._shape: tuple[int, int] | None = None
        self._residual: list[np.ndarray] = []
        self._logits = np.empty(0, self.dtype)

    @property
    def all_logits(self) -> bool:
        return self._all_logits

    @all_logits.setter
    def all_logits(self, value: bool) -> None:
        self._all_logits = value
        self._shape = None  # buffers are remade at the next step, and every stage's pointer bindings with them
        for stage in self.stages:
            stage.bound_shape = None

    def start(self, batch_size: int, context: int | None = None) -> None:
        self.kv.reset(batch_size, context)
        self._bind_kv()

    def _bind_kv(self) -> None:
        for stage in self.stages:
            for past, present in zip(stage.past, stage.present, strict=True):
                buffer = self.kv.buffers[past]
                for bind, name in ((stage.binding.bind_input, past), (stage.binding.bind_output, present)):
                    bind(name, self._cpu, buffer.dtype, list(buffer.shape), buffer.ctypes.data)

    def _bind_pointers(self, stage: _Stage) -> None:
        """(Re)bind the residual buffers and logits of a stage for the current batch shape."""
        last_only = LOGITS in stage.pointer_outputs and not self.all_logits
        for name in stage.residual_inputs:
            array = self._last_hidden if last_only else self._residual[self._buffer_of[name]]
            stage.binding.bind_input(name, self._cpu, array.dtype, list(array.shape), array.ctypes.data)
        for name in stage.pointer_outputs:
            array = self._logits if name == LOGITS else self._residual[self._buffer_of[name]]
            stage.binding.bind_output(name, self._cpu, array.dtype, list(array.shape), array.ctypes.data)
        stage.bound_shape = self._shape

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        shape = input_ids.shape
        check_step_shape(shape[0], shape[1], attention_mask.shape[1])
        if self.kv.ensure(attention_mask.shape[1]):
            self._bind_kv()
        if shape != self._shape:
            self._shape = shape
            self._residual = [np.empty((*shape, self.hidden_size), self.dtype) for _ in range(2)]
            logit_rows = shape[1] if self.all_logits else 1
            self._logits = np.empty((shape[0], logit_rows, self.vocab_size), self.dtype)
            self._last_hidden = np.empty((shape[0], 1, self.hidden_size), self.dtype)
        step_inputs = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                       "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                       "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64)}
        shared: dict[str, object] = {}
        run_options, cpu = self.run_options, self._cpu
        for stage in self.stages:
            binding = stage.binding
            if stage.bound_shape != shape:
                self._bind_pointers(stage)
            if stage.takes_last_hidden and not self.all_logits:
                np.copyto(self._last_hidden, self._residual[self._buffer_of[stage.residual_inputs[0]]][:, -1:, :])
            for name in stage.step_inputs:
                binding.bind_input(name, step_inputs[name])
            for name in stage.shared_inputs:
                binding.bind_ortvalue_input(name, shared[name])
            for name in stage.allocated_outputs:
                binding.bind_output(name, cpu)
            stage.run(binding, run_options)
            if stage.allocated_outputs:
                produced = binding.get_outputs()
                for index, name in enumerate(stage.bound_output_order):
                    shared[name] = produced[index]
            if stage.name in self.moe:
                self._run_experts(self.moe[stage.name], shared, shape[0] * shape[1])
        if self.moe:
            self.expert_stats.steps += 1
            self.expert_stats.routed_tokens += shape[0] * shape[1]
        return self._logits

    def _run_experts(self, block: MoeBlock, shared: dict, step_tokens: int) -> None:
        """The experts the router chose, each over its tokens, summed into the next residual buffer."""
        hidden, routing = shared[block.hidden].numpy(), shared[block.routing].numpy()
        chosen = chosen_experts(routing)
        self.expert_stats.record(block.layer, self.num_experts, chosen, step_tokens)

        def run_expert(expert: int, rows_hidden: np.ndarray, rows_routing: np.ndarray) -> np.ndarray:
            stage = self.experts[block.experts[expert]]
            out = np.empty_like(rows_hidden)
            run_on_arrays(stage.binding, stage.run, self.run_options, self._cpu,
                          dict(zip(stage.shared_inputs, (rows_hidden, rows_routing)
                                   if stage.shared_inputs[0] == block.hidden else (rows_routing, rows_hidden),
                                   strict=True)), stage.allocated_outputs[0], out)
            return out

        combine(self._residual[self._buffer_of[block.residual]], hidden, routing, chosen, run_expert,
                self._residual[self._buffer_of[block.output]])
