/* Decode attention for the CPU chain: an ONNX Runtime custom op, `pipeshard.DecodeAttention`, with the inputs,
 * outputs and attributes of com.microsoft.GroupQueryAttention, for one new token per sequence (a decode step).
 *
 * Why: at one new token ONNX Runtime's CPU GroupQueryAttention runs two small SGEMMs per head that each pack
 * their operand: on SmolLM2's 9 heads, hot, 42 us at 256 cached tokens and 176 us at 1024, against this op's
 * 24 and 84 us (one pass over each KV head's rows for all its query heads, the rows cut into an even number of
 * equal chunks per KV head for the intra-op threads, the key rows prefetched ahead of the scoring). The chain's
 * joined decode sessions (runtime/joined.py) swap it in for GroupQueryAttention; prompts keep ONNX Runtime's kernel.
 *
 * Semantics (those of GroupQueryAttention with past and present sharing one buffer): packed query [B, 1,
 * (N + 2 Nkv) H]; past/present key and value [B, Nkv, C, H], the new key and value written at row seqlens_k[b];
 * rotary (non-interleaved) from cos/sin caches [R, H/2] at that row's position; scores scaled, plus the optional
 * additive bias [B or 1, N or 1, 1, T]; softmax over the row's seqlens_k[b] + 1 positions, or the last
 * local_window_size of them. */
#if defined(__GNUC__) || defined(__clang__) /* the vector code below is GCC's vector extensions */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ortapi.h"

/* GroupQueryAttention's inputs, by position. */
enum { QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, COS_CACHE, SIN_CACHE, POSITION_IDS,
       ATTENTION_BIAS, INPUT_COUNT };
enum { OUTPUT, PRESENT_KEY, PRESENT_VALUE, OUTPUT_COUNT };
#define MAX_DIMS 8

typedef struct {
    void *const *api;
    int64_t num_heads, kv_num_heads;
    int64_t local_window; /* keys a query attends to, itself included (GQA's local_window_size); -1: all */
    float scale; /* 0: 1 / sqrt(head size) */
} Kernel;

typedef struct {
    const void *value;
    const float *data;
    int64_t dims[MAX_DIMS];
    size_t rank;
} Tensor;

/* The tensor's data and shape; an absent optional input leaves `tensor->value` null. */
static OrtStatus *read_tensor(void *const *api, const void *value, Tensor *tensor) {
    OrtStatus *status;
    void *info = NULL;
    tensor->value = value;
    tensor->data = NULL;
    tensor->rank = 0;
    if (value == NULL) return NULL;
    if ((status = ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(value, (void **)&tensor->data))) return status;
    if ((status = ((GetTypeAndShapeFn)api[GET_TENSOR_TYPE_AND_SHAPE])(value, &info))) return status;
    status = ((GetDimensionsCountFn)api[GET_DIMENSIONS_COUNT])(info, &tensor->rank);
    if (status == NULL && tensor->rank > MAX_DIMS) status = fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: rank > 8");
    if (status == NULL) status = ((GetDimensionsFn)api[GET_DIMENSIONS])(info, tensor->dims, tensor->rank);
    ((ReleaseFn)api[RELEASE_TENSOR_TYPE_AND_SHAPE_INFO])(info);
    return status;
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(_WIN32) /* ifunc: ELF only */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* Eight floats: GCC and Clang lower it to one AVX register, two SSE ones, or scalars. Head sizes are multiples. */
typedef float Lanes __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(8 * sizeof(int32_t))));
#define LANES 8
#define ROWS 4  /* key rows scored together: independent sums keep the FMA units busy */
#define TILE 8  /* value columns (in lanes) summed together, for the same reason */
#define CHUNK 256  /* most cached rows per task: long enough runs of rows for the hardware prefetchers (measured best) */
#define KEYS_AHEAD 16  /* key rows prefetched ahead of the scoring (8-32 measured alike) */
#define MAX_GROUP 64  /* query heads per KV head */

