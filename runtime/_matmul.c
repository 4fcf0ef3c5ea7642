/* Products with stored weights for the CPU chain: an ONNX Runtime custom op, `pipeshard.WeightMatMul`, that computes
 * Y = A B (or A B^T with trans_b = 1) for float A [..., K] and a 2-D weight B stored in float, float16 or bfloat16,
 * reading B as it is stored and computing in float: each weight converted exactly to float and every sum in float.
 *
 * Why: ONNX Runtime's CPU MatMul takes float16 weights only with float16 activations, and bfloat16 not at all; a
 * graph that casts the weight to float (what an fp16 / bf16 pack holds) gets the cast folded into a float copy of
 * every weight at load. This op reads the half-precision bytes themselves, so a decode step, bound by the bytes it
 * reads, reads half of them. runtime/weight_matmul.py swaps it in at session build.
 *
 * Two ways through, by the rows of A (M):
 *   - few rows (a decode step, M <= MAX_STREAM_ROWS): B streams through once, front to back, for all rows, the
 *     work cut into slices of B's rows (partial sums added at the end) and groups of columns for the intra-op
 *     threads; a transposed B goes by groups of its rows (dot products).
 *   - more rows (a prompt): per panel of 2 vectors of columns, B converted into a float panel once and multiplied
 *     into every tile of TILE_ROWS rows of A (accumulators in registers), one panel per task.
 * The instruction set is chosen at run time (AVX-512, AVX2 + F16C + FMA, or portable code), each compiled with its
 * own target attribute, so the extension builds for any x86-64 (and for other CPUs, portable code only).
 * PIPESHARD_MATMUL_ISA=avx512|avx2|portable forces one (tests check each against numpy).
 *
 * `pipeshard.BlockMatMul` (below) is the same machinery for a weight stored as 4-bit blocks (a GGUF pack's
 * MatMulNBits planes): the streaming path unpacks and converts the codes in registers, the blocked path dequantizes
 * each panel to float. */
#if defined(__GNUC__) || defined(__clang__) /* the vector code below is GCC's vector extensions */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ortapi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define X86 1
#endif

/* WEIGHT_FACTORED (a BlockMatMul's scales or minimums only): int8 per block times a float16 factor per super-block
 * of `factor_blocks` blocks, a K-quant's d * sc as stored. */
enum { WEIGHT_FP32 = 0, WEIGHT_FP16 = 1, WEIGHT_BF16 = 2, WEIGHT_FACTORED = 3 };
enum { INPUT_A, INPUT_B, INPUT_COUNT };
#define MAX_DIMS 8
#define MAX_STREAM_ROWS 4  /* rows of A up to which B is streamed once for all of them */
#define MINIMUM_TASK_COLUMNS 256 /* BlockMatMul: columns per task of a decode step's factored minimum term */
#define SCALE_CHUNK_FLOATS 4096 /* BlockMatMul: the float scales a decode task makes at a time (from halves or factors), */
#define SCALE_CHUNK_ROWS 32     /* for at least this many rows (fewer per call slow the kernel more than L2 does) */
#define BLOCK_STREAM_ROWS 16  /* BlockMatMul: rows of A up to which 4-bit blocks are streamed (once per 4 rows;
                               * measured faster than dequantized panels up to 16 rows) */
#define STREAM_DEPTH 8  /* rows of B summed in registers before their sums are added up */
#define STREAM_WIDTH 1024  /* most columns of one streaming task: its sums stay in the L1 cache */
#define TASK_BYTES (64 * 1024)  /* least weight bytes per streaming task: fewer, and the hand-off outweighs them */
#define MAX_TASKS 16
#define DOT_ROWS_PER_TASK 64  /* rows of a transposed B per task */
#define STRING_(x) #x
#define GLUE_STRING(x) STRING_(x)

