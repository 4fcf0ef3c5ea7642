"""The VRAM budget's ledger and what every device builds on: each byte of device memory is charged to it.

Apart from `runtime/devices.py` so that the CUDA device (`runtime/cuda_device.py`), which `make_device` imports
there, builds on it without importing devices.py back.
"""

from __future__ import annotations

import threading


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
                raise BudgetExceeded(
                    f"{purpose}: {nbytes} bytes would bring device memory to {self.used + nbytes}, "
                    f"over the budget of {self.budget_bytes}"
                )
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) + nbytes

    def release(self, nbytes: int, purpose: str) -> None:
        with self._lock:
            self.used -= nbytes
            self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) - nbytes


class LedgeredDevice:
    """What every device shares: a ledger that every byte of device memory is charged to."""

    cuda_options: dict[str, str] | None = None
    kernel_table = None  # runtime/kernel_check.py's KernelTable: device graphs are checked against it at load

    def __init__(self, budget_bytes: int) -> None:
        self.ledger = Ledger(budget_bytes)
        self.copied_bytes = 0
        self.copy_seconds = 0.0

    def set_budget(self, budget_bytes: int) -> None:
        if self.ledger.used > budget_bytes:
            raise BudgetExceeded(
                f"{self.ledger.used} bytes still in use, more than the new budget {budget_bytes}"
            )
        self.ledger.budget_bytes = budget_bytes

    def reserve(self, nbytes: int, purpose: str) -> None:
        """Charge memory the device uses without pipeshard allocating it (workspace, EP context)."""
        self.ledger.charge(nbytes, purpose)

    def unreserve(self, nbytes: int, purpose: str) -> None:
        self.ledger.release(nbytes, purpose)
