"""The cuda device's bookkeeping with a fake CUDA runtime (the real one needs a GPU: README, unverified)."""

import numpy as np
import pytest
from conftest import parse_python

from pipeshard.runtime.cuda_device import CudaDevice
from pipeshard.runtime.devices import BudgetExceeded


class FakeRuntime:
    """Records calls; pointers are counters; every call succeeds (error code 0)."""

    class cudaMemcpyKind:  # noqa: N801 - mirrors cuda.bindings.runtime
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    cudaEventDisableTiming = 2

    def __init__(self):
        self.calls = []
        self.next_pointer = 0x1000

    def _pointer(self):
        self.next_pointer += 0x1000
        return self.next_pointer

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name in ("cudaMalloc", "cudaMallocHost", "cudaStreamCreate", "cudaEventCreateWithFlags"):
                return 0, self._pointer()
            return (0,)

        return call


@pytest.fixture()
def device(monkeypatch):
    runtime = FakeRuntime()
    # Reading into "pinned" memory at a fake address would crash: the read is recorded instead.
    monkeypatch.setattr(
        CudaDevice,
        "_read_into",
        staticmethod(
            lambda path, offset, source: runtime.calls.append(("read", (str(path), offset, source.nbytes)))
        ),
    )
    return CudaDevice(1 << 20, runtime=runtime), runtime


@pytest.fixture()
def blob(tmp_path):
    path = tmp_path / "unit.bin"
    path.write_bytes(bytes(4096))
    return path


def test_allocations_are_charged_and_released(device):
    cuda, _ = device
    buffer = cuda.alloc(4096, "pinned")
    assert cuda.ledger.used == 4096
    cuda.free(buffer, "pinned")
    assert cuda.ledger.used == 0 and cuda.ledger.peak == 4096


def test_the_budget_is_enforced_before_cuda_malloc(device):
    cuda, runtime = device
    with pytest.raises(BudgetExceeded):
        cuda.alloc(2 << 20, "staging")
    assert not any(name == "cudaMalloc" for name, _ in runtime.calls)


def test_a_slot_refill_waits_for_its_last_reader_and_compute_waits_for_the_copy(device, blob):
    cuda, runtime = device
    slot = cuda.alloc(1024, "staging")
    blob = cuda.host_source(blob, 0, 1024)
    ticket = cuda.upload(slot, blob)
    ticket.result()
    assert ("cudaStreamWaitEvent", (cuda.compute_stream, ticket.event, 0)) in runtime.calls
    cuda.released_after_compute(slot)
    released = cuda._slot_released[slot.pointer]
    runtime.calls.clear()
    cuda.upload(slot, blob)
    names = [name for name, _ in runtime.calls]
    assert names.index("cudaStreamWaitEvent") < names.index("cudaMemcpyAsync")
    assert ("cudaStreamWaitEvent", (cuda.copy_stream, released, 0)) in runtime.calls


def test_the_ep_runs_on_our_compute_stream(device):
    cuda, _ = device
    options = cuda.cuda_options
    assert (
        options["user_compute_stream"] == str(cuda.compute_stream)
        and options["do_copy_in_default_stream"] == "0"
    )


def test_streamed_weights_are_held_once_in_pinned_memory_read_from_the_file(device, blob):
    """A streamed unit's bytes go from its blob file straight into page-locked memory (no mapped copy beside
    them); the report counts that memory, and close() frees it."""
    cuda, runtime = device
    source = cuda.host_source(blob, 1024, 2048)
    assert ("read", (str(blob), 1024, 2048)) in runtime.calls
    assert [args for name, args in runtime.calls if name == "cudaMallocHost"] == [(2048,)]
    assert cuda.host_bytes == 2048
    cuda.close()
    assert ("cudaFreeHost", (source.pointer,)) in runtime.calls and cuda.host_bytes == 0


def test_kv_copies_wait_for_compute_and_are_never_served_from_the_pinned_cache(device):
    cuda, runtime = device
    buffer = cuda.alloc(256, "kv")
    host = np.zeros((1, 2, 4, 8), np.float32)
    runtime.calls.clear()
    cuda.copy_in(buffer, host)
    cuda.copy_out(host, buffer)
    assert [name for name, _ in runtime.calls] == ["cudaStreamSynchronize", "cudaMemcpy"] * 2
    (_, copy_in), (_, copy_out) = runtime.calls[1], runtime.calls[3]
    assert copy_in == (buffer.pointer, host.ctypes.data, 256, 1)
    assert copy_out == (host.ctypes.data, buffer.pointer, 256, 2)
    assert cuda.host_bytes == 0