/* IEEE half to float, exactly (subnormals, infinities and NaNs included). */
static inline float fp16_to_float(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        const float tiny = (float)mantissa * 5.9604644775390625e-8f; /* mantissa * 2^-24: exact */
        return sign ? -tiny : tiny;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float bf16_to_float(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* A matrix W [N, K] of 4-bit codes in blocks (pipeshard.BlockMatMul, the layout of com.microsoft::MatMulNBits):
 * W[j][e] = (code - zero point) * scale of e's block, with codes uint8 [N, blocks, block / 2] (two per byte, the even
 * element in the low nibble), scales [N, blocks] (float, or float16 / bfloat16 read as stored), zero points uint8
 * [N, (blocks + 1) / 2] (two per byte, the even block's in the low nibble; none: 8 everywhere) and optionally a high
 * plane, codes in the same layout with zero point 8 counting 16 low steps each:
 * W[j][e] = ((low - zero point) + 16 (high - 8)) * scale. With `bits` 2 the plane holds 2-bit codes instead, four a
 * byte (element 4i + c in bits 2c, 2c + 1 of byte i), and its zero points four a byte likewise (none: 2 everywhere),
 * as com.microsoft::MatMulNBits lays out bits 2; no high plane then. Factored scales (WEIGHT_FACTORED) are int8
 * [N, blocks] with float16 factors [N, blocks / factor_blocks]; factored minimums int8 [blocks, N] with factors
 * [blocks / factor_blocks, N]: each block's float is factor times int8, one exact float product, as the exporter's
 * graph multiplies them (so no session holds a float32 copy). */
typedef struct {
    const uint8_t *low, *high, *zero_points;
    int bits; /* of the plane's codes: 4 or 2 */
    const void *scales;
    int scale_type;  /* a WEIGHT_* type */
    const void *minimums;  /* [blocks, N] of minimum_type (a WEIGHT_* type), or NULL */
    int minimum_type;
    const uint16_t *scale_factors, *minimum_factors; /* float16, where the type is WEIGHT_FACTORED */
    int64_t n, k, block, blocks, factor_blocks;
} BlockWeights;

/* 2^23 + z and 2^19 + z for z in [0, 144): what a 4-bit code made the float 2^23 + code (2^19 + code) loses to be
 * code - zero point (z: the zero point, plus 128 with a high plane's 16 (high - 8)); see block_step. */
static float code_offsets[2][144];

__attribute__((constructor)) static void fill_code_offsets(void) {
    for (int z = 0; z < 144; z++) {
        code_offsets[0][z] = (float)(8388608 + z);
        code_offsets[1][z] = (float)(524288 + z);
    }
}

static inline int block_zero_point(const BlockWeights *w, int64_t j, int64_t b) {
    if (w->bits == 2)
        return w->zero_points ? (w->zero_points[j * ((w->blocks + 3) / 4) + b / 4] >> (2 * (b & 3))) & 3 : 2;
    if (w->zero_points == NULL) return 8;
    return (w->zero_points[j * ((w->blocks + 1) / 2) + b / 2] >> (4 * (b & 1))) & 15;
}

/* One weight of B as a float (tails narrower than a vector). */
static inline float weight_at(int type, const void *b, int64_t at) {
    return type == WEIGHT_FP16 ? fp16_to_float(((const uint16_t *)b)[at])
           : type == WEIGHT_BF16 ? bf16_to_float(((const uint16_t *)b)[at]) : ((const float *)b)[at];
}

/* Block b's scale of W's row j, and its minimum, as floats. */
static inline float block_scale(const BlockWeights *w, int64_t j, int64_t b) {
    if (w->scale_type != WEIGHT_FACTORED) return weight_at(w->scale_type, w->scales, j * w->blocks + b);
    const int64_t factors = w->blocks / w->factor_blocks;
    return fp16_to_float(w->scale_factors[j * factors + b / w->factor_blocks]) *
           (float)((const int8_t *)w->scales)[j * w->blocks + b];
}

static inline float block_minimum(const BlockWeights *w, int64_t b, int64_t j) {
    if (w->minimum_type != WEIGHT_FACTORED) return weight_at(w->minimum_type, w->minimums, b * w->n + j);
    return fp16_to_float(w->minimum_factors[b / w->factor_blocks * w->n + j]) *
           (float)((const int8_t *)w->minimums)[b * w->n + j];
}

/* W's scales from row j0 on, pointed to in place for a `part` whose row 0 is W's row j0. */
static void scales_from_row(const BlockWeights *w, int64_t j0, BlockWeights *part) {
    const size_t size = w->scale_type == WEIGHT_FP32 ? sizeof(float) : w->scale_type == WEIGHT_FACTORED ? 1 : 2;
    part->scales = (const uint8_t *)w->scales + (size_t)(j0 * w->blocks) * size;
    if (w->scale_type == WEIGHT_FACTORED) part->scale_factors = w->scale_factors + j0 * (w->blocks / w->factor_blocks);
}

typedef struct {
    const char *name;
    int lanes, panel, tile_rows;
    void (*stream_rows)(const float *a, int64_t lda, int64_t rows, const void *b, int type, int64_t n, int64_t k0,
                        int64_t k1, int64_t c0, int64_t c1, float *acc, int64_t ldacc);
    void (*dot_rows)(const float *a, int64_t lda, int64_t rows, const void *b, int type, int64_t k, int64_t j0,
                     int64_t j1, float *out, int64_t ldo);
    void (*pack_panel)(const void *b, int type, int64_t k, int64_t k_stride, int64_t n_stride, int64_t n0,
                       int64_t cols, float *packed);
    void (*tile)(const float *a, int64_t lda, const float *packed, int64_t k, float *c, int64_t ldc);
    void (*block_rows)(const float *a, int64_t lda, int64_t rows, const BlockWeights *w, int64_t j0, int64_t j1,
                       float *out, int64_t ldo);
    void (*dequantize_panel)(const BlockWeights *w, int64_t n0, int64_t cols, float *packed, void *scratch);
    void (*widen_halves)(const uint16_t *from, float *to, int64_t count, int bf16);
    void (*compose_scales)(const int8_t *per_block, const uint16_t *factors, int64_t count, int64_t per_factor,
                           float *to);
    void (*compose_minimums)(const int8_t *per_block, const uint16_t *factors, int64_t blocks, int64_t per_factor,
                             int64_t n, float *to);
    void (*factored_minimum_term)(const float *sums, int64_t m, const BlockWeights *w, int64_t c0, int64_t c1,
                                  float *out);
} Kernels;

static inline uint64_t load_u64(const uint8_t *from) {
    uint64_t bytes;
    memcpy(&bytes, from, sizeof bytes);
    return bytes;
}

static inline uint16_t load_u16(const uint8_t *from) {
    uint16_t bytes;
    memcpy(&bytes, from, sizeof bytes);
    return bytes;
}

static inline uint32_t load_u32(const uint8_t *from) {
    uint32_t bytes;
    memcpy(&bytes, from, sizeof bytes);
    return bytes;
}

#if X86
#define ISA avx512
#define ISA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define LANES 16
#define TILE_ROWS 8
#define load_fp16(p) ((Floats_avx512)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))
#define load_bf16(p) \
    ((Floats_avx512)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16)))
#define unpack_nibbles(p)                                                                                   \
    _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x((long long)load_u64(p))),      \
                                       _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0)), \
                     _mm512_set1_epi32(15))
#define widen_bytes(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define unpack_crumbs(p)                                                                                    \
    _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi32((int)load_u32(p))),              \
                                       _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0)), \
                     _mm512_set1_epi32(3))
#include "_matmul_kernels.h"
#undef ISA
#undef ISA_TARGET
#undef LANES
#undef TILE_ROWS
#undef load_fp16
#undef load_bf16
#undef unpack_nibbles
#undef unpack_crumbs
#undef widen_bytes

#define ISA avx2
#define ISA_TARGET __attribute__((target("avx2,fma,f16c")))
#define LANES 8
#define TILE_ROWS 6
#define load_fp16(p) ((Floats_avx2)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#define load_bf16(p) \
    ((Floats_avx2)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16)))
#define unpack_nibbles(p)                                                                                   \
    _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_set1_epi32((int)load_u32(p))),              \
                                       _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)),                           \
                     _mm256_set1_epi32(15))
#define widen_bytes(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define unpack_crumbs(p)                                                                                    \
    _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_set1_epi16((short)load_u16(p))),            \
                                       _mm256_set_epi32(6, 6, 4, 4, 2, 2, 0, 0)),                           \
                     _mm256_set1_epi32(3))
