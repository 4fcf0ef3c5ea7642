"""A bounded read of a GGUF file's header, before any library parses it: a downloaded file is untrusted.

Every length, count and offset in the header is checked against the bytes the file really has before anything is
allocated or skipped, so a damaged or hostile file (a string of 2^60 bytes, an array of 2^40 elements, a tensor
past the end) is one `error:` line in milliseconds rather than a hang or an allocation the size of the claim. The
model it describes must be a model: its architecture named, its dimensions positive integers within reason, and
the tensors its blocks need present (else transformers would build a default-size model around nothing).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeshard.core.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4  # the format nests arrays; real files use one level
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16
# Value types: (struct format, bytes) for the fixed-size ones; STRING and ARRAY are read apart.
STRING, ARRAY = 8, 9
FIXED = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
# What each model dimension may be: the key under `{architecture}.`, and an upper bound no real model reaches.
DIMENSIONS = {
    "block_count": 1 << 12,
    "embedding_length": 1 << 20,
    "attention.head_count": 1 << 12,
}
OPTIONAL_DIMENSIONS = {
    "feed_forward_length": 1 << 22,
    "context_length": 1 << 24,
    "attention.head_count_kv": 1 << 12,
    "expert_count": 1 << 14,
    "expert_used_count": 1 << 14,
    "vocab_size": 1 << 24,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufHeader:
    """The file's scalar metadata (arrays as their element type and length) and tensor table."""

    version: int
    metadata: dict[str, object]
    tensors: tuple[TensorEntry, ...]
    data_start: int

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None


