"""Where device weights live and how they get there: one small interface, three devices.

- `sim`: a simulated accelerator for machines without one. Device buffers are host arrays charged to
  a ledger that enforces the budget (going over is a bug and raises); uploads are real memory copies
  on the prefetch thread; device sessions run on the CPU EP. It tests the machinery, never GPU speed.
- `cuda`: ONNX Runtime's CUDA EP; pinned host staging, a copy stream and events through cuda-python.
- `cpu`: no device at all (budget 0): every plan is the all-CPU chain.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pipeshard.errors import UserError


class BudgetExceeded(RuntimeError):
    """A device allocation would pass the VRAM budget: the plan or the runtime is wrong."""


class Ledger:
    """Bytes charged against the VRAM budget, by purpose; remembers the peak."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used = 0
        self.peak = 0
        self.by_purpose: dict[str, int] = {}
        self._lock = threading.Lock()

    def charge(self, nbytes: int, purpose: str) -> None:
        with self._lock:
            if self.used + nbytes > self.budget_bytes:
                raise BudgetExceeded(f"{purpose}: {nbytes} bytes would bring device memory to {self.used + nbytes}, "
                                     f"over the budget of {self.budget_bytes}")
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) + nbytes

    def release(self, nbytes: int, purpose: str) -> None:
        with self._lock:
            self.used -= nbytes
            self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) - nbytes


class LedgeredDevice:
    """What every device shares: a ledger that every byte of device memory is charged to."""

    def __init__(self, budget_bytes: int) -> None:
        self.ledger = Ledger(budget_bytes)
        self.copied_bytes = 0
        self.copy_seconds = 0.0

    def set_budget(self, budget_bytes: int) -> None:
        if self.ledger.used > budget_bytes:
            raise BudgetExceeded(f"{self.ledger.used} bytes still in use, more than the new budget {budget_bytes}")
        self.ledger.budget_bytes = budget_bytes

    def reserve(self, nbytes: int, purpose: str) -> None:
        """Charge memory the device uses without pipeshard allocating it (workspace, EP context)."""
        self.ledger.charge(nbytes, purpose)

    def unreserve(self, nbytes: int, purpose: str) -> None:
        self.ledger.release(nbytes, purpose)


class SimDevice(LedgeredDevice):
    """Host memory posing as device memory, with a budget and an asynchronous copy engine."""

    kind = "sim"
    providers = ["CPUExecutionProvider"]

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeshard-prefetch")

    def alloc(self, nbytes: int, purpose: str) -> np.ndarray:
        self.ledger.charge(nbytes, purpose)
        return np.empty(nbytes, dtype=np.uint8)

    def free(self, buffer: np.ndarray, purpose: str) -> None:
        self.ledger.release(buffer.nbytes, purpose)

    def upload(self, target: np.ndarray, source: np.ndarray) -> Future:
        """Copy host bytes into a device buffer on the copy thread; returns a waitable."""
        def copy() -> float:
            import time

            started = time.perf_counter()
            np.copyto(target[: source.nbytes], source)
            elapsed = time.perf_counter() - started
            self.copied_bytes += source.nbytes
            self.copy_seconds += elapsed
            return elapsed

        return self._copier.submit(copy)

    def upload_now(self, target: np.ndarray, source: np.ndarray) -> None:
        self.upload(target, source).result()

    @property
    def ort_device(self):
        """Where device sessions keep their KV outputs (host memory, on sim)."""
        return cpu_ort_device()

    def released_after_compute(self, buffer: np.ndarray) -> None:
        """Compute here is synchronous: a slot is free as soon as its sub-layer returned."""

    def bind_input(self, binding, name: str, buffer: np.ndarray, offset: int, dtype, shape) -> None:
        """Bind the tensor at `offset` in a device buffer (a weight, a KV cache) as a session input."""
        binding.bind_input(name, cpu_ort_device(), np.dtype(dtype), list(shape), buffer.ctypes.data + offset)

    def bind_output(self, binding, name: str, buffer: np.ndarray, offset: int, dtype, shape) -> None:
        """Bind a device buffer as a session output (a KV cache written in place)."""
        binding.bind_output(name, cpu_ort_device(), np.dtype(dtype), list(shape), buffer.ctypes.data + offset)

    def copy_in(self, target: np.ndarray, source: np.ndarray) -> None:
        """Synchronous host -> device copy of a host array that changes (a KV cache; never cached)."""
        np.copyto(target[: source.nbytes], source.reshape(-1).view(np.uint8))

    def copy_out(self, target: np.ndarray, source: np.ndarray) -> None:
        """Synchronous device -> host copy into a host array."""
        np.copyto(target.reshape(-1).view(np.uint8), source[: target.nbytes])

    def close(self) -> None:
        self._copier.shutdown(wait=True)


@functools.cache
def cpu_ort_device():
    """ONNX Runtime's handle for host memory, for raw IO binding."""
    import onnxruntime

    return onnxruntime.OrtDevice.make("cpu", 0)._get_c_device()


def make_device(kind: str, budget_bytes: int):
    """The device of a name; `cuda` only when the CUDA EP really loads."""
    if kind == "sim":
        return SimDevice(budget_bytes)
    if kind == "cuda":
        from pipeshard.profiles.measure_cuda import cuda_usable

        if not cuda_usable():
            raise UserError("--device cuda: no usable CUDA execution provider (install pipeshard[gpu] with CUDA 13 "
                            "and cuDNN 9, and check `nvidia-smi`); use --device sim or cpu")
        from pipeshard.runtime.cuda_device import CudaDevice

        return CudaDevice(budget_bytes)
    raise UserError(f"unknown device {kind!r}; choose cuda, sim or cpu")
