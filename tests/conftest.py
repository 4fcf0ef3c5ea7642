"""Shared fixtures: exports are made once per test session (tiny ones in seconds; SmolLM2 cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeshard.exporter.offline import force_offline

force_offline()
REPO = Path(__file__).resolve().parents[1]
# SmolLM2 exports take minutes: kept between test runs under build/ (ignored by git).
CACHE = Path(os.environ.get("PIPESHARD_TEST_CACHE", REPO / "build" / "test-cache"))


def _export_once(model: str, folder: Path) -> Path:
    from pipeshard.exporter import export_model

    if not (folder / "export.json").is_file():
        export_model(model, folder, force=True, quiet=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_export(tmp_path_factory) -> Path:
    return _export_once("tiny:llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def smollm2_export() -> Path:
    return _export_once("smollm2-135m", CACHE / "smollm2-fp32")
