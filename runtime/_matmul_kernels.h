/* The inner loops of pipeshard.WeightMatMul (runtime/_matmul.c) for one instruction set: included once per set,
 * with these macros defined:
 *   ISA          the suffix of the functions' names (avx512, avx2, portable)
 *   ISA_TARGET   the function attribute that lets the compiler use the set (empty for portable code)
 *   LANES        floats per vector
 *   TILE_ROWS    rows of A in one tile of the blocked product (TILE_ROWS x 2 vectors of accumulators)
 *   load_fp16(p), load_bf16(p)   LANES stored halves at p as one vector of floats
 *   unpack_nibbles(p)            LANES / 2 bytes at p as LANES int32: their low nibbles, then their high nibbles
 *   unpack_crumbs(p)             LANES / 4 bytes at p as LANES int32: their lowest 2 bits, then the next 2, ...
 *   widen_bytes(p)               LANES bytes at p as LANES int32
 * A vector of LANES floats, `Floats`, is GCC's vector extension; the compiler keeps it in registers of the set. */

#define GLUE_(name, isa) name##_##isa
#define GLUE(name, isa) GLUE_(name, isa)
#define FLOATS GLUE(Floats, ISA)
#define PANEL (2 * LANES) /* columns of one packed panel of B */

#define INTS GLUE(Ints, ISA)
#define NIBBLES GLUE(load_nibbles, ISA)

typedef float FLOATS __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t INTS __attribute__((vector_size(LANES * sizeof(int32_t))));

/* LANES codes of a 4-bit plane as integers: the low nibbles of the LANES / 2 bytes at p, then their high nibbles
 * (the even elements, then the odd ones: the order `permute_rows` (runtime/_matmul.c) gives each LANES of A). */
ISA_TARGET static inline INTS NIBBLES(const uint8_t *from) { return (INTS)unpack_nibbles(from); }

/* LANES codes of a 2-bit plane as integers: the lowest 2 bits of the LANES / 4 bytes at p, then their next 2 bits,
 * and so on (the order `permute_crumbs` (runtime/_matmul.c) gives each LANES of A). */
ISA_TARGET static inline INTS GLUE(load_crumbs, ISA)(const uint8_t *from) { return (INTS)unpack_crumbs(from); }

/* LANES bytes at p as LANES int32. */
ISA_TARGET static inline INTS GLUE(widen_bytes, ISA)(const uint8_t *from) { return (INTS)widen_bytes(from); }

ISA_TARGET static inline FLOATS GLUE(load_fp32, ISA)(const float *from) {
    FLOATS lanes;
    memcpy(&lanes, from, sizeof lanes);
    return lanes;
}

ISA_TARGET static inline void GLUE(store, ISA)(float *to, FLOATS lanes) { memcpy(to, &lanes, sizeof lanes); }

ISA_TARGET static inline FLOATS GLUE(broadcast, ISA)(float value) { return value - (FLOATS){0}; } /* x - 0 = x, -0 too */

/* The sum of the lanes, halves added to halves (log2(LANES) dependent adds, not LANES). */
ISA_TARGET static inline float GLUE(lane_sum, ISA)(FLOATS lanes) {
    float sums[LANES];
    memcpy(sums, &lanes, sizeof sums);
#pragma GCC unroll 8
    for (int width = LANES / 2; width >= 1; width /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < width; i++) sums[i] += sums[i + width];
    return sums[0];
}

/* LANES weights of B from element `at`, as floats. */
#define LOAD_WEIGHTS(type, b, at)                                                                       \
    ((type) == WEIGHT_FP16   ? load_fp16((const uint16_t *)(b) + (at))                                   \
     : (type) == WEIGHT_BF16 ? load_bf16((const uint16_t *)(b) + (at))                                   \
                             : GLUE(load_fp32, ISA)((const float *)(b) + (at)))

/* Rows [k, k + DEPTH) of B times columns [k, k + DEPTH) of the ROWS rows of A, added to acc[r][c - c0] for
 * columns [c0, c1): the block's rows read side by side, front to back (as many sequential streams), their products
 * summed in registers and added to `acc` once; with `ahead`, the next block's rows prefetched. DEPTH, ROWS and TYPE are constants where it is inlined, so every
 * loop over them unrolls and the sums stay in registers. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(stream_block, ISA)(
        const float *a, int64_t lda, const int ROWS, const void *b, const int TYPE, int64_t n, int64_t k,
        const int DEPTH, int64_t c0, int64_t c1, float *acc, int64_t ldacc, int ahead) {
    enum { WIDE = 4 };                    /* vectors of columns per step */
    const int SPLIT = ROWS == 1 ? 2 : 1;  /* one row: even and odd rows of B in separate sums, for more in flight */
    FLOATS scale[STREAM_DEPTH][MAX_STREAM_ROWS];
