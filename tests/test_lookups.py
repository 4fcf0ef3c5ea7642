"""The planner and the runtime read the files between stages through typed records (pipeshard/formats/), not dicts
by string keys (issue 38): a misspelt field is then an error where the file is read, not a KeyError or a silent
default mid-run. This counts string-key lookups in partitioner/ and runtime/ by walking their syntax trees:
`x["key"]` read, and `x.get("key")` / `x.pop("key")` / `x.setdefault("key")` (a store, `x["key"] = value`, writes
a document or a table rather than reading one, and is not counted). The lookups that must stay (a third-party
document read as it is) are listed in ALLOWED, each with its reason.

Run as a script to print the count per file: `python -P tests/test_lookups.py`."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import parse_python  # noqa: E402

FOLDERS = ("partitioner", "runtime")
LOOKUP_METHODS = ("get", "pop", "setdefault")
# The string-key lookups the two folders may hold outside ALLOWED: none.
MAX_LOOKUPS = 0

# (file, key): why that lookup stays a string key. Every occurrence of the key in the file is allowed.
ONNX_ATTRIBUTE = "an ONNX node's attributes, read by name"
NETWORKX_ATTRIBUTE = "networkx keeps a graph's, its nodes' and its edges' attributes in dicts"
ALLOWED: dict[tuple[str, str], str] = {
    # documents of other programs, read as they are
    ("runtime/images.py", "transparency"): "Pillow's Image.info, the file's metadata",
    ("runtime/text.py", "pad_token"): "Hugging Face's tokenizer_config.json",
    ("runtime/text.py", "eos_token"): "Hugging Face's tokenizer_config.json",
    ("runtime/text.py", "eos_token_id"): "Hugging Face's generation_config.json",
    ("runtime/conversation.py", "role"): "a chat message as the OpenAI-style chat API takes it",
    ("runtime/conversation.py", "content"): "a chat message as the OpenAI-style chat API takes it",
    ("runtime/conversation.py", "images"): "a chat message as the OpenAI-style chat API takes it",
    (
        "runtime/kernel_check.py",
        "onnxruntime_gpu",
    ): "ONNX Runtime's kernel table as tests/ort_kernels.py dumps it",
    ("runtime/kernel_check.py", "cuda"): "ONNX Runtime's kernel table as tests/ort_kernels.py dumps it",
    ("runtime/kernel_check.py", "schemas"): "ONNX Runtime's kernel table as tests/ort_kernels.py dumps it",
    ("runtime/capi.py", "RunWithBinding"): "ONNX Runtime's C API, its functions by name",
    ("runtime/decode_attention.py", "do_rotary"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "transB"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "bits"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "block_size"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "accuracy_level"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "keepdims"): ONNX_ATTRIBUTE,
    ("runtime/weight_matmul.py", "to"): ONNX_ATTRIBUTE,
    ("partitioner/graph.py", "tensors"): NETWORKX_ATTRIBUTE,
    ("partitioner/graph.py", "path"): NETWORKX_ATTRIBUTE,
    ("partitioner/graph.py", "name"): NETWORKX_ATTRIBUTE,
    ("partitioner/graph.py", "op_type"): NETWORKX_ATTRIBUTE,
    ("partitioner/graph.py", "producer"): NETWORKX_ATTRIBUTE,
    # ONNX graphs' inputs, bound by their names
    ("runtime/program.py", "input_ids"): "the decoder graph's input, bound by name",
    ("runtime/program.py", "position_ids"): "the decoder graph's input, bound by name",
    ("runtime/experts.py", "attention_mask"): "the decoder graph's input, bound by name",
    ("runtime/vision.py", "image_rows"): "the vision graph's input (vision_inputs.py), bound by name",
    ("runtime/vision.py", "rotary_ids"): "the vision graph's input (vision_inputs.py), bound by name",
}


def lookups_in(source: str) -> list[tuple[int, str]]:
    """(line, key) of every string-constant subscript and get / pop / setdefault call with a string-constant key."""
    found = []
    for node in ast.walk(parse_python(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_string(node.slice):
            found.append((node.lineno, node.slice.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOOKUP_METHODS
            and node.args
            and _is_string(node.args[0])
        ):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def count_lookups(root: Path = REPO) -> tuple[Counter, Counter]:
    """String-key lookups per file (a path relative to `root`): those counted, and those ALLOWED."""
    counted, allowed = Counter(), Counter()
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            for _line, key in lookups_in(path.read_text(encoding="utf-8")):
                (allowed if (name, key) in ALLOWED else counted)[name] += 1
    return counted, allowed


def test_partitioner_and_runtime_read_files_through_typed_records():
    counted, _allowed = count_lookups()
    where = ", ".join(f"{name} {count}" for name, count in counted.most_common())
    assert sum(counted.values()) <= MAX_LOOKUPS, f"string-key lookups: {where}"


def test_a_planted_lookup_is_counted(tmp_path):
    """The walk finds each form of lookup (so the count above cannot pass by finding nothing)."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "partitioner").mkdir()
    (tmp_path / "runtime" / "planted.py").write_text(
        'def f(d):\n    d["stored"] = 1\n'
        '    return d["a"], d.get("b"), d.pop("c", 0), d.setdefault("d", 1), d[0], d.get(x)\n'
    )
    counted, _allowed = count_lookups(tmp_path)
    assert counted == Counter({"runtime/planted.py": 4})


def test_every_allowed_lookup_is_still_there():
    """An allowance whose lookup is gone is removed with it (the list says only what stays)."""
    present = set()
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            name = path.relative_to(REPO).as_posix()
            present |= {(name, key) for _line, key in lookups_in(path.read_text(encoding="utf-8"))}
    assert set(ALLOWED) <= present, sorted(set(ALLOWED) - present)


def main() -> None:
    counted, allowed = count_lookups()
    for name, count in counted.most_common():
        print(f"{count:5d} {name}")
    print(
        f"{sum(counted.values()):5d} in all, besides {sum(allowed.values())} allowed (tests/test_lookups.py)"
    )


if __name__ == "__main__":
    main()
