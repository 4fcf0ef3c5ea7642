"""ONNX Runtime's C API through ctypes: the sessions of the CPU engines (the chain, the monolithic session).

Why not the Python binding: a decode step of the chain is ~60 session runs, and each call into the Python
binding starts cache-cold (the previous sub-layer's weights have just streamed through the caches), which
costs a few microseconds of interpreter and pybind dispatch per run on top of ONNX Runtime's own work.
Through the C API a block of runs is one call into `_runloop` (a small C extension) that calls
`RunWithBinding` for each session without coming back to Python.

The library is the `libonnxruntime` the onnxruntime wheel ships beside its Python binding (the one
onnxruntime-genai loads too; where the binding is loaded as well, a second ONNX Runtime in the process,
with its own environment): our sessions get a thread pool of their own, shared by all of them and
spinning between runs, whatever the host process chose for its other sessions.
`OrtApi` is append-only, so the table indices below hold for every release since the version asked for.
"""

from __future__ import annotations

import ctypes
import importlib.util
import struct
import sys
import time
import weakref
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError

try:
    from pipeshard.runtime import _runloop
except ImportError:  # not built (no C compiler at install): the same runs, one Python call each
    _runloop = None
from pipeshard.formats.export_info import BFLOAT16
from pipeshard.runtime import protowire as wire
from pipeshard.runtime.ort import default_threads, import_onnxruntime