#pragma GCC unroll 16
    for (int d = 0; d < DEPTH; d++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) scale[d][r] = GLUE(broadcast, ISA)(a[r * lda + k + d]);
    int64_t c = c0;
    for (; c + WIDE * LANES <= c1; c += WIDE * LANES) {
        FLOATS sums[MAX_STREAM_ROWS][2][WIDE] = {{{{0}}}};
        if (TYPE != WEIGHT_FP32 && ahead) /* the next block's rows, fetched while this one is summed (fp32: no gain) */
#pragma GCC unroll 16
            for (int d = 0; d < DEPTH; d++)
#pragma GCC unroll 4
                for (int line = 0; line < WIDE * LANES * 2; line += 64)
                    __builtin_prefetch((const char *)b + ((k + d + STREAM_DEPTH) * n + c) * 2 + line);
#pragma GCC unroll 16
        for (int d = 0; d < DEPTH; d++) {
            const int64_t at = (k + d) * n + c;
#pragma GCC unroll 4
            for (int j = 0; j < WIDE; j++) {
                const FLOATS w = LOAD_WEIGHTS(TYPE, b, at + j * LANES);
#pragma GCC unroll 4
                for (int r = 0; r < ROWS; r++) sums[r][SPLIT == 2 ? d & 1 : 0][j] += scale[d][r] * w;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
            for (int j = 0; j < WIDE; j++) {
                float *out = acc + r * ldacc + (c - c0) + j * LANES;
                GLUE(store, ISA)(out, GLUE(load_fp32, ISA)(out) + (sums[r][0][j] + sums[r][1][j]));
            }
    }
    for (; c + LANES <= c1; c += LANES) {
        FLOATS sums[MAX_STREAM_ROWS] = {{0}};
#pragma GCC unroll 16
        for (int d = 0; d < DEPTH; d++) {
            const FLOATS w = LOAD_WEIGHTS(TYPE, b, (k + d) * n + c);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) sums[r] += scale[d][r] * w;
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            float *out = acc + r * ldacc + (c - c0);
            GLUE(store, ISA)(out, GLUE(load_fp32, ISA)(out) + sums[r]);
        }
    }
    for (; c < c1; c++)
        for (int d = 0; d < DEPTH; d++) {
            const float w = weight_at(TYPE, b, (k + d) * n + c);
            for (int r = 0; r < ROWS; r++) acc[r * ldacc + (c - c0)] += a[r * lda + k + d] * w;
        }
}

/* acc[r][c - c0] = sum over k in [k0, k1) of a[r][k] B[k][c], for rows r < ROWS and columns [c0, c1) of a B
 * stored [K, N] (row stride n): blocks of STREAM_DEPTH rows of B, then the rows left one at a time. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(stream_fixed, ISA)(
        const float *a, int64_t lda, const int ROWS, const void *b, const int TYPE, int64_t n, int64_t k0,
        int64_t k1, int64_t c0, int64_t c1, float *acc, int64_t ldacc) {
    for (int r = 0; r < ROWS; r++) memset(acc + r * ldacc, 0, sizeof(float) * (size_t)(c1 - c0));
    int64_t k = k0;
    for (; k + STREAM_DEPTH <= k1; k += STREAM_DEPTH)
        GLUE(stream_block, ISA)(a, lda, ROWS, b, TYPE, n, k, STREAM_DEPTH, c0, c1, acc, ldacc,
                                k + 2 * STREAM_DEPTH <= k1);
    for (; k < k1; k++) GLUE(stream_block, ISA)(a, lda, ROWS, b, TYPE, n, k, 1, c0, c1, acc, ldacc, 0);
}

/* out[r][j] = a[r] . B[j] for rows r < ROWS and rows j in [j0, j1) of a B stored [N, K] (a transposed product,
 * like a tied lm_head): four rows of B at a time, each read once, front to back. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(dot_fixed, ISA)(
        const float *a, int64_t lda, const int ROWS, const void *b, const int TYPE, int64_t k, int64_t j0,
        int64_t j1, float *out, int64_t ldo) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        FLOATS sums[MAX_STREAM_ROWS][4] = {{{0}}};
        int64_t d = 0;
        for (; d + LANES <= k; d += LANES) {
            FLOATS w[4];
            if (j + 8 <= j1) /* the next four rows, fetched while these are summed */
                for (int q = 0; q < 4; q++)
                    __builtin_prefetch((const char *)b + ((j + 4 + q) * k + d) * (TYPE == WEIGHT_FP32 ? 4 : 2));
            for (int q = 0; q < 4; q++) w[q] = LOAD_WEIGHTS(TYPE, b, (j + q) * k + d);
            for (int r = 0; r < ROWS; r++) {
                const FLOATS x = GLUE(load_fp32, ISA)(a + r * lda + d);
                for (int q = 0; q < 4; q++) sums[r][q] += x * w[q];
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int q = 0; q < 4; q++) {
                float sum = GLUE(lane_sum, ISA)(sums[r][q]);
                for (int64_t e = d; e < k; e++) sum += a[r * lda + e] * weight_at(TYPE, b, (j + q) * k + e);
                out[r * ldo + j + q] = sum;
            }
    }
    for (; j < j1; j++)
        for (int r = 0; r < ROWS; r++) {
            FLOATS sum = {0};
            int64_t d = 0;
            for (; d + LANES <= k; d += LANES)
                sum += GLUE(load_fp32, ISA)(a + r * lda + d) * LOAD_WEIGHTS(TYPE, b, j * k + d);
            float total = GLUE(lane_sum, ISA)(sum);
            for (; d < k; d++) total += a[r * lda + d] * weight_at(TYPE, b, j * k + d);
            out[r * ldo + j] = total;
        }
}

