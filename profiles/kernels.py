"""Tiny ONNX models for the profiler's kernels and a timer that runs them through raw IO binding."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ONNX_FLOAT = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
NUMPY_FLOAT = {"fp32": np.float32, "fp16": np.float16}


def make_model(graph: onnx.GraphProto, opsets: list) -> onnx.ModelProto:
    """A model at the IR version its opsets need, not onnx's newest: ONNX Runtime releases read IR versions only up
    to their own (onnxruntime-gpu 1.31 refuses onnx 1.23's default IR 14)."""
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    )


def matmul_model(k: int, n: int, dtype: str) -> onnx.ModelProto:
    """Y[M, N] = X[M, K] @ W[K, N] with W a (random) initializer, as a sub-layer's weights are."""
    weight = numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((k, n), dtype=np.float32) * 0.02).astype(
            NUMPY_FLOAT[dtype]
        ),
        "W",
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "matmul",
        [helper.make_tensor_value_info("X", ONNX_FLOAT[dtype], ["M", k])],
        [helper.make_tensor_value_info("Y", ONNX_FLOAT[dtype], ["M", n])],
        initializer=[weight],
    )
    return make_model(graph, [helper.make_operatorsetid("", 21)])


def weight_matmul_model(k: int, n: int, dtype: str) -> onnx.ModelProto:
    """Y[M, N] = X[M, K] @ W[K, N] through pipeshard.WeightMatMul (runtime/_matmul.c), W a (random) fp16 or bf16
    initializer: the product a half-precision pack's CPU sub-layers run."""
    # 64 random rows repeated: the op streams every byte all the same, and drawing a whole sweep-sized matrix
    # took longer than timing it
    values = np.resize(np.random.default_rng(0).standard_normal((64, n), dtype=np.float32) * 0.02, (k, n))
    if dtype == "fp16":
        weight = numpy_helper.from_array(values.astype(np.float16), "W")
    else:  # bf16: the high half of each float32
        weight = helper.make_tensor(
            "W",
            TensorProto.BFLOAT16,
            [k, n],
            (values.view(np.uint32) >> 16).astype("<u2").tobytes(),
            raw=True,
        )
    graph = helper.make_graph(
        [helper.make_node("WeightMatMul", ["X", "W"], ["Y"], domain="pipeshard")],
        "weight_matmul",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[weight],
    )
    return make_model(graph, [helper.make_operatorsetid("", 21), helper.make_operatorsetid("pipeshard", 1)])


def quantized_planes(k: int, n: int, block: int = 32) -> dict[str, np.ndarray]:
    """quantized_matmul_model's weights: random 4-bit codes, float32 scales and zero points (8) per block."""
    rng = np.random.default_rng(0)
    blocks = k // block
    return {
        "B": rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8),
        "S": rng.uniform(1e-3, 2e-3, (n, blocks)).astype(np.float32),
        "Z": np.zeros((n, (blocks + 1) // 2), np.uint8),
    }


def quantized_matmul_model(
    k: int, n: int, block: int = 32, op: str = "MatMulNBits", weights_as_inputs: bool = False
) -> onnx.ModelProto:
    """Y[M, N] = X[M, K] @ W for W stored as one 4-bit plane with uint8 zero points and float32 scales per block
    (com.microsoft::MatMulNBits): the product a GGUF pack keeps its quantized weights in (random codes); with
    op="BlockMatMul", pipeshard's op over the same planes (what the chain's CPU sessions run, runtime/_matmul.c). With
    `weights_as_inputs` the planes, scales and zero points are graph inputs (the simulated device's sessions, which
    bind a unit's weights from its memory and cannot prepack them)."""
    inputs = [numpy_helper.from_array(value, name) for name, value in quantized_planes(k, n, block).items()]
    if op == "BlockMatMul":
        node = helper.make_node(
            "BlockMatMul", ["X", "B", "S", "Z"], ["Y"], domain="pipeshard", block_size=block
        )
    else:
        node = helper.make_node(
            "MatMulNBits",
            ["X", "B", "S", "Z"],
            ["Y"],
            domain="com.microsoft",
            K=k,
            N=n,
            bits=4,
            block_size=block,
        )
    graph = helper.make_graph(
        [node],
        "quantized_matmul",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])]
        + [
            helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            for t in (inputs if weights_as_inputs else [])
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[] if weights_as_inputs else inputs,
    )
    return make_model(
        graph,
        [
            helper.make_operatorsetid("", 21),
            helper.make_operatorsetid("com.microsoft", 1),
            helper.make_operatorsetid("pipeshard", 1),
        ],
    )