#include "_matmul_kernels.h"
#undef ISA
#undef ISA_TARGET
#undef LANES
#undef TILE_ROWS
#undef load_fp16
#undef load_bf16
#undef unpack_nibbles
#undef unpack_crumbs
#undef widen_bytes
#endif

/* Portable: the same loops in vectors the compiler lowers to what the baseline target has, halves converted one by
 * one. */
static inline void halves_to_floats(const uint16_t *from, float *to, int count, int bf16) {
    for (int i = 0; i < count; i++) to[i] = bf16 ? bf16_to_float(from[i]) : fp16_to_float(from[i]);
}
#define ISA portable
#define ISA_TARGET
#define LANES 8
#define TILE_ROWS 4
#define load_fp16(p) load_halves_portable((p), 0)
#define load_bf16(p) load_halves_portable((p), 1)
#define unpack_nibbles(p) unpack_nibbles_portable(p)
#define widen_bytes(p) bytes_as_ints_portable(p)
#define unpack_crumbs(p) unpack_crumbs_portable(p)
typedef float PortableFloats __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t PortableInts __attribute__((vector_size(8 * sizeof(int32_t))));
static inline PortableInts unpack_nibbles_portable(const uint8_t *from) {
    int32_t lanes[8];
    for (int i = 0; i < 4; i++) {
        lanes[i] = from[i] & 15;
        lanes[i + 4] = from[i] >> 4;
    }
    PortableInts vector;
    memcpy(&vector, lanes, sizeof vector);
    return vector;
}
static inline PortableInts unpack_crumbs_portable(const uint8_t *from) {
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = (from[i % 2] >> (2 * (i / 2))) & 3;
    PortableInts vector;
    memcpy(&vector, lanes, sizeof vector);
    return vector;
}
static inline PortableInts bytes_as_ints_portable(const uint8_t *from) {
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = from[i];
    PortableInts vector;
    memcpy(&vector, lanes, sizeof vector);
    return vector;
}
static inline PortableFloats load_halves_portable(const uint16_t *from, int bf16) {
    float lanes[8];
    halves_to_floats(from, lanes, 8, bf16);
    PortableFloats vector;
    memcpy(&vector, lanes, sizeof vector);
    return vector;
}
#include "_matmul_kernels.h"
#undef ISA
#undef ISA_TARGET
#undef LANES
#undef TILE_ROWS
#undef load_fp16
#undef load_bf16
#undef unpack_nibbles
#undef unpack_crumbs
#undef widen_bytes

/* The instruction set's kernels: forced by PIPESHARD_MATMUL_ISA, else the best this CPU runs. */
static const Kernels *choose_kernels(void) {
    const char *forced = getenv("PIPESHARD_MATMUL_ISA");
#if X86
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (forced && strcmp(forced, "avx512") == 0 && avx512) return &kernels_avx512;
    if (forced && strcmp(forced, "avx2") == 0 && avx2) return &kernels_avx2;
    if (forced && strcmp(forced, "portable") == 0) return &kernels_portable;
    if (avx512) return &kernels_avx512;
    if (avx2) return &kernels_avx2;
#else
    (void)forced;
#endif
    return &kernels_portable;
}

typedef struct {
    void *const *api;
    int64_t trans_b;
    const Kernels *kernels;
} Kernel;

typedef struct {
    const void *value;
    void *data;
    int64_t dims[MAX_DIMS];
    size_t rank;
    int element;
} Tensor;

static OrtStatus *read_tensor(void *const *api, const void *value, Tensor *tensor) {
    OrtStatus *status;
    void *info = NULL;
    tensor->value = value;
    if ((status = ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(value, &tensor->data))) return status;
    if ((status = ((GetTypeAndShapeFn)api[GET_TENSOR_TYPE_AND_SHAPE])(value, &info))) return status;
    status = ((GetElementTypeFn)api[GET_TENSOR_ELEMENT_TYPE])(info, &tensor->element);
    if (status == NULL) status = ((GetDimensionsCountFn)api[GET_DIMENSIONS_COUNT])(info, &tensor->rank);
    if (status == NULL && tensor->rank > MAX_DIMS) status = fail(api, ORT_INVALID_ARGUMENT, "WeightMatMul: rank > 8");
    if (status == NULL) status = ((GetDimensionsFn)api[GET_DIMENSIONS])(info, tensor->dims, tensor->rank);
    ((ReleaseFn)api[RELEASE_TENSOR_TYPE_AND_SHAPE_INFO])(info);
    return status;
}

/* One product, and how its tasks cut it. */
typedef struct {
    const Kernels *kernels;
    const float *a;
    const void *b;
    const BlockWeights *blocks;  /* BlockMatMul: B's 4-bit blocks (then b is unused) */
    float *out, *partials;
    int type, transposed;
    int64_t m, k, n;
    int64_t slices, slice_rows, groups, group_width;  /* streaming: B's rows in slices, its columns in groups */
    int failed;
} Product;

/* Streaming task `index`: slice index / groups of B's rows, columns of group index % groups, every row of A. */
static void stream_task(void *data, size_t index) {
    const Product *p = data;
    const int64_t slice = (int64_t)index / p->groups, group = (int64_t)index % p->groups;
    const int64_t k0 = slice * p->slice_rows, k1 = k0 + p->slice_rows < p->k ? k0 + p->slice_rows : p->k;
    const int64_t c0 = group * p->group_width, c1 = c0 + p->group_width < p->n ? c0 + p->group_width : p->n;
    if (p->partials)
        p->kernels->stream_rows(p->a, p->k, p->m, p->b, p->type, p->n, k0, k1, c0, c1,
                                p->partials + (int64_t)index * p->m * p->group_width, p->group_width);
    else
        p->kernels->stream_rows(p->a, p->k, p->m, p->b, p->type, p->n, k0, k1, c0, c1, p->out + c0, p->n);
}

/* Transposed B, task `index`: its rows [index DOT_ROWS_PER_TASK, ...) against every row of A. */
static void dot_task(void *data, size_t index) {
    const Product *p = data;
    const int64_t j0 = (int64_t)index * DOT_ROWS_PER_TASK;
    const int64_t j1 = j0 + DOT_ROWS_PER_TASK < p->n ? j0 + DOT_ROWS_PER_TASK : p->n;
    p->kernels->dot_rows(p->a, p->k, p->m, p->b, p->type, p->k, j0, j1, p->out, p->n);
}