/* The two above for any rows (1 .. MAX_STREAM_ROWS) and stored type: one specialized copy each. */
#define BY_ROWS_AND_TYPE(call, ...)                                                                       \
    switch (type * 8 + (int)rows) {                                                                       \
    case WEIGHT_FP32 * 8 + 1: call(__VA_ARGS__, 1, WEIGHT_FP32); break;                                   \
    case WEIGHT_FP32 * 8 + 2: call(__VA_ARGS__, 2, WEIGHT_FP32); break;                                   \
    case WEIGHT_FP32 * 8 + 3: call(__VA_ARGS__, 3, WEIGHT_FP32); break;                                   \
    case WEIGHT_FP32 * 8 + 4: call(__VA_ARGS__, 4, WEIGHT_FP32); break;                                   \
    case WEIGHT_FP16 * 8 + 1: call(__VA_ARGS__, 1, WEIGHT_FP16); break;                                   \
    case WEIGHT_FP16 * 8 + 2: call(__VA_ARGS__, 2, WEIGHT_FP16); break;                                   \
    case WEIGHT_FP16 * 8 + 3: call(__VA_ARGS__, 3, WEIGHT_FP16); break;                                   \
    case WEIGHT_FP16 * 8 + 4: call(__VA_ARGS__, 4, WEIGHT_FP16); break;                                   \
    case WEIGHT_BF16 * 8 + 1: call(__VA_ARGS__, 1, WEIGHT_BF16); break;                                   \
    case WEIGHT_BF16 * 8 + 2: call(__VA_ARGS__, 2, WEIGHT_BF16); break;                                   \
    case WEIGHT_BF16 * 8 + 3: call(__VA_ARGS__, 3, WEIGHT_BF16); break;                                   \
    case WEIGHT_BF16 * 8 + 4: call(__VA_ARGS__, 4, WEIGHT_BF16); break;                                   \
    default: break;                                                                                       \
    }
#define STREAM_CALL(a, lda, b, n, k0, k1, c0, c1, acc, ldacc, ROWS, TYPE) \
    GLUE(stream_fixed, ISA)(a, lda, ROWS, b, TYPE, n, k0, k1, c0, c1, acc, ldacc)
#define DOT_CALL(a, lda, b, k, j0, j1, out, ldo, ROWS, TYPE) \
    GLUE(dot_fixed, ISA)(a, lda, ROWS, b, TYPE, k, j0, j1, out, ldo)

ISA_TARGET static void GLUE(stream_rows, ISA)(const float *a, int64_t lda, int64_t rows, const void *b, int type,
                                              int64_t n, int64_t k0, int64_t k1, int64_t c0, int64_t c1,
                                              float *acc, int64_t ldacc) {
    BY_ROWS_AND_TYPE(STREAM_CALL, a, lda, b, n, k0, k1, c0, c1, acc, ldacc)
}

ISA_TARGET static void GLUE(dot_rows, ISA)(const float *a, int64_t lda, int64_t rows, const void *b, int type,
                                           int64_t k, int64_t j0, int64_t j1, float *out, int64_t ldo) {
    BY_ROWS_AND_TYPE(DOT_CALL, a, lda, b, k, j0, j1, out, ldo)
}

