"""The reference forward step: one ONNX Runtime session over the whole exported decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.formats.export_info import NUMPY_DTYPES, read_export_info
from pipeshard.formats.io_names import IMAGE_FEATURES, PAST_PREFIX, present_name
from pipeshard.runtime import capi
from pipeshard.runtime.kv import HostKvCache, check_step_shape, mrope_settings


class MonolithicStep:
    """Runs model.onnx with IO binding, through the same C-API runtime as the chain (so the two differ only
    by the split). The KV cache is one host buffer per layer bound as both past and present
    (GroupQueryAttention appends in place), bound once per generation."""

    def __init__(self, folder: Path, threads: int | None = None, optimize: bool = True) -> None:
        self.folder = Path(folder)
        self.info = read_export_info(self.folder)
        dims = self.info.dims
        self.max_context = dims.max_context
        rt = capi.runtime(threads)
        self.session = rt.session(self.folder / self.info.model_file, threads, optimize)
        past_names = [name for name in self.info.inputs if name.startswith(PAST_PREFIX)]
        self.kv = HostKvCache(
            past_names,
            dims.num_key_value_heads,
            dims.head_dim,
            NUMPY_DTYPES[self.info.attention_dtype],
        )
        activations = self.info.activation_dtype
        self.vocab_size = dims.vocab_size
        self.binding = self.session.binding()
        self.run_options = rt.run_options()
        self._logits = np.empty(0, activations)
        self.takes_images = IMAGE_FEATURES in self.info.inputs
        self.image_token_id = self.info.vision.preprocessing.image_token_id if self.takes_images else None
        self._no_features = np.zeros((0, dims.hidden_size), activations)
        self.mrope = mrope_settings(
            self.info.position_rows, self.info.vision and self.info.vision.preprocessing
        )

    def start(self, batch_size: int, context: int | None = None) -> None:
        self.binding.clear()  # lets the old KV buffers go before the new ones are made
        self._logits = np.empty(0, self._no_features.dtype)  # rebound at the next step
        self.kv.reset(batch_size, context)
        self._bind_kv()

    def _bind_kv(self) -> None:
        for name, buffer in self.kv.buffers.items():
            self.binding.bind_input(name, buffer)
            self.binding.bind_output(present_name(name), buffer)

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        image_features: np.ndarray | None = None,
    ) -> np.ndarray:
        """One step; a VLM's decoder takes the rows of the step's image tokens (`image_features`)."""
        batch, tokens = input_ids.shape
        total = attention_mask.shape[1]
        check_step_shape(batch, tokens, total)
        if self.kv.ensure(total):
            self._bind_kv()
        binding = self.binding
        binding.bind_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        binding.bind_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        if self.takes_images:
            binding.bind_input(
                IMAGE_FEATURES,
                np.ascontiguousarray(
                    self._no_features if image_features is None else image_features, self._no_features.dtype
                ),
            )
        if self._logits.shape[:2] != (batch, tokens):  # logits land in our buffer: no output is fetched back
            self._logits = np.empty((batch, tokens, self.vocab_size), self._no_features.dtype)
            binding.bind_output("logits", self._logits)
        capi.run(self.session, binding, self.run_options)
        return self._logits
