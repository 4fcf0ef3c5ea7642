/* The all-CPU chain's run loop: one call runs a block of ONNX Runtime sessions, each with its IoBinding,
 * through the C API's RunWithBinding, without returning to the interpreter between runs (every return costs
 * microseconds of cache-cold interpreter and binding code per session run). Used by runtime/capi.py, which
 * passes the function and the arrays as addresses. The module also hands out the custom ops linked into it: the
 * decode attention of runtime/_attention.c and the weight products of runtime/_matmul.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef void *(*RunWithBinding)(void *session, const void *run_options, const void *binding);

const void *pipeshard_decode_attention_op(void); /* runtime/_attention.c */
const void *pipeshard_weight_matmul_op(void);    /* runtime/_matmul.c */
const void *pipeshard_block_matmul_op(void);     /* runtime/_matmul.c */
const char *pipeshard_weight_matmul_isa(void);

/* run_block(run_with_binding, sessions, bindings, count, run_options) -> None, or (index, status) of the
 * first run that failed (the OrtStatus* for the caller to read and release). */
static PyObject *run_block(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "run_block(run_with_binding, sessions, bindings, count, run_options)");
        return NULL;
    }
    RunWithBinding run = (RunWithBinding)PyLong_AsVoidPtr(args[0]);
    void **sessions = (void **)PyLong_AsVoidPtr(args[1]);
    void **bindings = (void **)PyLong_AsVoidPtr(args[2]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    const void *run_options = PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (run == NULL || sessions == NULL || bindings == NULL) {
        PyErr_SetString(PyExc_ValueError, "run_block: null function or arrays");
        return NULL;
    }
    void *status = NULL;
    Py_ssize_t index;
    Py_BEGIN_ALLOW_THREADS
    for (index = 0; index < count; index++) {
        status = run(sessions[index], run_options, bindings[index]);
        if (status != NULL) break;
    }
    Py_END_ALLOW_THREADS
    if (status == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(nN)", index, PyLong_FromVoidPtr(status));
}

static PyObject *decode_attention_op(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyLong_FromVoidPtr((void *)pipeshard_decode_attention_op());
}

static PyObject *weight_matmul_op(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyLong_FromVoidPtr((void *)pipeshard_weight_matmul_op());
}

static PyObject *block_matmul_op(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyLong_FromVoidPtr((void *)pipeshard_block_matmul_op());
}

static PyObject *weight_matmul_isa(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyUnicode_FromString(pipeshard_weight_matmul_isa());
}

static PyMethodDef methods[] = {
    {"run_block", (PyCFunction)(void (*)(void))run_block, METH_FASTCALL,
     "Run a block of ONNX Runtime sessions with their bindings; None, or (index, status) of a failed run."},
    {"decode_attention_op", decode_attention_op, METH_NOARGS,
     "The address of the DecodeAttention custom op (an OrtCustomOp), for OrtApi::CustomOpDomain_Add."},
    {"weight_matmul_op", weight_matmul_op, METH_NOARGS,
     "The address of the WeightMatMul custom op (an OrtCustomOp), for OrtApi::CustomOpDomain_Add."},
    {"block_matmul_op", block_matmul_op, METH_NOARGS,
     "The address of the BlockMatMul custom op (an OrtCustomOp), for OrtApi::CustomOpDomain_Add."},
    {"weight_matmul_isa", weight_matmul_isa, METH_NOARGS,
     "The instruction set WeightMatMul runs on this CPU (avx512, avx2, portable; empty: no op)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_runloop", NULL, 0, methods};

PyMODINIT_FUNC PyInit__runloop(void) { return PyModule_Create(&module); }