/* Columns [n0, n0 + cols) of B (cols <= PANEL; element (k, c) at b[k * k_stride + c * n_stride]) as floats,
 * packed[k][PANEL], the columns past `cols` zero: the operand of `tile`. */
ISA_TARGET static void GLUE(pack_panel, ISA)(const void *b, int type, int64_t k, int64_t k_stride, int64_t n_stride,
                                             int64_t n0, int64_t cols, float *packed) {
    for (int64_t d = 0; d < k; d++) {
        float *to = packed + d * PANEL;
        const int64_t first = d * k_stride + n0 * n_stride;
        if (n_stride == 1 && cols == PANEL) {
            GLUE(store, ISA)(to, LOAD_WEIGHTS(type, b, first));
            GLUE(store, ISA)(to + LANES, LOAD_WEIGHTS(type, b, first + LANES));
            continue;
        }
        int64_t c = 0;
        for (; c < cols; c++) to[c] = weight_at(type, b, first + c * n_stride);
        for (; c < PANEL; c++) to[c] = 0.0f;
    }
}

/* c[r][0 .. PANEL) = sum over d < k of a[r][d] packed[d][.] for r < TILE_ROWS: TILE_ROWS x 2 vectors of
 * accumulators in registers, one broadcast of A and two loads of the panel per step. */
ISA_TARGET static void GLUE(tile, ISA)(const float *a, int64_t lda, const float *packed, int64_t k, float *c,
                                       int64_t ldc) {
    FLOATS sums[TILE_ROWS][2] = {{{0}}};
    for (int64_t d = 0; d < k; d++) {
        const FLOATS left = GLUE(load_fp32, ISA)(packed + d * PANEL);
        const FLOATS right = GLUE(load_fp32, ISA)(packed + d * PANEL + LANES);
        for (int r = 0; r < TILE_ROWS; r++) {
            const FLOATS x = GLUE(broadcast, ISA)(a[r * lda + d]);
            sums[r][0] += x * left;
            sums[r][1] += x * right;
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        GLUE(store, ISA)(c + r * ldc, sums[r][0]);
        GLUE(store, ISA)(c + r * ldc + LANES, sums[r][1]);
    }
}

/* ---- pipeshard.BlockMatMul: 4-bit blocks (BlockWeights, runtime/_matmul.c) ---- */

/* LANES codes of a 4-bit plane as integers: the low nibbles of the LANES / 2 bytes at p, then their high nibbles
 * (the even elements, then the odd ones: the order `permute_rows` gives each LANES of A). */
/* One block of W's row, codes at `low` (and `high`), against the block of each row of the permuted A at `a`: each
 * LANES bytes widened once into their low nibbles (the block's even elements) and high nibbles (the odd ones). A
 * code becomes a float by its bits: a low nibble c or'ed into the mantissa of 2^23 (whose last bit counts 1) is
 * 2^23 + c, a high nibble left in place (16 c) in the mantissa of 2^19 (whose last bit counts 1/16) is 2^19 + c;
 * subtracting 2^23 (2^19) + the zero point leaves c - zero point exactly (one AND-OR and one subtraction, where
 * an integer subtraction and a conversion would take a shift more). The weights are multiplied into A's elements
 * lane-wise, the block's lane sums times its scale added to `sums` (one vector per row of A). With HIGH each code
 * gains 16 (high - 8), exactly. A block narrower than 2 LANES (16 with AVX-512) takes one vector of nibbles from
 * LANES / 2 bytes. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(block_step, ISA)(
        const float *a, int64_t lda, const int ROWS, const int BLOCK, const int HIGH, const uint8_t *low,
        const uint8_t *high, int zero_point, float scale, FLOATS *sums) {
    const int z = zero_point + (HIGH ? 128 : 0);
    const FLOATS offset = GLUE(broadcast, ISA)(code_offsets[0][z]);
    const int32_t magic = 0x4b000000, odd_magic = 0x49000000; /* the bits of 2^23 and 2^19 */
    FLOATS block_sums[MAX_STREAM_ROWS] = {{0}};
    if (BLOCK % (2 * LANES) == 0) {
        const FLOATS odd_offset = GLUE(broadcast, ISA)(code_offsets[1][z]);
#pragma GCC unroll 4
        for (int g = 0; g < BLOCK; g += 2 * LANES) {
            const INTS bytes = GLUE(widen_bytes, ISA)(low + g / 2);
            INTS evens = (bytes & 15) | magic, odds = (bytes & 0xf0) | odd_magic;
            if (HIGH) {
                const INTS more = GLUE(widen_bytes, ISA)(high + g / 2) << 4;
                evens |= more & 0xf0;
                odds |= more & 0xf00;
            }
            const FLOATS even_weights = (FLOATS)evens - offset, odd_weights = (FLOATS)odds - odd_offset;
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                block_sums[r] += GLUE(load_fp32, ISA)(a + r * lda + g) * even_weights;
                block_sums[r] += GLUE(load_fp32, ISA)(a + r * lda + g + LANES) * odd_weights;
            }
        }
    } else {
#pragma GCC unroll 4
        for (int g = 0; g < BLOCK; g += LANES) {
            INTS codes = NIBBLES(low + g / 2) | magic;
            if (HIGH) codes |= NIBBLES(high + g / 2) << 4;
            const FLOATS weights = (FLOATS)codes - offset;
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) block_sums[r] += GLUE(load_fp32, ISA)(a + r * lda + g) * weights;
        }
    }
    const FLOATS scales = GLUE(broadcast, ISA)(scale);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) sums[r] += scales * block_sums[r];
}

