"""The reference forward step: one ONNX Runtime session over the whole exported decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.runtime.exportdir import read_export_info
from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class MonolithicStep:
    """Runs model.onnx with IO binding; the `present` outputs stay ORT values and are bound as the
    next step's `past` inputs, so the KV cache is never copied through numpy."""

    def __init__(self, folder: Path, threads: int | None = None, optimize: bool = True) -> None:
        ort = import_onnxruntime()
        self.folder = Path(folder)
        self.info = read_export_info(self.folder)
        dims = self.info["dims"]
        self.max_context = int(dims["max_context"])
        self.kv_heads = int(dims["num_key_value_heads"])
        self.head_dim = int(dims["head_dim"])
        self.kv_dtype = NUMPY_DTYPES[self.info["dtype"]]
        self.session = ort.InferenceSession(str(self.folder / self.info["model_file"]),
                                            cpu_session_options(threads, optimize),
                                            providers=["CPUExecutionProvider"])
        self.past_names = [name for name in self.info["inputs"] if name.startswith("past_key_values.")]
        self.present_names = [name for name in self.info["outputs"] if name.startswith("present.")]
        self.binding = self.session.io_binding()
        self.run_options = ort.RunOptions()
        self._ort = ort
        self._past = []

    def start(self, batch_size: int, context: int | None = None) -> None:
        empty = np.zeros((batch_size, self.kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        self._past = [self._ort.OrtValue.ortvalue_from_numpy(empty) for _ in self.past_names]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        binding = self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        for name, value in zip(self.past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits")
        for name in self.present_names:
            binding.bind_output(name)
        self.session._sess.run_with_iobinding(binding._iobinding, self.run_options)
        outputs = binding.get_outputs()
        self._past = outputs[1:]
        return outputs[0].numpy()