/* Blocked task `index`: columns [index panel, ...) of the output, every row of A, B's panel converted once. */
/* Rows [j0, j0 + rows) of a 2-bit W as a 4-bit one of their own (row 0 first) in `part`: codes and zero points
 * widened to nibbles in the returned allocation (the caller frees it; NULL: out of memory), scales pointed to in
 * place, no minimums (the caller adds their term). What a prompt's dequantized panels read. */
static uint8_t *nibble_rows(const BlockWeights *w, int64_t j0, int64_t rows, BlockWeights *part) {
    const int64_t blocks = w->blocks, crumb_bytes = blocks * w->block / 4, points = (blocks + 1) / 2;
    uint8_t *memory = malloc((size_t)(rows * (2 * crumb_bytes + points)));
    if (memory == NULL) return NULL;
    uint8_t *codes = memory, *zero_points = memory + rows * 2 * crumb_bytes;
    for (int64_t i = 0; i < rows * crumb_bytes; i++) {
        const uint8_t byte = w->low[j0 * crumb_bytes + i]; /* elements 4i .. 4i + 3 */
        codes[2 * i] = (uint8_t)((byte & 3) | (byte << 2 & 0x30));
        codes[2 * i + 1] = (uint8_t)((byte >> 4 & 3) | (byte >> 2 & 0x30));
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < points; b++) {
            const int even = block_zero_point(w, j0 + r, 2 * b);
            const int odd = 2 * b + 1 < blocks ? block_zero_point(w, j0 + r, 2 * b + 1) : 0;
            zero_points[r * points + b] = (uint8_t)(even | odd << 4);
        }
    *part = *w;
    part->low = codes;
    part->zero_points = zero_points;
    part->bits = 4;
    scales_from_row(w, j0, part);
    part->minimums = NULL;
    part->n = rows;
    return memory;
}

static void panel_task(void *data, size_t index) {
    Product *p = data;
    const Kernels *kernels = p->kernels;
    const int64_t panel = kernels->panel, rows = kernels->tile_rows, k = p->k;
    const int64_t n0 = (int64_t)index * panel, cols = n0 + panel <= p->n ? panel : p->n - n0;
    const BlockWeights *w = p->blocks;
    const size_t scratch = w ? sizeof(float) * (size_t)(3 * w->blocks * panel) + (size_t)(k * panel) : 0;
    float *packed = malloc(sizeof(float) * (size_t)(k * panel + rows * k + rows * panel) + scratch);
    if (packed == NULL) {
        p->failed = 1;
        return;
    }
    float *padded_a = packed + k * panel, *tile_out = padded_a + rows * k;
    if (w && w->bits == 2) {
        BlockWeights nibbles;
        uint8_t *widened = nibble_rows(w, n0, cols, &nibbles);
        if (widened == NULL) {
            free(packed);
            p->failed = 1;
            return;
        }
        kernels->dequantize_panel(&nibbles, 0, cols, packed, tile_out + rows * panel);
        free(widened);
    } else if (w) {
        kernels->dequantize_panel(w, n0, cols, packed, tile_out + rows * panel);
    } else {
        kernels->pack_panel(p->b, p->type, k, p->transposed ? 1 : p->n, p->transposed ? k : 1, n0, cols, packed);
    }
    for (int64_t r = 0; r < p->m; r += rows) {
        const int64_t count = r + rows <= p->m ? rows : p->m - r;
        const float *a = p->a + r * k;
        if (count < rows) { /* the last rows, zero-padded to a whole tile */
            memset(padded_a, 0, sizeof(float) * (size_t)(rows * k));
            memcpy(padded_a, a, sizeof(float) * (size_t)(count * k));
            a = padded_a;
        }
        if (count == rows && cols == panel) {
            kernels->tile(a, k, packed, k, p->out + r * p->n + n0, p->n);
            continue;
        }
        kernels->tile(a, k, packed, k, tile_out, panel);
        for (int64_t i = 0; i < count; i++)
            memcpy(p->out + (r + i) * p->n + n0, tile_out + i * panel, sizeof(float) * (size_t)cols);
    }
    free(packed);
}

static OrtStatus *parallel(void *const *api, void *context, void (*task)(void *, size_t), size_t tasks, void *data) {
    return ((ParallelForFn)api[KERNEL_CONTEXT_PARALLEL_FOR])(context, task, tasks, tasks, data);
}

/* Few rows, B [K, N]: slices of B's rows and groups of its columns, each task at least TASK_BYTES of B. */
static OrtStatus *stream(void *const *api, void *context, Product *p, size_t element_bytes) {
    p->groups = (p->n + STREAM_WIDTH - 1) / STREAM_WIDTH;
    p->group_width = ((p->n + p->groups - 1) / p->groups + p->kernels->lanes - 1) / p->kernels->lanes *
                     p->kernels->lanes;
    p->groups = (p->n + p->group_width - 1) / p->group_width;
    const int64_t bytes = p->k * p->n * (int64_t)element_bytes;
    int64_t slices = bytes / TASK_BYTES / p->groups;
    if (slices * p->groups > MAX_TASKS) slices = MAX_TASKS / p->groups;
    slices = slices < 1 ? 1 : slices > p->k ? p->k : slices;
    p->slice_rows = (p->k + slices - 1) / slices;
    p->slices = (p->k + p->slice_rows - 1) / p->slice_rows;
    const int direct = p->slices == 1; /* then each task's sums are its part of the output */
    const size_t tasks = (size_t)(p->slices * p->groups);
    p->partials = NULL;
    if (!direct) {
        p->partials = malloc(sizeof(float) * tasks * (size_t)(p->m * p->group_width));
        if (p->partials == NULL) return fail(api, ORT_FAIL, "WeightMatMul: out of memory");
    }
    OrtStatus *status = parallel(api, context, stream_task, tasks, p);
    if (status == NULL && !direct) {
        for (int64_t r = 0; r < p->m; r++)
            for (int64_t g = 0; g < p->groups; g++) {
                const int64_t c0 = g * p->group_width, width = c0 + p->group_width < p->n ? p->group_width : p->n - c0;
                float *out = p->out + r * p->n + c0;
                const float *first = p->partials + (g * p->m + r) * p->group_width;
                memcpy(out, first, sizeof(float) * (size_t)width);
                for (int64_t s = 1; s < p->slices; s++) {
                    const float *more = p->partials + ((s * p->groups + g) * p->m + r) * p->group_width;
                    for (int64_t c = 0; c < width; c++) out[c] += more[c];
                }
            }
    }
    free(p->partials);
    return status;
}

