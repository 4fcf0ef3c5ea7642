"""The wheel carries every subpackage under the one import name `pipeshard`."""

import subprocess
import sys
import zipfile
from pathlib import Path

from test_capi import has_c_compiler

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = [
    "pipeshard",
    "pipeshard/core",
    "pipeshard/formats",
    "pipeshard/exporter",
    "pipeshard/partitioner",
    "pipeshard/runtime",
    "pipeshard/profiles",
]


def _reuse_the_installed_extension(build: Path) -> dict[str, str]:
    """The environment of a build under BUILD whose extension step finds the run loop the install compiled in place
    (runtime/_runloop.*.so): setuptools copies an extension that is newer than all its sources instead of compiling
    it again. Without one, or with a source changed since, the build compiles."""
    import os
    import shutil
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    compiled = REPO / "runtime" / f"_runloop{suffix}"
    if compiled.is_file():
        folder = (
            build / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "pipeshard" / "runtime"
        )
        folder.mkdir(parents=True)
        shutil.copy2(compiled, folder)  # its time kept: what the up-to-date check compares
    settings = build.parent / "build.cfg"
    settings.write_text(f"[build]\nbuild_base = {build}\n")
    return {**os.environ, "DIST_EXTRA_CONFIG": str(settings)}


def test_wheel_contains_every_subpackage(tmp_path):
    (tmp_path / "wheel").mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(REPO),
        ],
        check=True,
        timeout=300,
        env=_reuse_the_installed_extension(tmp_path / "build"),
    )
    (wheel,) = (tmp_path / "wheel").glob("pipeshard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in SUBPACKAGES:
        assert f"{package}/__init__.py" in names, package
    assert "pipeshard/exporter/export.py" in names and "pipeshard/runtime/generate.py" in names
    built = any(n.startswith("pipeshard/runtime/_runloop.") and n.endswith((".so", ".pyd")) for n in names)
    assert built or not has_c_compiler(), "the chain's C run loop was not built into the wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pipeshard = pipeshard.cli:entry" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_console_command_runs():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("pipeshard")), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("pipeshard ")


def test_missing_onnxruntime_names_both_extras(monkeypatch):
    import builtins

    import pytest

    from pipeshard.core.errors import UserError
    from pipeshard.runtime.ort import import_onnxruntime

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    with pytest.raises(UserError, match=r"pipeshard\[cpu\].*pipeshard\[gpu\]"):
        import_onnxruntime()
