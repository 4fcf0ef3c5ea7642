"""Damaged and hostile GGUF files: each is one `error:` line naming what is wrong, in well under a second, before
any library parses the file (issue 42's six kinds of bad metadata, huge claimed strings and arrays, tensors past
the end or of unknown types)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest

from pipeshard.core.errors import UserError
from pipeshard.exporter.gguf_header import check_model, read_header
from pipeshard.exporter.sources import builtin_gguf_path, resolve_source

U32, I32, F32, STRING, ARRAY, U64 = 4, 5, 6, 8, 9, 10
GOOD_METADATA = [
    ("general.architecture", STRING, "llama"),
    ("llama.block_count", U32, 1),
    ("llama.embedding_length", U32, 8),
    ("llama.attention.head_count", U32, 2),
    ("llama.attention.head_count_kv", U32, 1),
    ("llama.context_length", U32, 64),
]
GOOD_TENSORS = [("token_embd.weight", (8, 16), 0), ("blk.0.attn_q.weight", (8, 8), 0)]


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        element, items = value
        return struct.pack("<IQ", element, len(items)) + b"".join(_value(element, v) for v in items)
    return struct.pack({U32: "<I", I32: "<i", F32: "<f", U64: "<Q"}[kind], value)


def gguf_bytes(
    metadata=GOOD_METADATA, tensors=GOOD_TENSORS, raw_metadata: bytes = b"", kv_count=None
) -> bytes:
    """A small GGUF v3 file of F32 tensors (type 0), laid out as llama.cpp writes them."""
    kvs = b"".join(_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, kind, v in metadata)
    infos, offset = b"", 0
    for name, dims, type_id in tensors:
        infos += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", type_id, offset)
        offset += 4 * dims[0] * (dims[1] if len(dims) > 1 else 1)
    count = len(metadata) + (1 if raw_metadata else 0) if kv_count is None else kv_count
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), count) + kvs + raw_metadata + infos
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * offset


def _metadata(**changes):
    kept = [(k, kind, v) for k, kind, v in GOOD_METADATA if k not in changes]
    return kept + [change for change in changes.values() if change is not None]


CASES = {
    "no metadata at all": (dict(metadata=[]), "no general.architecture"),
    "a string of 2^60 bytes": (
        dict(raw_metadata=_string("general.name") + struct.pack("<IQ", STRING, 1 << 60)),
        "runs past the end",
    ),
    "an array of 2^40 elements": (
        dict(raw_metadata=_string("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, F32, 1 << 40)),
        "runs past the end",
    ),
    "an array of 2^40 strings": (
        dict(raw_metadata=_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 40)),
        "more than the file can hold",
    ),
    "2^62 metadata entries": (dict(kv_count=1 << 62), "cannot fit"),
    "negative head counts": (
        dict(metadata=_metadata(**{"llama.attention.head_count": ("llama.attention.head_count", I32, -4)})),
        "llama.attention.head_count must be an integer",
    ),
    "width 0": (
        dict(metadata=_metadata(**{"llama.embedding_length": ("llama.embedding_length", U32, 0)})),
        "llama.embedding_length must be an integer",
    ),
    "a string block_count": (
        dict(metadata=_metadata(**{"llama.block_count": ("llama.block_count", STRING, "12")})),
        "llama.block_count must be an integer",
    ),
    "block_count 4e9": (
        dict(metadata=_metadata(**{"llama.block_count": ("llama.block_count", U32, 4_000_000_000)})),
        "llama.block_count must be an integer",
    ),
    "a missing dimension": (
        dict(metadata=_metadata(**{"llama.embedding_length": None})),
        "llama.embedding_length is missing",
    ),
    "KV heads that do not divide the heads": (
        dict(
            metadata=_metadata(**{"llama.attention.head_count_kv": ("llama.attention.head_count_kv", U32, 3)})
        ),
        "do not divide",
    ),
    "missing block tensors": (
        dict(metadata=_metadata(**{"llama.block_count": ("llama.block_count", U32, 2)})),
        "block 1 has no tensors",
    ),
    "no embedding tensor": (dict(tensors=GOOD_TENSORS[1:]), "token_embd.weight is missing"),
    "an unknown tensor type": (
        dict(tensors=[GOOD_TENSORS[0], ("blk.0.attn_q.weight", (8, 8), 250)]),
        "blk.0.attn_q.weight has GGML type 250",
    ),
    "a tensor of rank 9": (dict(tensors=[("token_embd.weight", (1,) * 9, 0)]), "has 9 dimensions"),
    "a zero dimension": (
        dict(tensors=[GOOD_TENSORS[0], ("blk.0.attn_q.weight", (8, 0), 0)]),
        "dimension of 0",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_gguf_is_one_error_naming_it_at_once(tmp_path, case):
    options, fragment = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes(**options))
    begin = time.perf_counter()
    with pytest.raises(UserError, match=fragment):
        resolve_source(str(path))
    assert time.perf_counter() - begin < 2


def test_a_truncated_or_cut_gguf_is_refused(tmp_path):
    whole = gguf_bytes()
    for size, fragment in (
        (len(whole) - 1, "truncated"),
        (40, "cannot fit"),
        (200, "past the end"),
        (10, "only 10 bytes"),
    ):
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(whole[:size])
        with pytest.raises(UserError, match=fragment):
            resolve_source(str(path))
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + struct.pack("<I", 1) + whole[8:])
    with pytest.raises(UserError, match="version 1"):
        resolve_source(str(tmp_path / "v1.gguf"))


def test_the_well_formed_file_and_the_shipped_ggufs_pass(tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(gguf_bytes())
    assert check_model(read_header(path), path) == "llama"
    smollm2 = read_header(builtin_gguf_path("smollm2-135m"))
    assert smollm2.architecture == "llama" and smollm2.metadata["llama.block_count"] == 30
    assert len(smollm2.tensors) == 272 and smollm2.metadata["tokenizer.ggml.tokens"] == (STRING, 49152)


def test_export_of_a_hostile_gguf_is_one_error_line_exit_2(tmp_path):
    path = tmp_path / "huge.gguf"
    path.write_bytes(gguf_bytes(**CASES["an array of 2^40 elements"][0]))
    done = subprocess.run(
        [sys.executable, "-m", "pipeshard.cli", "export", str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 2 and done.stderr.startswith("error:") and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()