/* `count` stored halves (float16, or bfloat16 with `bf16`) as floats. */
ISA_TARGET static void GLUE(widen_halves, ISA)(const uint16_t *from, float *to, int64_t count, int bf16) {
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES) GLUE(store, ISA)(to + i, bf16 ? load_bf16(from + i) : load_fp16(from + i));
    for (; i < count; i++) to[i] = bf16 ? bf16_to_float(from[i]) : fp16_to_float(from[i]);
}

/* LANES int8s at p as floats. */
ISA_TARGET static inline FLOATS GLUE(signed_bytes, ISA)(const int8_t *p) {
    return __builtin_convertvector(((INTS)GLUE(widen_bytes, ISA)((const uint8_t *)p) ^ 128) - 128, FLOATS);
}

/* Factored scales [rows, blocks] as floats: `count` factors (float16), each times its `per_factor` int8s (exact
 * products). Factors are widened a vector at a time; a vector of int8s spans one factor's blocks, or two factors'
 * where a factor has half a vector of them. */
ISA_TARGET static void GLUE(compose_scales, ISA)(const int8_t *per_block, const uint16_t *factors, int64_t count,
                                                 int64_t per_factor, float *to) {
    FLOATS first_half;
    for (int l = 0; l < LANES; l++) first_half[l] = 2 * l < LANES ? 1.0f : 0.0f;
    for (int64_t f0 = 0; f0 < count; f0 += LANES) {
        const int64_t group = count - f0 < LANES ? count - f0 : LANES;
        float times[LANES];
        if (group == LANES)
            GLUE(store, ISA)(times, load_fp16(factors + f0));
        else
            for (int64_t f = 0; f < group; f++) times[f] = fp16_to_float(factors[f0 + f]);
        const int8_t *codes = per_block + f0 * per_factor;
        float *out = to + f0 * per_factor;
        int64_t f = 0;
        if (per_factor % LANES == 0) {
            for (; f < group; f++)
                for (int64_t b = 0; b < per_factor; b += LANES)
                    GLUE(store, ISA)(out + f * per_factor + b, GLUE(broadcast, ISA)(times[f]) *
                                                                 GLUE(signed_bytes, ISA)(codes + f * per_factor + b));
        } else if (2 * per_factor == LANES) { /* first * 1 + second * 0 is first exactly: factors are finite */
            for (; f + 2 <= group; f += 2)
                GLUE(store, ISA)(out + f * per_factor,
                                 (GLUE(broadcast, ISA)(times[f]) * first_half +
                                  GLUE(broadcast, ISA)(times[f + 1]) * (1.0f - first_half)) *
                                         GLUE(signed_bytes, ISA)(codes + f * per_factor));
        }
        for (; f < group; f++)
            for (int64_t b = 0; b < per_factor; b++) out[f * per_factor + b] = times[f] * (float)codes[f * per_factor + b];
    }
}

/* Factored minimums [blocks, n] as floats: block b's row of int8s times row b / per_factor of the factors. */
ISA_TARGET static void GLUE(compose_minimums, ISA)(const int8_t *per_block, const uint16_t *factors, int64_t blocks,
                                                   int64_t per_factor, int64_t n, float *to) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *factor = factors + b / per_factor * n;
        const int8_t *row = per_block + b * n;
        float *out = to + b * n;
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES) {
            GLUE(store, ISA)(out + j, load_fp16(factor + j) * GLUE(signed_bytes, ISA)(row + j));
        }
        for (; j < n; j++) out[j] = fp16_to_float(factor[j]) * (float)row[j];
    }
}