/* The product's output [A's leading dims..., N], and M, the rows of A. */
static OrtStatus *product_output(void *const *api, void *context, const Tensor *a, int64_t n, int64_t *m, float **out) {
    int64_t dims[MAX_DIMS];
    *m = 1;
    for (size_t i = 0; i + 1 < a->rank; i++) {
        dims[i] = a->dims[i];
        *m *= a->dims[i];
    }
    dims[a->rank - 1] = n;
    void *output = NULL;
    OrtStatus *status = ((GetOutputFn)api[KERNEL_CONTEXT_GET_OUTPUT])(context, 0, dims, a->rank, &output);
    return status ? status : ((GetTensorDataFn)api[GET_TENSOR_MUTABLE_DATA])(output, (void **)out);
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
    const Tensor *a = &in[INPUT_A], *b = &in[INPUT_B];
    if (a->element != FLOAT || a->rank < 1)
        return fail(api, ORT_INVALID_ARGUMENT, "WeightMatMul: A is not a float tensor of rank >= 1");
    const int type = b->element == FLOAT16 ? WEIGHT_FP16 : b->element == BFLOAT16 ? WEIGHT_BF16
                     : b->element == FLOAT ? WEIGHT_FP32 : -1;
    if (type < 0 || b->rank != 2)
        return fail(api, ORT_INVALID_ARGUMENT, "WeightMatMul: B is not a 2-D float, float16 or bfloat16 tensor");
    const int64_t k = a->dims[a->rank - 1], n = kernel->trans_b ? b->dims[0] : b->dims[1];
    if ((kernel->trans_b ? b->dims[1] : b->dims[0]) != k)
        return fail(api, ORT_INVALID_ARGUMENT, "WeightMatMul: the inner dimensions of A and B differ");
    int64_t m = 0;
    float *out = NULL;
    if ((status = product_output(api, context, a, n, &m, &out))) return status;
    if (m == 0 || n == 0) return NULL;
    if (k == 0) {
        memset(out, 0, sizeof(float) * (size_t)(m * n));
        return NULL;
    }
    Product p = {.kernels = kernel->kernels, .a = a->data, .b = b->data, .out = out, .type = type, .m = m, .k = k,
                 .n = n};
    if (m <= MAX_STREAM_ROWS) {
        if (!kernel->trans_b) return stream(api, context, &p, type == WEIGHT_FP32 ? 4 : 2);
        return parallel(api, context, dot_task, (size_t)((n + DOT_ROWS_PER_TASK - 1) / DOT_ROWS_PER_TASK), &p);
    }
    p.transposed = (int)kernel->trans_b;
    status = parallel(api, context, panel_task, (size_t)((n + p.kernels->panel - 1) / p.kernels->panel), &p);
    if (status == NULL && p.failed) status = fail(api, ORT_FAIL, "WeightMatMul: out of memory");
    return status;
}

static OrtStatus *create_kernel(const void *op, const void *api_table, const void *info, void **kernel_out) {
    (void)op;
    void *const *api = (void *const *)api_table;
    Kernel *kernel = calloc(1, sizeof(Kernel));
    if (kernel == NULL) return fail(api, ORT_FAIL, "WeightMatMul: out of memory");
    kernel->api = api;
    kernel->kernels = choose_kernels();
    OrtStatus *no_trans = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "trans_b", &kernel->trans_b);
    if (no_trans != NULL) { /* optional, default 0 */
        ((ReleaseFn)api[RELEASE_STATUS])(no_trans);
        kernel->trans_b = 0;
    }
    *kernel_out = kernel;
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const void *op) { (void)op; return "WeightMatMul"; }
static const char *cpu_provider(const void *op) { (void)op; return "CPUExecutionProvider"; }
static size_t input_count(const void *op) { (void)op; return INPUT_COUNT; }
static size_t output_count(const void *op) { (void)op; return 1; }
static int output_type(const void *op, size_t index) { (void)op; (void)index; return FLOAT; }
static int input_type(const void *op, size_t index) { (void)op; return index == INPUT_A ? FLOAT : UNDEFINED; }
static int default_memory(const void *op, size_t index) { (void)op; (void)index; return 0; }
static int required(const void *op, size_t index) { (void)op; (void)index; return REQUIRED; }

static const CustomOp weight_matmul = {
    .version = 16,
    .GetName = op_name,
    .GetExecutionProviderType = cpu_provider,
    .GetInputType = input_type,
    .GetInputTypeCount = input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = required,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* ---- pipeshard.BlockMatMul(A, B, scales[, zero_points[, high[, minimums[, scale_factors[, minimum_factors]]]]]),
 * attribute block_size: Y = A W^T for W [N, K]
 * stored as 4-bit blocks (BlockWeights), what com.microsoft::MatMulNBits (bits 4) computes, in float: each code
 * minus its zero point an exact integer, every product and sum in float (no quantized activations). A decode step
 * (M <= MAX_STREAM_ROWS) streams W once: A's rows permuted once per call so each vector of codes (a vector's worth
 * of bytes: their low nibbles, then their high ones) meets its elements, W's rows cut into tasks; up to
 * BLOCK_STREAM_ROWS rows W is streamed once per 4 of them. A prompt dequantizes panels of W to float and takes
 * WeightMatMul's blocked path. With `minimums` M [blocks, N] (float, float16 or bfloat16: a format's per-block
 * minimum), Y also gains blocksums(A) M: streamed rows add it after (each block of A's rows summed, then
 * WeightMatMul's product over M), dequantized panels hold (code - zero point) * scale + minimum, as ggml defines
 * a weight. With `scale_factors` (float16 [N, supers]) the scales are a K-quant's int8 [N, blocks] as stored, each
 * times its super-block's factor (WEIGHT_FACTORED); `minimum_factors` ([supers, N]) likewise for int8 minimums.
 * With attribute `bits` 2 (default 4) W is one 2-bit plane (BlockWeights): streamed rows unpack four codes
 * a byte (A permuted to match), a prompt's panels widen their rows to nibbles first and add the minimum term after.
 * runtime/weight_matmul.py swaps it in for MatMulNBits (and its minimum term). ---- */
enum { BLOCK_A, BLOCK_B, BLOCK_SCALES, BLOCK_ZERO_POINTS, BLOCK_HIGH, BLOCK_MINIMUMS, BLOCK_SCALE_FACTORS,
       BLOCK_MINIMUM_FACTORS, BLOCK_INPUT_COUNT };

typedef struct {
    void *const *api;
    int64_t block, bits;
    const Kernels *kernels;
} BlockKernel;

/* Each row of A [rows, k] with every `width` elements reordered evens first, then odds: the order of the codes
 * the kernels unpack (2 vectors of them from a vector's worth of bytes; one from half of that where a block is
 * narrower). */
static void permute_rows(const float *a, int64_t rows, int64_t k, int width, float *to) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < k; g += width)
            for (int i = 0; i < width / 2; i++) {
                to[r * k + g + i] = a[r * k + g + 2 * i];
                to[r * k + g + width / 2 + i] = a[r * k + g + 2 * i + 1];
            }
}