CUSTOM_DOMAIN = "pipeshard"  # the op domain of runtime/_attention.c and runtime/_matmul.c
_API_VERSION = 13  # the OrtApi version asked for; every later one extends the table (indices checked in tests
# against ONNX Runtime's own onnxruntime_c_api.h: tests/test_ort_api.py)
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_PATH = ctypes.c_wchar_p if sys.platform == "win32" else ctypes.c_char_p  # ORTCHAR_T
_SIGNATURES = {  # name: (OrtApi index, argument types, result type); OrtStatus* unless stated
    "GetErrorMessage": (2, (_P,), ctypes.c_char_p),
    "CreateSession": (7, (_P, _PATH, _P, _PP), _P),
    "CreateSessionOptions": (10, (_PP,), _P),
    "DisableMemPattern": (17, (_P,), _P),
    "SetSessionLogSeverityLevel": (22, (_P, ctypes.c_int), _P),
    "SetSessionGraphOptimizationLevel": (23, (_P, ctypes.c_int), _P),
    "SetIntraOpNumThreads": (24, (_P, ctypes.c_int), _P),
    "SetInterOpNumThreads": (25, (_P, ctypes.c_int), _P),
    "CreateCustomOpDomain": (26, (ctypes.c_char_p, _PP), _P),
    "CustomOpDomain_Add": (27, (_P, _P), _P),
    "AddCustomOpDomain": (28, (_P, _P), _P),
    "CreateRunOptions": (39, (_PP,), _P),
    "CreateTensorWithDataAsOrtValue": (
        49,
        (_P, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_int, _PP),
        _P,
    ),
    "GetTensorMutableData": (51, (_P, _PP), _P),
    "GetTensorElementType": (60, (_P, ctypes.POINTER(ctypes.c_int)), _P),
    "GetDimensionsCount": (61, (_P, ctypes.POINTER(ctypes.c_size_t)), _P),
    "GetDimensions": (62, (_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t), _P),
    "GetTensorTypeAndShape": (65, (_P, _PP), _P),
    "CreateMemoryInfo": (68, (ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _PP), _P),
    "CreateCpuMemoryInfo": (69, (ctypes.c_int, ctypes.c_int, _PP), _P),
    "AllocatorFree": (76, (_P, _P), _P),
    "GetAllocatorWithDefaultOptions": (78, (_PP,), _P),
    "ReleaseStatus": (93, (_P,), None),
    "ReleaseMemoryInfo": (94, (_P,), None),
    "ReleaseSession": (95, (_P,), None),
    "ReleaseValue": (96, (_P,), None),
    "ReleaseRunOptions": (97, (_P,), None),
    "ReleaseTensorTypeAndShapeInfo": (99, (_P,), None),
    "ReleaseSessionOptions": (100, (_P,), None),
    "CreateEnvWithGlobalThreadPools": (119, (ctypes.c_int, ctypes.c_char_p, _P, _PP), _P),
    "DisablePerSessionThreads": (120, (_P,), _P),
    "CreateThreadingOptions": (121, (_PP,), _P),
    "ReleaseThreadingOptions": (122, (_P,), None),
    "AddSessionConfigEntry": (130, (_P, ctypes.c_char_p, ctypes.c_char_p), _P),
    "RunWithBinding": (133, (_P, _P, _P), _P),
    "CreateIoBinding": (134, (_P, _PP), _P),
    "ReleaseIoBinding": (135, (_P,), None),
    "BindInput": (136, (_P, ctypes.c_char_p, _P), _P),
    "BindOutput": (137, (_P, ctypes.c_char_p, _P), _P),
    "BindOutputToDevice": (138, (_P, ctypes.c_char_p, _P), _P),
    "ClearBoundInputs": (141, (_P,), None),
    "ClearBoundOutputs": (142, (_P,), None),
    "GetBoundOutputValues": (140, (_P, _P, ctypes.POINTER(_PP), ctypes.POINTER(ctypes.c_size_t)), _P),
    "CreateAndRegisterAllocator": (144, (_P, _P, _P), _P),
    "SetGlobalIntraOpNumThreads": (147, (_P, ctypes.c_int), _P),
    "SetGlobalInterOpNumThreads": (148, (_P, ctypes.c_int), _P),
    "SetGlobalSpinControl": (149, (_P, ctypes.c_int), _P),
    "AddInitializer": (150, (_P, ctypes.c_char_p, _P), _P),
    "CreateArenaCfg": (156, (ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, _PP), _P),
    "ReleaseArenaCfg": (157, (_P,), None),
    "CreatePrepackedWeightsContainer": (166, (_PP,), _P),
    "ReleasePrepackedWeightsContainer": (167, (_P,), None),
    "CreateSessionWithPrepackedWeightsContainer": (168, (_P, _PATH, _P, _P, _PP), _P),
    "CreateSessionFromArrayWithPrepackedWeightsContainer": (169, (_P, _P, ctypes.c_size_t, _P, _P, _PP), _P),
    "SessionOptionsAppendExecutionProvider_CUDA_V2": (204, (_P, _P), _P),
    "CreateCUDAProviderOptions": (205, (_PP,), _P),
    "UpdateCUDAProviderOptions": (
        206,
        (_P, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t),
        _P,
    ),
    "ReleaseCUDAProviderOptions": (208, (_P,), None),
}
_ELEMENT_TYPES = {
    1: np.float32,
    2: np.uint8,
    3: np.int8,
    4: np.uint16,
    5: np.int16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    10: np.float16,
    11: np.float64,
    12: np.uint32,
    13: np.uint64,
    16: BFLOAT16,
}
_ELEMENT_TYPE_OF = {np.dtype(t): code for code, t in _ELEMENT_TYPES.items()}
_DEVICE_ALLOCATOR, _ARENA_ALLOCATOR, _MEM_TYPE_DEFAULT = 0, 1, 0
_ENABLE_ALL, _DISABLE_ALL = 99, 0
_LOG_ERROR = 3
# For models made from bytes: ONNX Runtime checks every external-data path against it, even for initializers given
# with AddInitializer.
_EXTERNAL_DATA_FOLDER = b"session.model_external_initializers_file_folder_path"
_MODEL_GRAPH, _GRAPH_NODE = 7, 1  # ModelProto.graph, GraphProto.node
# pipeshard's custom ops: op type -> the `_runloop` function that returns its OrtCustomOp.
_CUSTOM_OPS = {
    "DecodeAttention": "decode_attention_op",
    "WeightMatMul": "weight_matmul_op",
    "BlockMatMul": "block_matmul_op",
}


class OrtError(RuntimeError):
    """An ONNX Runtime call through the C API failed; the message is ONNX Runtime's."""


