"""examples/bench_floor.py: the MatMul floor is the pack's matrix products, chained, and the script runs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeshard.formats.manifest import load_pack

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_floor.py"


def _floor_module():
    spec = importlib.util.spec_from_file_location("bench_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floor_holds_every_matrix_product_of_a_decode_step(tiny_pack, tmp_path):
    import onnx
    import onnxruntime as ort

    floor = _floor_module()
    pack = load_pack(tiny_pack)
    products = floor.matrix_products(pack)
    weights = {
        w.name: list(w.shape)
        for entry in pack.sub_layers
        if entry.kind not in ("embed", "prologue")
        for w in entry.weights
        if len(w.shape) == 2
    }
    assert sorted(p["shape"] for p in products) == sorted(weights.values())
    assert products[-1]["n"] == pack.model.vocab_size  # the output layer comes last
    path = floor.floor_model(products, tmp_path)
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node if n.op_type in ("MatMul", "Gemm")] == [
        p["op"] for p in products
    ]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": np.ones((1, products[0]["k"]), np.float32)})
    assert logits.shape == (1, pack.model.vocab_size) and np.isfinite(logits).all()


def test_the_script_times_floor_and_chain_in_processes_of_their_own(tiny_pack):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_pack), "--pairs", "1", "--steps", "5", "--prompt-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "pair 1: floor" in done.stdout and "median over 1 pairs: chain / floor time" in done.stdout


def test_a_folder_that_is_no_pack_is_one_error_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.startswith("error:") and "Traceback" not in done.stderr