/* Each row of A [rows, k] with every `lanes` elements reordered as a 2-bit plane's codes unpack (load_crumbs): lane l
 * takes element 4 (l % (lanes / 4)) + l / (lanes / 4). */
static void permute_crumbs(const float *a, int64_t rows, int64_t k, int lanes, float *to) {
    const int bytes = lanes / 4;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < k; g += lanes)
            for (int l = 0; l < lanes; l++) to[r * k + g + l] = a[r * k + g + 4 * (l % bytes) + l / bytes];
}

/* Decode task `index`: W's rows [index slice_rows, ...) against every row of the permuted A. Half-precision or
 * factored scales are made floats for the task's rows first: the kernels' inner loop reads float scales. */
static void block_task(void *data, size_t index) {
    Product *p = data;
    const BlockWeights *w = p->blocks;
    const int64_t j0 = (int64_t)index * p->slice_rows, j1 = j0 + p->slice_rows < p->n ? j0 + p->slice_rows : p->n;
    if (w->scale_type == WEIGHT_FP32) {
        p->kernels->block_rows(p->a, p->k, p->m, w, j0, j1, p->out, p->n);
        return;
    }
    const int64_t row_bytes = w->blocks * w->block * w->bits / 8, blocks = w->blocks;
    const int64_t fit = SCALE_CHUNK_FLOATS / blocks / 2 * 2, chunk = fit > SCALE_CHUNK_ROWS ? fit : SCALE_CHUNK_ROWS;
    float *scales = malloc(sizeof(float) * (size_t)(chunk * blocks));
    if (scales == NULL) {
        p->failed = 1;
        return;
    }
    for (int64_t j = j0; j < j1; j += chunk) { /* a chunk's float scales stay in the cache while its rows stream */
        const int64_t rows = j + chunk < j1 ? chunk : j1 - j;
        if (w->scale_type == WEIGHT_FACTORED)
            p->kernels->compose_scales((const int8_t *)w->scales + j * blocks,
                                       w->scale_factors + j * (blocks / w->factor_blocks),
                                       rows * (blocks / w->factor_blocks), w->factor_blocks, scales);
        else
            p->kernels->widen_halves((const uint16_t *)w->scales + j * blocks, scales, rows * blocks,
                                     w->scale_type == WEIGHT_BF16);
        BlockWeights part = *w; /* the chunk's rows alone, from row 0 */
        part.low = w->low + j * row_bytes;
        part.high = w->high ? w->high + j * row_bytes : NULL;
        part.zero_points = w->zero_points ? w->zero_points + j * ((blocks * w->bits + 7) / 8) : NULL;
        part.scales = scales;
        part.scale_type = WEIGHT_FP32;
        part.n = rows;
        p->kernels->block_rows(p->a, p->k, p->m, &part, 0, rows, p->out + j, p->n);
    }
    free(scales);
}

/* A decode step's minimum term over factored minimums: W's columns in tasks of MINIMUM_TASK_COLUMNS. */
typedef struct {
    const Kernels *kernels;
    const float *sums;
    int64_t m;
    const BlockWeights *w;
    float *out;
} MinimumTerm;

static void minimum_task(void *data, size_t index) {
    const MinimumTerm *t = data;
    const int64_t c0 = (int64_t)index * MINIMUM_TASK_COLUMNS;
    const int64_t c1 = c0 + MINIMUM_TASK_COLUMNS < t->w->n ? c0 + MINIMUM_TASK_COLUMNS : t->w->n;
    t->kernels->factored_minimum_term(t->sums, t->m, t->w, c0, c1, t->out);
}

/* out[r][n] += sum over blocks b of (the sum of block b of A's row r) minimums[b][n]: the minimum term (W's
 * minimums; factored ones made in registers as they are used, or, for a prompt, made floats for the call). */
