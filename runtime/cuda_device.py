"""The `cuda` device: ONNX Runtime's CUDA EP fed by our own copy stream (cuda-python).

Weights of streamed sub-layers are kept in pinned host memory; uploads are cudaMemcpyAsync on a
copy stream we own, each followed by an event. ORT runs on a compute stream we also own (the EP's
`user_compute_stream`), and before a sub-layer runs the compute stream waits on its upload's event;
before a staging slot is refilled the copy stream waits on the event recorded after the slot's last
user ran. So copies overlap compute and nothing is read before it arrived. Device buffers are
cudaMalloc'd, charged to the same Ledger as the sim device, and bound by pointer.

Events are reused, never made per copy (a generated answer makes thousands of copies): an upload takes an
event from a pool and gives it back once the compute stream's wait on it has been issued (CUDA waits on the
record made before the wait call, so re-recording it later is safe); each staging slot has one release event,
re-recorded after each reader and destroyed with the slot.

Unverified: no GPU was available when this was written (README). The GPU check exercises it.
"""

from __future__ import annotations

import numpy as np

from pipeshard.runtime.devices import LedgeredDevice


def _check(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err!r}")
    return values[0] if len(values) == 1 else (values or None)


class DeviceBuffer:
    """A cudaMalloc'd block: its address and size (what binding by pointer needs)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes


class CopyTicket:
    """An upload in flight: `result()` makes the compute stream wait for it (the host does not block)."""

    def __init__(self, device: CudaDevice, event) -> None:
        self.device = device
        self.event = event
        self._returned = False

    def result(self) -> None:
        if self._returned:
            return  # the wait was issued already: the compute stream stays ordered after the copy
        _check(self.device.rt.cudaStreamWaitEvent(self.device.compute_stream, self.event, 0))
        self._returned = True
        self.device._free_events.append(self.event)


class CudaDevice(LedgeredDevice):
    kind = "cuda"

    def __init__(self, budget_bytes: int, runtime=None) -> None:
        if runtime is None:
            from cuda.bindings import runtime
        super().__init__(budget_bytes)
        self.rt = runtime
        _check(self.rt.cudaSetDevice(0))
        self.copy_stream = _check(self.rt.cudaStreamCreate())
        self.compute_stream = _check(self.rt.cudaStreamCreate())
        cuda_options = {"device_id": 0, "user_compute_stream": str(int(self.compute_stream)),
                        "do_copy_in_default_stream": "0"}
        self.providers = [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
        self._pinned_host: dict[int, tuple[int, int]] = {}  # id(source) -> (pointer, bytes)
        self._slot_released: dict[int, object] = {}  # buffer pointer -> its release event
        self._free_events: list = []
        self._events: list = []  # every event made, destroyed at close()

    def alloc(self, nbytes: int, purpose: str) -> DeviceBuffer:
        self.ledger.charge(nbytes, purpose)
        try:
            return DeviceBuffer(int(_check(self.rt.cudaMalloc(nbytes))), nbytes)
        except RuntimeError:
            self.ledger.release(nbytes, purpose)
            raise

    def free(self, buffer: DeviceBuffer, purpose: str) -> None:
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(self.rt.cudaFree(buffer.pointer))
        self.ledger.release(buffer.nbytes, purpose)
        released = self._slot_released.pop(buffer.pointer, None)
        if released is not None:
            self._free_events.append(released)

    def _event(self):
        """An event nobody waits on any more, or a new one."""
        if self._free_events:
            return self._free_events.pop()
        event = _check(self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming))
        self._events.append(event)
        return event

    def _pinned(self, source: np.ndarray) -> int:
        """A pinned host copy of a weight blob (made once): async copies need page-locked memory."""
        key = id(source.base if source.base is not None else source)
        if key not in self._pinned_host:
            pointer = int(_check(self.rt.cudaMallocHost(source.nbytes)))
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * source.nbytes).from_address(pointer))[:] = source
            self._pinned_host[key] = (pointer, source.nbytes)
        return self._pinned_host[key][0]

    def upload(self, target: DeviceBuffer, source: np.ndarray) -> CopyTicket:
        """Copy a blob into a device buffer on the copy stream, after the buffer's last reader finished."""
        released = self._slot_released.get(target.pointer)
        if released is not None:
            _check(self.rt.cudaStreamWaitEvent(self.copy_stream, released, 0))
        _check(self.rt.cudaMemcpyAsync(target.pointer, self._pinned(source), source.nbytes,
                                       self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.copy_stream))
        event = self._event()
        _check(self.rt.cudaEventRecord(event, self.copy_stream))
        self.copied_bytes += source.nbytes
        return CopyTicket(self, event)

    def upload_now(self, target: DeviceBuffer, source: np.ndarray) -> None:
        ticket = self.upload(target, source)
        _check(self.rt.cudaStreamSynchronize(self.copy_stream))
        ticket._returned = True
        self._free_events.append(ticket.event)

    def released_after_compute(self, buffer: DeviceBuffer) -> None:
        """Record that the compute stream's work so far is the last reader of `buffer` (a staging slot)."""
        event = self._slot_released.get(buffer.pointer)
        if event is None:
            event = self._slot_released[buffer.pointer] = self._event()
        _check(self.rt.cudaEventRecord(event, self.compute_stream))

    @property
    def ort_device(self):
        """ORT's handle for this GPU, for binding by pointer."""
        import onnxruntime

        return onnxruntime.OrtDevice.make("cuda", 0)._get_c_device()

    def bind_input(self, binding, name: str, buffer: DeviceBuffer, offset: int, dtype, shape) -> None:
        binding.bind_input(name, self.ort_device, np.dtype(dtype), list(shape), buffer.pointer + offset)

    def bind_output(self, binding, name: str, buffer: DeviceBuffer, offset: int, dtype, shape) -> None:
        binding.bind_output(name, self.ort_device, np.dtype(dtype), list(shape), buffer.pointer + offset)

    def copy_in(self, target: DeviceBuffer, source: np.ndarray) -> None:
        """A KV cache to the device, synchronously (pageable memory: it changes, so it is never pinned)."""
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(self.rt.cudaMemcpy(target.pointer, source.ctypes.data, source.nbytes,
                                  self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def copy_out(self, target: np.ndarray, source: DeviceBuffer) -> None:
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(self.rt.cudaMemcpy(target.ctypes.data, source.pointer, target.nbytes,
                                  self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))

    def close(self) -> None:
        _check(self.rt.cudaStreamSynchronize(self.copy_stream))
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        for pointer, _ in self._pinned_host.values():
            _check(self.rt.cudaFreeHost(pointer))
        self._pinned_host.clear()
        for event in self._events:
            _check(self.rt.cudaEventDestroy(event))
        self._events, self._free_events = [], []
        self._slot_released.clear()