/* out[r][j] += sum over blocks b of sums[r][b] minimum[b][j] for rows r < m (<= MAX_STREAM_ROWS) and columns
 * [c0, c1) of W, its minimums factored (int8 [blocks, n] times float16 factors [blocks / per_factor, n]): each
 * minimum made in a register as it is used. */
ISA_TARGET static void GLUE(factored_minimum_term, ISA)(const float *sums, int64_t m, const BlockWeights *w, int64_t c0,
                                                        int64_t c1, float *out) {
    const int64_t n = w->n, blocks = w->blocks, per_factor = w->factor_blocks;
    const int8_t *per_block = w->minimums;
    const uint16_t *factors = w->minimum_factors;
    int64_t j = c0;
    for (; j + LANES <= c1; j += LANES) {
        FLOATS acc[MAX_STREAM_ROWS] = {0};
        for (int64_t first = 0; first < blocks; first += per_factor) {
            const FLOATS factor = load_fp16(factors + first / per_factor * n + j);
            for (int64_t b = first; b < first + per_factor; b++) {
                const FLOATS minimum = factor * GLUE(signed_bytes, ISA)(per_block + b * n + j);
                for (int64_t r = 0; r < m; r++) acc[r] += GLUE(broadcast, ISA)(sums[r * blocks + b]) * minimum;
            }
        }
        for (int64_t r = 0; r < m; r++) GLUE(store, ISA)(out + r * n + j, GLUE(load_fp32, ISA)(out + r * n + j) + acc[r]);
    }
    for (; j < c1; j++)
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) acc += sums[r * blocks + b] * block_minimum(w, b, j);
            out[r * n + j] += acc;
        }
}

/* out[r][j] = a[r] . W[j] for rows r < ROWS of the permuted A and J rows of W from j (module doc of
 * runtime/_matmul.c): blocks two at a time, one byte of zero points between them. ROWS, J, BLOCK and HIGH are
 * constants where it is inlined. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(block_dot_fixed, ISA)(
        const float *a, int64_t lda, const int ROWS, const BlockWeights *w, const int J, const int BLOCK,
        const int HIGH, int64_t j, float *out, int64_t ldo) {
    const int64_t blocks = w->blocks, half = BLOCK / 2, point_stride = (blocks + 1) / 2;
    FLOATS sums[2][MAX_STREAM_ROWS] = {{{0}}};
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2)
#pragma GCC unroll 2
        for (int q = 0; q < J; q++) {
            const int64_t at = ((j + q) * blocks + b) * half;
            const int points = w->zero_points ? w->zero_points[(j + q) * point_stride + b / 2] : 0x88;
            const float *scales = (const float *)w->scales + (j + q) * blocks + b;
            GLUE(block_step, ISA)(a + b * BLOCK, lda, ROWS, BLOCK, HIGH, w->low + at, HIGH ? w->high + at : NULL,
                                  points & 15, scales[0], sums[q]);
            GLUE(block_step, ISA)(a + (b + 1) * BLOCK, lda, ROWS, BLOCK, HIGH, w->low + at + half,
                                  HIGH ? w->high + at + half : NULL, points >> 4, scales[1], sums[q]);
        }
    if (b < blocks)
#pragma GCC unroll 2
        for (int q = 0; q < J; q++) {
            const int64_t at = ((j + q) * blocks + b) * half;
            GLUE(block_step, ISA)(a + b * BLOCK, lda, ROWS, BLOCK, HIGH, w->low + at, HIGH ? w->high + at : NULL,
                                  block_zero_point(w, j + q, b), ((const float *)w->scales)[(j + q) * blocks + b],
                                  sums[q]);
        }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 2
        for (int q = 0; q < J; q++) out[r * ldo + j + q] = GLUE(lane_sum, ISA)(sums[q][r]);
}

/* out[r][j] for rows r < ROWS of A, permuted by `permute_crumbs`, and rows [j0, j1) of a 2-bit W (float scales):
 * each block's codes LANES at a time, made floats as block_step makes them. ROWS and BLOCK are constants where it
 * is inlined. */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(crumb_rows_fixed, ISA)(
        const float *a, int64_t lda, const int ROWS, const BlockWeights *w, const int BLOCK, int64_t j0, int64_t j1,
        float *out, int64_t ldo) {
    const int64_t blocks = w->blocks, row_bytes = blocks * BLOCK / 4, point_bytes = (blocks + 3) / 4;
    const int32_t magic = 0x4b000000; /* the bits of 2^23 */
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *codes = w->low + j * row_bytes;
        const uint8_t *points = w->zero_points ? w->zero_points + j * point_bytes : NULL;
        const float *scales = (const float *)w->scales + j * blocks;
        FLOATS sums[MAX_STREAM_ROWS] = {{0}};
        for (int64_t b = 0; b < blocks; b++) {
            const int point = points ? points[b / 4] >> (2 * (b & 3)) & 3 : 2;
            const FLOATS offset = GLUE(broadcast, ISA)(code_offsets[0][point]);
            FLOATS block_sums[MAX_STREAM_ROWS] = {{0}};
#pragma GCC unroll 4
            for (int g = 0; g < BLOCK; g += LANES) {
                const FLOATS weights = (FLOATS)(GLUE(load_crumbs, ISA)(codes + (b * BLOCK + g) / 4) | magic) - offset;
#pragma GCC unroll 4
                for (int r = 0; r < ROWS; r++)
                    block_sums[r] += GLUE(load_fp32, ISA)(a + r * lda + b * BLOCK + g) * weights;
            }
            const FLOATS scale = GLUE(broadcast, ISA)(scales[b]);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) sums[r] += scale * block_sums[r];
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) out[r * ldo + j] = GLUE(lane_sum, ISA)(sums[r]);
    }
}

