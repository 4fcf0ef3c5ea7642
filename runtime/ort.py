"""ONNX Runtime import and session settings shared by every session pipeshard creates."""

from __future__ import annotations

import os
from types import ModuleType

from pipeshard.errors import UserError


def import_onnxruntime() -> ModuleType:
    """Import onnxruntime, or say which extra installs it (`cpu` and `gpu` must not be mixed)."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError(
            "ONNX Runtime is not installed: pip install 'pipeshard[cpu]' (CPU) or 'pipeshard[gpu]' (CUDA), "
            "never both"
        ) from None
    return onnxruntime


def default_threads() -> int:
    """Intra-op threads: the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_shared_arena_registered = False


def _register_shared_cpu_arena(ort) -> None:
    """One CPU arena for every session of the process: dozens of sub-layer sessions each growing a
    private arena to its own peak cost memory and first-touch page faults; a shared one is reused."""
    global _shared_arena_registered
    if not _shared_arena_registered:
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))
        _shared_arena_registered = True


def cpu_session_options(threads: int | None = None, optimize: bool = True):
    """Options for a CPU-EP session. Spinning is off: many sessions each spinning their own
    pool made a chain of sessions several times slower (ORT-NOTES, "Thread pools")."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.log_severity_level = 3
    _register_shared_cpu_arena(ort)
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options