static inline Lanes load(const float *from) {
    Lanes lanes;
    memcpy(&lanes, from, sizeof lanes);
    return lanes;
}

static inline void store(float *to, Lanes lanes) { memcpy(to, &lanes, sizeof lanes); }

static inline float total(Lanes lanes) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += lanes[i];
    return sum;
}

/* e^x in every lane for x <= 0 (a softmax's shifted scores): 2^n e^r with |r| <= ln2 / 2 and Cephes' degree-6
 * polynomial for e^r (within 2 ulp); 0 below -87.3, where e^x is no longer a normal float. */
static inline Lanes exp_lanes(Lanes x) {
    const IntLanes underflow = x < -87.33654f;
    x = (Lanes)((IntLanes)x & ~underflow);
    const Lanes scaled = x * 1.44269504088896341f + 0.5f;
    IntLanes n = __builtin_convertvector(scaled, IntLanes);
    n += (IntLanes)(__builtin_convertvector(n, Lanes) > scaled);  /* truncation -> floor: -1 where it rounded up */
    const Lanes whole = __builtin_convertvector(n, Lanes);
    const Lanes r = x - whole * 0.693359375f - whole * -2.12194440e-4f;
    Lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const Lanes power = (Lanes)((n + 127) << 23);
    return (Lanes)((IntLanes)(p * power) & ~underflow);
}

/* Non-interleaved rotary embedding of one head at one position, in place. */
static void rotate(float *x, const float *cos_row, const float *sin_row, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float first = x[i], second = x[i + half];
        x[i] = first * cos_row[i] - second * sin_row[i];
        x[i + half] = second * cos_row[i] + first * sin_row[i];
    }
}

/* One chunk of the cached rows [begin, end) for the `group` query heads that read one KV head (queries already
 * rotated and scaled): per head, the chunk's highest score, the sum of e^(score - highest) and the sum of those
 * weights times the value rows, so that chunks done on different threads combine into the softmax over all rows
 * (`combine`). The key and value rows are read from memory once, for all heads of the group. `scores` has room for
 * `group` rows of CHUNK + LANES floats. */
VECTOR_CLONES
static void attend_chunk(const float *queries, int64_t group, const float *keys, const float *values,
                         const float *const *biases, int64_t begin, int64_t end, int64_t head_size, float *scores,
                         float *partials) {
    const int64_t stride = CHUNK + LANES, rows = end - begin;
    int64_t t = 0;
    for (; t + ROWS <= rows; t += ROWS) {
        const float *key = keys + (begin + t) * head_size;
        /* the key rows KEYS_AHEAD rows on: the prefetchers alone left the scoring waiting on them */
        for (int64_t at = 0; at < ROWS * head_size; at += 64 / sizeof(float))
            __builtin_prefetch(key + KEYS_AHEAD * head_size + at);
        /* the value rows these weights will multiply: fetched while the keys are scored, not after */
        for (int64_t at = 0; at < ROWS * head_size; at += 64 / sizeof(float))
            __builtin_prefetch(values + (begin + t) * head_size + at);
        for (int64_t j = 0; j < group; j++) {
            const float *q = queries + j * head_size;
            Lanes sums[ROWS] = {{0}};
            for (int64_t d = 0; d < head_size; d += LANES) {
                const Lanes query = load(q + d);
                for (int r = 0; r < ROWS; r++) sums[r] += query * load(key + r * head_size + d);
            }
            for (int r = 0; r < ROWS; r++) scores[j * stride + t + r] = total(sums[r]);
        }
    }
    for (; t < rows; t++)
        for (int64_t j = 0; j < group; j++) {
            Lanes sum = {0};
            for (int64_t d = 0; d < head_size; d += LANES)
                sum += load(queries + j * head_size + d) * load(keys + (begin + t) * head_size + d);
            scores[j * stride + t] = total(sum);
        }
    const int64_t padded = (rows + LANES - 1) / LANES * LANES;
    for (int64_t j = 0; j < group; j++) {
        float *row = scores + j * stride, *partial = partials + j * (head_size + 2);
        float highest = -INFINITY;
        for (t = 0; t < rows; t++) {
            row[t] += biases[j] ? biases[j][begin + t] : 0.0f;
            highest = row[t] > highest ? row[t] : highest;
        }
        for (t = rows; t < padded; t++) row[t] = -INFINITY;  /* e^-inf = 0: the last lanes add nothing */
        Lanes sums = {0};
        for (t = 0; t < padded; t += LANES) {
            const Lanes weights = exp_lanes(load(row + t) - highest);
            store(row + t, weights);
            sums += weights;
        }
        partial[0] = highest;
        partial[1] = total(sums);
        float *out = partial + 2;
        int64_t d = 0;
        for (; d + TILE * LANES <= head_size; d += TILE * LANES) {
            Lanes acc[TILE] = {{0}};
            for (t = 0; t < rows; t++) {
                const float weight = row[t];
                const float *value = values + (begin + t) * head_size + d;
                for (int c = 0; c < TILE; c++) acc[c] += weight * load(value + c * LANES);
            }
            for (int c = 0; c < TILE; c++) store(out + d + c * LANES, acc[c]);
        }
        for (; d < head_size; d += LANES) {
            Lanes acc = {0};
            for (t = 0; t < rows; t++) acc += row[t] * load(values + (begin + t) * head_size + d);
            store(out + d, acc);
        }
    }
}