class _Library:
    """The loaded library and its OrtApi functions."""

    def __init__(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        library.OrtGetApiBase.restype = ctypes.POINTER(_ApiBase)
        table = library.OrtGetApiBase().contents.GetApi(_API_VERSION)
        if not table:
            raise UserError(f"{path} does not provide ONNX Runtime C API version {_API_VERSION}")
        self.table = ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p))
        for name, (index, arguments, result) in _SIGNATURES.items():
            setattr(self, name, ctypes.CFUNCTYPE(result, *arguments)(self.table[index]))
        self.run_with_binding_address = self.table[_SIGNATURES["RunWithBinding"][0]]

    def check(self, status) -> None:
        """Raise OrtError with ONNX Runtime's message if `status` is an error (non-null)."""
        if status:
            message = self.GetErrorMessage(status).decode(errors="replace")
            self.ReleaseStatus(status)
            raise OrtError(message)

    def make(self, function, *arguments) -> ctypes.c_void_p:
        """Call a Create* function whose last argument receives the object; return the object."""
        made = ctypes.c_void_p()
        self.check(function(*arguments, ctypes.byref(made)))
        return made


class _ApiBase(ctypes.Structure):
    _fields_ = [
        ("GetApi", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)),
        ("GetVersionString", ctypes.CFUNCTYPE(ctypes.c_char_p)),
    ]


