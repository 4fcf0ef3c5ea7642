"""pipeshard.WeightMatMul (runtime/_matmul.c) against numpy, on every instruction set this CPU runs."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from pipeshard.formats.export_info import BFLOAT16
from pipeshard.runtime import capi

pytestmark = pytest.mark.skipif(
    not capi.custom_ops_available(), reason="the C extension (and with it the op) was not built"
)

ELEMENT = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
ISAS = ["portable", "avx2", "avx512"]


def _model(element: int, trans_b: int, rank: int) -> bytes:
    node = helper.make_node("WeightMatMul", ["a", "b"], ["y"], domain=capi.CUSTOM_DOMAIN, trans_b=trans_b)
    graph = helper.make_graph(
        [node],
        "product",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [None] * rank),
            helper.make_tensor_value_info("b", element, [None, None]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * rank)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(capi.CUSTOM_DOMAIN, 1)]
    )
    return model.SerializeToString()


def _stored(weights: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The weights as stored in `dtype` (what the op reads) and as the float32 values they hold (numpy's
    reference)."""
    if dtype == "fp32":
        return weights, weights
    if dtype == "fp16":
        half = weights.astype(np.float16)
        return half, half.astype(np.float32)
    bits = (
        weights.view(np.uint32) + 0x7FFF + ((weights.view(np.uint32) >> 16) & 1)
    ) >> 16  # round to nearest even
    bits = bits.astype(np.uint16)
    return bits.view(BFLOAT16), (bits.astype(np.uint32) << 16).view(np.float32)


def _product(
    a: np.ndarray, stored: np.ndarray, dtype: str, trans_b: bool, isa: str, monkeypatch
) -> np.ndarray:
    monkeypatch.setenv("PIPESHARD_MATMUL_ISA", isa)  # read when the session makes the op's kernel
    rt = capi.runtime()
    session = rt.session(_model(ELEMENT[dtype], int(trans_b), a.ndim))
    binding = session.binding()
    binding.bind_input("a", a)
    binding.bind_input("b", stored)
    columns = stored.shape[0] if trans_b else stored.shape[1]
    out = np.full((*a.shape[:-1], columns), np.nan, np.float32)
    binding.bind_output("y", out)
    capi.run(session, binding, rt.run_options())
    return out


def _supported(isa: str) -> bool:
    import os

    os.environ["PIPESHARD_MATMUL_ISA"] = isa
    try:
        return capi.weight_matmul_isa() == isa
    finally:
        del os.environ["PIPESHARD_MATMUL_ISA"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "rows, inner, columns, trans_b",
    [
        (1, 576, 960, False),  # a decode step's q/k/v (one slice per task group, partial sums added)
        (3, 64, 100, False),  # columns that are not whole vectors
        (4, 1536, 576, False),  # the most rows that stream
        (1, 7, 3, False),  # less than a vector either way
        (
            2,
            576,
            1030,
            True,
        ),  # a transposed weight (tied lm_head): dot products, rows of B not a multiple of 4
        (5, 96, 70, False),  # blocked: a short last tile and a narrow last panel
        (37, 300, 64, False),
        (19, 200, 45, True),  # blocked over a transposed weight
    ],
)
def test_equals_numpy_in_float32_over_the_stored_weights(
    isa, dtype, rows, inner, columns, trans_b, monkeypatch
):
    if not _supported(isa):
        pytest.skip(f"this CPU does not run {isa}")
    rng = np.random.default_rng(rows * 1000 + inner)
    a = rng.standard_normal((1, rows, inner), np.float32)
    stored, values = _stored(
        rng.standard_normal((columns, inner) if trans_b else (inner, columns), np.float32), dtype
    )
    expected = a.astype(np.float64) @ (values.T if trans_b else values).astype(np.float64)
    got = _product(a, stored, dtype, trans_b, isa, monkeypatch)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5 * np.sqrt(inner))


def test_half_precision_specials_convert_exactly(monkeypatch):
    """Subnormals, infinities and NaN of float16 come out as the float32 values they are (the portable
    conversion is bit manipulation; the vector ones are the CPU's)."""
    specials = np.array([[6e-8, -6e-8, 1e-5, 65504.0, np.inf, -np.inf, 0.0, -0.0]], np.float16)
    specials = np.repeat(specials, 2, axis=1)  # 16 columns: one whole vector per row of B
    for isa in ISAS:
        if not _supported(isa):
            continue
        got = _product(np.ones((1, 1, 1), np.float32), specials, "fp16", False, isa, monkeypatch)
        np.testing.assert_array_equal(got[0], specials.astype(np.float32), err_msg=isa)
