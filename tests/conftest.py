"""Shared fixtures: exports are made once per test session (tiny ones in seconds; SmolLM2 cached)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeshard.exporter.offline import force_offline

force_offline()
REPO = Path(__file__).resolve().parents[1]
# SmolLM2 exports take minutes: kept between test runs under build/ (ignored by git).
CACHE = Path(os.environ.get("PIPESHARD_TEST_CACHE", REPO / "build" / "test-cache"))


def _export_once(model: str, folder: Path, dtype: str = "fp32") -> Path:
    """Export unless a current export (same schema and dtype) is already there."""
    from pipeshard.exporter import export_model
    from pipeshard.formats.export_info import EXPORT_SCHEMA_VERSION

    info = folder / "export.json"
    current = json.loads(info.read_text()) if info.is_file() else {}
    if current.get("schema_version") != EXPORT_SCHEMA_VERSION or current.get("dtype", "fp32") != dtype:
        export_model(model, folder, dtype=dtype, force=True, quiet=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_export(tmp_path_factory) -> Path:
    return _export_once("tiny:llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def smollm2_export() -> Path:
    return _export_once("smollm2-135m", CACHE / "smollm2-fp32")


@pytest.fixture(scope="session", params=["fp16", "bf16"])
def smollm2_half_export(request) -> Path:
    """SmolLM2 exported with fp16, then bf16 weights (computed in fp32)."""
    return _export_once("smollm2-135m", CACHE / f"smollm2-{request.param}", request.param)


@pytest.fixture(scope="session")
def tiny_pack(tiny_llama_export, tmp_path_factory) -> Path:
    """tiny:llama partitioned once; tests only read it (copy it to change it)."""
    from pipeshard.partitioner.partition import partition

    folder = tmp_path_factory.mktemp("tiny-pack") / "pack"
    partition(tiny_llama_export, folder)
    return folder