def library_path() -> Path:
    """The ONNX Runtime shared library inside the installed onnxruntime package, found without importing the
    package (its Python binding is a second ONNX Runtime: ~20 MiB resident that a CPU-only process never uses)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.origin:
        import_onnxruntime()  # raises the error that says which extra installs it
    folder = Path(spec.origin).parent / "capi"
    for pattern in ("libonnxruntime.so*", "libonnxruntime*.dylib", "onnxruntime.dll"):
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    raise UserError(
        f"ONNX Runtime's shared library (libonnxruntime) is not in {folder}: pipeshard's CPU engines "
        "run through its C API; reinstall onnxruntime from its wheel"
    )


class Runtime:
    """The process's C-API ONNX Runtime: library, environment (one intra-op pool shared by every session,
    spinning between runs; one CPU arena shared by every session), CPU memory info, default allocator."""

    def __init__(self, threads: int) -> None:
        self.lib = lib = _Library(library_path())
        self.threads = threads
        options = lib.make(lib.CreateThreadingOptions)
        try:
            lib.check(lib.SetGlobalIntraOpNumThreads(options, threads))
            lib.check(lib.SetGlobalInterOpNumThreads(options, 1))
            lib.check(lib.SetGlobalSpinControl(options, 1))
            self.env = lib.make(lib.CreateEnvWithGlobalThreadPools, _LOG_ERROR, b"pipeshard", options)
        finally:
            lib.ReleaseThreadingOptions(options)
        self.cpu = lib.make(lib.CreateCpuMemoryInfo, _ARENA_ALLOCATOR, _MEM_TYPE_DEFAULT)
        arena = lib.make(lib.CreateArenaCfg, 0, -1, -1, -1)
        try:
            lib.check(lib.CreateAndRegisterAllocator(self.env, self.cpu, arena))
        finally:
            lib.ReleaseArenaCfg(arena)
        self.allocator = lib.make(lib.GetAllocatorWithDefaultOptions)
        self._custom_ops: dict[frozenset[str], ctypes.c_void_p] = {}
        self._memory_infos: dict[tuple[str, int], ctypes.c_void_p] = {}

    def memory_info(self, name: str, device_id: int) -> ctypes.c_void_p:
        """ONNX Runtime's description of a device's memory (`Cuda`, device 0), for tensors over buffers we
        allocated; made once, kept for the process."""
        key = (name, device_id)
        if key not in self._memory_infos:
            self._memory_infos[key] = self.lib.make(
                self.lib.CreateMemoryInfo, name.encode(), _DEVICE_ALLOCATOR, device_id, _MEM_TYPE_DEFAULT
            )
        return self._memory_infos[key]

    def session(
        self,
        model: Path | bytes,
        threads: int | None = None,
        optimize: bool = True,
        prepack: bool = True,
        shared: SharedWeights | None = None,
        weights_folder: Path | None = None,
        initializers: dict[str, np.ndarray] | None = None,
        cuda_options: dict[str, str] | None = None,
    ) -> Session:
        """A session over a model file, or over a serialized model whose external data lie in `weights_folder`.
        `initializers`: arrays used in place of the model's initializers of those names (not copied; kept while
        the session lives); sessions made with the same `shared` and the same arrays prepack them once.
        `cuda_options`: run on the CUDA EP with these provider options; a node it has no kernel for makes ONNX
        Runtime refuse the session (one `error:` line), never a silent CPU fallback."""
        try:
            return Session(
                self,
                model,
                threads or self.threads,
                optimize,
                prepack,
                shared,
                weights_folder,
                initializers or {},
                cuda_options,
            )
        except OrtError as error:
            if cuda_options is not None:
                raise UserError(
                    f"{model if isinstance(model, Path) else 'a joined device graph'}: ONNX Runtime refused it on "
                    f"the CUDA EP ({str(error).splitlines()[0][:300]})"
                ) from None
            if not isinstance(model, Path):
                raise
            raise UserError(
                f"{model}: ONNX Runtime cannot load it ({str(error).splitlines()[0][:300]}); "
                "`pipeshard inspect PACK --verify` checks a pack's files"
            ) from None

    def custom_op_domain(self, ops: frozenset[str]) -> ctypes.c_void_p | None:
        """A `pipeshard` op domain holding `ops` (of DecodeAttention, runtime/_attention.c; WeightMatMul and
        BlockMatMul, runtime/_matmul.c), made at first use; None for no ops, or where the C extension was built
        without them, or not at all. Each session builds its own schemas and kernel registry for every op of its
        domain, so a session gets a domain of the ops its graph runs only."""
        if not ops or not custom_ops_available():
            return None
        if ops not in self._custom_ops:
            domain = self.lib.make(self.lib.CreateCustomOpDomain, CUSTOM_DOMAIN.encode())
            for name in sorted(ops):
                self.lib.check(self.lib.CustomOpDomain_Add(domain, ctypes.c_void_p(_custom_op(name))))
            self._custom_ops[ops] = domain  # lives as long as the process: sessions keep a pointer to it
        return self._custom_ops[ops]

    def run_options(self) -> RunOptions:
        return RunOptions(self)

    def tensor(self, array: np.ndarray) -> ctypes.c_void_p:
        """A new OrtValue over a C-contiguous array's memory (the array must outlive every use of it)."""
        if not array.flags.c_contiguous:
            raise ValueError(f"cannot bind a non-contiguous {array.dtype} array")
        return self.tensor_at(self.cpu, array.ctypes.data, array.dtype, array.shape)

    def tensor_at(self, memory: ctypes.c_void_p, address: int, dtype, shape) -> ctypes.c_void_p:
        """A new OrtValue over memory at `address` described by `memory` (host or device), which must outlive
        every use of it."""
        dtype = np.dtype(dtype)
        element = _ELEMENT_TYPE_OF.get(dtype)
        if element is None:
            raise ValueError(f"cannot bind a {dtype} tensor")
        dims = (ctypes.c_int64 * len(shape))(*shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.lib.make(
            self.lib.CreateTensorWithDataAsOrtValue, memory, address, nbytes, dims, len(shape), element
        )


_runtime: Runtime | None = None


def runtime(threads: int | None = None) -> Runtime:
    """The process's C-API runtime, made at first use with a pool of `threads` intra-op threads (the cores
    this process may use by default). ONNX Runtime has one environment per process, so the pool keeps that
    size: sessions asking for another thread count get pools of their own (`Session`)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime(threads or default_threads())
    return _runtime


class Session:
    """A CPU-EP session of the C-API runtime, options as the Python binding's sessions get from
    `cpu_session_options` (no memory patterns, the shared arena, prepacking unless disabled). With the runtime's
    thread count it runs on the shared pool; with another, on a pool of its own that does not spin (dozens of
    spinning pools would fight over the cores: ORT-NOTES, "Thread pools")."""

    def __init__(
        self,
        rt: Runtime,
        model: Path | bytes,
        threads: int,
        optimize: bool,
        prepack: bool,
        shared: SharedWeights | None,
        weights_folder: Path | None,
        initializers: dict[str, np.ndarray],
        cuda_options: dict[str, str] | None = None,
    ) -> None:
        lib = rt.lib
        self.runtime = rt
        options = lib.make(lib.CreateSessionOptions)
        values = []
        try:
            for name, array in initializers.items():
                values.append(rt.tensor(array))
                lib.check(lib.AddInitializer(options, name.encode(), values[-1]))
            if threads == rt.threads:
                lib.check(lib.DisablePerSessionThreads(options))
            else:
                lib.check(lib.SetIntraOpNumThreads(options, threads))
                lib.check(lib.SetInterOpNumThreads(options, 1))
                lib.check(lib.AddSessionConfigEntry(options, b"session.intra_op.allow_spinning", b"0"))
            lib.check(lib.DisableMemPattern(options))
            lib.check(lib.SetSessionLogSeverityLevel(options, _LOG_ERROR))
            lib.check(
                lib.SetSessionGraphOptimizationLevel(options, _ENABLE_ALL if optimize else _DISABLE_ALL)
            )
            lib.check(lib.AddSessionConfigEntry(options, b"session.use_env_allocators", b"1"))
            if not prepack:
                lib.check(lib.AddSessionConfigEntry(options, b"session.disable_prepacking", b"1"))
            if cuda_options is not None:
                # A node the CUDA EP has no kernel for fails the session instead of running on the CPU unseen.
                lib.check(lib.AddSessionConfigEntry(options, b"session.disable_cpu_ep_fallback", b"1"))
                _append_cuda(lib, options, cuda_options)
            container = shared.pointer if shared is not None else None
            if isinstance(model, bytes):
                if weights_folder is not None:
                    lib.check(
                        lib.AddSessionConfigEntry(
                            options, _EXTERNAL_DATA_FOLDER, str(weights_folder).encode()
                        )
                    )
                if (domain := rt.custom_op_domain(_custom_ops_run(model))) is not None:
                    lib.check(lib.AddCustomOpDomain(options, domain))
                self.pointer = lib.make(
                    lib.CreateSessionFromArrayWithPrepackedWeightsContainer,
                    rt.env,
                    model,
                    len(model),
                    options,
                    container,
                )
            else:
                encoded = str(model) if sys.platform == "win32" else str(model).encode()
                self.pointer = lib.make(
                    lib.CreateSessionWithPrepackedWeightsContainer, rt.env, encoded, options, container
                )
        except BaseException:
            for value in values:
                lib.ReleaseValue(value)
            raise
        finally:
            lib.ReleaseSessionOptions(options)
        # The finalizer's arguments outlive the session in any order of collection: the container, the values
        # over the given initializers, and the arrays they point into.
        self._finalizer = weakref.finalize(
            self, _release_session, lib, self.pointer, shared, values, initializers
        )
        self._finalizer.atexit = (
            False  # the process's end frees it; ONNX Runtime's statics may be gone by then
        )

    def binding(self) -> Binding:
        return Binding(self)


def _append_cuda(lib: _Library, options: ctypes.c_void_p, cuda_options: dict[str, str]) -> None:
    """Put the CUDA EP first in a session's providers, with its options as strings (the stream's address too)."""
    provider = lib.make(lib.CreateCUDAProviderOptions)
    try:
        keys = (ctypes.c_char_p * len(cuda_options))(*[k.encode() for k in cuda_options])
        values = (ctypes.c_char_p * len(cuda_options))(*[str(v).encode() for v in cuda_options.values()])
        lib.check(lib.UpdateCUDAProviderOptions(provider, keys, values, len(cuda_options)))
        lib.check(lib.SessionOptionsAppendExecutionProvider_CUDA_V2(options, provider))
    finally:
        lib.ReleaseCUDAProviderOptions(provider)


def _release_session(
    lib: _Library, pointer: ctypes.c_void_p, shared: SharedWeights | None, values: list, initializers: dict
) -> None:
    lib.ReleaseSession(pointer)
    for value in values:
        lib.ReleaseValue(value)


class SharedWeights:
    """A prepacked-weights container: sessions made with it keep one copy of equal prepacked weights (a sub-layer's
    prompt and decode sessions). Released when the last of them and this object are gone."""

    def __init__(self, rt: Runtime) -> None:
        self.pointer = rt.lib.make(rt.lib.CreatePrepackedWeightsContainer)
        self._finalizer = weakref.finalize(self, rt.lib.ReleasePrepackedWeightsContainer, self.pointer)
        self._finalizer.atexit = False


class Binding:
    """An IoBinding: host arrays bound by pointer (kept alive while bound), values ONNX Runtime allocates."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.lib = lib = session.runtime.lib
        self.pointer = lib.make(lib.CreateIoBinding, session.pointer)
        self._bound: dict[
            tuple[str, str], object
        ] = {}  # (side, name): the array or value whose memory is bound
        # The session is an argument of the finalizer, so it outlives the binding even when both are collected
        # in one cycle (the order of finalizers in a cycle is not defined).
        self._finalizer = weakref.finalize(self, _release_binding, lib, self.pointer, session)
        self._finalizer.atexit = False

    def bind_input(self, name: str, array: np.ndarray) -> None:
        self._bind(self.lib.BindInput, "in", name, array)

    def bind_output(self, name: str, array: np.ndarray) -> None:
        self._bind(self.lib.BindOutput, "out", name, array)

    def bind_input_at(self, name: str, memory, address: int, dtype, shape, owner) -> None:
        """Bind a tensor at an address in host or device memory (`memory`: its memory info; `owner`: the buffer,
        kept while bound)."""
        self._bind_value(
            self.lib.BindInput,
            "in",
            name,
            self.session.runtime.tensor_at(memory, address, dtype, shape),
            owner,
        )

    def bind_output_at(self, name: str, memory, address: int, dtype, shape, owner) -> None:
        self._bind_value(
            self.lib.BindOutput,
            "out",
            name,
            self.session.runtime.tensor_at(memory, address, dtype, shape),
            owner,
        )

    def _bind(self, function, side: str, name: str, array: np.ndarray) -> None:
        self._bind_value(function, side, name, self.session.runtime.tensor(array), array)

    def _bind_value(self, function, side: str, name: str, value: ctypes.c_void_p, owner) -> None:
        try:
            self.lib.check(function(self.pointer, name.encode(), value))
        finally:
            self.lib.ReleaseValue(value)  # the binding holds its own reference
        self._bound[side, name] = owner

    def bind_value_input(self, name: str, value: Value) -> None:
        """Bind a value another session's run produced (no copy)."""
        self.lib.check(self.lib.BindInput(self.pointer, name.encode(), value.pointer))
        self._bound["in", name] = value

    def bind_output_to_cpu(self, name: str) -> None:
        """Let ONNX Runtime allocate the output at each run (read it with `outputs`)."""
        self.lib.check(self.lib.BindOutputToDevice(self.pointer, name.encode(), self.session.runtime.cpu))
        self._bound.pop(("out", name), None)

    def clear(self) -> None:
        """Unbind everything, letting go of the bound arrays (before buffers are remade, so the old ones are not
        held beside the new)."""
        self.lib.ClearBoundInputs(self.pointer)
        self.lib.ClearBoundOutputs(self.pointer)
        self._bound.clear()

    def outputs(self) -> list[Value]:
        """The bound outputs after a run, in the order they were first bound."""
        lib = self.lib
        values, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        allocator = self.session.runtime.allocator
        lib.check(
            lib.GetBoundOutputValues(self.pointer, allocator, ctypes.byref(values), ctypes.byref(count))
        )
        try:
            return [Value(lib, ctypes.c_void_p(values[i])) for i in range(count.value)]
        finally:
            if count.value:
                lib.check(lib.AllocatorFree(allocator, ctypes.cast(values, ctypes.c_void_p)))


