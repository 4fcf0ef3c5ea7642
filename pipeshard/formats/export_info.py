"""Reading an export folder (the exporter's output) without importing the exporter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json
from pipeshard.formats.fields import Fields
from pipeshard.formats.image_preprocessing import ImagePreprocessing
from pipeshard.formats.manifest import MAX_DIMENSION, FileDigest

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
class ModelDims:
    """export.json's `dims`: the decoder's dimensions (the exporter's DecoderDims; MoE fields 0 for a dense model)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    num_experts: int = 0  # MoE only: experts per layer, routed per token, and each expert's FFN width
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sliding_window: int = 0  # keys a sliding-window layer attends to (0: none)

    @classmethod
    def from_json(cls, fields: Fields) -> ModelDims:
        values = {}
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "max_context"):  # fmt: skip
            values[name] = fields.int(name, maximum=MAX_DIMENSION)
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size", "sliding_window"):
            values[name] = fields.int(name, 0, maximum=MAX_DIMENSION)
        fields.done()
        return cls(**values)


@dataclass(frozen=True)
class ExportVision:
    """export.json's `vision` section: the vision graph's file, what its blocks' costs are counted from, and its image
    preprocessing; `facts` is the section as written (the pack's manifest carries it on, docs/vlm.md)."""

    file: str
    family: str  # idefics3 | qwen2_vl | llava | gemma3: how the partitioner cuts the tower into blocks
    hidden_size: int
    num_attention_heads: int
    preprocessing: ImagePreprocessing | None
    facts: dict

    @classmethod
    def from_json(cls, fields: Fields) -> ExportVision:
        preprocessing = fields.object("preprocessing", None)
        return cls(
            file=fields.str("file"),
            family=fields.str("family", "idefics3"),
            hidden_size=fields.int("hidden_size", minimum=1, maximum=MAX_DIMENSION),
            num_attention_heads=fields.int("num_attention_heads", minimum=1, maximum=MAX_DIMENSION),
            preprocessing=ImagePreprocessing.from_json(preprocessing) if preprocessing else None,
            facts=fields.document,
        )


@dataclass(frozen=True)
class ExportInfo:
    """export.json: what the exporter wrote (docs/cli.md, "export"), as the partitioner and runtime read it."""

    architecture: str
    dims: ModelDims
    dtype: str  # the stored weights: fp32 | fp16 | bf16 | gguf (a GGUF's quantized blocks)
    compute_dtype: str  # activations
    model_file: str
    inputs: list[str]
    outputs: list[str]
    position_rows: int = 1  # 3: M-RoPE position ids
    tie_word_embeddings: bool = False
    vision: ExportVision | None = None  # a VLM's vision graph: its file, dims, image token and preprocessing
    shape_only: bool = False
    files: dict[str, FileDigest] = field(default_factory=dict)  # sizes checked at load, digests by --verify
    attention_dtype: str = "fp32"  # the fused attention's inputs, output and KV cache (docs/precision.md)

    @property
    def activation_dtype(self) -> np.dtype:
        return NUMPY_DTYPES[self.compute_dtype]

    @classmethod
    def from_json(cls, document: object, where: str) -> ExportInfo:
        fields = Fields(document, where)
        fields.schema(EXPORT_SCHEMA_VERSION, "export the model again")
        dims = ModelDims.from_json(fields.object("dims"))
        dtype = fields.str("dtype", choices=("fp32", "fp16", "bf16", "gguf"))
        files = {}
        listed = fields.object("files", {})
        for name in list(listed.document):
            entry = listed.object(name)
            files[name] = FileDigest(entry.int("bytes"), entry.str("sha256"))
            entry.done()
        vision = fields.object("vision", None)
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
            vision=ExportVision.from_json(vision) if vision else None,
            shape_only=fields.bool("shape_only", False),
            files=files,
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
