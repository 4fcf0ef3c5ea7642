"""pipeshard.DecodeAttention (runtime/_attention.c) against GroupQueryAttention, and its use in the chain."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from pipeshard.runtime import capi
from pipeshard.runtime.decode_attention import DECODE_OP, covered

pytestmark = pytest.mark.skipif(
    not capi.custom_ops_available(), reason="the C extension (and with it the op) was not built"
)

HEADS, KV_HEADS, HEAD = 6, 2, 16


def _attention_model(
    op: str, domain: str, batch: int, new: int, capacity: int, rotary: bool, bias: bool, **attributes
) -> bytes:
    """One attention node over a packed query and a shared past/present KV buffer."""
    floats = TensorProto.FLOAT
    width = (HEADS + 2 * KV_HEADS) * HEAD
    cache = [batch, KV_HEADS, capacity, HEAD]
    inputs = [
        helper.make_tensor_value_info("qkv", floats, [batch, new, width]),
        helper.make_tensor_value_info("past_key", floats, cache),
        helper.make_tensor_value_info("past_value", floats, cache),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    names = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "", "", "", ""]
    if rotary:
        inputs += [helper.make_tensor_value_info(n, floats, [capacity, HEAD // 2]) for n in ("cos", "sin")]
        names[7:9] = ["cos", "sin"]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", floats, [batch, 1, new, capacity]))
        names[10] = "bias"
    node = helper.make_node(
        op,
        names,
        ["out", "present_key", "present_value"],
        domain=domain,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=int(rotary),
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        "attention",
        inputs,
        [
            helper.make_tensor_value_info("out", floats, [batch, new, HEADS * HEAD]),
            helper.make_tensor_value_info("present_key", floats, cache),
            helper.make_tensor_value_info("present_value", floats, cache),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    )
    return model.SerializeToString()


def _run(
    op: str,
    domain: str,
    lengths: list[int],
    capacity: int,
    rotary: bool,
    bias: bool,
    new: int = 1,
    **attributes,
):
    """Outputs and the KV buffers after one step of `new` tokens for rows of `lengths` cached tokens (the earlier
    columns of a row shorter than the longest are padding, masked by the bias)."""
    rt = capi.runtime()
    rng = np.random.default_rng(7)
    batch = len(lengths)
    session = rt.session(_attention_model(op, domain, batch, new, capacity, rotary, bias, **attributes))
    key = rng.standard_normal((batch, KV_HEADS, capacity, HEAD), np.float32)
    value = rng.standard_normal((batch, KV_HEADS, capacity, HEAD), np.float32)
    total = max(lengths) + new
    feeds = {
        "qkv": rng.standard_normal((batch, new, (HEADS + 2 * KV_HEADS) * HEAD), np.float32),
        "seqlens_k": np.full(batch, total - 1, np.int32),
        "total": np.array(capacity, np.int32),
        "cos": np.cos(rng.uniform(0, 6, (capacity, HEAD // 2))).astype(np.float32),
        "sin": np.sin(rng.uniform(0, 6, (capacity, HEAD // 2))).astype(np.float32),
    }
    padding = np.zeros((batch, 1, new, capacity), np.float32)
    for row, length in enumerate(lengths):
        padding[row, ..., : max(lengths) - length] = np.finfo(np.float32).min
    feeds["bias"] = padding
    binding = session.binding()
    for name in (
        ("qkv", "seqlens_k", "total") + (("cos", "sin") if rotary else ()) + (("bias",) if bias else ())
    ):
        binding.bind_input(name, feeds[name])
    binding.bind_input("past_key", key)
    binding.bind_input("past_value", value)
    binding.bind_output("present_key", key)
    binding.bind_output("present_value", value)
    out = np.empty((batch, new, HEADS * HEAD), np.float32)
    binding.bind_output("out", out)
    capi.run(session, binding, rt.run_options())
    return out, key, value


@pytest.mark.parametrize(
    "lengths, rotary, bias",
    [([37], True, True), ([37, 20, 5], True, True), ([12, 12], False, False), ([0], True, True)],
)
def test_equals_group_query_attention_at_one_new_token(lengths, rotary, bias):
    expected = _run("GroupQueryAttention", "com.microsoft", lengths, 48, rotary, bias)
    got = _run(DECODE_OP, capi.CUSTOM_DOMAIN, lengths, 48, rotary, bias)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)  # the output: float rounding apart
    for cache_got, cache_expected in zip(
        got[1:], expected[1:], strict=True
    ):  # the KV rows: the new row written
        np.testing.assert_allclose(cache_got, cache_expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lengths, capacity", [([600, 130], 640), ([256, 3], 264)])
def test_long_rows_are_attended_in_chunks_and_combined(lengths, capacity):
    """601 rows are four chunks per KV head (152, 152, 152, 145), 257 rows two (132, 125); the shorter rows have
    rows in the first chunk only."""
    expected = _run("GroupQueryAttention", "com.microsoft", lengths, capacity, True, True)
    got = _run(DECODE_OP, capi.CUSTOM_DOMAIN, lengths, capacity, True, True)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "lengths, capacity, window",
    [([37], 48, 16), ([37, 20, 5], 48, 8), ([0], 48, 8), ([600, 130], 640, 100), ([600, 130], 640, 300)],
)
def test_a_local_window_attends_to_the_last_window_keys_as_group_query_attention_does(
    lengths, capacity, window
):
    expected = _run(
        "GroupQueryAttention", "com.microsoft", lengths, capacity, True, True, local_window_size=window
    )
    got = _run(DECODE_OP, capi.CUSTOM_DOMAIN, lengths, capacity, True, True, local_window_size=window)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    unwindowed = _run("GroupQueryAttention", "com.microsoft", lengths, capacity, True, True)
    assert max(lengths) < window or not np.allclose(
        unwindowed[0], expected[0], atol=1e-3
    )  # the window matters


def test_takes_one_new_token_and_checks_the_cache_capacity():
    with pytest.raises(capi.OrtError, match="one new token per sequence"):
        _run(DECODE_OP, capi.CUSTOM_DOMAIN, [4], 16, True, True, new=2)
    with pytest.raises(capi.OrtError, match="exceeds the KV capacity"):
        _run(DECODE_OP, capi.CUSTOM_DOMAIN, [16], 16, True, True)


def test_covers_only_what_it_computes():
    def node(**attributes):
        return helper.make_node(
            "GroupQueryAttention",
            ["qkv", "", "", "k", "v", "s", "t", "cos", "sin"],
            ["o", "pk", "pv"],
            domain="com.microsoft",
            num_heads=4,
            kv_num_heads=2,
            do_rotary=1,
            **attributes,
        )

    def check(made, float_inputs=frozenset({"k"})) -> bool:
        return covered(made.SerializeToString(), set(float_inputs))

    assert (
        check(node()) and check(node(local_window_size=-1, softcap=0.0)) and check(node(local_window_size=8))
    )
    assert not check(node(), set())  # a float16 cache
    assert not check(node(rotary_interleaved=1))
    assert not check(node(softcap=30.0))
    separate = helper.make_node(
        "GroupQueryAttention",
        ["q", "key", "value", "k", "v", "s", "t"],
        ["o", "pk", "pv"],
        domain="com.microsoft",
        num_heads=4,
        kv_num_heads=2,
    )
    assert not check(separate)


def test_the_chain_decodes_through_it_with_the_same_tokens(tiny_pack):
    from pipeshard.runtime.step import Step

    fast, reference = Step(tiny_pack, threads=2), Step(tiny_pack, threads=2, decode_attention=False)
    assert fast.decode_attention and not reference.decode_attention
    rng = np.random.default_rng(3)
    prompts = rng.integers(3, 200, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), np.int64)
    mask[1, :4] = 0  # the second prompt is left-padded
    runs = []
    for step in (fast, reference):
        step.start(2, 40)
        ids, positions, attention_mask, tokens, logits = (
            prompts,
            np.maximum(np.cumsum(mask, 1) - 1, 0),
            mask,
            [],
            [],
        )
        for _ in range(12):
            last = step.forward(ids, attention_mask, positions)[:, -1].copy()
            logits.append(last)
            ids = last.argmax(-1)[:, None].astype(np.int64)
            tokens.append(ids[:, 0].tolist())
            attention_mask = np.concatenate([attention_mask, np.ones((2, 1), np.int64)], axis=1)
            positions = positions[:, -1:] + 1
        runs.append((tokens, np.stack(logits)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-4)
    assert not np.array_equal(runs[0][1][1:], runs[1][1][1:])  # decode steps did run another kernel


def test_the_decode_graph_differs_from_the_pack_s_only_in_the_attention_node(tiny_pack):
    """The swap is done on protobuf's wire format (runtime/protowire.py), checked here with the onnx package."""
    import onnx

    from pipeshard.formats.manifest import load_pack
    from pipeshard.runtime import protowire
    from pipeshard.runtime.joined import join

    manifest = load_pack(tiny_pack).manifest
    for entry in manifest.sub_layers:
        data = (tiny_pack / entry.files["onnx"]).read_bytes()
        assert protowire.serialize(protowire.parse(data)) == data
    entry = next(e for e in manifest.sub_layers if e.kind == "attn")
    path = tiny_pack / entry.files["onnx"]
    float_inputs = {i.name for i in entry.inputs if i.dtype == "float32"}
    joined = join([path], {o.name for o in entry.outputs}, float_inputs)
    assert joined.decode_attention_nodes == 1
    original, rewritten = onnx.load(path, load_external_data=False), onnx.ModelProto.FromString(joined.model)
    changed = [new for old, new in zip(original.graph.node, rewritten.graph.node, strict=True) if old != new]
    assert [(n.domain, n.op_type) for n in changed] == [(capi.CUSTOM_DOMAIN, DECODE_OP)]
    changed[0].domain, changed[0].op_type = "com.microsoft", "GroupQueryAttention"
    assert rewritten.graph == original.graph
    assert [(o.domain, o.version) for o in rewritten.opset_import] == [
        (o.domain, o.version) for o in original.opset_import
    ] + [(capi.CUSTOM_DOMAIN, 1)]
    assert join([path], set(), float_inputs - {entry.kv.past[0]}).decode_attention_nodes == 0  # not covered