def _release_binding(lib: _Library, pointer: ctypes.c_void_p, session: Session) -> None:
    """Release a binding; `session`, held by the finalizer until now, is let go after it."""
    lib.ReleaseIoBinding(pointer)


class Value:
    """An OrtValue ONNX Runtime allocated (a run's output), released when dropped."""

    def __init__(self, lib: _Library, pointer: ctypes.c_void_p) -> None:
        self.lib = lib
        self.pointer = pointer
        self._finalizer = weakref.finalize(self, lib.ReleaseValue, pointer)
        self._finalizer.atexit = False

    def numpy(self) -> np.ndarray:
        """A view of the tensor's memory (valid while this value lives: the view keeps it)."""
        lib = self.lib
        info = lib.make(lib.GetTensorTypeAndShape, self.pointer)
        try:
            element, rank = ctypes.c_int(), ctypes.c_size_t()
            lib.check(lib.GetTensorElementType(info, ctypes.byref(element)))
            lib.check(lib.GetDimensionsCount(info, ctypes.byref(rank)))
            dims = (ctypes.c_int64 * rank.value)()
            lib.check(lib.GetDimensions(info, dims, rank.value))
        finally:
            lib.ReleaseTensorTypeAndShapeInfo(info)
        dtype = np.dtype(_ELEMENT_TYPES[element.value])
        shape = tuple(dims)
        data = lib.make(lib.GetTensorMutableData, self.pointer)
        count = int(np.prod(shape, dtype=np.int64))
        if not count:
            return np.empty(shape, dtype)
        buffer = (ctypes.c_byte * (count * dtype.itemsize)).from_address(data.value)
        buffer.owner = self  # the view's base: the value lives as long as any view of it
        return np.frombuffer(buffer, dtype, count).reshape(shape)


