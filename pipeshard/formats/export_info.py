"""Reading an export folder (the exporter's output) without importing the exporter."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import read_json

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
NUMPY_DTYPES = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "bf16": BFLOAT16,
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy type of a dtype name in a manifest or export.json (fp16, bfloat16, int64, ...)."""
    return NUMPY_DTYPES.get(name) or np.dtype(name)


def compute_dtype(model: dict) -> np.dtype:
    """The type of a model's activations and KV cache: its `compute_dtype` (half-precision weights computed in
    float32), else its `dtype` (exports made before weights and activations could differ)."""
    return NUMPY_DTYPES[model.get("compute_dtype", model["dtype"])]


REQUIRED_FIELDS = ("architecture", "dims", "dtype", "model_file", "inputs", "outputs")


def read_export_info(folder: Path) -> dict:
    """The export.json of an export folder, checked for the fields the runtime relies on."""
    path = Path(folder) / "export.json"
    info = read_json(path, "pipeshard export folder")
    if info.get("schema_version") != EXPORT_SCHEMA_VERSION:
        raise UserError(
            f"{path}: unsupported schema_version {info.get('schema_version')!r} "
            f"(this pipeshard reads {EXPORT_SCHEMA_VERSION}; export the model again)"
        )
    for field in REQUIRED_FIELDS:
        if field not in info:
            raise UserError(f"{path}: missing field {field!r}")
    if not (Path(folder) / info["model_file"]).is_file():
        raise UserError(f"{Path(folder) / info['model_file']} is missing")
    for name, listed in info.get("files", {}).items():
        path = Path(folder) / name
        if not path.is_file():
            raise UserError(f"{path} is missing (listed in export.json)")
        if path.stat().st_size != listed["bytes"]:
            raise UserError(
                f"{path} has {path.stat().st_size} bytes, export.json says {listed['bytes']} "
                "(truncated or replaced)"
            )
    return info
