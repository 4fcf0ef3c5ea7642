/* What pipeshard's custom ops (runtime/_attention.c, runtime/_matmul.c) use of ONNX Runtime's C API, declared
 * here rather than taken from onnxruntime_c_api.h, which the onnxruntime wheel does not ship. */
#ifndef PIPESHARD_ORTAPI_H
#define PIPESHARD_ORTAPI_H
#include <stddef.h>
#include <stdint.h>

typedef void OrtStatus;
typedef OrtStatus *(*CreateStatusFn)(int code, const char *message);
typedef OrtStatus *(*GetAttributeFloatFn)(const void *info, const char *name, float *out);
typedef OrtStatus *(*GetAttributeInt64Fn)(const void *info, const char *name, int64_t *out);
typedef OrtStatus *(*GetInputFn)(const void *context, size_t index, const void **out);
typedef OrtStatus *(*GetOutputFn)(void *context, size_t index, const int64_t *dims, size_t count, void **out);
typedef OrtStatus *(*GetTensorDataFn)(const void *value, void **out);
typedef OrtStatus *(*GetTypeAndShapeFn)(const void *value, void **out);
typedef OrtStatus *(*GetElementTypeFn)(const void *info, int *out);
typedef OrtStatus *(*GetDimensionsCountFn)(const void *info, size_t *out);
typedef OrtStatus *(*GetDimensionsFn)(const void *info, int64_t *out, size_t count);
typedef void (*ReleaseFn)(void *object);
typedef OrtStatus *(*ParallelForFn)(const void *context, void (*task)(void *data, size_t index), size_t total,
                                    size_t batches, void *data);

/* OrtApi function indices (the table is append-only; see runtime/capi.py; KernelContext_ParallelFor since
 * ONNX Runtime 1.17, pipeshard requires 1.31). */
enum {
    CREATE_STATUS = 0, GET_TENSOR_MUTABLE_DATA = 51, GET_TENSOR_ELEMENT_TYPE = 60, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62,
    GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { UNDEFINED = 0, FLOAT = 1, UINT8 = 2, INT8 = 3, INT32 = 6, INT64 = 7, FLOAT16 = 10, BFLOAT16 = 16 };  /* tensor element types */
enum { REQUIRED = 0, OPTIONAL = 1 };

/* The fields of OrtCustomOp up to version 16 (KernelComputeV2), in their order. */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *op, const void *api, const void *info);
    const char *(*GetName)(const void *op);
    const char *(*GetExecutionProviderType)(const void *op);
    int (*GetInputType)(const void *op, size_t index);
    size_t (*GetInputTypeCount)(const void *op);
    int (*GetOutputType)(const void *op, size_t index);
    size_t (*GetOutputTypeCount)(const void *op);
    void (*KernelCompute)(void *kernel, void *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const void *op, size_t index);
    int (*GetOutputCharacteristic)(const void *op, size_t index);
    int (*GetInputMemoryType)(const void *op, size_t index);
    int (*GetVariadicInputMinArity)(const void *op);
    int (*GetVariadicInputHomogeneity)(const void *op);
    int (*GetVariadicOutputMinArity)(const void *op);
    int (*GetVariadicOutputHomogeneity)(const void *op);
    OrtStatus *(*CreateKernelV2)(const void *op, const void *api, const void *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, void *context);
} CustomOp;

static inline OrtStatus *fail(void *const *api, int code, const char *message) {
    return ((CreateStatusFn)api[CREATE_STATUS])(code, message);
}
#endif
