"""The MatMul floor of a decode step: how close the CPU chain comes to its matrix products alone.

    python examples/bench_floor.py PACK [--pairs 4] [--steps 150] [--prompt-tokens 256] [--threads 2]

The floor is one ONNX Runtime session holding only the pack's decode-step matrix products (MatMul / Gemm, in
order, with each weight's shape and layout, seeded random values), each fed the previous one's output cut or
repeated to the width it takes: what streaming the model's weights through MLAS costs with nothing else in a step.
Against it, the chain's decode step at the prompt's context (`pipeshard.runtime.step.Step`).

Each measurement runs in a process of its own, floor and chain alternating (in one process two engines' weights
evict each other from the caches, and both run far slower than alone). A process times `--steps` steps in five
blocks and samples the bandwidth probe of `pipeshard bench` (profiles/bandwidth.py, over the same bytes) after
each block, so each figure has its own process's roofline: a step's weight bytes over its median time, against the
probe's best sample.
Dense packs only (a MoE step reads the chosen experts only).

Not a `pipeshard bench` row: the floor is a synthetic graph that makes no tokens, and the figure is one decode step's
time against it at a fixed context, not a generation (the bench's roofline column is the other reference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WRAP = 64
PROBE_SAMPLES = 30
PROBE_BLOCKS = 5


def matrix_products(pack) -> list[dict]:
    """The decode step's matrix products in order: op, weight shape, and for Gemm whether the weight is
    transposed; the widths each takes (k) and makes (n)."""
    import onnx

    products = []
    for entry in pack.sub_layers:
        if entry.kind == "embed":
            continue  # a Gather: one row per token
        model = onnx.load(str(pack.path(entry.files["onnx"])), load_external_data=False)
        shapes = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type not in ("MatMul", "Gemm") or node.input[1] not in shapes:
                continue
            shape = shapes[node.input[1]]
            trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
            k, n = (shape[1], shape[0]) if trans_b else (shape[0], shape[1])
            products.append({"op": node.op_type, "shape": shape, "trans_b": trans_b, "k": k, "n": n})
    return products


def floor_model(products: list[dict], folder: Path) -> Path:
    """The floor's ONNX file (weights as external data beside it)."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, initializers = [], []
    width, tensor = products[0]["k"], "x"
    for index, product in enumerate(products):
        k = product["k"]
        if width != k:  # cut (or repeat, then cut) the last output to this product's width
            if width < k:
                copies = -(-k // width)
                nodes.append(helper.make_node("Concat", [tensor] * copies, [f"repeated{index}"], axis=1))
                tensor = f"repeated{index}"
            initializers.append(numpy_helper.from_array(np.array([k], np.int64), f"width{index}"))
            nodes.append(helper.make_node("Slice", [tensor, "zero", f"width{index}", "one"], [f"cut{index}"]))
            tensor = f"cut{index}"
        weight = (rng.standard_normal(product["shape"]) * 0.02).astype(np.float32)
        initializers.append(numpy_helper.from_array(weight, f"weight{index}"))
        attributes = {"transB": 1} if product["trans_b"] else {}
        nodes.append(
            helper.make_node(product["op"], [tensor, f"weight{index}"], [f"product{index}"], **attributes)
        )
        width, tensor = product["n"], f"product{index}"
    initializers += [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "matmul_floor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, products[0]["k"]])],
        [helper.make_tensor_value_info(tensor, TensorProto.FLOAT, [1, width])],
        initializers,
    )
    path = folder / "floor.onnx"
    save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
        str(path),
        save_as_external_data=True,
        location="floor.weights",
    )
    return path