class RunOptions:
    def __init__(self, rt: Runtime) -> None:
        self.pointer = rt.lib.make(rt.lib.CreateRunOptions)
        self._finalizer = weakref.finalize(self, rt.lib.ReleaseRunOptions, self.pointer)
        self._finalizer.atexit = False


class Block:
    """Sessions run one after another, each with its binding and the same run options. With the `_runloop`
    extension one call runs them all (the interpreter is not re-entered between runs); without it, or with a
    `timer` (called with each run's sub-layer name and seconds), one ctypes call per run."""

    def __init__(
        self, rt: Runtime, runs: list[tuple[str, Session, Binding]], run_options: RunOptions, timer=None
    ) -> None:
        self.lib = rt.lib
        self.names = [name for name, _, _ in runs]
        self._owners = (runs, run_options)
        self._sessions = (ctypes.c_void_p * len(runs))(*[session.pointer.value for _, session, _ in runs])
        self._bindings = (ctypes.c_void_p * len(runs))(*[binding.pointer.value for _, _, binding in runs])
        self._options = run_options.pointer
        self.timer = timer
        self.native = timer is None and _runloop is not None
        self._arguments = (
            rt.lib.run_with_binding_address,
            ctypes.addressof(self._sessions),
            ctypes.addressof(self._bindings),
            len(runs),
            run_options.pointer.value,
        )

    def __call__(self) -> None:
        if self.native:
            failed = _runloop.run_block(*self._arguments)
            if failed is not None:
                index, status = failed
                self._raise(index, ctypes.c_void_p(status))
            return
        run = self.lib.RunWithBinding
        for index, (session, binding) in enumerate(zip(self._sessions, self._bindings, strict=True)):
            started = time.perf_counter()
            status = run(session, self._options, binding)
            if status:
                self._raise(index, status)
            if self.timer is not None:
                self.timer(self.names[index], time.perf_counter() - started)

    def _raise(self, index: int, status) -> None:
        try:
            self.lib.check(status)
        except OrtError as error:
            raise OrtError(f"sub-layer {self.names[index]}: {error}") from None