/* What every task of one decode step reads: the queries (rotated, scaled), the caches, the bias, and where the
 * tasks put their chunks' partial results. */
typedef struct {
    const float *queries, *bias, *keys, *values;
    float *scratch, *partials;
    const int32_t *lengths;
    int64_t heads, kv_heads, group, head_size, capacity, chunks, chunk_rows, bias_rows, bias_heads, bias_width;
    int64_t local_window;
} Step;

/* Task `index`: chunk index % chunks of KV head (index / chunks) % kv_heads of sequence index / (chunks kv_heads). */
static void attend_task(void *data, size_t index) {
    const Step *step = data;
    const int64_t chunk = (int64_t)index % step->chunks, g = (int64_t)index / step->chunks % step->kv_heads;
    const int64_t b = (int64_t)index / (step->chunks * step->kv_heads), size = step->head_size;
    const int64_t length = step->lengths[b] + 1;
    const int64_t first = step->local_window > 0 && length > step->local_window ? length - step->local_window : 0;
    const int64_t begin = first + chunk * step->chunk_rows;
    const int64_t end = begin + step->chunk_rows < length ? begin + step->chunk_rows : length;
    float *partials = step->partials + (int64_t)index * step->group * (size + 2);
    if (begin >= end) {  /* past this sequence's rows: a chunk that weighs nothing */
        for (int64_t j = 0; j < step->group; j++) partials[j * (size + 2)] = -INFINITY;
        return;
    }
    const float *biases[MAX_GROUP];
    for (int64_t j = 0; j < step->group; j++) {
        const int64_t h = g * step->group + j;
        biases[j] = step->bias ? step->bias + ((step->bias_rows == 1 ? 0 : b) * step->bias_heads +
                                               (step->bias_heads == 1 ? 0 : h)) * step->bias_width : NULL;
    }
    const int64_t cache = (b * step->kv_heads + g) * step->capacity * size;
    attend_chunk(step->queries + (b * step->heads + g * step->group) * size, step->group, step->keys + cache,
                 step->values + cache, biases, begin, end, size,
                 step->scratch + (int64_t)index * step->group * (CHUNK + LANES), partials);
}

