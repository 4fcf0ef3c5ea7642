"""Reading a model pack (manifest.json + sub-layer files): the contract between partitioner and runtime."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.errors import UserError
from pipeshard.fsutil import sha256_file
from pipeshard.runtime.exportdir import numpy_dtype, read_json

MANIFEST_NAME = "manifest.json"
PACK_SCHEMA_VERSION = 2  # 2: KV caches are in-place buffers (GroupQueryAttention), see docs/model-pack.md
WEIGHT_ALIGNMENT = 4096
SUB_LAYER_FIELDS = ("name", "kind", "layer", "files", "blob", "weights", "inputs", "outputs", "kv", "cost")


@dataclass
class Pack:
    """A loaded manifest and where its files are."""

    folder: Path
    manifest: dict

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def sub_layers(self) -> list[dict]:
        return self.manifest["sub_layers"]

    @property
    def shape_only(self) -> bool:
        """Made by `export --shape-only`: shapes, bytes and costs for planning, no weights to run."""
        return bool(self.manifest.get("shape_only"))

    def require_weights(self) -> None:
        """Refuse to run a shape-only pack."""
        if self.shape_only:
            raise UserError(
                f"{self.folder} is a shape-only pack (export --shape-only): it holds no weights, so it "
                "can be inspected and planned but not run; export the model with its weights to run it"
            )

    def path(self, name: str) -> Path:
        return self.folder / name


@dataclass
class MappedWeights:
    """Stored weights as read-only arrays over their files, each file mapped once."""

    maps: dict[Path, mmap.mmap] = field(default_factory=dict)

    def add(self, folder: Path, stored: list[dict]) -> dict[str, np.ndarray]:
        """Map a sub-layer's weights (its manifest entries); returns them by name."""
        added = {}
        for weight in stored:
            path = folder / weight["file"]
            if path not in self.maps:
                with open(path, "rb") as file:
                    self.maps[path] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = numpy_dtype(weight["dtype"])
            added[weight["name"]] = np.frombuffer(
                self.maps[path], dtype, weight["bytes"] // dtype.itemsize, weight["offset"]
            ).reshape(weight["shape"])
        return added

    def release_pages(self) -> None:
        """Let the kernel drop the mapped pages (read again from the files if used)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped in self.maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)


def evaluate_cost(coefficients: dict[str, float], tokens: float, context: float) -> float:
    """A manifest cost at T new tokens and context C: const + T*t + C*c + T*C*tc."""
    return (
        coefficients.get("const", 0.0)
        + coefficients.get("T", 0.0) * tokens
        + coefficients.get("C", 0.0) * context
        + coefficients.get("TC", 0.0) * tokens * context
    )


def is_pack(folder: Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def load_pack(folder: Path, verify: bool = False) -> Pack:
    """Read and check a pack: schema, every file present, blob sizes always, sha256 when `verify`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} does not exist or is not a folder")
    path = folder / MANIFEST_NAME
    manifest = read_json(path, "model pack")
    if manifest.get("schema_version") != PACK_SCHEMA_VERSION:
        raise UserError(
            f"{path}: unsupported schema_version {manifest.get('schema_version')!r} "
            f"(this pipeshard reads {PACK_SCHEMA_VERSION}; export and partition the model again)"
        )
    for required in ("model", "sub_layers"):
        if required not in manifest:
            raise UserError(f"{path}: missing field {required!r}")
    for index, entry in enumerate(manifest["sub_layers"]):
        for required in SUB_LAYER_FIELDS:
            if required not in entry:
                raise UserError(f"{path}: sub_layers[{index}] has no field {required!r}")
        if manifest.get("shape_only"):
            continue  # no sub-layer files and no blobs: shapes, bytes and costs only
        for file_name in entry["files"].values():
            if not (folder / file_name).is_file():
                raise UserError(f"{folder / file_name} is missing (sub-layer {entry['name']})")
        blob = entry["blob"]
        if blob:
            blob_path = folder / blob["file"]
            if not blob_path.is_file():
                raise UserError(f"{blob_path} is missing (sub-layer {entry['name']})")
            size = blob_path.stat().st_size
            if size != blob["bytes"]:
                raise UserError(
                    f"{blob_path} has {size} bytes, the manifest says {blob['bytes']} (truncated or replaced)"
                )
            if verify and sha256_file(blob_path) != blob["sha256"]:
                raise UserError(f"{blob_path} does not match its sha256 in the manifest (corrupt)")
    for name, listed in manifest.get("files", {}).items():
        file_path = folder / name
        if not file_path.is_file():
            raise UserError(f"{file_path} is missing (listed in the manifest)")
        if (
            file_path.stat().st_size != listed["bytes"]
            or verify
            and sha256_file(file_path) != listed["sha256"]
        ):
            raise UserError(f"{file_path} does not match the manifest (corrupt or replaced)")
    return Pack(folder, manifest)
