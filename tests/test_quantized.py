"""GGUF's quantized blocks kept as stored (`export --dtype gguf`): every format unpacked bit for bit as ggml
dequantizes it, products and embeddings over its 4-bit planes equal to the dequantized weights' (float rounding),
and the real SmolLM2 (Q4_1 + Q8_0) and Gemma3 (Q4_K, Q5_0, Q6_K, Q8_0) packs giving transformers' greedy tokens."""

import hashlib
import json

import numpy as np
import onnx
import pytest
from conftest import EVERY_FORMAT
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from onnx import TensorProto, helper, numpy_helper

from pipeshard.exporter.gguf_blocks import FORMATS, unpack
from pipeshard.exporter.quantized_weights import (
    StoredRows,
    format_layout,
    make_planes,
    store_weights_quantized,
)
from pipeshard.formats.io_names import QUANTIZED_PART_TAILS

COLUMNS = 512
# where the K-quants keep their float16 fields (random bytes elsewhere are valid codes and 6-bit scales)
HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _raw_blocks(format_name: str, rows: int, seed: int = 0) -> np.ndarray:
    """Stored bytes [rows, bytes per row] of FORMAT: gguf's own quantizer where it has one, else random blocks
    with sane float16 scales."""
    rng = np.random.default_rng(seed)
    block_bytes, block_weights, _ = FORMATS[format_name]
    quantization = getattr(GGMLQuantizationType, format_name)
    if format_name not in HALF_FIELDS:
        return quantize(rng.standard_normal((rows, COLUMNS)).astype(np.float32), quantization)
    blocks = rng.integers(0, 256, (rows, COLUMNS // block_weights, block_bytes)).astype(np.uint8)
    for offset in HALF_FIELDS[format_name]:
        halves = rng.uniform(1e-3, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_each_format_unpacks_to_ggmls_dequantized_values_bit_for_bit(format_name):
    raw = _raw_blocks(format_name, rows=6)
    expected = dequantize(raw, getattr(GGMLQuantizationType, format_name)).reshape(6, COLUMNS)
    blocks = unpack(format_name, raw, COLUMNS)
    assert blocks.block in (16, 32) and blocks.codes.dtype == np.int8
    assert np.array_equal(blocks.dequantized(), expected)


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_the_shape_only_layout_of_each_format_is_the_one_its_blocks_are_stored_as(format_name):
    stored, _ = _stored_rows([format_name], rows=8)
    planes = make_planes(stored, [(0, row) for row in range(8)])
    layout = format_layout(format_name, 8, COLUMNS)
    assert planes.layout == layout
    assert all(
        name.endswith(QUANTIZED_PART_TAILS) for name, _, _ in layout.parts("W", gathered=True).values()
    )
    parts = layout.parts("W", gathered=True)
    assert {role: list(values.shape) for role, values in planes.values().items()} == {
        role: shape for role, (_, shape, _) in parts.items()
    }


# Bits per weight a large matrix is stored in: 4-bit planes (two for wider codes), zero points where codes are
# unsigned, scales and minimums as the format stores them (a K-quant's int8 per block, float16 per super-block)
STORED_BITS = {
    "Q4_0": 4.5,
    "Q4_1": 5.125,
    "Q5_0": 8.625,
    "Q5_1": 9.125,
    "Q8_0": 8.625,
    "Q2_K": 3.25,  # one 2-bit plane
    "Q3_K": 4.5625,
    "Q4_K": 4.75,
    "Q5_K": 8.75,
    "Q6_K": 8.8125,
}


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_a_matrix_is_stored_in_its_formats_scales_not_float32_ones(format_name):
    stored, _ = _stored_rows([format_name], rows=256)
    planes = make_planes(stored, [(0, row) for row in range(256)])
    values = planes.values()
    values.pop("gather_zero_points", None)  # an embedding's only
    assert 8 * sum(v.nbytes for v in values.values()) / (256 * COLUMNS) == STORED_BITS[format_name]
    assert format_layout(format_name, 4096, 4096).bits_per_weight == STORED_BITS[format_name]
    assert not any(v.dtype == np.float32 for v in values.values())


def _stored_rows(formats: list[str], rows: int) -> tuple[StoredRows, list[np.ndarray]]:
    tensors, names, digests, dequantized = [], [], {}, []
    for index, format_name in enumerate(formats):
        blocks = unpack(format_name, _raw_blocks(format_name, rows, seed=index + 1), COLUMNS)
        values = blocks.dequantized()
        for row, row_values in enumerate(values):
            digests.setdefault(hashlib.blake2b(row_values.tobytes(), digest_size=16).digest(), (index, row))
        tensors.append(blocks)
        names.append(f"t{index}")
        dequantized.append(values)
    return StoredRows(tensors, names, digests), dequantized


def _model(product: np.ndarray, table: np.ndarray) -> onnx.ModelProto:
    """y = x @ product (product [K, N]); rows = Gather(table, ids) (table [V, K])."""
    nodes = [
        helper.make_node("MatMul", ["x", "product"], ["y"], name="product"),
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="embedding", axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", product.shape[0]]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, None),
        ],
        [numpy_helper.from_array(product, "product"), numpy_helper.from_array(table, "table")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    "formats",
    [[name] for name in FORMATS] + [["Q4_K", "Q6_K", "Q8_0"], ["Q4_0", "Q4_1"], ["Q2_K", "Q5_K"]],
    ids=lambda formats: "+".join(formats),
)
def test_products_and_embeddings_over_the_planes_equal_the_dequantized_weights(formats):
    import onnxruntime as ort

    stored, dequantized = _stored_rows(formats, rows=8)
    product = np.concatenate(
        dequantized, axis=0
    )  # a fused projection: several tensors' rows, one after another
    table = dequantized[-1][::-1].copy()
    model = _model(np.ascontiguousarray(product.T), table)
    assert store_weights_quantized(model, stored)
    assert {n.op_type for n in model.graph.node} >= {"MatMulNBits", "Gather", "BitShift"}
    # The embedding widens only the rows it gathered: no Cast or Mul reads the table's stored parts whole (ONNX
    # Runtime would fold it into a float32 copy of them).
    table_parts = {t.name for t in model.graph.initializer if t.name.startswith("table")}
    assert not [
        n.name for n in model.graph.node if n.op_type in ("Cast", "Mul") and set(n.input) & table_parts
    ]
    assert not any(
        t.data_type == TensorProto.FLOAT and t.name in ("product", "table") for t in model.graph.initializer
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((1, 5, COLUMNS)).astype(np.float32)
    ids = np.array([[0, 3, 7, 3, 1]])
    y, rows = session.run(None, {"x": x, "ids": ids})
    expected = x @ product.T
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(x).sum(-1).max() * np.abs(product).max()
    assert np.abs(rows - table[ids]).max() <= 1e-6 * np.abs(table).max()


def test_a_weight_that_is_no_quantized_tensors_rows_stays_as_it_is():
    stored, dequantized = _stored_rows(["Q4_0"], rows=4)
    product = dequantized[0].T.copy()
    product[0, 0] += 1.0  # one row no longer a stored row
    model = _model(product, dequantized[0])
    assert store_weights_quantized(model, stored) == {"Q4_0": 1}  # the table only
    assert "product" in {t.name for t in model.graph.initializer}


@pytest.fixture(scope="module")
def smollm2_quantized(models):
    import torch

    from pipeshard.exporter.sources import load_source, resolve_source

    reference = load_source(resolve_source("smollm2-135m"), torch.float32).model
    return models.export("smollm2-135m", "gguf"), models.pack("smollm2-135m", "gguf"), reference


@pytest.mark.slow
def test_smollm2_kept_quantized_gives_transformers_greedy_tokens_on_export_chain_and_sim(smollm2_quantized):
    import torch
    from prompts import SMOLLM2_PROMPTS

    import pipeshard

    export, pack, reference = smollm2_quantized
    engines = {
        "export": pipeshard.load(export),
        "chain": pipeshard.load(pack),
        "sim": pipeshard.load(pack, vram="25%", device="sim", profile="laptop-8gb", context=256),
    }
    eos = set(engines["chain"].codec.eos_token_ids)
    for prompt in SMOLLM2_PROMPTS:
        ids = engines["chain"].generator.prompt_ids(prompt)
        with torch.no_grad():
            output = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        theirs = output[0, len(ids) :].tolist()
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))]
        for name, engine in engines.items():
            (ours,) = engine.generator.generate([ids], pipeshard.api.SamplingSettings(max_new_tokens=32))
            assert ours.tokens == theirs, (name, prompt)
        assert len(theirs) >= 5


@pytest.mark.slow
def test_smollm2_pack_holds_the_gguf_blocks_not_float_weights(smollm2_quantized):
    from pipeshard.exporter.sources import builtin_gguf_path, gguf_reader
    from pipeshard.formats.manifest import load_pack

    _, pack, _ = smollm2_quantized
    manifest = load_pack(pack).manifest
    assert manifest.model.dtype == "gguf"
    gguf_bytes = sum(int(t.n_bytes) for t in gguf_reader(builtin_gguf_path("smollm2-135m")).tensors)
    blob_bytes = sum(e.blob.bytes for e in manifest.sub_layers if e.blob)
    float_matrices = [
        w.name
        for e in manifest.sub_layers
        for w in e.weights
        if w.dtype == "float32"
        and len(w.shape) == 2
        and "_q4_" not in w.name
        and not w.name.startswith("_gqa")
    ]
    assert not float_matrices
    assert blob_bytes <= 1.15 * gguf_bytes, (blob_bytes, gguf_bytes)


@pytest.fixture(scope="module")
def tiny_quantized(tiny_gguf):
    """The every-format tiny GGUF's export and pack, and transformers' model of the GGUF."""
    import torch

    from pipeshard.exporter.sources import load_source, resolve_source

    gguf, export, pack = tiny_gguf
    return export, pack, load_source(resolve_source(str(gguf)), torch.float32).model


@pytest.mark.slow
def test_every_format_gives_transformers_tokens_and_logits_on_export_chain_and_sim(tiny_quantized):
    import torch

    import pipeshard
    from pipeshard.formats.manifest import load_pack

    export, pack, reference = tiny_quantized
    stored = {w.dtype for e in load_pack(pack).manifest.sub_layers for w in e.weights}
    assert "uint8" in stored and load_pack(pack).manifest.model.dtype == "gguf"
    formats = json.loads((export / "export.json").read_text())["quantized_weights"]
    assert set("+".join(formats).split("+")) == set(EVERY_FORMAT)
    engines = {
        "export": pipeshard.load(export),
        "chain": pipeshard.load(pack),
        "sim": pipeshard.load(pack, vram="30%", device="sim", profile="laptop-8gb", context=256),
    }
    eos = set(engines["chain"].codec.eos_token_ids)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = engines["chain"].generator.prompt_ids(prompt, chat_template=False)
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].numpy()
            output = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        theirs = output[0, len(ids) :].tolist()
        theirs = theirs[: next((i for i, t in enumerate(theirs) if t in eos), len(theirs))]
        for name, engine in engines.items():
            (ours,) = engine.generator.generate([ids], pipeshard.api.SamplingSettings(max_new_tokens=16))
            assert ours.tokens == theirs, (name, prompt)
        step = engines["chain"].step
        step.all_logits = True
        step.start(1)
        ours_logits = step.forward(
            np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None]
        )
        assert np.abs(ours_logits[0] - logits).max() <= 1e-4 * max(1.0, np.abs(logits).max()), prompt
        step.all_logits = False


@pytest.mark.slow
def test_the_device_graphs_of_a_quantized_pack_have_cuda_kernels_but_the_known_attention_gap(tiny_quantized):
    """MatMulNBits over the planes and the minimum terms' ops: all in the CUDA EP's kernel
    table of the pinned onnxruntime-gpu (float32 GroupQueryAttention is issue 41's known gap)."""
    from test_cuda_kernels import TABLE, KernelTable, device_graphs, missing_kernels

    if not TABLE.is_file():
        pytest.skip(f"no CUDA kernel table at {TABLE}: `make install` fetches it")
    table = KernelTable(json.loads(TABLE.read_text()))
    _, pack, _ = tiny_quantized
    graphs = device_graphs(pack)
    ops = {n.op_type for graph in graphs.values() for n in graph.graph.node}
    assert {"MatMulNBits", "ReduceSum", "Cast"} <= ops  # the embedding (its Gather) stays on the host
    gaps = [gap for name, graph in graphs.items() for gap in missing_kernels(graph, name, table)]
    assert {(gap.op, gap.types[0]) for gap in gaps} <= {("com.microsoft::GroupQueryAttention", "float")}, gaps