/* Each head's output from its chunks' partial results: sum_c e^(m_c - m) out_c / sum_c e^(m_c - m) l_c. */
static void combine(const Step *step, int64_t batch, float *out) {
    const int64_t size = step->head_size, group = step->group;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < step->heads; h++) {
            const int64_t g = h / group, j = h % group;
            const float *first = step->partials + ((b * step->kv_heads + g) * step->chunks * group + j) * (size + 2);
            const int64_t hop = group * (size + 2);
            float highest = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < step->chunks; c++) highest = first[c * hop] > highest ? first[c * hop] : highest;
            float *o = out + (b * step->heads + h) * size;
            for (int64_t d = 0; d < size; d++) o[d] = 0.0f;
            for (int64_t c = 0; c < step->chunks; c++) {
                const float *partial = first + c * hop;
                if (partial[0] == -INFINITY) continue;
                const float weight = expf(partial[0] - highest);
                sum += weight * partial[1];
                for (int64_t d = 0; d < size; d++) o[d] += weight * partial[2 + d];
            }
            const float inverse = 1.0f / sum;
            for (int64_t d = 0; d < size; d++) o[d] *= inverse;
        }
}

static OrtStatus *compute(void *kernel_state, void *context) {
    const Kernel *kernel = kernel_state;
    void *const *api = kernel->api;
    OrtStatus *status;
    Tensor in[INPUT_COUNT];
    for (size_t index = 0; index < INPUT_COUNT; index++) {
        const void *value = NULL;
        if ((status = ((GetInputFn)api[KERNEL_CONTEXT_GET_INPUT])(context, index, &value))) return status;
        if ((status = read_tensor(api, value, &in[index]))) return status;
    }
    const Tensor *query = &in[QUERY], *past_key = &in[PAST_KEY], *past_value = &in[PAST_VALUE];
    const Tensor *seqlens = &in[SEQLENS_K], *cos_cache = &in[COS_CACHE], *sin_cache = &in[SIN_CACHE];
    const Tensor *bias = &in[ATTENTION_BIAS];
    if (in[KEY].value || in[VALUE].value || in[POSITION_IDS].value)
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: takes a packed query and no position_ids");
    if (query->rank != 3 || query->dims[1] != 1)
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: takes one new token per sequence");
    const int64_t batch = query->dims[0], heads = kernel->num_heads, kv_heads = kernel->kv_num_heads;
    const int64_t head_size = query->dims[2] / (heads + 2 * kv_heads);
    if (head_size * (heads + 2 * kv_heads) != query->dims[2] || heads % kv_heads || head_size % LANES)
        return fail(api, ORT_INVALID_ARGUMENT,
                    "DecodeAttention: query width is not (num_heads + 2 kv_num_heads) H with H a multiple of 8");
    const int64_t group = heads / kv_heads;
    if (group > MAX_GROUP) return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: more than 64 query heads per KV head");
    if (past_key->rank != 4 || past_value->rank != 4 || memcmp(past_key->dims, past_value->dims, 4 * sizeof(int64_t)) ||
        past_key->dims[0] != batch || past_key->dims[1] != kv_heads || past_key->dims[3] != head_size)
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: past key/value are not [batch, kv_num_heads, C, H]");
    const int64_t capacity = past_key->dims[2];
    if (seqlens->rank != 1 || seqlens->dims[0] != batch)
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: seqlens_k is not [batch]");
    const int64_t half = head_size / 2;
    if (!cos_cache->value != !sin_cache->value || (cos_cache->value && (cos_cache->rank != 2 || cos_cache->dims[1] != half ||
        sin_cache->rank != 2 || sin_cache->dims[0] != cos_cache->dims[0] || sin_cache->dims[1] != half)))
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: cos/sin caches are not both [R, H/2]");
    if (bias->value && (bias->rank != 4 || (bias->dims[0] != 1 && bias->dims[0] != batch) ||
        (bias->dims[1] != 1 && bias->dims[1] != heads) || bias->dims[2] != 1))
        return fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: attention_bias is not [batch or 1, heads or 1, 1, T]");

    const int32_t *lengths = (const int32_t *)seqlens->data;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t position = lengths[b], length = position + 1;
        if (position < 0 || length > capacity || (bias->value && length > bias->dims[3]) ||
            (cos_cache->value && position >= cos_cache->dims[0]))
            return fail(api, ORT_INVALID_ARGUMENT,
                        "DecodeAttention: seqlens_k[b] + 1 exceeds the KV capacity, the bias or the rotary caches");
        longest = length > longest ? length : longest;
    }
    /* the most cached rows one sequence's query attends to (the last `local_window` with a sliding window) */
    const int64_t attended = kernel->local_window > 0 && longest > kernel->local_window ? kernel->local_window
                                                                                          : longest;

    void *outputs[OUTPUT_COUNT];
    int64_t output_dims[3] = {batch, 1, heads * head_size};
    if ((status = ((GetOutputFn)api[KERNEL_CONTEXT_GET_OUTPUT])(context, OUTPUT, output_dims, 3, &outputs[OUTPUT])))
        return status;
    for (int which = PRESENT_KEY; which <= PRESENT_VALUE; which++)
        if ((status = ((GetOutputFn)api[KERNEL_CONTEXT_GET_OUTPUT])(context, which, past_key->dims, 4, &outputs[which])))
            return status;
    float *out, *present_key, *present_value;
    if ((status = ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(outputs[OUTPUT], (void **)&out))) return status;
    if ((status = ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(outputs[PRESENT_KEY], (void **)&present_key)))
        return status;
    if ((status = ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(outputs[PRESENT_VALUE], (void **)&present_value)))
        return status;
    const size_t cache_floats = (size_t)(batch * kv_heads * capacity * head_size);
    if (present_key != past_key->data) memcpy(present_key, past_key->data, cache_floats * sizeof(float));
    if (present_value != past_value->data) memcpy(present_value, past_value->data, cache_floats * sizeof(float));

    const float *cos_data = cos_cache->value ? cos_cache->data : NULL, *sin_data = sin_cache->data;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t position = lengths[b];
        const float *packed = query->data + b * query->dims[2];
        for (int64_t g = 0; g < kv_heads; g++) {
            float *key_row = present_key + ((b * kv_heads + g) * capacity + position) * head_size;
            float *value_row = present_value + ((b * kv_heads + g) * capacity + position) * head_size;
            memcpy(key_row, packed + (heads + g) * head_size, sizeof(float) * (size_t)head_size);
            memcpy(value_row, packed + (heads + kv_heads + g) * head_size, sizeof(float) * (size_t)head_size);
            if (cos_data) rotate(key_row, cos_data + position * half, sin_data + position * half, half);
        }
    }
    Step step = {
        .bias = bias->value ? bias->data : NULL, .keys = present_key, .values = present_value, .lengths = lengths,
        .heads = heads, .kv_heads = kv_heads, .group = group, .head_size = head_size, .capacity = capacity,
        .chunks = (attended + CHUNK - 1) / CHUNK, .local_window = kernel->local_window,
        .bias_rows = bias->value ? bias->dims[0] : 0, .bias_heads = bias->value ? bias->dims[1] : 0,
        .bias_width = bias->value ? bias->dims[3] : 0,
    };
    /* Chunks of equal rows, an even number per KV head: with two threads and an odd number of KV heads (SmolLM2's
     * 3), whole chunks of CHUNK rows and a short last one left one thread with twice the other's rows. */
    step.chunks += step.chunks & 1;
    step.chunk_rows = ((attended + step.chunks - 1) / step.chunks + ROWS - 1) / ROWS * ROWS;
    const size_t tasks = (size_t)(batch * kv_heads * step.chunks);
    const size_t query_floats = (size_t)(batch * heads * head_size);
    const size_t scratch_floats = tasks * (size_t)(group * (CHUNK + LANES));
    const size_t partial_floats = tasks * (size_t)(group * (head_size + 2));
    float *queries = malloc(sizeof(float) * (query_floats + scratch_floats + partial_floats));
    if (queries == NULL) return fail(api, ORT_FAIL, "DecodeAttention: out of memory");
    step.queries = queries;
    step.scratch = queries + query_floats;
    step.partials = step.scratch + scratch_floats;
    const float scale = kernel->scale != 0.0f ? kernel->scale : 1.0f / sqrtf((float)head_size);
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            float *q = queries + (b * heads + h) * head_size;
            memcpy(q, query->data + b * query->dims[2] + h * head_size, sizeof(float) * (size_t)head_size);
            if (cos_data) rotate(q, cos_data + lengths[b] * half, sin_data + lengths[b] * half, half);
            for (int64_t d = 0; d < head_size; d++) q[d] *= scale;
        }
    status = ((ParallelForFn)api[KERNEL_CONTEXT_PARALLEL_FOR])(context, attend_task, tasks, tasks, &step);
    if (status == NULL) combine(&step, batch, out);
    free(queries);
    return status;
}