static OrtStatus *add_minimum_term(void *const *api, void *context, const Kernels *kernels, const float *a,
                                   int64_t m, const BlockWeights *w, float *out) {
    const int factored = w->minimum_type == WEIGHT_FACTORED, streamed = m <= MAX_STREAM_ROWS;
    const int64_t made = factored && !streamed ? w->blocks * w->n : 0;
    float *sums = malloc(sizeof(float) * (size_t)(m * w->blocks + m * w->n + made));
    if (sums == NULL) return fail(api, ORT_FAIL, "BlockMatMul: out of memory");
    float *term = sums + m * w->blocks, *minimums = term + m * w->n;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < w->blocks; b++) {
            float sum = 0.0f;
            for (int64_t e = 0; e < w->block; e++) sum += a[r * w->k + b * w->block + e];
            sums[r * w->blocks + b] = sum;
        }
    OrtStatus *status;
    if (factored && streamed) {
        MinimumTerm t = {.kernels = kernels, .sums = sums, .m = m, .w = w, .out = out};
        status = parallel(api, context, minimum_task, (size_t)((w->n + MINIMUM_TASK_COLUMNS - 1) / MINIMUM_TASK_COLUMNS),
                          &t);
        free(sums);
        return status;
    }
    if (factored)
        kernels->compose_minimums(w->minimums, w->minimum_factors, w->blocks, w->factor_blocks, w->n, minimums);
    const int type = factored ? WEIGHT_FP32 : w->minimum_type;
    Product q = {.kernels = kernels, .a = sums, .b = factored ? minimums : w->minimums, .out = term, .type = type,
                 .m = m, .k = w->blocks, .n = w->n};
    if (streamed) {
        status = stream(api, context, &q, type == WEIGHT_FP32 ? 4 : 2);
    } else {
        status = parallel(api, context, panel_task, (size_t)((w->n + kernels->panel - 1) / kernels->panel), &q);
        if (status == NULL && q.failed) status = fail(api, ORT_FAIL, "BlockMatMul: out of memory");
    }
    if (status == NULL)
        for (int64_t i = 0; i < m * w->n; i++) out[i] += term[i];
    free(sums);
    return status;
}

static int64_t element_count(const Tensor *tensor) {
    int64_t count = 1;
    for (size_t i = 0; i < tensor->rank; i++) count *= tensor->dims[i];
    return count;
}

static int half_or_float(int element) {
    return element == FLOAT16 ? WEIGHT_FP16 : element == BFLOAT16 ? WEIGHT_BF16 : element == FLOAT ? WEIGHT_FP32 : -1;
}

/* The float16 factors of factored scales ([N, supers]; `minimums`: of factored minimums, [supers, N]), where
 * given: they set W's blocks per factor, which the two must agree on and which must divide its blocks. */
static OrtStatus *read_factors(void *const *api, const Tensor *factors, int given, int64_t n, int minimums,
                               BlockWeights *w) {
    if (!given) return NULL;
    const int64_t count = element_count(factors), supers = n > 0 ? count / n : 0;
    const int64_t factor_blocks = supers > 0 ? w->blocks / supers : 0;
    if (factors->element != FLOAT16 || n == 0 || count != supers * n || factor_blocks == 0 ||
        factor_blocks * supers != w->blocks || (w->factor_blocks && w->factor_blocks != factor_blocks))
        return fail(api, ORT_INVALID_ARGUMENT, minimums ? "BlockMatMul: minimum factors are not float16 [supers, N]"
                                                        : "BlockMatMul: scale factors are not float16 [N, supers]");
    w->factor_blocks = factor_blocks;
    if (minimums)
        w->minimum_factors = factors->data;
    else
        w->scale_factors = factors->data;
    return NULL;
}

static OrtStatus *block_compute(void *kernel_state, void *context) {
    const BlockKernel *kernel = kernel_state;
    void *const *api = kernel->api;
    OrtStatus *status;
    Tensor in[BLOCK_INPUT_COUNT];
    int given[BLOCK_INPUT_COUNT] = {0};
    for (size_t index = 0; index < BLOCK_INPUT_COUNT; index++) {
        const void *value = NULL;
        if ((status = ((GetInputFn)api[KERNEL_CONTEXT_GET_INPUT])(context, index, &value))) return status;
        if (value == NULL) continue; /* an optional input not given */
        if ((status = read_tensor(api, value, &in[index]))) return status;
        given[index] = 1;
    }
    const Tensor *a = &in[BLOCK_A], *b = &in[BLOCK_B];
    if (!given[BLOCK_A] || !given[BLOCK_B] || !given[BLOCK_SCALES])
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: A, B and scales are required");
    if (a->element != FLOAT || a->rank < 1)
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: A is not a float tensor of rank >= 1");
    const int64_t block = kernel->block, bits = kernel->bits;
    if (b->element != UINT8 || b->rank != 3 || b->dims[2] * 8 != block * bits)
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: B is not uint8 [N, blocks, block_size * bits / 8]");
    const int64_t n = b->dims[0], blocks = b->dims[1], k = blocks * block;
    if (a->dims[a->rank - 1] != k)
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: A's last dimension is not B's blocks times block_size");
    const int scale_type = given[BLOCK_SCALE_FACTORS] ? WEIGHT_FACTORED : half_or_float(in[BLOCK_SCALES].element);
    if (scale_type < 0 || element_count(&in[BLOCK_SCALES]) != n * blocks ||
        (scale_type == WEIGHT_FACTORED && in[BLOCK_SCALES].element != INT8))
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: scales are not N x blocks floats (or int8 with factors)");
    if (given[BLOCK_ZERO_POINTS] && (in[BLOCK_ZERO_POINTS].element != UINT8 ||
                                     element_count(&in[BLOCK_ZERO_POINTS]) != n * ((blocks * bits + 7) / 8)))
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: zero points are not uint8 [N, (blocks * bits + 7) / 8]");
    if (given[BLOCK_HIGH] && (bits != 4 || in[BLOCK_HIGH].element != UINT8 ||
                              element_count(&in[BLOCK_HIGH]) != element_count(b)))
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: the high plane is not shaped as a 4-bit B");
    BlockWeights w = {
        .low = b->data, .high = given[BLOCK_HIGH] ? in[BLOCK_HIGH].data : NULL,
        .zero_points = given[BLOCK_ZERO_POINTS] ? in[BLOCK_ZERO_POINTS].data : NULL, .bits = (int)bits,
        .scales = in[BLOCK_SCALES].data, .scale_type = scale_type, .n = n, .k = k, .block = block, .blocks = blocks,
    };
    if ((status = read_factors(api, &in[BLOCK_SCALE_FACTORS], given[BLOCK_SCALE_FACTORS], n, 0, &w))) return status;
    if (given[BLOCK_MINIMUMS]) {
        const Tensor *minimums = &in[BLOCK_MINIMUMS];
        w.minimums = minimums->data;
        w.minimum_type = given[BLOCK_MINIMUM_FACTORS] ? WEIGHT_FACTORED : half_or_float(minimums->element);
        if (w.minimum_type < 0 || element_count(minimums) != blocks * n ||
            (w.minimum_type == WEIGHT_FACTORED ? minimums->element != INT8 : minimums->rank != 2))
            return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: minimums are not [blocks, N] floats (or int8 with "
                                                   "factors)");
        status = read_factors(api, &in[BLOCK_MINIMUM_FACTORS], given[BLOCK_MINIMUM_FACTORS], n, 1, &w);
        if (status) return status;
    } else if (given[BLOCK_MINIMUM_FACTORS]) {
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: minimum factors without minimums");
    }
    int64_t m = 0;
    float *out = NULL;
    if ((status = product_output(api, context, a, n, &m, &out))) return status;
    if (m == 0 || n == 0) return NULL;
    if (k == 0) {
        memset(out, 0, sizeof(float) * (size_t)(m * n));
        return NULL;
    }
    Product p = {.kernels = kernel->kernels, .a = a->data, .blocks = &w, .out = out, .m = m, .k = k, .n = n};
    if (m > BLOCK_STREAM_ROWS) { /* 4-bit panels hold the minimums, if any; 2-bit ones add their term after */
        status = parallel(api, context, panel_task, (size_t)((n + p.kernels->panel - 1) / p.kernels->panel), &p);
        if (status == NULL && p.failed) status = fail(api, ORT_FAIL, "BlockMatMul: out of memory");
        if (status == NULL && w.minimums && bits == 2)
            status = add_minimum_term(api, context, p.kernels, a->data, m, &w, out);
        return status;
    }
    float *permuted = malloc(sizeof(float) * (size_t)(m * k));
    if (permuted == NULL) return fail(api, ORT_FAIL, "BlockMatMul: out of memory");
    const int lanes = p.kernels->lanes;
    if (bits == 2)
        permute_crumbs(a->data, m, k, lanes, permuted);
    else
        permute_rows(a->data, m, k, block % (2 * lanes) == 0 ? 2 * lanes : lanes, permuted);
    p.a = permuted;
    /* tasks of at least TASK_BYTES of W, at most MAX_TASKS, an even number of rows each */
    const int64_t row_bytes = blocks * (block * bits / 8 * (w.high ? 2 : 1) + (int64_t)sizeof(float)) + 1;
    int64_t rows = TASK_BYTES / row_bytes > (n + MAX_TASKS - 1) / MAX_TASKS ? TASK_BYTES / row_bytes
                                                                            : (n + MAX_TASKS - 1) / MAX_TASKS;
    p.slice_rows = rows < 2 ? 2 : (rows + 1) / 2 * 2;
    status = NULL;
    for (int64_t r = 0; r < m && status == NULL; r += MAX_STREAM_ROWS) { /* W streamed once per 4 rows of A */
        p.a = permuted + r * k;
        p.out = out + r * n;
        p.m = m - r < MAX_STREAM_ROWS ? m - r : MAX_STREAM_ROWS;
        status = parallel(api, context, block_task, (size_t)((n + p.slice_rows - 1) / p.slice_rows), &p);
        if (status == NULL && p.failed) status = fail(api, ORT_FAIL, "BlockMatMul: out of memory");
    }
    free(permuted);
    if (status == NULL && w.minimums)
        status = add_minimum_term(api, context, p.kernels, a->data, m, &w, out);
    return status;
}

