"""The `cuda` device: ONNX Runtime's CUDA EP fed by our own copy stream (cuda-python).

Streamed weights are held once, in pinned host memory: a streamed unit's bytes are read from its blob file
straight into a page-locked buffer (never through the memory map, so the model's streamed part is not in host
RAM twice), and uploads are cudaMemcpyAsync from there on a copy stream we own, each followed by an event.
Pinned units are copied once, synchronously, from the mapped blob. ORT runs on a compute stream we also own
(the EP's `user_compute_stream`); before a sub-layer runs, the compute stream waits on its upload's event;
before a staging slot is refilled, the copy stream waits on the event recorded after the slot's last user
ran. So copies overlap compute and nothing is read before it arrived. Device buffers are cudaMalloc'd,
charged to the ledger, and bound by pointer through a CUDA memory info.

Events are reused, never made per copy (a generated answer makes thousands of copies): an upload takes an
event from a pool and gives it back once the compute stream's wait on it has been issued (CUDA waits on the
record made before the wait call, so re-recording it later is safe); each staging slot has one release event,
re-recorded after each reader and returned to the pool when the slot is freed.

Unverified: no GPU was available when this was written (README). The GPU check exercises it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeshard.runtime.ledger import LedgeredDevice


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


class PinnedSource:
    """A streamed unit's bytes in page-locked host memory (cudaMallocHost), read from its blob file."""

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
    kind = "cuda"  # DeviceKind.CUDA (runtime/devices.py imports this module, not the other way)

    def __init__(self, budget_bytes: int, runtime=None, device_id: int = 0, kernel_table=None) -> None:
        """`kernel_table`: the CUDA EP's kernels (runtime/kernel_check.py) every device graph is checked against."""
        if runtime is None:
            from cuda.bindings import runtime
        super().__init__(budget_bytes)
        self.kernel_table = kernel_table
        self.rt = runtime
        self.device_id = device_id
        _check(self.rt.cudaSetDevice(device_id))
        self.copy_stream = _check(self.rt.cudaStreamCreate())
        self.compute_stream = _check(self.rt.cudaStreamCreate())
        self.cuda_options = {
            "device_id": str(device_id),
            "user_compute_stream": str(int(self.compute_stream)),
            "do_copy_in_default_stream": "0",
        }
        self._sources: list[PinnedSource] = []
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

    def address(self, buffer: DeviceBuffer) -> int:
        return buffer.pointer

    def memory_info(self, rt):
        """ONNX Runtime's memory info for this GPU's memory (C API), for binding by pointer."""
        return rt.memory_info("Cuda", self.device_id)

    def _event(self):
        """An event nobody waits on any more, or a new one."""
        if self._free_events:
            return self._free_events.pop()
        event = _check(self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming))
        self._events.append(event)
        return event

    def host_source(self, path: Path, offset: int, nbytes: int) -> PinnedSource:
        """Page-locked host memory holding a streamed unit's bytes, read from the file into it (once)."""
        pointer = int(_check(self.rt.cudaMallocHost(nbytes)))
        source = PinnedSource(pointer, nbytes)
        self._sources.append(source)
        self._read_into(path, offset, source)
        return source

    @staticmethod
    def _read_into(path: Path, offset: int, source: PinnedSource) -> None:
        view = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * source.nbytes).from_address(source.pointer)
        )
        with open(path, "rb") as file:
            file.seek(offset)
            if file.readinto(memoryview(view)) != source.nbytes:
                raise RuntimeError(f"{path}: short read of {source.nbytes} bytes at {offset}")

    @property
    def host_bytes(self) -> int:
        """Pinned host memory held for streamed units."""
        return sum(source.nbytes for source in self._sources)

    def upload(self, target: DeviceBuffer, source: PinnedSource) -> CopyTicket:
        """Copy a streamed unit into a device buffer on the copy stream, after the buffer's last reader finished."""
        released = self._slot_released.get(target.pointer)
        if released is not None:
            _check(self.rt.cudaStreamWaitEvent(self.copy_stream, released, 0))
        _check(
            self.rt.cudaMemcpyAsync(
                target.pointer,
                source.pointer,
                source.nbytes,
                self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                self.copy_stream,
            )
        )
        event = self._event()
        _check(self.rt.cudaEventRecord(event, self.copy_stream))
        self.copied_bytes += source.nbytes
        return CopyTicket(self, event)

    def upload_array(self, target: DeviceBuffer, source: np.ndarray) -> CopyTicket:
        """A host array (a streamed attention's KV, kept in host memory) into a device buffer on the copy stream,
        after the buffer's last reader finished; the caller leaves the array as it is until the ticket is waited
        on. From pageable memory the driver stages the copy (it returns once the bytes left the array)."""
        return self.upload(target, PinnedSource(source.ctypes.data, source.nbytes))

    def upload_now(self, target: DeviceBuffer, source: np.ndarray) -> None:
        """A pinned unit's weights, from the mapped blob (pageable), before the plan's first step."""
        _check(
            self.rt.cudaMemcpy(
                target.pointer,
                source.ctypes.data,
                source.nbytes,
                self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            )
        )
        self.copied_bytes += source.nbytes

    def released_after_compute(self, buffer: DeviceBuffer) -> None:
        """Record that the compute stream's work so far is the last reader of `buffer` (a staging slot)."""
        event = self._slot_released.get(buffer.pointer)
        if event is None:
            event = self._slot_released[buffer.pointer] = self._event()
        _check(self.rt.cudaEventRecord(event, self.compute_stream))

    def copy_in(self, target: DeviceBuffer, source: np.ndarray) -> None:
        """Host data that changes (KV, activations) to the device, after the compute stream's work so far."""
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(
            self.rt.cudaMemcpy(
                target.pointer,
                source.ctypes.data,
                source.nbytes,
                self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            )
        )

    def copy_out(self, target: np.ndarray, source: DeviceBuffer) -> None:
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(
            self.rt.cudaMemcpy(
                target.ctypes.data,
                source.pointer,
                target.nbytes,
                self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
            )
        )

    def copy_out_rows(
        self, target: np.ndarray, source: DeviceBuffer, offset: int, rows: int, width: int, pitch: int
    ) -> None:
        """`rows` runs of `width` bytes, `pitch` apart from `offset` on, from the device buffer into the same places
        of the contiguous host array `target`, after the compute stream's work so far (one 2-D copy)."""
        if offset + (rows - 1) * pitch + width > min(target.nbytes, source.nbytes):
            raise ValueError("copy_out_rows: the region passes the end of a buffer")
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(
            self.rt.cudaMemcpy2D(
                target.ctypes.data + offset,
                pitch,
                source.pointer + offset,
                pitch,
                width,
                rows,
                self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
            )
        )

    def copy_in_rows(
        self, target: DeviceBuffer, source: np.ndarray, offset: int, rows: int, width: int, pitch: int
    ) -> None:
        """The same runs from the contiguous host array `source` into the device buffer, after the compute stream's
        work so far (one 2-D copy; a kept prefix's KV into a slot)."""
        if offset + (rows - 1) * pitch + width > min(target.nbytes, source.nbytes):
            raise ValueError("copy_in_rows: the region passes the end of a buffer")
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        _check(
            self.rt.cudaMemcpy2D(
                target.pointer + offset,
                pitch,
                source.ctypes.data + offset,
                pitch,
                width,
                rows,
                self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            )
        )

    def close(self) -> None:
        _check(self.rt.cudaStreamSynchronize(self.copy_stream))
        _check(self.rt.cudaStreamSynchronize(self.compute_stream))
        for source in self._sources:
            _check(self.rt.cudaFreeHost(source.pointer))
        self._sources.clear()
        for event in self._events:
            _check(self.rt.cudaEventDestroy(event))
        self._events, self._free_events = [], []
        self._slot_released.clear()
