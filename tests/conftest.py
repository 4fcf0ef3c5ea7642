"""Shared fixtures: every export and pack a test reads is made once per test session (`models`); the exports are
kept between runs under build/test-cache while the code that made them is unchanged."""

from __future__ import annotations

import ast
import collections
import fcntl
import functools
import gc
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeshard.exporter.offline import force_offline

force_offline()
REPO = Path(__file__).resolve().parents[1]
# Exports are kept between test runs under build/ (ignored by git), each under the fingerprint of the code and the
# libraries that made it: a change to the exporter makes them again.
CACHE = Path(os.environ.get("PIPESHARD_TEST_CACHE", REPO / "build" / "test-cache"))
FINGERPRINT_FILE = ".made-by"
EXPORT_CODE = ("exporter", "pipeshard/core", "pipeshard/formats")
EXPORT_LIBRARIES = ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "gguf")


def parse_python(source: str) -> ast.Module:
    """`ast.parse` with the garbage collector off. CPython 3.11.7's AST builder keeps one recursion counter for every
    thread (gh-106905): a collection during the build can run finalizers, switch threads and let another thread's parse
    move the counter, which fails this parse with "AST constructor recursion depth mismatch"."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if was_enabled:
            gc.enable()


@functools.cache
def _export_fingerprint() -> str:
    """A digest of every source file an export runs and the versions of the libraries it uses."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    for folder in EXPORT_CODE:
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    for library in EXPORT_LIBRARIES:
        digest.update(f"{library}={version(library)}".encode())
    return digest.hexdigest()


def _export_once(model: str, folder: Path, dtype: str = "fp32", attention: str = "fp32") -> Path:
    """Export unless an export made by the same code and libraries is already there."""
    from pipeshard.exporter import export_model

    stamp = folder / FINGERPRINT_FILE
    CACHE.mkdir(parents=True, exist_ok=True)
    # `make test` runs two pytest workers: the one that exports first holds the folder, the other waits for it
    with open(CACHE / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and stamp.read_text() == _export_fingerprint()):
            export_model(model, folder, dtype=dtype, force=True, quiet=True, attention_dtype=attention)
            stamp.write_text(_export_fingerprint())
    return folder


def _folder_name(name: str, dtype: str, attention: str) -> str:
    return f"{name.replace(':', '-')}-{dtype}" + ("" if attention == "fp32" else f"-attention-{attention}")


class Models:
    """The session's exports and packs, each made on first use and shared by every test after it. Tests only read
    them: a test that changes one works on a copy (shutil.copytree)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.partition_seconds: dict[tuple[str, str, str], float] = {}  # how long each pack took to make
        self._exports: dict[tuple[str, str, str], Path] = {}
        self._packs: dict[tuple[str, str, str], Path] = {}

    def export(self, name: str, dtype: str = "fp32", attention: str = "fp32") -> Path:
        """NAME (`tiny:ARCH` or a built-in model) exported with DTYPE weights and ATTENTION (`--attention-dtype`),
        kept under CACHE between runs."""
        key = (name, dtype, attention)
        if key not in self._exports:
            folder = CACHE / _folder_name(*key)
            self._exports[key] = _export_once(name, folder, dtype, attention)
        return self._exports[key]

    def pack(self, name: str, dtype: str = "fp32", attention: str = "fp32") -> Path:
        """The pack of `export(name, dtype, attention)`, partitioned once per session."""
        from pipeshard.partitioner.partition import partition

        key = (name, dtype, attention)
        if key not in self._packs:
            export = self.export(*key)
            folder = self.root / _folder_name(*key) / "pack"
            started = time.perf_counter()
            partition(export, folder)
            self.partition_seconds[key] = time.perf_counter() - started
            self._packs[key] = folder
        return self._packs[key]


ALONE_FLAG = "PIPESHARD_TEST_ALONE_FLAG"  # a file the controller makes when a worker has finished
_all_cpus: list[int] = []  # a worker's CPUs before it took its share; empty once it has them back


def pytest_configure(config) -> None:
    """Each of `make test`'s workers on its own share of the CPUs (ONNX Runtime and torch size their thread pools
    by it): two workers each running two threads on two cores spend much of their time switching and spinning.
    The last worker left takes every CPU back (`_every_cpu_once_alone`)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not hasattr(os, "sched_setaffinity"):
        return
    if worker is None:
        if getattr(config.option, "numprocesses", None):
            os.environ[ALONE_FLAG] = str(Path(tempfile.mkdtemp(prefix="pipeshard-tests-")) / "alone")
        return
    cpus = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if 1 < count <= len(cpus):
        _all_cpus[:] = cpus
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % count :: count])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    flag = os.environ.get(ALONE_FLAG)
    if flag:
        Path(flag).touch()


@pytest.fixture(autouse=True)
def _every_cpu_once_alone() -> None:
    """Give a worker every CPU back once another has finished (sessions and processes made after it use them)."""
    flag = os.environ.get(ALONE_FLAG)
    if _all_cpus and flag and os.path.exists(flag):
        os.sched_setaffinity(0, _all_cpus)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(len(_all_cpus))
        _all_cpus.clear()


def pytest_collection_modifyitems(config, items) -> None:
    """The files holding the most slow tests first, each file's tests in their own order. `make test`'s workers take
    a file at a time in this order (`--dist loadfile --no-loadscope-reorder`): a long file started last would keep
    one worker busy while the other has nothing left, and the many fast files after them even the two out."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    place = {path: index for index, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-slow[item.path], place[item.path]))


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_llama_export(models) -> Path:
    return models.export("tiny:llama")


@pytest.fixture(scope="session")
def tiny_pack(models) -> Path:
    """tiny:llama partitioned once; tests only read it (copy it to change it)."""
    return models.pack("tiny:llama")


@pytest.fixture(scope="session")
def smollm2_export(models) -> Path:
    return models.export("smollm2-135m")


# the 15 matrices of the tiny GGUF take these in turn: every format holds one or two roles (the tied embedding Q8_0,
# the fused q/k/v projections mixing 32- and 16-weight blocks)
EVERY_FORMAT = ["Q8_0", "Q4_0", "Q6_K", "Q4_1", "Q2_K", "Q5_0", "Q3_K", "Q5_1", "Q4_K", "Q5_K"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny llama GGUF in every quantized format (tests/tiny_gguf.py), exported as stored and partitioned once:
    (the GGUF, its export, its pack)."""
    from tiny_gguf import write_tiny_llama_gguf

    from pipeshard.exporter import export_model
    from pipeshard.partitioner.partition import partition

    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf = write_tiny_llama_gguf(root / "tiny.gguf", EVERY_FORMAT)
    export_model(str(gguf), root / "export", quiet=True)
    partition(root / "export", root / "pack")
    return gguf, root / "export", root / "pack"