def _custom_op(name: str) -> int:
    """The address of pipeshard's custom op `name` (runtime/_attention.c, runtime/_matmul.c)."""
    return getattr(_runloop, _CUSTOM_OPS[name])()


def _custom_ops_run(model: bytes) -> frozenset[str]:
    """The op types of the `pipeshard` domain a serialized model's graph runs (none where it does not parse: ONNX
    Runtime then says why)."""
    try:
        graph = next(value for number, _, value in wire.parse(model) if number == _MODEL_GRAPH)
        nodes = [wire.parse(value) for number, _, value in wire.parse(graph) if number == _GRAPH_NODE]
    except (StopIteration, ValueError, IndexError, struct.error):
        return frozenset()
    return frozenset(
        op for domain, op in map(wire.node_op, nodes) if domain == CUSTOM_DOMAIN and op in _CUSTOM_OPS
    )


def release_free_heap() -> None:
    """Give the C heap's free memory back to the system, where the C library can (glibc's malloc_trim). Sessions
    sharing prepacked weights pack each weight once more to find it in the container, then free that copy; glibc
    keeps such freed blocks in its heap (its mmap threshold rises with them): a large share of the shared bytes."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


def custom_ops_available() -> bool:
    """Whether the C extension is built with pipeshard's ops (compilers with GCC's vector extensions)."""
    return _runloop is not None and bool(_runloop.decode_attention_op()) and bool(_runloop.weight_matmul_op())


def weight_matmul_isa() -> str:
    """The instruction set pipeshard's WeightMatMul runs here (avx512, avx2, portable), or "" without the op."""
    return _runloop.weight_matmul_isa() if custom_ops_available() else ""


def run(session: Session, binding: Binding, run_options: RunOptions) -> None:
    """One run of a session with its binding."""
    lib = session.runtime.lib
    lib.check(lib.RunWithBinding(session.pointer, run_options.pointer, binding.pointer))