class _Cursor:
    """Reads little-endian values from a mapped file, refusing any read past its end."""

    def __init__(self, data, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def fail(self, what: str) -> UserError:
        return UserError(f"{self.path} is not a readable GGUF file ({what}, at byte {self.at})")

    def take(self, count: int, what: str) -> int:
        if count < 0 or count > len(self.data) - self.at:
            raise self.fail(f"{what} of {count} bytes runs past the end of the file")
        start = self.at
        self.at += count
        return start

    def fixed(self, type_id: int, what: str):
        form, size = FIXED[type_id]
        return struct.unpack_from(form, self.data, self.take(size, what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.fixed(10, what + " length")
        if limit is not None and length > limit:
            raise self.fail(f"{what} of {length} bytes is longer than {limit}")
        start = self.take(length, what)
        try:
            return bytes(self.data[start : start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def skip_string(self, what: str) -> None:
        self.take(self.fixed(10, what + " length"), what)


def _value(cursor: _Cursor, type_id: int, key: str, depth: int = 0):
    """A metadata value: scalars and strings as themselves, arrays as (element type, length) once skipped."""
    if type_id in FIXED:
        return cursor.fixed(type_id, f"the value of {key}")
    if type_id == STRING:
        return cursor.string(f"the string {key}")
    if type_id != ARRAY:
        raise cursor.fail(f"{key} has unknown value type {type_id}")
    if depth >= MAX_ARRAY_DEPTH:
        raise cursor.fail(f"{key} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    element = cursor.fixed(4, f"the element type of {key}")
    count = cursor.fixed(10, f"the length of {key}")
    if element in FIXED:
        cursor.take(count * FIXED[element][1], f"the array {key} ({count} elements)")
    elif element == STRING:
        if count * 8 > len(cursor.data) - cursor.at:
            raise cursor.fail(f"the array {key} claims {count} strings, more than the file can hold")
        for _ in range(count):
            cursor.skip_string(f"a string of {key}")
    elif element == ARRAY:
        if count * 12 > len(cursor.data) - cursor.at:
            raise cursor.fail(f"the array {key} claims {count} arrays, more than the file can hold")
        for _ in range(count):
            _value(cursor, ARRAY, key, depth + 1)
    else:
        raise cursor.fail(f"{key} has unknown element type {element}")
    return (element, count)


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at `path`, every field bounded by the file's size; UserError if damaged."""
    path = Path(path)
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size < 24:
            raise UserError(f"{path} is not a GGUF file (only {size} bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(_Cursor(data, path), size)


def _read(cursor: _Cursor, size: int) -> GgufHeader:
    if bytes(cursor.data[0:4]) != MAGIC:
        raise UserError(f"{cursor.path} is not a GGUF file (bad magic bytes)")
    cursor.at = 4
    version = cursor.fixed(4, "the version")
    if version not in VERSIONS:
        raise cursor.fail(f"version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
    tensor_count = cursor.fixed(10, "the tensor count")
    kv_count = cursor.fixed(10, "the metadata count")
    if kv_count * 13 > size or tensor_count * 24 > size:  # the smallest entry of each
        raise cursor.fail(
            f"{kv_count} metadata entries and {tensor_count} tensors cannot fit in {size} bytes"
        )
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = cursor.string("a metadata key", MAX_KEY_BYTES)
        metadata[key] = _value(cursor, cursor.fixed(4, f"the type of {key}"), key)
    tensors = []
    for _ in range(tensor_count):
        name = cursor.string("a tensor name", MAX_KEY_BYTES)
        rank = cursor.fixed(4, f"the rank of {name}")
        if not 1 <= rank <= MAX_DIMS:
            raise cursor.fail(f"tensor {name} has {rank} dimensions (1 to {MAX_DIMS})")
        dims = tuple(cursor.fixed(10, f"a dimension of {name}") for _ in range(rank))
        tensors.append(
            TensorEntry(name, dims, cursor.fixed(4, f"the type of {name}"), cursor.fixed(10, name))
        )
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.at // alignment) * alignment
    header = GgufHeader(version, metadata, tuple(tensors), data_start)
    _check_tensors(header, cursor.path, size)
    return header


def _check_tensors(header: GgufHeader, path: Path, size: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {t.value: t for t in GGMLQuantizationType}
    for tensor in header.tensors:
        kind = known.get(tensor.type_id)
        if kind is None:
            raise UserError(
                f"{path}: tensor {tensor.name} has GGML type {tensor.type_id}, which is not known"
            )
        if any(d <= 0 for d in tensor.dims):
            raise UserError(f"{path}: tensor {tensor.name} has a dimension of 0 ({list(tensor.dims)})")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if tensor.dims[0] % block:
            raise UserError(
                f"{path}: tensor {tensor.name} ({kind.name}) has rows of {tensor.dims[0]}, not a multiple of "
                f"its block of {block}"
            )
        elements = 1
        for d in tensor.dims:
            elements *= d
        end = header.data_start + tensor.offset + elements // block * block_bytes
        if end > size:
            raise UserError(f"{path} is truncated: tensor {tensor.name} ends past the end of the file")


def check_model(header: GgufHeader, path: Path) -> str:
    """The architecture the header declares, once its dimensions and tensors can be a model of it."""
    architecture = header.architecture
    if architecture is None:
        raise UserError(f"{path}: no general.architecture in its metadata: not a model file")
    dimensions = {}
    for name, limit in {**DIMENSIONS, **OPTIONAL_DIMENSIONS}.items():
        key = f"{architecture}.{name}"
        value = header.metadata.get(key)
        if value is None and name in OPTIONAL_DIMENSIONS:
            continue
        if value is None:
            raise UserError(f"{path}: {key} is missing from its metadata")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise UserError(f"{path}: {key} must be an integer from 1 to {limit}, not {value!r}")
        dimensions[name] = value
    heads, kv_heads = dimensions["attention.head_count"], dimensions.get("attention.head_count_kv")
    if kv_heads is not None and heads % kv_heads:
        raise UserError(f"{path}: {kv_heads} KV heads do not divide {heads} attention heads")
    names = {t.name for t in header.tensors}
    if "token_embd.weight" not in names:
        raise UserError(f"{path}: tensor token_embd.weight is missing")
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    missing = sorted(set(range(dimensions["block_count"])) - blocks)
    if missing:
        raise UserError(
            f"{path}: {architecture}.block_count is {dimensions['block_count']} but block {missing[0]} has "
            "no tensors"
        )
    return architecture
