"""pipeshard.BlockMatMul (runtime/_matmul.c) against numpy's `(code - zero point) * scale` products, on every
instruction set this CPU runs, and the swap of MatMulNBits for it (runtime/weight_matmul.py)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pipeshard.formats.manifest import load_pack
from pipeshard.runtime import capi
from pipeshard.runtime.joined import join
from pipeshard.runtime.step import Step
from pipeshard.runtime.weight_matmul import product_weights, small_constants, swap_products

pytestmark = pytest.mark.skipif(
    not capi.custom_ops_available(), reason="the C extension (and with it the op) was not built"
)

ISAS = ["portable", "avx2", "avx512"]


def _supported(isa: str) -> bool:
    import os

    os.environ["PIPESHARD_MATMUL_ISA"] = isa
    try:
        return capi.weight_matmul_isa() == isa
    finally:
        del os.environ["PIPESHARD_MATMUL_ISA"]


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _pack_crumbs(values: np.ndarray) -> np.ndarray:
    """Values 0..3 [..., 4n] -> bytes [..., n], element 4i + c in bits 2c, 2c + 1 (MatMulNBits' bits 2)."""
    return sum(values[..., c::4].astype(np.uint8) << (2 * c) for c in range(4)).astype(np.uint8)


def _planes(
    rng,
    rows: int,
    columns: int,
    block: int,
    zero_points: bool,
    high: bool,
    scale_dtype=np.float32,
    bits: int = 4,
) -> dict[str, np.ndarray]:
    """Random planes of W [rows, columns] in MatMulNBits' layout (codes of `bits`, scales of `scale_dtype`), and
    W's float64 values."""
    blocks = columns // block
    pack = _pack_nibbles if bits == 4 else _pack_crumbs
    low = rng.integers(0, 2**bits, (rows, blocks, block), dtype=np.uint8)
    scales = (rng.standard_normal((rows, blocks)) * 0.05).astype(scale_dtype)
    points = (
        rng.integers(0, 2**bits, (rows, blocks), dtype=np.uint8)
        if zero_points
        else np.full((rows, blocks), 2 ** (bits - 1))
    )
    codes = low.astype(np.int64) - points[..., None]
    planes = {"b": pack(low), "scales": scales, "bits": bits}
    if zero_points:
        per_byte = 8 // bits
        padded = np.zeros((rows, -(-blocks // per_byte) * per_byte), np.uint8)
        padded[:, :blocks] = points
        planes["zero_points"] = pack(padded)
    if high:
        high_codes = rng.integers(0, 16, (rows, blocks, block), dtype=np.uint8)
        codes = codes + 16 * (high_codes.astype(np.int64) - 8)
        planes["high"] = _pack_nibbles(high_codes)
    planes["values"] = (codes * scales.astype(np.float64)[..., None]).reshape(rows, columns)
    return planes


def _block_model(block: int, inputs: list[str], scale_type: int = TensorProto.FLOAT, bits: int = 4) -> bytes:
    extra = {"bits": bits} if bits != 4 else {}  # the attribute's default
    node = helper.make_node(
        "BlockMatMul", inputs, ["y"], domain=capi.CUSTOM_DOMAIN, block_size=block, **extra
    )
    types = {"a": TensorProto.FLOAT, "b": TensorProto.UINT8, "scales": scale_type}
    graph = helper.make_graph(
        [node],
        "product",
        [helper.make_tensor_value_info(n, types.get(n, TensorProto.UINT8), None) for n in inputs if n],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(capi.CUSTOM_DOMAIN, 1)]
    )
    return model.SerializeToString()


def _block_product(a: np.ndarray, planes: dict, block: int, isa: str, monkeypatch) -> np.ndarray:
    monkeypatch.setenv("PIPESHARD_MATMUL_ISA", isa)  # read when the session makes the op's kernel
    names = [
        "a",
        "b",
        "scales",
        "zero_points" if "zero_points" in planes else "",
        "high" if "high" in planes else "",
    ]
    while not names[-1]:
        names.pop()
    rt = capi.runtime()
    scale_type = TensorProto.FLOAT16 if planes["scales"].dtype == np.float16 else TensorProto.FLOAT
    session = rt.session(_block_model(block, names, scale_type, planes["bits"]))
    binding = session.binding()
    binding.bind_input("a", a)
    for name in names[1:]:
        if name:
            binding.bind_input(name, planes[name])
    out = np.full((*a.shape[:-1], planes["b"].shape[0]), np.nan, np.float32)
    binding.bind_output("y", out)
    capi.run(session, binding, rt.run_options())
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(
    "bits, zero_points, high",
    [(4, True, False), (4, False, False), (4, False, True), (2, True, False), (2, False, False)],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 64, 300])  # streamed up to 16 rows
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])  # half-precision scales read as stored
def test_equals_numpy_over_the_codes_minus_zero_points_times_scales(
    isa, block, bits, zero_points, high, rows, scale_dtype, monkeypatch
):
    if not _supported(isa):
        pytest.skip(f"this CPU does not run {isa}")
    rng = np.random.default_rng(rows * 100 + block + 2 * zero_points + high + bits)
    # odd N; K / block odd with blocks of 32 (the last byte of zero points half padding; 2-bit: three quarters)
    inner, columns = (5 * 32 if block == 32 else 3 * 64), 37 + 40 * (rows == 1)
    planes = _planes(rng, columns, inner, block, zero_points, high, scale_dtype, bits)
    a = rng.standard_normal((1, rows, inner), np.float32)
    expected = a.astype(np.float64) @ planes["values"].T
    got = _block_product(a, planes, block, isa, monkeypatch)
    scale = np.abs(a).astype(np.float64) @ np.abs(planes["values"]).T
    np.testing.assert_array_less(np.abs(got - expected), 1e-6 * scale + 1e-30)