static OrtStatus *block_create_kernel(const void *op, const void *api_table, const void *info, void **kernel_out) {
    (void)op;
    void *const *api = (void *const *)api_table;
    int64_t block = 0;
    OrtStatus *status = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "block_size", &block);
    if (status != NULL) return status;
    if (block != 16 && block != 32)
        return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: block_size is not 16 or 32");
    int64_t bits = 4;
    OrtStatus *no_bits = ((GetAttributeInt64Fn)api[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "bits", &bits);
    if (no_bits != NULL) { /* optional, default 4 */
        ((ReleaseFn)api[RELEASE_STATUS])(no_bits);
        bits = 4;
    }
    if (bits != 2 && bits != 4) return fail(api, ORT_INVALID_ARGUMENT, "BlockMatMul: bits is not 2 or 4");
    BlockKernel *kernel = calloc(1, sizeof(BlockKernel));
    if (kernel == NULL) return fail(api, ORT_FAIL, "BlockMatMul: out of memory");
    kernel->api = api;
    kernel->block = block;
    kernel->bits = bits;
    kernel->kernels = choose_kernels();
    *kernel_out = kernel;
    return NULL;
}

static const char *block_op_name(const void *op) { (void)op; return "BlockMatMul"; }
static size_t block_input_count(const void *op) { (void)op; return BLOCK_INPUT_COUNT; }
static int block_input_type(const void *op, size_t index) {
    (void)op;
    return index == BLOCK_A ? FLOAT
           : index == BLOCK_SCALES || index == BLOCK_MINIMUMS ? UNDEFINED
           : index == BLOCK_SCALE_FACTORS || index == BLOCK_MINIMUM_FACTORS ? FLOAT16 : UINT8;
}
static int block_input_characteristic(const void *op, size_t index) {
    (void)op;
    return index <= BLOCK_SCALES ? REQUIRED : OPTIONAL;
}

static const CustomOp block_matmul = {
    .version = 16,
    .GetName = block_op_name,
    .GetExecutionProviderType = cpu_provider,
    .GetInputType = block_input_type,
    .GetInputTypeCount = block_input_count,
    .GetOutputType = output_type,
    .GetOutputTypeCount = output_count,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = block_input_characteristic,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = default_memory,
    .CreateKernelV2 = block_create_kernel,
    .KernelComputeV2 = block_compute,
};

/* The op's OrtCustomOp, for OrtApi::CustomOpDomain_Add, and the instruction set it runs here. */
const void *pipeshard_weight_matmul_op(void) { return &weight_matmul; }
const void *pipeshard_block_matmul_op(void) { return &block_matmul; }
const char *pipeshard_weight_matmul_isa(void) { return choose_kernels()->name; }

#else
/* Without GCC's vector extensions (MSVC) there are no ops: half-precision weights run ONNX Runtime's cast + MatMul,
 * 4-bit blocks its MatMulNBits. */
const void *pipeshard_weight_matmul_op(void) { return 0; }
const void *pipeshard_block_matmul_op(void) { return 0; }
const char *pipeshard_weight_matmul_isa(void) { return ""; }
#endif