def attention_model(heads: int, kv_heads: int, head_dim: int, dtype: str) -> onnx.ModelProto:
    """GroupQueryAttention as the exporter emits it, `heads` query heads sharing `kv_heads` KV heads:
    q [1, T, heads * head_dim], k/v [1, T, kv_heads * head_dim], the past and present one buffer
    [1, kv_heads, C, head_dim] holding the C - T cached tokens and receiving the T new ones in place, an
    additive bias [1, 1, T, C]."""
    width, kv_width = heads * head_dim, kv_heads * head_dim
    float_type = ONNX_FLOAT[dtype]
    inputs = [helper.make_tensor_value_info("Q", float_type, [1, "T", width])]
    inputs += [helper.make_tensor_value_info(name, float_type, [1, "T", kv_width]) for name in ("K", "V")]
    inputs += [
        helper.make_tensor_value_info(name, float_type, [1, kv_heads, "C", head_dim]) for name in ("PK", "PV")
    ]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("bias", float_type, [1, 1, "T", "C"]),
    ]
    outputs = [helper.make_tensor_value_info("Y", float_type, [1, "T", width])]
    outputs += [
        helper.make_tensor_value_info(name, float_type, [1, kv_heads, "C", head_dim]) for name in ("K2", "V2")
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["Q", "K", "V", "PK", "PV", "seqlens_k", "total", "", "", "", "bias"],
        ["Y", "K2", "V2"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=float(head_dim) ** -0.5,
    )
    graph = helper.make_graph([node], "attention", inputs, outputs)
    return make_model(
        graph, [helper.make_operatorsetid("", 21), helper.make_operatorsetid("com.microsoft", 1)]
    )


def attention_feeds(heads: int, kv_heads: int, head_dim: int, tokens: int, context: int, dtype: str):
    """Inputs, output shapes and in-place aliases (present -> past) for `attention_model` at T, C."""
    rng = np.random.default_rng(2)
    float_type = NUMPY_FLOAT[dtype]
    context = max(context, tokens)
    new = {
        name: rng.standard_normal((1, tokens, count * head_dim), dtype=np.float32).astype(float_type)
        for name, count in (("Q", heads), ("K", kv_heads), ("V", kv_heads))
    }
    past = {
        name: rng.standard_normal((1, kv_heads, context, head_dim), dtype=np.float32).astype(float_type)
        for name in ("PK", "PV")
    }
    lengths = {
        "seqlens_k": np.array([context - 1], np.int32),
        "total": np.array(context, np.int32),
        "bias": np.zeros((1, 1, tokens, context), float_type),
    }
    outputs = {"Y": ((1, tokens, heads * head_dim), float_type)}
    return {**new, **past, **lengths}, outputs, {"K2": "PK", "V2": "PV"}


def hop_model(width: int) -> onnx.ModelProto:
    """The smallest useful session: one Add on a residual-sized vector."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["Y"])],
        "hop",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, width])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1, width])],
    )
    return make_model(graph, [helper.make_operatorsetid("", 21)])


def op_chain_model(width: int, count: int) -> onnx.ModelProto:
    """`count` small element-wise ops in a row: the per-node cost a sub-layer pays beyond its math."""
    nodes = [
        helper.make_node("Add" if i % 2 else "Mul", [f"t{i}", f"t{i}"], [f"t{i + 1}"]) for i in range(count)
    ]
    graph = helper.make_graph(
        nodes,
        "ops",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 1, width])],
        [helper.make_tensor_value_info(f"t{count}", TensorProto.FLOAT, [1, 1, width])],
    )
    return make_model(graph, [helper.make_operatorsetid("", 21)])


def median_seconds(
    run: Callable[[], None], min_seconds: float, min_runs: int = 3, max_runs: int = 2000
) -> float:
    """Median wall time of `run` after one warm-up call, repeated for at least `min_seconds`."""
    run()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - started < min_seconds and len(times) < max_runs):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


class BoundSession:
    """A session with its inputs and outputs bound once to numpy buffers (raw IO binding)."""

    def __init__(
        self,
        ort,
        model: onnx.ModelProto,
        options,
        providers,
        inputs: dict[str, np.ndarray],
        output_shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
        device: str = "cpu",
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.binding = self.session.io_binding()
        self._ort = ort
        self.device = device
        self.bind(inputs, output_shapes, aliases or {})
        self.run_options = ort.RunOptions()
        self._raw = self.binding._iobinding
        self._run = self.session._sess.run_with_iobinding

    def bind(
        self,
        inputs: dict[str, np.ndarray],
        output_shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
        aliases: dict[str, str] | None = None,
    ) -> None:
        """(Re)bind inputs and preallocated outputs, e.g. for another token count M. An output named in
        `aliases` is written in place into the memory of the input it maps to (a KV cache)."""
        ort, device = self._ort, self.device
        self.keep_alive = []
        bound = {}
        for name, array in inputs.items():
            value = ort.OrtValue.ortvalue_from_numpy(array, device, 0)
            self.keep_alive.append(value)
            self.binding.bind_ortvalue_input(name, value)
            bound[name] = value
        for output, source in (aliases or {}).items():
            value = bound[source]
            self.binding.bind_output(output, device, 0, value.element_type(), value.shape(), value.data_ptr())
        for name, (shape, dtype) in output_shapes.items():
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, 0)
            self.keep_alive.append(value)
            self.binding.bind_ortvalue_output(name, value)

    def __call__(self) -> None:
        self._run(self._raw, self.run_options)


def attention_rows(
    ort,
    options,
    providers,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tokens: tuple[int, ...],
    contexts: tuple[int, ...],
    dtype: str,
    seconds_per_point: float,
    device: str = "cpu",
    progress=lambda: None,
) -> list[dict]:
    """The attention kernel timed at every (T, C): the profile's `attention` table rows (FLOPs counted over the query
    heads)."""
    model = attention_model(heads, kv_heads, head_dim, dtype)
    rows = []
    for t in tokens:
        for c in contexts:
            inputs, outputs, aliases = attention_feeds(heads, kv_heads, head_dim, t, c, dtype)
            session = BoundSession(
                ort, model, options, providers, inputs, outputs, device=device, aliases=aliases
            )
            seconds = median_seconds(session, seconds_per_point)
            rows.append(
                {
                    "T": t,
                    "C": c,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "seconds": seconds,
                    "gflops": 4 * heads * head_dim * t * c / seconds / 1e9,
                }
            )
            progress()
    return rows


@contextlib.contextmanager
def cpu_matmul_load(ort, options, k: int, n: int) -> Iterator[None]:
    """Keep the CPU busy with [64, k] x [k, n] MatMuls on a background thread while the block runs."""
    session = BoundSession(
        ort,
        matmul_model(k, n, "fp32"),
        options,
        ["CPUExecutionProvider"],
        {"X": np.ones((64, k), np.float32)},
        {"Y": ((64, n), np.float32)},
    )
    stop = threading.Event()

    def compute() -> None:
        while not stop.is_set():
            session()

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        time.sleep(0.02)
        yield
    finally:
        stop.set()
        worker.join()
