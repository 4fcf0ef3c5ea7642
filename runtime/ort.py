"""ONNX Runtime import and session settings shared by every session pipeshard creates."""

from __future__ import annotations

import logging
import os
from types import ModuleType

from pipeshard.core.errors import UserError

log = logging.getLogger(__name__)


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


_process_pool_threads = 0


def use_process_thread_pool(threads: int | None = None) -> bool:
    """Give every ONNX Runtime session this process makes through the Python binding (the planned runtime's,
    the tokenizer's) one intra-op thread pool whose workers spin between ops; the chain and the monolithic
    session have such a pool in their C-API runtime anyway (runtime/capi.py). Call it first thing in a
    process that runs only pipeshard (the CLI does): dozens of sub-layer sessions can afford spinning only
    when they share one pool (per-session spinning pools starve each other), and it beats per-session pools
    without spinning on decode (docs/runtime.md).
    Afterwards every session in the process, pipeshard's or not, must be created with
    `use_per_session_threads = False` (ONNX Runtime refuses others). Returns False, changing nothing,
    when ORT refuses (its environment already exists)."""
    global _process_pool_threads
    ort = import_onnxruntime()
    threads = threads or default_threads()
    if _process_pool_threads:
        if threads != _process_pool_threads:
            log.warning(
                "warning: this process's ONNX Runtime thread pool has %d threads; %d asked for now",
                _process_pool_threads,
                threads,
            )
        return True
    try:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads, 1)
    except Exception:  # noqa: BLE001 - any refusal means: keep per-session pools
        return False
    _process_pool_threads = threads
    return True


_requested_pool_threads: int | None = None


def request_process_thread_pool(threads: int | None = None) -> None:
    """`use_process_thread_pool` at the first session made through the Python binding, if one is made: a process
    that runs only the C-API engines (runtime/capi.py) then never loads the binding's ONNX Runtime (~20 MiB)."""
    global _requested_pool_threads
    _requested_pool_threads = threads or default_threads()


def cpu_session_options(threads: int | None = None, optimize: bool = True):
    """Options for a CPU-EP session: the process's shared thread pool if `use_process_thread_pool`
    was called, else a per-session pool with spinning off (many sessions each spinning their own
    pool made a chain several times slower: ORT-NOTES, "Thread pools")."""
    ort = import_onnxruntime()
    if _requested_pool_threads and not _process_pool_threads:
        use_process_thread_pool(_requested_pool_threads)
    options = ort.SessionOptions()
    if _process_pool_threads:
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads or default_threads()
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # A memory pattern is traced and cached per distinct set of input shapes; decoding grows the context
    # every step, so each step at a context not seen before traces one, and the cache keeps one entry per
    # context length per session. Off, the shared arena serves the same allocations, no slower (docs/cli.md).
    options.enable_mem_pattern = False
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.log_severity_level = 3
    _register_shared_cpu_arena(ort)
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options


CUDA_PROVIDERS = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]


def cuda_usable() -> bool:
    """True when a session asked for CUDA really gets the CUDA EP (onnxruntime-gpu silently falls
    back to the CPU when the CUDA libraries are missing)."""
    ort = import_onnxruntime()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
    )
    try:
        if hasattr(ort, "preload_dlls"):  # the CUDA / cuDNN libraries of the nvidia-* pip packages
            ort.preload_dlls()
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        session = ort.InferenceSession(model.SerializeToString(), providers=CUDA_PROVIDERS)
    except Exception:  # noqa: BLE001 - any failure to create means "not usable"
        return False
    return session.get_providers()[0] == "CUDAExecutionProvider"