#define CRUMB_ROWS_BY_BLOCK(ROWS)                                                                        \
    switch (w->block) {                                                                                  \
    case 16: GLUE(crumb_rows_fixed, ISA)(a, lda, ROWS, w, 16, j0, j1, out, ldo); break;                  \
    case 32: GLUE(crumb_rows_fixed, ISA)(a, lda, ROWS, w, 32, j0, j1, out, ldo); break;                  \
    default: break;                                                                                      \
    }

/* Rows [j0, j1) of W against every row of A, two at a time (two streams of W, twice the sums in flight). Whole
 * rows: cutting long rows into slabs of A that stay in the L1 cache measured slower (K = 4096 .. 11584). */
ISA_TARGET static inline __attribute__((always_inline)) void GLUE(block_rows_fixed, ISA)(
        const float *a, int64_t lda, const int ROWS, const BlockWeights *w, const int BLOCK, const int HIGH,
        int64_t j0, int64_t j1, float *out, int64_t ldo) {
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) GLUE(block_dot_fixed, ISA)(a, lda, ROWS, w, 2, BLOCK, HIGH, j, out, ldo);
    if (j < j1) GLUE(block_dot_fixed, ISA)(a, lda, ROWS, w, 1, BLOCK, HIGH, j, out, ldo);
}

#define BLOCK_ROWS_BY_BLOCK(ROWS, HIGH)                                                                   \
    switch (w->block) {                                                                                   \
    case 16: GLUE(block_rows_fixed, ISA)(a, lda, ROWS, w, 16, HIGH, j0, j1, out, ldo); break;             \
    case 32: GLUE(block_rows_fixed, ISA)(a, lda, ROWS, w, 32, HIGH, j0, j1, out, ldo); break;             \
    default: break;                                                                                       \
    }
#define BLOCK_ROWS_BY_HIGH(ROWS)                        \
    if (w->high) {                                      \
        BLOCK_ROWS_BY_BLOCK(ROWS, 1)                    \
    } else {                                            \
        BLOCK_ROWS_BY_BLOCK(ROWS, 0)                    \
    }

/* out[r][j] for rows r < rows (1 .. MAX_STREAM_ROWS) of A, permuted by `permute_rows`, and rows [j0, j1) of W. */
ISA_TARGET static void GLUE(block_rows, ISA)(const float *a, int64_t lda, int64_t rows, const BlockWeights *w,
                                             int64_t j0, int64_t j1, float *out, int64_t ldo) {
    if (w->bits == 2) {
        switch (rows) {
        case 1: CRUMB_ROWS_BY_BLOCK(1) break;
        case 2: CRUMB_ROWS_BY_BLOCK(2) break;
        case 3: CRUMB_ROWS_BY_BLOCK(3) break;
        case 4: CRUMB_ROWS_BY_BLOCK(4) break;
        default: break;
        }
        return;
    }
    switch (rows) {
    case 1: BLOCK_ROWS_BY_HIGH(1) break;
    case 2: BLOCK_ROWS_BY_HIGH(2) break;
    case 3: BLOCK_ROWS_BY_HIGH(3) break;
    case 4: BLOCK_ROWS_BY_HIGH(4) break;
    default: break;
    }
}