def _swapped(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` with its MatMulNBits swapped as a CPU session's graph is (its inline weights as the stored ones)."""
    weights = {
        t.name
        for t in model.graph.initializer
        if t.data_type in (TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT16)
    }
    constants = small_constants(t.SerializeToString() for t in model.graph.initializer)
    nodes, swapped = swap_products(
        [n.SerializeToString() for n in model.graph.node],
        weights,
        {o.name for o in model.graph.output},
        constants,
    )
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for node in nodes:
        if node is not None:
            out.graph.node.add().ParseFromString(node)
    out.opset_import.append(helper.make_opsetid(capi.CUSTOM_DOMAIN, 1))
    return out, swapped


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], output: str, columns: int) -> np.ndarray:
    rt = capi.runtime()
    session = rt.session(model.SerializeToString(), threads=2)
    binding = session.binding()
    for name, value in inputs.items():
        binding.bind_input(name, value)
    out = np.full((*inputs["x"].shape[:-1], columns), np.nan, np.float32)
    binding.bind_output(output, out)
    capi.run(session, binding, rt.run_options())
    return out


@pytest.mark.parametrize(
    "formats",
    [
        ["Q4_0"],
        ["Q4_1"],
        ["Q8_0"],
        ["Q5_1"],
        ["Q4_K", "Q6_K", "Q8_0"],
        *([f] for f in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")),
    ],
)
@pytest.mark.parametrize("rows", [1, 4, 9, 37])  # streamed once, twice (the minimum term added after); panels
@pytest.mark.parametrize("isa", ISAS)
def test_matmulnbits_swapped_for_block_matmul_computes_what_onnx_runtime_does(
    formats, rows, isa, monkeypatch
):
    """Every plane layout the exporter writes (zero points or none, a high plane and a minimum term folded into the
    low plane's op), against ONNX Runtime's MatMulNBits over the same planes."""
    from test_quantized import COLUMNS, _model, _stored_rows

    if not _supported(isa):
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv("PIPESHARD_MATMUL_ISA", isa)

    from pipeshard.exporter.quantized_weights import store_weights_quantized

    stored, dequantized = _stored_rows(formats, rows=8)
    product = np.concatenate(dequantized, axis=0)
    model = _model(np.ascontiguousarray(product.T), dequantized[-1])
    store_weights_quantized(model, stored)
    swapped, count = _swapped(model)
    products = [
        n for n in swapped.graph.node if n.op_type in ("BlockMatMul", "MatMulNBits", "MatMul", "ReduceSum")
    ]
    stored = {t.name for t in model.graph.initializer}
    assert [n.op_type for n in products] == ["BlockMatMul"] and count == 1
    inputs = list(products[0].input) + [""] * (8 - len(products[0].input))
    assert inputs[4] == ("product_q4_high" if "product_q4_high" in stored else "")
    bits = {a.name: a.i for a in products[0].attribute}.get("bits", 4)
    assert bits == (2 if "product_q2_low" in stored else 4)  # Q2_K's one 2-bit plane
    # stored scales and minimums read as stored, half-precision ones without a Cast, a K-quant's int8 and float16
    # factors without their float32 product (which ONNX Runtime would fold into a float32 copy)
    low = f"product_q{bits}_low"
    factored = f"{low}_scales_sub" in stored
    assert inputs[2] == (f"{low}_scales_sub" if factored else f"{low}_scales"), (inputs, stored)
    assert inputs[6] == (f"{low}_scales_super" if factored else "")
    minimums = [name for name in ("product_minimums", "product_minimums_sub") if name in stored]
    assert inputs[5] == (minimums[0] if minimums else "")
    assert inputs[7] == ("product_minimums_super" if "product_minimums_sub" in stored else "")
    assert not [
        n.op_type for n in swapped.graph.node if n.op_type != "BlockMatMul" and "product" in n.input[0]
    ]
    x = np.random.default_rng(rows).standard_normal((1, rows, COLUMNS)).astype(np.float32)
    ids = np.zeros((1, rows), np.int64)
    columns = product.shape[0]
    theirs = _run(model, {"x": x, "ids": ids}, "y", columns)
    ours = _run(swapped, {"x": x, "ids": ids}, "y", columns)
    reference = x.astype(np.float64) @ product.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(product.T).astype(np.float64)
    assert np.all(np.abs(ours - reference) <= 1e-6 * scale)
    assert np.all(np.abs(ours - theirs) <= 2e-6 * scale)


def test_a_quantized_packs_chain_computes_the_unswapped_graphs_logits(tiny_gguf):
    _, _, pack = tiny_gguf
    swapped_ops = []
    for entry in load_pack(pack).sub_layers:
        weights = product_weights(entry.weights, float_weights=False)
        if weights:
            joined = join(
                [pack / entry.files["onnx"]], {o.name for o in entry.outputs}, product_weights=weights
            )
            swapped_ops += [
                (node.op_type, {a.name: a.i for a in node.attribute}.get("bits", 4))
                for node in onnx.load_from_string(joined.model).graph.node
            ]
    ops = {op for op, _ in swapped_ops}
    # every product on pipeshard's op, the 2-bit plane (Q2_K) too
    assert "MatMulNBits" not in ops and {bits for op, bits in swapped_ops if op == "BlockMatMul"} == {2, 4}
    ids = np.array([[5, 17, 99, 3, 42, 7]], dtype=np.int64)
    logits = []
    for step in (
        Step(pack, threads=2),
        Step(pack, threads=2, weight_matmul=False),
    ):  # the ops; ONNX Runtime's
        step.start(1)
        prompt = step.forward(ids, np.ones_like(ids), np.arange(6)[None]).copy()
        decode = [
            step.forward(np.array([[token]]), np.ones((1, 7 + i), np.int64), np.array([[6 + i]])).copy()
            for i, token in enumerate((11, 23, 5))
        ]
        logits.append((prompt, *decode))
    for ours, theirs in zip(logits[0], logits[1], strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-4 * max(1.0, np.abs(theirs).max()))
