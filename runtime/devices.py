"""Where a plan's device work lives: one small protocol, three devices.

- `cpu`: no device memory at all (a budget of 0): the all-CPU plan runs on it.
- `sim`: a simulated accelerator for machines without one. Device buffers are host arrays charged to a ledger
  that enforces the budget (going over is a bug and raises); uploads are real memory copies on the prefetch
  thread; device sessions run on the CPU EP. It tests the machinery, never GPU speed.
- `cuda`: ONNX Runtime's CUDA EP fed by our own copy stream (`runtime/cuda_device.py`).

The step (`runtime/step.py`) talks to a device only through `Device`: memory (alloc, free, the address and the
ONNX Runtime memory info a binding points at), copies (an asynchronous upload returning a waitable, synchronous
copies in and out), and what its sessions need (`cuda_options`).
"""

from __future__ import annotations

import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.runtime.ledger import BudgetExceeded as BudgetExceeded  # callers catch it from here
from pipeshard.runtime.ledger import Ledger, LedgeredDevice


class DeviceKind(StrEnum):
    """What `--device` names: no device at all (`cpu`), the simulated one, CUDA. Not a placement: a plan places
    units on the CPU on every kind of device."""

    CPU = "cpu"
    SIM = "sim"
    CUDA = "cuda"


DEVICE_KINDS = tuple(DeviceKind)


class Waitable(Protocol):
    def result(self) -> object: ...


class Device(Protocol):
    """What the step needs of a device."""

    kind: str
    ledger: Ledger
    cuda_options: dict[str, str] | None  # the CUDA EP's options for device sessions; None: the CPU EP
    kernel_table: (
        object  # a KernelTable every device graph must pass at load (runtime/kernel_check.py); None: none
    )
    copied_bytes: int
    copy_seconds: float

    def alloc(self, nbytes: int, purpose: str): ...
    def free(self, buffer, purpose: str) -> None: ...
    def address(self, buffer) -> int: ...
    def memory_info(self, rt): ...
    def host_source(self, path: Path, offset: int, nbytes: int): ...
    def upload(self, target, source) -> Waitable: ...
    def upload_array(self, target, source: np.ndarray) -> Waitable: ...
    def upload_now(self, target, source: np.ndarray) -> None: ...
    def released_after_compute(self, buffer) -> None: ...
    def copy_in(self, target, source: np.ndarray) -> None: ...
    def copy_out(self, target: np.ndarray, source) -> None: ...
    def copy_out_rows(
        self, target: np.ndarray, source, offset: int, rows: int, width: int, pitch: int
    ) -> None: ...
    def copy_in_rows(
        self, target, source: np.ndarray, offset: int, rows: int, width: int, pitch: int
    ) -> None: ...
    def set_budget(self, budget_bytes: int) -> None: ...
    def reserve(self, nbytes: int, purpose: str) -> None: ...
    def unreserve(self, nbytes: int, purpose: str) -> None: ...
    @property
    def host_bytes(self) -> int: ...
    def close(self) -> None: ...


class HostMemoryDevice(LedgeredDevice):
    """A device whose memory is host memory (cpu, sim): buffers are byte arrays, bound through the CPU's memory
    info, copies are memory copies."""

    def alloc(self, nbytes: int, purpose: str) -> np.ndarray:
        self.ledger.charge(nbytes, purpose)
        return np.empty(nbytes, dtype=np.uint8)

    def free(self, buffer: np.ndarray, purpose: str) -> None:
        self.ledger.release(buffer.nbytes, purpose)

    def address(self, buffer: np.ndarray) -> int:
        return buffer.ctypes.data

    def memory_info(self, rt):
        return rt.cpu

    def host_source(self, path: Path, offset: int, nbytes: int) -> np.ndarray:
        """The host bytes a streamed unit is uploaded from: a view of its memory-mapped blob."""
        return np.memmap(path, np.uint8, mode="r", offset=offset, shape=(nbytes,))

    @property
    def host_bytes(self) -> int:
        """Host memory the device holds besides the mapped blobs (none)."""
        return 0

    def upload_now(self, target: np.ndarray, source: np.ndarray) -> None:
        np.copyto(target[: source.nbytes], source.reshape(-1).view(np.uint8))

    def released_after_compute(self, buffer: np.ndarray) -> None:
        """Compute here is synchronous: a slot is free as soon as its sub-layer returned."""

    def copy_in(self, target: np.ndarray, source: np.ndarray) -> None:
        np.copyto(target[: source.nbytes], source.reshape(-1).view(np.uint8))

    def copy_out(self, target: np.ndarray, source: np.ndarray) -> None:
        np.copyto(target.reshape(-1).view(np.uint8), source[: target.nbytes])

    def copy_out_rows(
        self, target: np.ndarray, source: np.ndarray, offset: int, rows: int, width: int, pitch: int
    ) -> None:
        """`rows` runs of `width` bytes, `pitch` apart from `offset` on, from the device buffer into the same
        places of the contiguous host array `target` (the new rows of a streamed KV cache)."""
        host = target.reshape(-1).view(np.uint8)
        np.copyto(*_strided_regions(host, source, offset, rows, width, pitch))

    def copy_in_rows(
        self, target: np.ndarray, source: np.ndarray, offset: int, rows: int, width: int, pitch: int
    ) -> None:
        """The same runs from the contiguous host array `source` into the device buffer `target` (a kept prefix's
        KV into a slot of a KV cache on the device)."""
        host = source.reshape(-1).view(np.uint8)
        np.copyto(*reversed(_strided_regions(host, target, offset, rows, width, pitch)))


