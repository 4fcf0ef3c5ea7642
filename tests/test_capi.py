"""The chain's ONNX Runtime C-API layer: sessions, bindings, values, and the native run loop."""

import shutil
import sysconfig
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pipeshard.core.errors import UserError
from pipeshard.runtime import capi


def has_c_compiler() -> bool:
    """Whether setuptools would find the C compiler Python was built with."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(compiler) is not None


def _sum_model(path, rows: int = 2):
    """y = a + b over [rows, 3] floats, saved to `path`."""
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [rows, 3]) for name in "ab"]
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "sum",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 3])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


@pytest.fixture
def sum_session(tmp_path):
    rt = capi.runtime(1)
    return rt, rt.session(_sum_model(tmp_path / "sum.onnx"))


def test_arrays_bound_by_pointer_and_values_onnx_runtime_allocates(sum_session):
    rt, session = sum_session
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 10, np.float32)
    binding = session.binding()
    binding.bind_input("a", a)
    binding.bind_input("b", b)
    out = np.zeros((2, 3), np.float32)
    binding.bind_output("y", out)
    capi.run(session, binding, rt.run_options())
    assert np.array_equal(out, a + b)

    binding.bind_output_to_cpu("y")
    a += 1  # bound by pointer: the next run reads the new values
    capi.run(session, binding, rt.run_options())
    (value,) = binding.outputs()
    view = value.numpy()
    del value  # the view keeps the value alive
    assert view.dtype == np.float32 and np.array_equal(view, a + b)


def test_a_failed_run_names_its_sub_layer_on_both_loops(sum_session, monkeypatch):
    rt, session = sum_session
    good, bad = session.binding(), session.binding()
    for binding, rows in ((good, 2), (bad, 5)):
        binding.bind_input("a", np.ones((rows, 3), np.float32))
        binding.bind_input("b", np.ones((rows, 3), np.float32))
        binding.bind_output_to_cpu("y")
    runs = [("L0.ffn", session, good), ("L1.ffn", session, bad)]
    timed = []
    for block in (
        capi.Block(rt, runs, rt.run_options()),
        capi.Block(rt, runs, rt.run_options(), timer=lambda name, s: timed.append(name)),
    ):
        with pytest.raises(capi.OrtError, match=r"^sub-layer L1\.ffn: .*"):
            block()
    assert timed == ["L0.ffn"]


def test_errors_of_onnx_runtime_come_back_with_its_message(tmp_path):
    rt = capi.runtime(1)
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    with pytest.raises(UserError, match="(?i)broken.onnx: ONNX Runtime cannot load it.*(protobuf|parse)"):
        rt.session(tmp_path / "broken.onnx")
    with pytest.raises(capi.OrtError, match="(?i)protobuf|parse|load"):
        rt.session(b"not a model")
    with pytest.raises(ValueError, match="cannot bind"):
        rt.tensor(np.ones((4, 4), np.float32)[:, ::2])


def test_a_missing_shared_library_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "capi").mkdir()
    monkeypatch.setattr(
        capi.importlib.util, "find_spec", lambda name: SimpleNamespace(origin=str(tmp_path / "x.py"))
    )
    with pytest.raises(UserError, match="libonnxruntime"):
        capi.library_path()


def test_the_native_loop_is_built_and_gives_the_python_loops_logits(tiny_pack, monkeypatch):
    """The chain's decode step is one native call for a dense model, with the same logits, bit for bit, as
    one run per ctypes call (what a machine without a C compiler gets)."""
    from pipeshard.runtime.step import Step

    if capi._runloop is None and not has_c_compiler():
        pytest.skip("no C compiler here: the _runloop extension is optional and was not built")
    assert capi._runloop is not None, (
        "the _runloop extension was not built (pip install -e . with a C compiler)"
    )

    def decode(step) -> np.ndarray:
        step.start(1, 16)
        mask = np.ones((1, 5), np.int64)
        logits = [step.forward(np.array([[3, 14, 15, 92, 65]], np.int64), mask, np.arange(5)[None]).copy()]
        for token in (7, 8, 9):
            mask = np.ones((1, mask.shape[1] + 1), np.int64)
            logits.append(step.forward(np.array([[token]]), mask, np.array([[mask.shape[1] - 1]])).copy())
        return np.stack(logits)

    # ONNX Runtime's attention in both (the decode attention op is part of the extension)
    native = Step(tiny_pack, threads=1, decode_attention=False)
    native_logits = decode(native)
    assert [op.native for op in native._program] == [True]  # the whole decode step in one call
    monkeypatch.setattr(capi, "_runloop", None)
    python = Step(tiny_pack, threads=1, decode_attention=False)
    assert np.array_equal(decode(python), native_logits)
    assert not any(op.native for op in python._program)


def test_a_new_generation_lets_the_old_kv_buffers_go(tiny_pack, tiny_llama_export):
    """Bindings keep what they are bound to alive; start() unbinds first, so the old KV buffers are freed
    before the new ones are made (not held beside them at the peak)."""
    import weakref

    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.step import Step

    for step in (Step(tiny_pack, threads=1), MonolithicStep(tiny_llama_export, threads=1)):
        step.start(1, 16)
        step.forward(np.array([[5, 6]], np.int64), np.ones((1, 2), np.int64), np.arange(2)[None])
        old = [weakref.ref(buffer) for buffer in step.kv.buffers.values()]
        freed_before_new = []

        def reset(*args, kv=step.kv, original=step.kv.reset, old=old, freed=freed_before_new):
            kv.buffers = {}  # what reset does first; then nothing else may hold the old buffers
            freed.append(all(ref() is None for ref in old))
            original(*args)

        step.kv.reset = reset
        step.start(1, 16)
        assert freed_before_new == [True]
        logits = step.forward(np.array([[5, 6]], np.int64), np.ones((1, 2), np.int64), np.arange(2)[None])
        assert np.isfinite(logits).all()


@pytest.mark.skipif(not capi.custom_ops_available(), reason="the C extension's custom ops are not built")
def test_a_session_registers_only_the_custom_ops_its_graph_runs():
    """Each session builds schemas and kernels for every op of its domain: a graph of BlockMatMul gets that op's."""
    block = helper.make_node(
        "BlockMatMul", ["a", "b", "scales"], ["y"], domain=capi.CUSTOM_DOMAIN, block_size=32
    )
    add = helper.make_node("Add", ["y", "y"], ["z"])
    graph = helper.make_graph(
        [block, add], "g", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    assert capi._custom_ops_run(model) == {"BlockMatMul"}
    assert (
        capi._custom_ops_run(helper.make_model(helper.make_graph([add], "g", [], [])).SerializeToString())
        == set()
    )
    assert capi._custom_ops_run(b"not a model") == set()
    rt = capi.runtime()
    assert rt.custom_op_domain(frozenset()) is None
    assert rt.custom_op_domain(frozenset({"BlockMatMul"})) is rt.custom_op_domain(frozenset({"BlockMatMul"}))