/* Rows [n0, n0 + cols) of W (cols <= PANEL) as floats, packed[k][PANEL] (the columns past `cols` zero), each
 * weight (code - zero point) * scale (+ its block's minimum, where given) rounded once: the operand of `tile`. The
 * rows' bytes are first gathered side by side, bytes[byte][PANEL] (each row read front to back), with their scales,
 * offsets (2^23 + zero point, as in block_step) and minimums; then each byte of the panel's columns gives two rows
 * of the panel in vectors. `scratch` holds (k / 2) PANEL bytes per plane and 3 blocks PANEL floats. */
ISA_TARGET static void GLUE(dequantize_panel, ISA)(const BlockWeights *w, int64_t n0, int64_t cols, float *packed,
                                                   void *scratch) {
    const int64_t half = w->block / 2, row_bytes = w->blocks * half, blocks = w->blocks;
    float *scales = scratch, *offsets = scales + blocks * PANEL, *minimums = offsets + blocks * PANEL;
    uint8_t *low = (uint8_t *)(minimums + blocks * PANEL), *high = low + row_bytes * PANEL;
    for (int64_t c = 0; c < PANEL; c++) {
        const int64_t j = n0 + c;
        for (int64_t b = 0; b < blocks; b++) {
            scales[b * PANEL + c] = c < cols ? block_scale(w, j, b) : 0.0f;
            offsets[b * PANEL + c] = c < cols ? code_offsets[0][block_zero_point(w, j, b) + (w->high ? 128 : 0)]
                                              : code_offsets[0][0];
            minimums[b * PANEL + c] =
                    c < cols && w->minimums ? block_minimum(w, b, j) : 0.0f;
        }
        for (int64_t i = 0; i < row_bytes; i++) low[i * PANEL + c] = c < cols ? w->low[j * row_bytes + i] : 0;
        if (w->high)
            for (int64_t i = 0; i < row_bytes; i++) high[i * PANEL + c] = c < cols ? w->high[j * row_bytes + i] : 0;
    }
    const int32_t magic = 0x4b000000; /* the bits of 2^23 */
    for (int64_t b = 0; b < blocks; b++)
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const FLOATS scale = GLUE(load_fp32, ISA)(scales + b * PANEL + v * LANES);
            const FLOATS offset = GLUE(load_fp32, ISA)(offsets + b * PANEL + v * LANES);
            const FLOATS minimum = GLUE(load_fp32, ISA)(minimums + b * PANEL + v * LANES);
            for (int64_t i = 0; i < half; i++) {
                const int64_t at = (b * half + i) * PANEL + v * LANES;
                const INTS bytes = GLUE(widen_bytes, ISA)(low + at);
                INTS evens = (bytes & 15) | magic, odds = (bytes >> 4) | magic;
                if (w->high) {
                    const INTS more = GLUE(widen_bytes, ISA)(high + at);
                    evens |= (more & 15) << 4;
                    odds |= more & 0xf0;
                }
                float *to = packed + (b * w->block + 2 * i) * PANEL + v * LANES;
                GLUE(store, ISA)(to, ((FLOATS)evens - offset) * scale + minimum);
                GLUE(store, ISA)(to + PANEL, ((FLOATS)odds - offset) * scale + minimum);
            }
        }
}

static const Kernels GLUE(kernels, ISA) = {
    .name = GLUE_STRING(ISA), .lanes = LANES, .panel = PANEL, .tile_rows = TILE_ROWS,
    .stream_rows = GLUE(stream_rows, ISA), .dot_rows = GLUE(dot_rows, ISA), .pack_panel = GLUE(pack_panel, ISA),
    .tile = GLUE(tile, ISA), .block_rows = GLUE(block_rows, ISA), .dequantize_panel = GLUE(dequantize_panel, ISA),
    .widen_halves = GLUE(widen_halves, ISA), .compose_scales = GLUE(compose_scales, ISA),
    .compose_minimums = GLUE(compose_minimums, ISA), .factored_minimum_term = GLUE(factored_minimum_term, ISA),
};

#undef FLOATS
#undef PANEL
#undef LOAD_WEIGHTS
#undef BY_ROWS_AND_TYPE
#undef STREAM_CALL
#undef DOT_CALL
#undef NIBBLES
#undef INTS
#undef BLOCK_ROWS_BY_BLOCK
#undef BLOCK_ROWS_BY_HIGH
#undef CRUMB_ROWS_BY_BLOCK
#undef GLUE
#undef GLUE_
