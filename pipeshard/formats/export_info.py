"""Reading an export folder (the exporter's output) without importing the exporter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json
from pipeshard.formats.fields import Fields
from pipeshard.formats.image_preprocessing import ImagePreprocessing
from pipeshard.formats.manifest import FileDigest

EXPORT_SCHEMA_VERSION = 2  # 2: attention is GroupQueryAttention over one in-place KV buffer
KV_CACHE = {
    "layout": "shared-buffer",
    "attention": "com.microsoft.GroupQueryAttention",
    "shape": ["batch", "kv_heads", "capacity", "head_dim"],
}
# numpy has no bfloat16: its bits travel as this 2-byte type, which the C-API runtime passes to ONNX Runtime as
# bfloat16 (runtime/capi.py)
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
# numpy types of the dtype names exports and packs use (model dtype; ONNX names of weights)
# What `pipeshard export --attention-dtype` offers: float16 is what ONNX Runtime's CUDA GroupQueryAttention has
# kernels for and its CPU EP runs too (bfloat16 has CUDA kernels only), so a sim device runs the same graphs.
ATTENTION_DTYPES = ("fp32", "fp16")
NUMPY_DTYPES = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "bf16": BFLOAT16,
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "uint8": np.dtype(np.uint8),  # a GGUF pack's planes: looked up per streamed unit, so kept in the table
    "int8": np.dtype(np.int8),
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy type of a dtype name in a manifest or export.json (fp16, bfloat16, int64, ...)."""
    return NUMPY_DTYPES.get(name) or np.dtype(name)


@dataclass(frozen=True)
class ExportInfo:
    """export.json: what the exporter wrote (docs/cli.md, "export"), as the partitioner and runtime read it."""

    architecture: str
    dims: dict[str, int]  # the model's dimensions as the export config names them
    dtype: str  # the stored weights: fp32 | fp16 | bf16 | gguf (a GGUF's quantized blocks)
    compute_dtype: str  # activations
    model_file: str
    inputs: list[str]
    outputs: list[str]
    position_rows: int = 1  # 3: M-RoPE position ids
    tie_word_embeddings: bool = False
    vision: dict | None = None  # a VLM's vision graph: its file, dims, image token and preprocessing
    shape_only: bool = False
    files: dict[str, FileDigest] = field(default_factory=dict)  # sizes checked at load, digests by --verify
    attention_dtype: str = "fp32"  # the fused attention's inputs, output and KV cache (docs/precision.md)
    vision_file: str | None = None  # the vision graph's file (the `vision` section's `file`)
    image_preprocessing: ImagePreprocessing | None = None  # the `vision` section's `preprocessing`, read

    @property
    def activation_dtype(self) -> np.dtype:
        return NUMPY_DTYPES[self.compute_dtype]

    @classmethod
    def from_json(cls, document: object, where: str) -> ExportInfo:
        fields = Fields(document, where)
        fields.schema(EXPORT_SCHEMA_VERSION, "export the model again")
        dims = fields.raw("dims")
        if not isinstance(dims, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in dims.values()
        ):
            fields.fail("must map dimension names to non-negative integers", "dims")
        dtype = fields.str("dtype", choices=("fp32", "fp16", "bf16", "gguf"))
        files = {}
        listed = fields.object("files", {})
        for name in list(listed.document):
            entry = listed.object(name)
            files[name] = FileDigest(entry.int("bytes"), entry.str("sha256"))
            entry.done()
        vision = fields.raw("vision", None)
        if vision is not None and not isinstance(vision, dict):
            fields.fail("must be an object", "vision")
        vision_fields = fields.object("vision", None)
        preprocessing = vision_fields and vision_fields.object("preprocessing", None)
        info = cls(
            architecture=fields.str("architecture"),
            dims=dims,
            dtype=dtype,
            compute_dtype=(compute := fields.str("compute_dtype", dtype, choices=("fp32", "fp16", "bf16"))),
            attention_dtype=fields.str("attention_dtype", compute, choices=("fp32", "fp16", "bf16")),
            model_file=fields.str("model_file"),
            inputs=fields.str_list("inputs"),
            outputs=fields.str_list("outputs"),
            position_rows=fields.int("position_rows", 1, minimum=1, maximum=3),
            tie_word_embeddings=fields.bool("tie_word_embeddings", False),
            vision=vision,
            shape_only=fields.bool("shape_only", False),
            files=files,
            vision_file=vision_fields and vision_fields.str("file", None),
            image_preprocessing=ImagePreprocessing.from_json(preprocessing) if preprocessing else None,
        )
        if "/" in info.model_file or ".." in info.model_file:
            fields.fail("must name a file inside the export folder", "model_file")
        fields.done(ignore=DESCRIPTIVE_FIELDS)
        return info


# Fields that describe how the export was made; nothing downstream reads them.
DESCRIPTIVE_FIELDS = ("source", "task", "opset", "kv_cache", "max_logit_difference_vs_pytorch", "onnx_tokenizer_check",
                      "tools", "quantized_weights")  # fmt: skip


def read_export_info(folder: Path) -> ExportInfo:
    """The export.json of an export folder, checked field by field, with the files it lists."""
    path = Path(folder) / "export.json"
    info = ExportInfo.from_json(read_json(path, "pipeshard export folder"), str(path))
    if not (Path(folder) / info.model_file).is_file():
        raise UserError(f"{Path(folder) / info.model_file} is missing")
    for name, listed in info.files.items():
        file_path = Path(folder) / name
        if not file_path.is_file():
            raise UserError(f"{file_path} is missing (listed in export.json)")
        if file_path.stat().st_size != listed.bytes:
            raise UserError(
                f"{file_path} has {file_path.stat().st_size} bytes, export.json says {listed.bytes} (truncated or "
                "replaced)"
            )
    return info