def test_streamed_kv_uploads_wait_for_the_slot_and_new_rows_come_back_in_one_2d_copy(device):
    cuda, runtime = device
    slot = cuda.alloc(1024, "kv staging")
    host = np.zeros((1, 2, 16, 8), np.float32)  # [batch, kv heads, capacity, head dim]
    cuda.released_after_compute(slot)  # the slot's last reader
    runtime.calls.clear()
    cuda.upload_array(slot, host).result()
    names = [name for name, _ in runtime.calls]
    assert names.index("cudaStreamWaitEvent") < names.index("cudaMemcpyAsync")
    assert next(args for name, args in runtime.calls if name == "cudaMemcpyAsync")[:3] == (
        slot.pointer,
        host.ctypes.data,
        host.nbytes,
    )
    runtime.calls.clear()
    pitch = 16 * 8 * 4
    cuda.copy_out_rows(host, slot, offset=5 * 8 * 4, rows=2, width=8 * 4, pitch=pitch)
    assert runtime.calls == [
        ("cudaStreamSynchronize", (cuda.compute_stream,)),
        ("cudaMemcpy2D", (host.ctypes.data + 160, pitch, slot.pointer + 160, pitch, 32, 2, 2)),
    ]
    with pytest.raises(ValueError):
        cuda.copy_out_rows(host, slot, offset=1000, rows=2, width=32, pitch=pitch)


def test_events_are_reused_across_thousands_of_copies_and_destroyed_at_close(device, blob):
    cuda, runtime = device
    slots = [cuda.alloc(1024, "staging") for _ in range(2)]
    blob = cuda.host_source(blob, 0, 1024)
    for step in range(2000):  # the copies of a long answer through a two-slot ring
        slot = slots[step % 2]
        ticket = cuda.upload(slot, blob)
        ticket.result()
        cuda.released_after_compute(slot)
    created = [name for name, _ in runtime.calls].count("cudaEventCreateWithFlags")
    assert created <= 4, created
    cuda.close()
    destroyed = [args[0] for name, args in runtime.calls if name == "cudaEventDestroy"]
    assert sorted(destroyed) == sorted(cuda_events_made(runtime))


def cuda_events_made(runtime) -> list[int]:
    """The pointers the fake runtime handed out for events, in call order."""
    made, pointer = [], 0x1000
    for name, _ in runtime.calls:
        if name in ("cudaMalloc", "cudaMallocHost", "cudaStreamCreate", "cudaEventCreateWithFlags"):
            pointer += 0x1000
            if name == "cudaEventCreateWithFlags":
                made.append(pointer)
    return made


def test_every_cuda_call_of_the_device_exists_in_the_real_bindings():
    """cuda-bindings imports without a GPU: the names the device calls are checked against the real module."""
    import ast
    import inspect

    from pipeshard.runtime import cuda_device

    runtime = pytest.importorskip("cuda.bindings.runtime")
    called = {
        node.attr
        for node in ast.walk(parse_python(inspect.getsource(cuda_device)))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("cuda")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "rt"
    }
    assert called and not [name for name in called if not hasattr(runtime, name)]


def test_cuda_sessions_and_memory_go_through_the_c_api(monkeypatch):
    """The C API path a CUDA device's sessions take: a memory info for CUDA memory is made, CPU fallback is refused,
    and appending the CUDA EP reaches ONNX Runtime, which on this CPU-only build says it has no CUDA (a wrong table
    index or argument list would crash or fail otherwise): one `error:` line."""
    from pipeshard.core.errors import UserError
    from pipeshard.runtime import capi

    rt = capi.runtime()
    entries = []
    add_entry = rt.lib.AddSessionConfigEntry
    monkeypatch.setattr(
        rt.lib,
        "AddSessionConfigEntry",
        lambda options, key, value: entries.append((key, value)) or add_entry(options, key, value),
    )
    assert rt.memory_info("Cuda", 0).value and rt.memory_info("Cuda", 0) is rt.memory_info("Cuda", 0)
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    with pytest.raises(UserError, match="(?i)refused it on the CUDA EP .*cuda") as refused:
        rt.session(
            model.SerializeToString(), cuda_options={"device_id": "0", "do_copy_in_default_stream": "0"}
        )
    assert "\n" not in str(refused.value)
    assert (b"session.disable_cpu_ep_fallback", b"1") in entries
    entries.clear()
    rt.session(model.SerializeToString())
    assert entries and all(key != b"session.disable_cpu_ep_fallback" for key, _ in entries)
