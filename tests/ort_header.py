"""ONNX Runtime's C API header, for checking the OrtApi table indices `runtime/capi.py` calls through.

The onnxruntime wheel ships no headers. `make install` runs this file to fetch `onnxruntime_c_api.h` from the
npm Unity plugin `com.github.asus4.onnxruntime` (ORT 1.29: the OrtApi table is append-only, so its indices hold
for the 1.32 the wheel ships) into build/ort-headers/; nothing is vendored, and tests never touch the network.
"""

from __future__ import annotations

import io
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

HEADER = Path(__file__).resolve().parent.parent / "build" / "ort-headers" / "onnxruntime_c_api.h"
PLUGIN = "https://registry.npmjs.org/com.github.asus4.onnxruntime/-/com.github.asus4.onnxruntime-0.4.9.tgz"
MEMBER = (
    "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers/onnxruntime_c_api.h"
)


def ort_api_members(text: str) -> list[str]:
    """The function names of `struct OrtApi`, in table order (index = position)."""
    body = text[text.index("struct OrtApi {") + len("struct OrtApi {") :]
    body = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", body, flags=re.S))
    names, depth, start = [], 0, 0
    for index, char in enumerate(body):
        if char in "({":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "}":
            if depth == 0:
                break
            depth -= 1
        elif char == ";" and depth == 0:
            statement, start = body[start:index].strip(), index + 1
            if statement:
                names.append(_member_name(statement))
    return names


def _member_name(statement: str) -> str:
    patterns = (
        (r"ORT_API2_STATUS\(\s*(\w+)", ""),
        (r"ORT_API_STATUS\(\s*(\w+)", ""),
        (r"ORT_CLASS_RELEASE\(\s*(\w+)", "Release"),
        (r"ORT_API_T\(\s*[^,]+,\s*(\w+)", ""),
        (r"\(\s*ORT_API_CALL\s*\*\s*(\w+)\s*\)", ""),
    )
    for pattern, prefix in patterns:
        if found := re.search(pattern, statement):
            return prefix + found.group(1)
    raise ValueError(f"not an OrtApi member: {statement[:120]}")


def fetch(path: Path = HEADER) -> None:
    """Download the plugin once and keep the header (written atomically)."""
    if path.is_file():
        return
    with urllib.request.urlopen(PLUGIN, timeout=300) as response:
        archive = tarfile.open(fileobj=io.BytesIO(response.read()), mode="r:gz")
    header = archive.extractfile(MEMBER).read()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(header)
    partial.replace(path)


if __name__ == "__main__":
    fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else HEADER)