def _strided_regions(host: np.ndarray, device: np.ndarray, offset: int, rows: int, width: int, pitch: int):
    """The same `rows` runs of `width` bytes, `pitch` apart from `offset` on, in a host and a device byte array."""
    for region in (host, device):
        if offset + (rows - 1) * pitch + width > region.nbytes:
            raise ValueError("copy_rows: the region passes the end of a buffer")
    shape, strides = (rows, width), (pitch, 1)
    return (
        np.lib.stride_tricks.as_strided(host[offset:], shape, strides),
        np.lib.stride_tricks.as_strided(device[offset:], shape, strides),
    )


class CpuDevice(HostMemoryDevice):
    """No device: every plan it runs places every unit on the CPU."""

    kind = DeviceKind.CPU

    def __init__(self, budget_bytes: int = 0) -> None:
        super().__init__(budget_bytes)

    def upload(self, target: np.ndarray, source: np.ndarray) -> Future:
        self.upload_now(target, source)
        done: Future = Future()
        done.set_result(0.0)
        return done

    def upload_array(self, target: np.ndarray, source: np.ndarray) -> Future:
        return self.upload(target, source.reshape(-1).view(np.uint8))

    def close(self) -> None:
        """Nothing to release."""


class SimDevice(HostMemoryDevice):
    """Host memory posing as device memory, with a budget and an asynchronous copy engine. With a kernel table
    (the CUDA EP's, read offline) its device graphs are refused at load as a CUDA device would refuse them."""

    kind = DeviceKind.SIM

    def __init__(self, budget_bytes: int, kernel_table=None) -> None:
        super().__init__(budget_bytes)
        self.kernel_table = kernel_table
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeshard-prefetch")

    def upload(self, target: np.ndarray, source: np.ndarray) -> Future:
        """Copy host bytes into a device buffer on the copy thread; returns a waitable."""

        def copy() -> float:
            started = time.perf_counter()
            np.copyto(target[: source.nbytes], source)
            _drop_mapped_pages(source)
            elapsed = time.perf_counter() - started
            self.copied_bytes += source.nbytes
            self.copy_seconds += elapsed
            return elapsed

        return self._copier.submit(copy)

    def upload_array(self, target: np.ndarray, source: np.ndarray) -> Future:
        """A host array (a streamed attention's KV) into a device buffer on the copy thread; the caller leaves the
        array as it is until the copy is waited for."""
        return self.upload(target, source.reshape(-1).view(np.uint8))

    def close(self) -> None:
        self._copier.shutdown(wait=True)


def drop_mapped_range(mapped: np.memmap, offset: int, nbytes: int) -> None:
    """Let the kernel take back the pages of bytes [offset, offset + nbytes) of a memory-mapped file (a unit
    uploaded to the device for good): they are then not in host memory beside the device's copy."""
    mapping = getattr(mapped, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED") or nbytes <= 0:
        return
    start = offset - offset % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(mapping)) - start)


def _drop_mapped_pages(source: np.ndarray) -> None:
    """Let the kernel take back a memory-mapped source's pages once copied (they stay in the page cache): the
    streamed part of the model is then not resident twice, in the mapping and in the CPU sessions."""
    mapped = getattr(source, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def make_device(kind: str, budget_bytes: int, kernel_table=None) -> Device:
    """The device of a name; `cuda` only when the CUDA EP really loads. `kernel_table`: what the device checks its
    graphs against before making sessions (none by default: a `cuda` device's no-fallback sessions refuse a graph
    with a node its EP cannot run all the same)."""
    if kind == DeviceKind.CPU:
        return CpuDevice(budget_bytes)
    if kind == DeviceKind.SIM:
        return SimDevice(budget_bytes, kernel_table)
    if kind == DeviceKind.CUDA:
        from pipeshard.runtime.ort import cuda_usable

        if not cuda_usable():
            raise UserError(
                "--device cuda: no usable CUDA execution provider (install pipeshard[gpu] with CUDA 13 "
                "and cuDNN 9, and check `nvidia-smi`); use --device sim or cpu"
            )
        from pipeshard.runtime.cuda_device import CudaDevice

        # No kernel table read from the onnxruntime in the process: its registry walk loads every provider library
        # and crashes the process where TensorRT's libraries are absent (seen on the first GPU run); the device's
        # sessions refuse CPU fallback, so ONNX Runtime itself names a node without a CUDA kernel.
        return CudaDevice(budget_bytes, kernel_table=kernel_table)
    raise UserError(f"unknown device {kind!r}; choose {', '.join(DEVICE_KINDS)}")