static OrtStatus *create_kernel(const void *op, const void *api_table, const void *info, void **kernel_out) {
    (void)op;
    void *const *api = (void *const *)api_table;
    Kernel *kernel = calloc(1, sizeof(Kernel));
    if (kernel == NULL) return fail(api, ORT_FAIL, "DecodeAttention: out of memory");
    kernel->api = api;
    OrtStatus *status = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "num_heads", &kernel->num_heads);
    if (status == NULL)
        status = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "kv_num_heads", &kernel->kv_num_heads);
    if (status == NULL && (kernel->num_heads < 1 || kernel->kv_num_heads < 1))
        status = fail(api, ORT_INVALID_ARGUMENT, "DecodeAttention: num_heads and kv_num_heads must be positive");
    if (status != NULL) {
        free(kernel);
        return status;
    }
    OrtStatus *no_scale = ((GetAttributeFloatFn)api[KERNEL_INFO_GET_ATTRIBUTE_FLOAT])(info, "scale", &kernel->scale);
    if (no_scale != NULL) { /* optional, as in GroupQueryAttention */
        ((ReleaseFn)api[RELEASE_STATUS])(no_scale);
        kernel->scale = 0.0f;
    }
    OrtStatus *no_window = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "local_window_size",
                                                                                       &kernel->local_window);
    if (no_window != NULL) { /* optional, as in GroupQueryAttention */
        ((ReleaseFn)api[RELEASE_STATUS])(no_window);
        kernel->local_window = -1;
    }
    *kernel_out = kernel;
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const void *op) { (void)op; return "DecodeAttention"; }
static const char *cpu_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static size_t input_count(const void *op) { (void)op; return INPUT_COUNT; }
static size_t output_count(const void *op) { (void)op; return OUTPUT_COUNT; }
static int output_type(const void *op, size_t index) { (void)op; (void)index; return FLOAT; }
static int default_memory(const void *op, size_t index) { (void)op; (void)index; return 0; }
static int required(const void *op, size_t index) { (void)op; (void)index; return REQUIRED; }

static int input_type(const void *op, size_t index) {
    (void)op;
    return index == SEQLENS_K || index == TOTAL_SEQUENCE_LENGTH ? INT32 : index == POSITION_IDS ? INT64 : FLOAT;
}

static int input_characteristic(const void *op, size_t index) {
    (void)op;
    return index == KEY || index == VALUE || index == COS_CACHE || index == SIN_CACHE || index == POSITION_IDS ||
                   index == ATTENTION_BIAS ? OPTIONAL : REQUIRED;
}

static const CustomOp decode_attention = {
    .version = 16,
    .GetName = op_name,
    .GetExecutionProviderType = cpu_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = input_characteristic,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* The op's OrtCustomOp, for OrtApi::CustomOpDomain_Add. */
const void *pipeshard_decode_attention_op(void) { return &decode_attention; }

#else
/* Without GCC's vector extensions (MSVC) there is no op: the chain keeps ONNX Runtime's attention. */
const void *pipeshard_decode_attention_op(void) { return 0; }
#endif
