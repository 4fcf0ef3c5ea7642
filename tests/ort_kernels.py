"""ONNX Runtime's CUDA kernel table, for checking that every node of a device graph has a CUDA kernel.

A node whose op, opset and types have no CUDA kernel runs on the CPU without a word (the CUDA GroupQueryAttention
is fp16/bf16 only). The registrations are built in code at run time, not written anywhere in the wheel, so
`make install` runs this file: it downloads the onnxruntime-gpu wheel (pip caches it), loads the wheel's CUDA
provider against do-nothing stand-ins for the CUDA libraries (built here with the C compiler: every call reports
success), asks ONNX Runtime for its kernel definitions and operator schemas, and writes them into
build/ort-kernels/; nothing is vendored, and tests never touch the network.

The table: {"onnxruntime_gpu": version, "cuda": [[domain, op, since_from, since_to, {constraint: [types]}], ...],
"schemas": {domain: {op: [[since_version, inputs, outputs], ...]}}}, each input or output a [type_str, option].
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ONNXRUNTIME_GPU = "1.31.1"  # the wheel the GPU check installs: the newest, built for CUDA 13
TABLE = Path(__file__).resolve().parent.parent / "build" / "ort-kernels" / f"cuda-{ONNXRUNTIME_GPU}.json"
CUDA_PROVIDER = "CUDAExecutionProvider"
# The libraries every Linux machine has; the providers' other dependencies (CUDA, cuDNN, TensorRT) get stand-ins.
SYSTEM_LIBRARIES = tuple("libc. libm. libdl. librt. libpthread. libstdc++. libgcc_s. ld-linux".split())


def fetch(path: Path = TABLE) -> None:
    """Build the table once (written atomically); the wheel and the stand-ins are thrown away after."""
    path = path.resolve()
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        work = Path(scratch)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             f"onnxruntime-gpu=={ONNXRUNTIME_GPU}", "-d", work],
            check=True,
        )  # fmt: skip
        (wheel,) = work.glob("onnxruntime_gpu-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(work / "site", [m for m in archive.namelist() if m.startswith("onnxruntime/")])
        stand_ins = build_stand_ins(work / "site" / "onnxruntime" / "capi", work / "stand-ins")
        partial = path.with_suffix(".partial")
        environment = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(work / "site"), str(Path(__file__).resolve().parent)]),
            "LD_LIBRARY_PATH": str(stand_ins),
        }
        code = f"import ort_kernels; ort_kernels.write_registry({str(partial)!r})"
        subprocess.run([sys.executable, "-c", code], check=True, env=environment, cwd=work)
        partial.replace(path)


def build_stand_ins(capi: Path, folder: Path) -> Path:
    """A shared library for each non-system library the provider libraries need, defining every symbol they
    import from it as a function that returns 0 (success for CUDA, cuBLAS and cuDNN), under the library's own
    symbol version: enough to load the providers and construct the CUDA one without a GPU or a driver."""
    folder.mkdir(parents=True)
    imports_of: dict[str, set[str]] = {}  # stand-in library -> the symbols imported from it by version
    unversioned: set[str] = set()  # imported with no version: every stand-in defines them
    for provider in sorted(capi.glob("libonnxruntime_providers_*.so")):
        for library in re.findall(r"\(NEEDED\).*\[(.+)\]", _output("readelf", "-d", provider)):
            if not library.startswith(SYSTEM_LIBRARIES):
                imports_of.setdefault(library, set())
        for line in _output("nm", "-D", "--undefined-only", provider).splitlines():
            kind, symbol = line.split()[-2:]
            if kind != "U" or symbol == "Provider_GetHost":  # Provider_GetHost: ONNX Runtime's own
                continue
            name, _, version = symbol.partition("@")
            if not version:
                unversioned.add(name)
            elif version in imports_of:
                imports_of[version].add(name)
    for library, symbols in imports_of.items():
        source = folder / f"{library}.c"
        source.write_text(
            "".join(f"long {name}(void) {{ return 0; }}\n" for name in sorted(symbols | unversioned))
        )
        command = ["cc", "-shared", "-fPIC", "-o", folder / library, source, f"-Wl,-soname,{library}"]
        if symbols:
            script = folder / f"{library}.map"
            script.write_text(f"{library} {{ global: *; }};\n")
            command.append(f"-Wl,--version-script={script}")
        subprocess.run(command, check=True)
    return folder


def _output(*command: str | Path) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def write_registry(path: str) -> None:
    """Inside the wheel's onnxruntime: every CUDA kernel definition, and the schemas of their domains."""
    import onnxruntime

    from pipeshard.runtime.kernel_check import registrations

    if onnxruntime.__version__ != ONNXRUNTIME_GPU:
        raise RuntimeError(f"loaded onnxruntime {onnxruntime.__version__} from {onnxruntime.__file__}")
    Path(path).write_text(json.dumps(registrations(onnxruntime, CUDA_PROVIDER), sort_keys=True))


if __name__ == "__main__":
    fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else TABLE)