def measure(
    kind: str, pack_folder: str, floor_path: str, threads: int, prompt: int, steps: int, weight_bytes: int
) -> dict:
    """One process's figure: the median step time of the floor or the chain, and the best of the probe's samples
    taken between blocks of steps."""
    from pipeshard.profiles.bandwidth import BandwidthProbe
    from pipeshard.runtime.ort import cpu_session_options, import_onnxruntime, use_process_thread_pool

    use_process_thread_pool(threads)
    if kind == "floor":
        ort = import_onnxruntime()
        session = ort.InferenceSession(
            floor_path, cpu_session_options(threads), providers=["CPUExecutionProvider"]
        )
        binding = session.io_binding()
        first = session.get_inputs()[0]
        binding.bind_cpu_input(first.name, np.ones(first.shape, np.float32))
        output = session.get_outputs()[0]
        result = np.empty(output.shape, np.float32)
        binding.bind_output(output.name, "cpu", 0, np.float32, output.shape, result.ctypes.data)

        def step(_: int) -> None:
            session.run_with_iobinding(binding)
    else:
        from pipeshard.runtime.step import Step

        chain = Step(Path(pack_folder), threads=threads)
        chain.start(1, prompt + WRAP + 1)
        chain.forward(
            np.full((1, prompt), 7, np.int64), np.ones((1, prompt), np.int64), np.arange(prompt)[None]
        )
        masks = [np.ones((1, prompt + 1 + i), np.int64) for i in range(WRAP)]
        positions = [np.array([[mask.shape[1] - 1]], np.int64) for mask in masks]
        token = np.array([[5]], np.int64)

        def step(index: int) -> None:
            chain.forward(token, masks[index % WRAP], positions[index % WRAP])

    for index in range(10):  # warm: first runs pack weights and fault pages in
        step(index)
    probe = BandwidthProbe(threads, weight_bytes)
    times = []
    for block in range(PROBE_BLOCKS):  # the machine's load moves: probe it all along
        for index in range(block * steps // PROBE_BLOCKS, (block + 1) * steps // PROBE_BLOCKS):
            started = time.perf_counter()
            step(index)
            times.append(time.perf_counter() - started)
        probe.sample(PROBE_SAMPLES // PROBE_BLOCKS)
    best = probe.result()["best_bytes_per_s"]
    return {"kind": kind, "step_s": statistics.median(times), "probe_best_bytes_per_s": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--measure", choices=("floor", "chain"), help=argparse.SUPPRESS
    )  # a child process's part
    parser.add_argument("--floor-path", help=argparse.SUPPRESS)
    parser.add_argument("--weight-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(
            json.dumps(
                measure(
                    args.measure,
                    args.pack,
                    args.floor_path,
                    args.threads,
                    args.prompt_tokens,
                    args.steps,
                    args.weight_bytes,
                )
            )
        )
        return
    from pipeshard.core.errors import UserError
    from pipeshard.formats.export_info import NUMPY_DTYPES
    from pipeshard.formats.manifest import load_pack

    try:
        pack = load_pack(Path(args.pack))
    except UserError as error:
        _refuse(str(error))
    if pack.model.num_experts:
        _refuse("the floor is for dense packs (a MoE decode step reads its chosen experts only)")
    if NUMPY_DTYPES[pack.model.dtype] != np.float32:
        _refuse(f"the floor is for fp32 packs (its weights are fp32), not {pack.model.dtype}")
    products = matrix_products(pack)
    weight_bytes = sum(int(np.prod(p["shape"])) * 4 for p in products)
    print(f"{len(products)} matrix products, {weight_bytes / 1e6:.1f} MB of weights a step")
    results: dict[str, list[dict]] = {"floor": [], "chain": []}
    with tempfile.TemporaryDirectory() as folder:
        floor_path = floor_model(products, Path(folder))
        for pair in range(args.pairs):
            for kind in ("floor", "chain") if pair % 2 == 0 else ("chain", "floor"):
                command = [
                    sys.executable,
                    __file__,
                    args.pack,
                    "--measure",
                    kind,
                    "--floor-path",
                    str(floor_path),
                    "--weight-bytes",
                    str(weight_bytes),
                    "--threads",
                    str(args.threads),
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--steps",
                    str(args.steps),
                ]
                printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results[kind].append(json.loads(printed.strip().splitlines()[-1]))
            floor, chain = results["floor"][-1], results["chain"][-1]
            print(
                f"pair {pair + 1}: floor {floor['step_s'] * 1e3:6.2f} ms "
                f"({_share(floor, weight_bytes)} of its probe)  "
                f"chain {chain['step_s'] * 1e3:6.2f} ms ({_share(chain, weight_bytes)})  "
                f"chain / floor time {chain['step_s'] / floor['step_s']:.3f}"
            )
    ratios = [c["step_s"] / f["step_s"] for f, c in zip(results["floor"], results["chain"], strict=True)]
    print(
        f"median over {args.pairs} pairs: chain / floor time {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); of the probe's best: floor "
        f"{statistics.median(_shares(results['floor'], weight_bytes)):.0%}, chain "
        f"{statistics.median(_shares(results['chain'], weight_bytes)):.0%}"
    )


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _shares(runs: list[dict], weight_bytes: int) -> list[float]:
    return [weight_bytes / run["step_s"] / run["probe_best_bytes_per_s"] for run in runs]


def _share(run: dict, weight_bytes: int) -> str:
    return f"{_shares([run], weight_bytes)[0]:.0%}"


if __name__ == "__main__":
    main()
