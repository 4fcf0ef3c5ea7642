"""The all-CPU chain: every sub-layer of a pack in manifest order, one CPU-EP session each.

Boundary tensors move as ORT values through IO binding: the residual stream goes through two
preallocated buffers (ping-pong), the prologue's shared values and each attention's KV cache are
ORT-allocated values handed from one step to the next without touching numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime
from pipeshard.runtime.pack import Pack, load_pack

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")


class _Stage:
    """One sub-layer's session, binding and the names it reads and writes."""

    def __init__(self, ort, pack: Pack, entry: dict, options) -> None:
        self.name = entry["name"]
        self.session = ort.InferenceSession(str(pack.path(entry["files"]["onnx"])), options,
                                            providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.inputs = [i["name"] for i in entry["inputs"]]
        self.outputs = [o["name"] for o in entry["outputs"]]
        kv = entry["kv"] or {}
        self.past = kv.get("past", [])
        self.present = kv.get("present", [])


class ChainStep:
    """A ForwardStep over a model pack, all on the CPU EP."""

    def __init__(self, folder: Path, threads: int | None = None, optimize: bool = True, prepack: bool = True,
                 verify: bool = False) -> None:
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
        self.stages = [_Stage(ort, self.pack, entry, options) for entry in self.pack.sub_layers]
        produced_by = {name: stage for stage in self.stages for name in stage.outputs}
        # Residual-stream tensors: float [batch, tokens, hidden] passed between consecutive compute stages.
        residual_kinds = {e["name"]: [o["name"] for o in e["outputs"]
                                      if o["shape"] and o["shape"][-1] == self.hidden_size and len(o["shape"]) == 3]
                          for e in self.pack.sub_layers}
        self._residual = {name for names in residual_kinds.values() for name in names}
        self._logits_name = "logits"
        self._produced_by = produced_by
        self.run_options = ort.RunOptions()
        self._kv: dict[str, object] = {}
        self._buffers: dict[tuple[int, int], list[np.ndarray]] = {}

    def start(self, batch_size: int) -> None:
        empty = np.zeros((batch_size, self.kv_heads, 0, self.head_dim), dtype=self.dtype)
        self._kv = {name: self._ort.OrtValue.ortvalue_from_numpy(empty)
                    for stage in self.stages for name in stage.past}

    def _residual_buffers(self, batch: int, tokens: int) -> list[np.ndarray]:
        key = (batch, tokens)
        if key not in self._buffers:
            self._buffers = {key: [np.empty((batch, tokens, self.hidden_size), self.dtype) for _ in range(2)]}
        return self._buffers[key]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        batch, tokens = input_ids.shape
        step_inputs = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                       "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                       "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64)}
        buffers = self._residual_buffers(batch, tokens)
        logits = np.empty((batch, tokens, self.vocab_size), self.dtype)
        values: dict[str, object] = {}
        flip = 0
        for stage in self.stages:
            binding = stage.binding
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            for name in stage.inputs:
                if name in step_inputs:
                    binding.bind_cpu_input(name, step_inputs[name])
                elif name in self._kv:
                    binding.bind_ortvalue_input(name, self._kv[name])
                elif isinstance(values[name], np.ndarray):
                    array = values[name]
                    binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
                else:
                    binding.bind_ortvalue_input(name, values[name])
            allocated = []
            for name in stage.outputs:
                if name in self._residual:
                    array = buffers[flip]
                    flip ^= 1
                    binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
                    values[name] = array
                elif name == self._logits_name:
                    binding.bind_output(name, "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
                else:
                    binding.bind_output(name)
                    allocated.append(name)
            stage.session._sess.run_with_iobinding(binding._iobinding, self.run_options)
            if allocated:
                produced = dict(zip(stage.outputs, binding.get_outputs(), strict=True))
                for name in allocated:
                    values[name] = produced[name]
            for past, present in zip(stage.past, stage.present, strict=True):
                self._kv[past] = values.pop(present)
        return logits
