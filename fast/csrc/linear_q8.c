/* y = x @ W.T computed as llama.cpp's CPU backend computes it: the fast engine's --compute q8.
 *
 * W: [N, K] in GGUF block layout (Q8_0 (8), Q4_0 (2), Q5_0 (6): ggml-common.h's block_q8_0 / block_q4_0 /
 * block_q5_0; Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14): block_q2_K ... block_q6_K, the section
 * "K-quants" below), x: [M, K] float32
 * row-major, y: [M, N] float32 row-major.
 *
 * What it computes for Q8_0, Q4_0, Q5_0 (docs/quantized-activations.md; the weight types whose vec_dot_type is
 * Q8_0 in ggml-cpu.c's type_traits_cpu; the K-quants, whose vec_dot_type is Q8_K: their section):
 * 1. Each row of x becomes block_q8_0 blocks of 32, as quantize_row_q8_0 of ggml/src/ggml-cpu/arch/x86/quants.c
 *    (its AVX path, the one the harness's llama.cpp build runs): amax the largest magnitude, d = fp16(amax / 127)
 *    (round to nearest even), q = round_even(x * (127 / amax)) (0 where amax is 0), through _mm256_cvtps_epi32 and
 *    the saturating packs (a NaN, an infinity or a value beyond int32 gives -128). reference/activation_quants.py
 *    quantize_q8_0 is the same function in float64/NumPy; tests/test_q8_compute.py compares them bit for bit.
 * 2. Per block b of a weight row n and activation row m: the exact integer sum of the weight's integers times
 *    the activation's int8 values, as eight int32 lanes (lane j: elements 4j .. 4j+3 of the block, as
 *    _mm256_maddubs_epi16 + _mm256_madd_epi16 leave them in ggml_vec_dot_q8_0_q8_0 / ..._q4_0_q8_0), each lane
 *    converted to float32 and multiplied by d_w * d_x (one float32 product of the two fp16 scales) with a fused
 *    multiply-add into an accumulator lane: lanes 0-7 take the even blocks, lanes 8-15 the odd ones (a 16-lane
 *    accumulator, one __m512 or two __m256), blocks in order; then the lanes are summed as a fixed tree:
 *    B_i = A_i + A_{i+8} (i < 8), C_i = B_i + B_{i+4}, D_i = C_i + C_{i+2}, y = D_0 + D_1.
 *    Weight integers: Q8_0 its int8 qs; Q4_0 the nibble n - 8; Q5_0 (n | h << 4) - 16. The 4- and 5-bit sums
 *    are taken as sum(n * q) - off * sum(q) (off = 8, 16) with the activation lane sums sum(q) computed once per
 *    activation block: the same integers as llama.cpp's signed products.
 *    The order of the fp32 sums differs from llama.cpp's (its lanes take every block, and on this build Q4_0 runs
 *    through repack.cpp's interleaved GEMV): the difference is fp32 accumulation only, what gates.py bounds.
 * The result of a row of x does not depend on the other rows, on M, on the thread count, nor on the ISA path
 * (every path computes the same integers and the same float operations in the same order).
 *
 * ISA paths, chosen at run time (__builtin_cpu_supports): AVX-512 VNNI (_mm512_dpbusd_epi32 over two blocks at
 * once: lanes 0-7 block b, 8-15 block b+1, the accumulator's layout; the weights' signed integers through
 * ggml's sign trick, |w| times q with w's sign; at M >= 2 two rows of W at a time, so that each activation vector
 * is loaded once for both; one function per (rows of W, rows of x), V5_ROWS; a last odd block goes through the
 * AVX2 path's operations on lanes 0-7, the same integers), AVX2 (_mm256_maddubs_epi16 / _mm256_madd_epi16, two __m256
 * accumulators), or plain C. The AVX2 helpers (a2_*) are inlined into the VNNI functions (a function may inline one
 * whose target is a subset of its own; the objects show no call).
 * g4h_q8_force_isa() caps the choice (the tests compare the paths). Compiled with -ffp-contract=off: the only fused
 * multiply-adds are the explicit ones.
 * Threads: workpool.h, runs of ~128 KB of packed rows, each row whole (one sequential stream: cutting K in L1-sized
 * chunks across the rows of a run was slower, measured at 2048 x 8192, 1 thread: M = 1 2.15 ms of CPU against
 * 0.58, M = 8 3.73 against 2.83); the caller quantizes x first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#include "workpool.h"

#if defined(__x86_64__) || defined(__i386__)
#define Q8_X86 1
#include <immintrin.h>
#endif

#define QK 32
#define MAX_M 64

/* ------------------------------------------------------------------ the activation rows, quantized once per call */

typedef struct {
    int8_t *q;    /* [M, K] */
    float *d;     /* [M, nb]: fp16(amax/127) widened */
    int32_t *s;   /* [M, nb, 8]: lane sums of q (elements 4j .. 4j+3) */
} xq_t;

/* quantize_row_q8_0 (arch/x86/quants.c, AVX path) of one row; also the lane sums */
static void quantize_row(const float *x, long K, int8_t *q, float *d, int32_t *s) {
    for (long b = 0; b < K / QK; b++, x += QK, q += QK, s += 8) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        d[b] = g4h_f16_to_f32(g4h_f32_to_f16(amax / 127.0f));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < QK; j++) {
            float v = rintf(x[j] * id); /* the default rounding mode: nearest even, as _MM_ROUND_NEAREST */
            int32_t i = fabsf(v) < 2147483648.0f ? (int32_t)v : INT32_MIN; /* _mm256_cvtps_epi32 */
            q[j] = (int8_t)(i > 127 ? 127 : i < -128 ? -128 : i);           /* packs_epi32, packs_epi16 */
        }
        for (int j = 0; j < 8; j++) s[j] = q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3];
    }
}

/* ------------------------------------------------------------------ plain C: the definition */

/* The integers of one weight block as element-order values: signed (Q8_0) or unsigned with an offset. */
static inline int decode_block(int type, const uint8_t *b, int32_t *w) {
    if (type == 8) {
        for (int j = 0; j < QK; j++) w[j] = (int8_t)b[2 + j];
        return 0;
    }
    if (type == 2) {
        for (int j = 0; j < 16; j++) {
            w[j] = b[2 + j] & 15;
            w[j + 16] = b[2 + j] >> 4;
        }
        return 8;
    }
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
    for (int j = 0; j < 16; j++) {
        w[j] = (b[6 + j] & 15) | (int32_t)(((qh >> j) & 1u) << 4);
        w[j + 16] = (b[6 + j] >> 4) | (int32_t)(((qh >> (j + 16)) & 1u) << 4);
    }
    return 16;
}

static inline float tree16(const float *a) {
    float b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    for (int i = 0; i < 2; i++) d[i] = c[i] + c[i + 2];
    return d[0] + d[1];
}

/* A row function: rows of W from w (R of them, rb bytes apart: the VNNI path's pairs; 1 elsewhere) against the M
 * rows of x, into y[m * ldy + r]. */
typedef void (*row_fn)(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K, long M, float *y,
                       long ldy);
/* The register blocks of a path: F##MB computes MB rows of x from m0 (the same arguments as a row function, m0 for
 * M). BLOCKS_N dispatches the rows of x to them in blocks of up to N rows, through a switch rather than a table of
 * pointers, so that the compiler may inline the small blocks into the loop (one dispatch per row of W). */
#define BLOCK_CALL(F, MB) F##MB(type, ts, w, rb, nb, x, K, m0, y, ldy)
#define BLOCK_CASE(F, MB) \
    case MB: BLOCK_CALL(F, MB); break;
#define BLOCKS_4(F)                                                                                     \
    for (long m0 = 0; m0 < M; m0 += 4) switch (M - m0 < 4 ? M - m0 : 4) {                              \
        BLOCK_CASE(F, 1) BLOCK_CASE(F, 2) BLOCK_CASE(F, 3) default: BLOCK_CALL(F, 4);                   \
        }
#define BLOCKS_8(F)                                                                                     \
    for (long m0 = 0; m0 < M; m0 += 8) switch (M - m0 < 8 ? M - m0 : 8) {                              \
        BLOCK_CASE(F, 1) BLOCK_CASE(F, 2) BLOCK_CASE(F, 3) BLOCK_CASE(F, 4)                             \
        BLOCK_CASE(F, 5) BLOCK_CASE(F, 6) BLOCK_CASE(F, 7) default: BLOCK_CALL(F, 8);                   \
        }

static void row_generic(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K, long M,
                        float *y, long ldy) {
    (void)rb;
    float acc[MAX_M][16];
    for (long m = 0; m < M; m++)
        for (int l = 0; l < 16; l++) acc[m][l] = 0.0f;
    for (long b = 0; b < nb; b++) {
        int32_t wv[QK];
        const uint8_t *blk = w + b * ts;
        const int off = decode_block(type, blk, wv);
        const float dw = g4h_f16_load(blk);
        const int base = (b & 1) ? 8 : 0;
        for (long m = 0; m < M; m++) {
            const int8_t *q = x->q + m * K + b * QK;
            const int32_t *s = x->s + (m * nb + b) * 8;
            const float d = dw * x->d[m * nb + b];
            for (int j = 0; j < 8; j++) {
                int32_t sum = 0;
                for (int i = 4 * j; i < 4 * j + 4; i++) sum += wv[i] * q[i];
                sum -= off * s[j];
                acc[m][base + j] = fmaf((float)sum, d, acc[m][base + j]);
            }
        }
    }
    for (long m = 0; m < M; m++) y[m * ldy] = tree16(acc[m]);
}

#if defined(Q8_X86)
/* ------------------------------------------------------------------ AVX2 (its helpers also serve the VNNI path) */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline float a2_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the 32 integers of a weight block in element order: signed bytes (Q8_0) or unsigned (Q4_0, Q5_0) */
static inline __m256i a2_decode(int type, const uint8_t *b) {
    if (type == 8) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const uint8_t *qs = b + (type == 2 ? 2 : 6);
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    if (type == 2) return v;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    /* bit j of qh -> 0x10 in byte j (llama.cpp's bytes_from_bits_32) */
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    const __m256i bitm = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);
    h = _mm256_cmpeq_epi8(_mm256_or_si256(h, bitm), _mm256_set1_epi64x(-1));
    return _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
}

/* eight int32 lane sums of w * q over one block (the offset taken off with the lane sums s) */
static inline __m256i a2_dot(int type, __m256i w, __m256i aw, const int8_t *q, const int32_t *s) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i y = _mm256_loadu_si256((const __m256i *)q);
    if (type == 8) return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), ones);
    __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), ones);
    __m256i c = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)s), type == 2 ? 3 : 4);
    return _mm256_sub_epi32(v, c);
}

static inline float a2_tree(__m256 lo, __m256 hi) {
    __m256 b = _mm256_add_ps(lo, hi);
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

/* one block of a weight row (w: its integers, aw = |w|, dw: its scale) against the block of an activation row at
 * q (lane sums s, scale dx): the eight lane sums times dw * dx, fused into the 8-lane accumulator acc (the header's
 * step 2) */
static inline __m256 a2_step(int type, __m256i w, __m256i aw, float dw, const int8_t *q, const int32_t *s, float dx,
                             __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2_dot(type, w, aw, q, s)), _mm256_set1_ps(dw * dx), acc);
}

/* the last block b of a weight row (at blk) when nb is odd, an even block: accumulator lanes 0-7 (acc[m], for mb
 * rows of x from m0). The AVX2 operations on every vector path: the VNNI path's v5_last passes its lanes 0-7. */
static inline void a2_last(int type, const uint8_t *blk, const xq_t *x, long K, long nb, long b, long m0, int mb,
                           __m256 *acc) {
    const __m256i w0 = a2_decode(type, blk), aw0 = _mm256_sign_epi8(w0, w0);
    const float d0 = a2_f16(blk);
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) {
        const long r = m0 + m;
        acc[m] = a2_step(type, w0, aw0, d0, x->q + r * K + b * QK, x->s + (r * nb + b) * 8, x->d[r * nb + b], acc[m]);
    }
}

#define A2_ROW(MB)                                                                                            \
    static void a2_row_##MB(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K,     \
                            long m0, float *y, long ldy) {                                                    \
        (void)rb;                                                                                             \
        __m256 e[MB], o[MB];                                                                                  \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) e[m] = o[m] = _mm256_setzero_ps();                \
        long b = 0;                                                                                           \
        for (; b + 1 < nb; b += 2) {                                                                          \
            const uint8_t *b0 = w + b * ts, *b1 = b0 + ts;                                                    \
            __m256i w0 = a2_decode(type, b0), w1 = a2_decode(type, b1);                                      \
            __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);                           \
            const float d0 = a2_f16(b0), d1 = a2_f16(b1);                                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                            \
                const long r = m0 + m;                                                                        \
                const int8_t *q = x->q + r * K + b * QK;                                                      \
                const int32_t *s = x->s + (r * nb + b) * 8;                                                   \
                const float *dx = x->d + r * nb + b;                                                          \
                __m256 v0 = _mm256_cvtepi32_ps(a2_dot(type, w0, aw0, q, s));                                  \
                e[m] = _mm256_fmadd_ps(v0, _mm256_set1_ps(d0 * dx[0]), e[m]);                                 \
                __m256 v1 = _mm256_cvtepi32_ps(a2_dot(type, w1, aw1, q + QK, s + 8));                         \
                o[m] = _mm256_fmadd_ps(v1, _mm256_set1_ps(d1 * dx[1]), o[m]);                                 \
            }                                                                                                 \
        }                                                                                                     \
        if (b < nb) a2_last(type, w + b * ts, x, K, nb, b, m0, MB, e);                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] = a2_tree(e[m], o[m]);         \
    }
A2_ROW(1) A2_ROW(2) A2_ROW(3) A2_ROW(4)

static void row_avx2(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K, long M, float *y,
                     long ldy) {
    BLOCKS_4(a2_row_)
}
#pragma GCC pop_options

/* ------------------------------------------------------------------ AVX-512 VNNI */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")

/* two weight blocks (b0: lanes 0-7 of the sums, b1: 8-15) as 64 bytes */
static inline __m512i v5_decode2(int type, const uint8_t *b0, const uint8_t *b1) {
    if (type == 8)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                  _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    const int at = type == 2 ? 2 : 6;
    __m128i t0 = _mm_loadu_si128((const __m128i *)(b0 + at)), t1 = _mm_loadu_si128((const __m128i *)(b1 + at));
    /* 128-bit lanes: [lo nibbles b0 | hi nibbles b0 | lo b1 | hi b1] */
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_srli_epi16(t0, 4), t0)),
                                   _mm256_set_m128i(_mm_srli_epi16(t1, 4), t1), 1);
    v = _mm512_and_si512(v, _mm512_set1_epi8(15));
    if (type == 2) return _mm512_sub_epi8(v, _mm512_set1_epi8(8)); /* n - 8, signed, as llama.cpp's bx */
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    __mmask64 k = (__mmask64)h0 | (__mmask64)h1 << 32;
    return _mm512_sub_epi8(_mm512_or_si512(v, _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(0x10))),
                           _mm512_set1_epi8(16)); /* (n | h << 4) - 16 */
}

/* the lane tree of the header over a 16-lane accumulator (lanes 0-7 low half, 8-15 high half) */
static inline float v5_tree(__m512 a) {
    return a2_tree(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* the scales of two weight blocks as [d0 x 8, d1 x 8] */
static inline __m512 v5_scales(const uint8_t *b0, const uint8_t *b1) {
    return _mm512_insertf32x8(_mm512_set1_ps(a2_f16(b0)), _mm256_set1_ps(a2_f16(b1)), 1);
}

/* [d0 x 8, d1 x 8] from two consecutive floats */
static inline __m512 v5_pair(const float *d) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)d))));
}

/* y with the signs of w (neg: w's sign bits): _mm256_sign_epi8's trick, as ggml's mul_sum_i8_pairs, so that |w|
 * times it is w times y (w = 0 gives 0 either way) */
static inline __m512i v5_sign(__m512i y, __mmask64 neg) { return _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y); }

/* two blocks of |w| (aw) against two blocks of y signed by v5_sign (sy), summed in 16 int32 lanes, times
 * d_w * d_x (dw: v5_scales, dx: v5_pair), fused into acc */
static inline __m512 v5_step(__m512i aw, __m512i sy, __m512 dw, __m512 dx, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sy)),
                           _mm512_mul_ps(dw, dx), acc);
}

/* a2_last on lanes 0-7 of 16-lane accumulators */
static inline void v5_last(int type, const uint8_t *blk, const xq_t *x, long K, long nb, long b, long m0, int mb,
                           __m512 *acc) {
    __m256 lo[8];
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) lo[m] = _mm512_castps512_ps256(acc[m]);
    a2_last(type, blk, x, K, nb, b, m0, mb, lo);
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) acc[m] = _mm512_insertf32x8(acc[m], lo[m], 0);
}

/* R rows of W (at w, w + rb) against MB rows of x from m0, into y[., 0 .. R-1]: blocks two at a time (lanes 0-7
 * block b, 8-15 block b + 1); with R = 2 each activation vector is loaded once for both rows (the activations, not
 * the weights, are most of the bytes read at M >= 2). Each output's operations do not depend on R. */
#define V5_ROWS(R, MB)                                                                                        \
    static void v5_rows_##R##_##MB(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x,      \
                                   long K, long m0, float *y, long ldy) {                                     \
        __m512 a[R][MB];                                                                                      \
        _Pragma("GCC unroll 2") for (int h = 0; h < R; h++)                                                   \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) a[h][m] = _mm512_setzero_ps();               \
        long b = 0;                                                                                           \
        for (; b + 1 < nb; b += 2) {                                                                          \
            const uint8_t *p0 = w + b * ts, *p1 = p0 + ts, *u0 = p0 + (R - 1) * rb, *u1 = u0 + ts; /* u: R = 2 */ \
            const __m512i wv = v5_decode2(type, p0, p1), uv = R > 1 ? v5_decode2(type, u0, u1) : wv;          \
            const __m512i aw = _mm512_abs_epi8(wv), au = _mm512_abs_epi8(uv);                                 \
            const __mmask64 nw = _mm512_movepi8_mask(wv), nu = _mm512_movepi8_mask(uv);                       \
            const __m512 dw = v5_scales(p0, p1), du = v5_scales(u0, u1);                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                            \
                const long r = m0 + m;                                                                        \
                const __m512i q = _mm512_loadu_si512((const void *)(x->q + r * K + b * QK));                  \
                const __m512 dx = v5_pair(x->d + r * nb + b);                                                 \
                const __m512i sw = v5_sign(q, nw), su = R > 1 ? v5_sign(q, nu) : sw;                           \
                a[0][m] = v5_step(aw, sw, dw, dx, a[0][m]);                                                   \
                if (R > 1) a[R - 1][m] = v5_step(au, su, du, dx, a[R - 1][m]);                                \
            }                                                                                                 \
        }                                                                                                     \
        if (b < nb)                                                                                           \
            _Pragma("GCC unroll 2") for (int h = 0; h < R; h++)                                               \
                v5_last(type, w + h * rb + b * ts, x, K, nb, b, m0, MB, a[h]);                                \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)                                                  \
            _Pragma("GCC unroll 2") for (int h = 0; h < R; h++) y[(m0 + m) * ldy + h] = v5_tree(a[h][m]);     \
    }
V5_ROWS(1, 1) V5_ROWS(1, 2) V5_ROWS(1, 3) V5_ROWS(1, 4) V5_ROWS(1, 5) V5_ROWS(1, 6) V5_ROWS(1, 7) V5_ROWS(1, 8)
V5_ROWS(2, 1) V5_ROWS(2, 2) V5_ROWS(2, 3) V5_ROWS(2, 4) V5_ROWS(2, 5) V5_ROWS(2, 6) V5_ROWS(2, 7) V5_ROWS(2, 8)

static void row_vnni(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K, long M, float *y,
                     long ldy) {
    BLOCKS_8(v5_rows_1_)
}

/* rows n and n + 1 of W (at w, w + rb) into y[., 0] and y[., 1] */
static void row2_vnni(int type, long ts, const uint8_t *w, long rb, long nb, const xq_t *x, long K, long M, float *y,
                      long ldy) {
    BLOCKS_8(v5_rows_2_)
}
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------ K-quants: Q2_K ... Q6_K against Q8_K
 *
 * The activation rows as block_q8_K (quantize_row_q8_K_ref of ggml/src/ggml-quants.c, what quantize_row_q8_K of
 * arch/x86/quants.c calls): per 256 values, max the first value of largest magnitude (with its sign), iscale =
 * -127/max, q = MIN(127, nearest_int(iscale * x)) stored as int8 (the C conversion: the low byte), d = 1/iscale
 * (a float32, negative for a positive max), bsums the int16 sums of 16; a block of zeros gives d = 0, q = 0 (and
 * bsums 0: ggml leaves them unwritten, they multiply a zero scale). reference/activation_quants.py quantize_q8_K is
 * the same function; tests/test_q8_compute.py compares both with the built library's from_float, bit for bit.
 *
 * The product of a weight row and an activation row: ggml_vec_dot_q4_K_q8_K_generic / ..._q5_K_q8_K_generic /
 * ..._q6_K_q8_K_generic (and Q2_K's, Q3_K's below) of ggml/src/ggml-cpu/quants.c, in their order and with the fused
 * multiply-adds GCC forms there (the library's compiled generic functions hold vfmadd231ps for `sums[l] += d *
 * aux32[l]` and vfnmadd231ss for `sumf -= dmin * sumi`; the tests compare with them bit for bit):
 *   Q4_K, Q5_K, Q6_K: per super-block i of 256: eight int32 lanes aux32[l] = sum over the 16- (Q6_K) or 32-value
 *   (Q4_K, Q5_K) sub-blocks of scale_sub * sum(w * q) over the values of index = l (mod 8) in the sub-block (exact
 *   integers: Q4_K w the nibble 0..15, Q5_K the nibble + 16 * its bit of qh (0..31), scale their 6-bit scale; Q6_K
 *   w = q6 - 32, scale its int8 scale); d = fp16(d_w) * d_x (float32); sums[l] = fmaf(d, (float)aux32[l], sums[l]).
 *   Q4_K and Q5_K also: sumi = sum_j bsums[j] * min[j / 2] (exact), dmin = fp16(dmin_w) * d_x, sumf = fmaf(-dmin,
 *   (float)sumi, sumf). Then y = sumf (0 for Q6_K) + sums[0] + ... + sums[7], left to right. (float)aux32 and
 *   (float)sumi are exact (below 2^24).
 *   Q3_K (ggml_vec_dot_q3_K_q8_K_generic) as Q6_K: sub-blocks of 16, w = its two bits of qs minus 4 unless its bit
 *   of hmask is set (-4..3), scale its 6-bit scale minus 32; the same eight lanes and float operations (the library's
 *   generic: vfmadd231ps, then the eight vaddss).
 *   Q2_K (ggml_vec_dot_q2_K_q8_K_generic): one exact int isum = sum over the 16 sub-blocks of 16 of (sc & 15) *
 *   sum(w * q), w its two bits (0..3); summs = sum_j bsums[j] * (sc[j] >> 4); dall = d_x * fp16(d_w), dmin = d_x *
 *   fp16(dmin_w); sumf += fmaf(dall, (float)isum, -(dmin * (float)summs)) per super-block (the library's generic
 *   holds vmulss, vfmsub132ss, vaddss), y = sumf (no lanes).
 * The AVX2 path computes the same integers per lane and the same float operations in the same order, so the same
 * bits: the activation rows are kept a second time with each 16 bytes in the order 0, 8, 1, 9, ..., 7, 15 (qp), the
 * weights' bytes put in that order by one _mm256_shuffle_epi8, so that each int16 of _mm256_maddubs_epi16 sums two
 * values of one lane (l and l + 8); _mm256_unpacklo/hi_epi16 of two such vectors then pairs two sub-blocks' sums of
 * one lane, and _mm256_madd_epi16 with their two scales adds them into int32 lanes (lanes 0-3 and 4-7 in two
 * accumulators, folded once per super-block). The AVX-512 VNNI path does the same on 512-bit vectors (four 128-bit
 * lanes of pair sums; _mm512_dpwssd_epi32 multiplies by the two scales and adds), folded into the same eight lanes
 * before the same float operations: the same bits again. Q2_K and Q3_K take the AVX2 path on both vector levels
 * (AK23_ROW; Q2_K's single integer sum needs no lane order, its values multiply x->q as stored). Every path takes
 * the integers exactly, so the order of the integer additions is free; the float operations are the generic's, one
 * by one. Both vector paths prefetch
 * the packed stream 2 KB ahead (AK_PREFETCH: from memory a 2048 x 2816 Q4_K product at M = 1 took 0.94 ms of CPU
 * without it, 0.46-0.51 with 1-2 KB, on the shared 2-core machine under load). ggml's own AVX2 path (what the built
 * library runs) sums in another order (lanes by pairs of values, the min term in four fp32 lanes, a tree at the
 * end): that difference is fp32 accumulation only (the tests bound it with fp32_bound, and find it at 1e-3 of it).
 */
#define QKK 256

typedef struct {
    int8_t *q;    /* [M, K] */
    int8_t *qp;   /* [M, K], each 16 bytes in the order 0, 8, 1, 9, ..., 7, 15 (the AVX2 path) */
    float *d;     /* [M, nb] */
    int16_t *bs;  /* [M, nb, 16]: bsums */
    int16_t *bs2; /* [M, nb, 8]: bsums[2i] + bsums[2i + 1] (the Q4_K min term on the AVX2 path) */
} xk_t;

/* nearest_int of ggml-quants.c (|v| <= 4194303 there; the bits are kept for any other value as the C does) */
static inline int32_t k_nearest_int(float v) {
    float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* quantize_row_q8_K_ref of one row (K a multiple of 256), its bsums, and the qp / bs2 copies */
static void quantize_row_k(const float *x, long K, int8_t *q, int8_t *qp, float *d, int16_t *bs, int16_t *bs2) {
    for (long b = 0; b < K / QKK; b++, x += QKK, q += QKK, qp += QKK, bs += 16, bs2 += 8) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QKK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (!amax) {
            d[b] = 0.0f;
            memset(q, 0, QKK);
        } else {
            const float iscale = -127.f / max;
            for (int j = 0; j < QKK; j++) {
                const int32_t v = k_nearest_int(iscale * x[j]);
                q[j] = (int8_t)(uint8_t)(uint32_t)(v < 127 ? v : 127);
            }
            d[b] = 1 / iscale;
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[16 * j + i];
            bs[j] = (int16_t)sum;
        }
        for (int j = 0; j < 8; j++) bs2[j] = (int16_t)(bs[2 * j] + bs[2 * j + 1]);
        for (int c = 0; c < QKK; c += 16)
            for (int k = 0; k < 8; k++) {
                qp[c + 2 * k] = q[c + k];
                qp[c + 2 * k + 1] = q[c + k + 8];
            }
    }
}

/* the 6-bit scales and mins of a block_q4_K (its 12 bytes at sc12), as the generic path unpacks them */
static inline void q4k_scales(const uint8_t *sc12, uint8_t *scales, uint8_t *mins) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t utmp[4];
    memcpy(utmp, sc12, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    memcpy(scales, utmp, 8);
    memcpy(mins, utmp + 2, 8);
}

/* the 16 6-bit scales of a block_q3_K (its 12 bytes at sc12), as the generic path unpacks them (0..63; minus 32) */
static inline void q3k_scales(const uint8_t *sc12, int8_t *scales) {
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t auxs[4];
    memcpy(auxs, sc12, 12);
    const uint32_t tmp = auxs[2];
    auxs[2] = ((auxs[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    auxs[3] = ((auxs[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    auxs[0] = (auxs[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    auxs[1] = (auxs[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(scales, auxs, 16);
}

typedef void (*rowk_fn)(int type, long ts, const uint8_t *w, long nb, const xk_t *x, long K, long M, float *y,
                        long ldy);

/* ggml_vec_dot_q4_K_q8_K_generic / ggml_vec_dot_q6_K_q8_K_generic (the header of this section), row by row */
static void rowk_generic(int type, long ts, const uint8_t *w, long nb, const xk_t *x, long K, long M, float *y,
                         long ldy) {
    for (long m = 0; m < M; m++) {
        float sums[8] = {0}, sumf = 0.0f;
        for (long i = 0; i < nb; i++) {
            const uint8_t *blk = w + i * ts;
            const int8_t *q8 = x->q + m * K + i * QKK;
            const float dx = x->d[m * nb + i];
            int8_t a[QKK];
            int32_t aux32[8] = {0};
            if (type == 10) { /* block_q2_K: scales[16] (scale low nibble, min high), qs[64], d, dmin (fp16) */
                const uint8_t *sc = blk, *q2 = blk + 16;
                int summs = 0;
                for (int j = 0; j < 16; j++) summs += x->bs[(m * nb + i) * 16 + j] * (sc[j] >> 4);
                const float dall = dx * g4h_f16_load(blk + 80), dmin = dx * g4h_f16_load(blk + 82);
                int isum = 0;
                /* value 128h + 32t + l: (q2[32h + l] >> 2t) & 3, sub-block (value / 16) scale sc[...] & 15 */
                for (int v = 0; v < QKK; v++) {
                    const int h = v / 128, t = (v % 128) / 32, l = v % 32;
                    a[v] = (int8_t)((q2[32 * h + l] >> (2 * t)) & 3);
                }
                for (int j = 0; j < 16; j++) {
                    int isuml = 0;
                    for (int l = 0; l < 16; l++) isuml += q8[16 * j + l] * a[16 * j + l];
                    isum += (sc[j] & 0xF) * isuml;
                }
                sumf += fmaf(dall, (float)isum, -(dmin * (float)summs));
                continue;
            }
            if (type == 11) { /* block_q3_K: hmask[32], qs[64], scales[12] (16 6-bit, minus 32), d (fp16) */
                const uint8_t *hm = blk, *q3 = blk + 32;
                /* value 128h + 32t + l: ((q3[32h + l] >> 2t) & 3) - 4 unless bit 4h + t of hm[l] is set */
                for (int v = 0; v < QKK; v++) {
                    const int h = v / 128, t = (v % 128) / 32, l = v % 32;
                    a[v] = (int8_t)(((q3[32 * h + l] >> (2 * t)) & 3) - ((hm[l] >> (4 * h + t)) & 1 ? 0 : 4));
                }
                int8_t sc[16];
                q3k_scales(blk + 96, sc);
                for (int j = 0; j < 16; j++)
                    for (int c = 0; c < 16; c += 8)
                        for (int l = 0; l < 8; l++) {
                            const int16_t p = (int16_t)(q8[16 * j + c + l] * a[16 * j + c + l]);
                            aux32[l] += (sc[j] - 32) * p;
                        }
                const float d = g4h_f16_load(blk + 108) * dx;
                for (int l = 0; l < 8; l++) sums[l] = fmaf(d, (float)aux32[l], sums[l]);
                continue;
            }
            if (type == 12 || type == 13) { /* block_q4_K: d, dmin (fp16), scales[12], qs[128]; block_q5_K: d,
                                             * dmin, scales[12], qh[32], qs[128] (value 64j + l: bit 2j of qh[l],
                                             * 64j + 32 + l: bit 2j + 1, as 16) */
                const uint8_t *q4 = blk + (type == 13 ? 48 : 16), *qh = blk + 16;
                for (int j = 0; j < 4; j++, q4 += 32)
                    for (int l = 0; l < 32; l++) {
                        const int h0 = type == 13 ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
                        const int h1 = type == 13 ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
                        a[64 * j + l] = (int8_t)((q4[l] & 0xF) + h0);
                        a[64 * j + 32 + l] = (int8_t)((q4[l] >> 4) + h1);
                    }
                uint8_t scales[8], mins[8];
                q4k_scales(blk + 4, scales, mins);
                const int16_t *bsums = x->bs + (m * nb + i) * 16;
                int sumi = 0;
                for (int j = 0; j < 16; j++) sumi += bsums[j] * mins[j / 2];
                for (int j = 0; j < 8; j++)
                    for (int c = 0; c < 32; c += 8)
                        for (int l = 0; l < 8; l++) {
                            const int16_t p = (int16_t)(q8[32 * j + c + l] * a[32 * j + c + l]);
                            aux32[l] += scales[j] * p;
                        }
                const float d = g4h_f16_load(blk) * dx;
                for (int l = 0; l < 8; l++) sums[l] = fmaf(d, (float)aux32[l], sums[l]);
                const float dmin = g4h_f16_load(blk + 2) * dx;
                sumf = fmaf(-dmin, (float)sumi, sumf);
            } else { /* block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16) */
                const uint8_t *ql = blk, *qh = blk + 128;
                const int8_t *sc = (const int8_t *)(blk + 192);
                for (int h = 0; h < 2; h++, ql += 64, qh += 32)
                    for (int l = 0; l < 32; l++) {
                        int8_t *o = a + 128 * h;
                        o[l] = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        o[l + 32] = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        o[l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        o[l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    }
                for (int j = 0; j < 16; j++)
                    for (int c = 0; c < 16; c += 8)
                        for (int l = 0; l < 8; l++) {
                            const int16_t p = (int16_t)(q8[16 * j + c + l] * a[16 * j + c + l]);
                            aux32[l] += sc[j] * p;
                        }
                const float d = g4h_f16_load(blk + 208) * dx;
                for (int l = 0; l < 8; l++) sums[l] = fmaf(d, (float)aux32[l], sums[l]);
            }
        }
        if (type != 10) /* Q2_K: one float sum (sumf + 0.0f would turn a -0.0f into +0.0f) */
            for (int l = 0; l < 8; l++) sumf += sums[l];
        y[m * ldy] = sumf;
    }
}

#if defined(Q8_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* 16 bytes 0..15 -> 0, 8, 1, 9, ..., 7, 15 in each 128-bit lane (the qp order) */
static inline __m256i ak_perm(__m256i v) {
    const __m256i p = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3,
                                       11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm256_shuffle_epi8(v, p);
}

/* lanes 0-3 (A: [sub-block pair, first 128 bits | second]) and 4-7 (B) -> the eight int32 lanes, as float */
static inline __m256 ak_fold(__m256i A, __m256i B) {
    return _mm256_cvtepi32_ps(
        _mm256_add_epi32(_mm256_permute2x128_si256(A, B, 0x20), _mm256_permute2x128_si256(A, B, 0x31)));
}

static inline float ak_final(float s, __m256 acc) {
    float l[8];
    _mm256_storeu_ps(l, acc);
    for (int k = 0; k < 8; k++) s += l[k];
    return s;
}

#ifndef AK_PREFETCH
#define AK_PREFETCH 2048
#endif
/* software prefetch of the super-block AK_PREFETCH bytes ahead in W's stream (rows are contiguous) */
static inline void ak_prefetch(const uint8_t *blk, long ts) {
    if (AK_PREFETCH > 0)
        for (long o = 0; o < ts; o += 64) __builtin_prefetch(blk + AK_PREFETCH + o);
}

static inline int32_t ak_hsum4(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    return _mm_cvtsi128_si32(v);
}

/* q4k_scales in registers (as ggml's AVX2 path unpacks them): the eight scales and the eight mins as int16 */
static inline void ak_q4k_scales(const uint8_t *sc12, __m128i *scales, __m128i *mins) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t u0, u1, u2;
    memcpy(&u0, sc12, 4);
    memcpy(&u1, sc12 + 4, 4);
    memcpy(&u2, sc12 + 8, 4);
    const uint32_t m3 = ((u2 >> 4) & kmask2) | (((u1 >> 6) & kmask3) << 4);
    const uint32_t m2 = u1 & kmask1;
    const uint32_t s1 = (u2 & kmask2) | (((u0 >> 6) & kmask3) << 4);
    const uint32_t s0 = u0 & kmask1;
    *scales = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)s1, (int)s0));
    *mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m3, (int)m2));
}

/* Q4_K (H5 0: ak4_row_MB) and Q5_K (H5 1: ak5_row_MB, the fifth bit of value 64j + l from bit 2j of qh[l] and of
 * 64j + 32 + l from bit 2j + 1, put at 0x10 of its byte before the reorder) */
#define AK4_ROW(F, MB, H5)                                                                                    \
    static void F##MB(const uint8_t *w, long ts, long nb, const xk_t *x, long K, long m0, float *y, long ldy) { \
        __m256 acc[MB];                                                                                       \
        float mac[MB];                                                                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps(), mac[m] = 0.0f;     \
        const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);                                  \
        (void)m16;                                                                                            \
        for (long i = 0; i < nb; i++) {                                                                       \
            const uint8_t *blk = w + i * ts;                                                                  \
            ak_prefetch(blk, ts);                                                                             \
            __m128i sc16, mv;                                                                                 \
            ak_q4k_scales(blk + 4, &sc16, &mv);                                                               \
            const float dw = a2_f16(blk), dminw = a2_f16(blk + 2);                                            \
            __m256i A[MB], B[MB];                                                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) A[m] = B[m] = _mm256_setzero_si256();        \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                             \
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(blk + (H5 ? 48 : 16) + 32 * j));    \
                __m256i wl = _mm256_and_si256(bits, m4), wh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4); \
                if (H5) {                                                                                     \
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 16));                       \
                    wl = _mm256_or_si256(wl, _mm256_and_si256(                                                \
                                                 _mm256_slli_epi16(_mm256_srli_epi16(hb, 2 * j), 4), m16));   \
                    wh = _mm256_or_si256(wh, _mm256_and_si256(                                                \
                                                 _mm256_slli_epi16(_mm256_srli_epi16(hb, 2 * j + 1), 4), m16)); \
                }                                                                                             \
                wl = ak_perm(wl);                                                                             \
                wh = ak_perm(wh);                                                                             \
                const __m256i sv = /* scales 2j, 2j + 1 as one int32, broadcast */                            \
                    _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(sc16), _mm256_set1_epi32(j));          \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                        \
                    const int8_t *q = x->qp + (m0 + m) * K + i * QKK + 64 * j;                                \
                    const __m256i r0 = _mm256_maddubs_epi16(wl, _mm256_loadu_si256((const __m256i *)q));      \
                    const __m256i r1 = _mm256_maddubs_epi16(wh, _mm256_loadu_si256((const __m256i *)(q + 32))); \
                    A[m] = _mm256_add_epi32(A[m], _mm256_madd_epi16(_mm256_unpacklo_epi16(r0, r1), sv));      \
                    B[m] = _mm256_add_epi32(B[m], _mm256_madd_epi16(_mm256_unpackhi_epi16(r0, r1), sv));      \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                            \
                const long r = (m0 + m) * nb + i;                                                             \
                const float dx = x->d[r];                                                                     \
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), ak_fold(A[m], B[m]), acc[m]);               \
                const int32_t sumi =                                                                          \
                    ak_hsum4(_mm_madd_epi16(_mm_loadu_si128((const __m128i *)(x->bs2 + r * 8)), mv));         \
                mac[m] = fmaf(-(dminw * dx), (float)sumi, mac[m]);                                            \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] = ak_final(mac[m], acc[m]);    \
    }
AK4_ROW(ak4_row_, 1, 0) AK4_ROW(ak4_row_, 2, 0) AK4_ROW(ak4_row_, 3, 0) AK4_ROW(ak4_row_, 4, 0)
AK4_ROW(ak5_row_, 1, 1) AK4_ROW(ak5_row_, 2, 1) AK4_ROW(ak5_row_, 3, 1) AK4_ROW(ak5_row_, 4, 1)

/* the four vectors of 32 six-bit values (0..63) of one 128-value half of a block_q6_K, in the qp order */
#define AK6_ROW(MB)                                                                                           \
    static void ak6_row_##MB(const uint8_t *w, long ts, long nb, const xk_t *x, long K, long m0, float *y,   \
                             long ldy) {                                                                      \
        __m256 acc[MB];                                                                                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();                    \
        const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m30 = _mm256_set1_epi8(0x30);       \
        const __m256i m32 = _mm256_set1_epi8(32);                                                             \
        for (long i = 0; i < nb; i++) {                                                                       \
            const uint8_t *blk = w + i * ts;                                                                  \
            ak_prefetch(blk, ts);                                                                             \
            const int8_t *sc = (const int8_t *)(blk + 192);                                                   \
            const float dw = a2_f16(blk + 208);                                                               \
            __m256i A[MB], B[MB];                                                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) A[m] = B[m] = _mm256_setzero_si256();        \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;                                   \
                const int8_t *s = sc + 8 * h;                                                                 \
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);                                   \
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));                            \
                const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);                                   \
                __m256i v[4];                                                                                 \
                v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4)); \
                v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),                                              \
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4)); \
                v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)); \
                v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),                        \
                                       _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));                      \
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) v[t] = ak_perm(v[t]);                      \
                /* sub-blocks (0, 2) in the first 128 bits, (1, 3) in the second; then (4, 6), (5, 7) */       \
                /* the int16 scales as int32 pairs [(0, 2), (1, 3), (4, 6), (5, 7)], then broadcast by halves */ \
                const __m256i sp = _mm256_castsi128_si256(_mm_shuffle_epi8(                                   \
                    _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)s)),                                   \
                    _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15)));                    \
                const __m256i s0 = _mm256_permutevar8x32_epi32(sp, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)); \
                const __m256i s1 = _mm256_permutevar8x32_epi32(sp, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)); \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                        \
                    const int8_t *q = x->qp + (m0 + m) * K + i * QKK + 128 * h;                               \
                    __m256i r[4];                                                                             \
                    _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                     \
                        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * t));                 \
                        r[t] = _mm256_sub_epi16(_mm256_maddubs_epi16(v[t], qv), _mm256_maddubs_epi16(m32, qv)); \
                    }                                                                                         \
                    A[m] = _mm256_add_epi32(A[m], _mm256_madd_epi16(_mm256_unpacklo_epi16(r[0], r[1]), s0));  \
                    B[m] = _mm256_add_epi32(B[m], _mm256_madd_epi16(_mm256_unpackhi_epi16(r[0], r[1]), s0));  \
                    A[m] = _mm256_add_epi32(A[m], _mm256_madd_epi16(_mm256_unpacklo_epi16(r[2], r[3]), s1));  \
                    B[m] = _mm256_add_epi32(B[m], _mm256_madd_epi16(_mm256_unpackhi_epi16(r[2], r[3]), s1));  \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(                    \
                _mm256_set1_ps(dw * x->d[(m0 + m) * nb + i]), ak_fold(A[m], B[m]), acc[m]);                   \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] = ak_final(0.0f, acc[m]);      \
    }
AK6_ROW(1) AK6_ROW(2) AK6_ROW(3) AK6_ROW(4)

/* Q2_K (T 10: ak2_row_MB) and Q3_K (T 11: ak3_row_MB): sub-blocks of 16 as Q6_K. Per half h of 128 values, vector t
 * holds values 128h + 32t + (0..31), (qs[32h + l] >> 2t) & 3 (sub-blocks 8h + 2t, 8h + 2t + 1 in its two 128-bit
 * halves); Q3_K adds 4 where bit 4h + t of hmask[l] is set (unsigned a + 4, 0..7; the 4 taken off through
 * maddubs(4, q)), its scales the 6-bit ones minus 32 (int8); Q2_K's weights 0..3 and scales 0..15 (low nibbles)
 * multiply x->q in element order (its integer sum is one int, the lanes do not matter), its min term
 * sum(bsums * (sc >> 4)) by one madd. Float operations: Q3_K Q6_K's (eight lanes, fmadd, the final sum); Q2_K
 * sumf += fmaf(dall, isum, -(dmin * summs)) per super-block, the generic's. */
#define AK23_ROW(F, MB, T)                                                                                    \
    static void F##MB(const uint8_t *w, long ts, long nb, const xk_t *x, long K, long m0, float *y, long ldy) { \
        __m256 acc[MB];                                                                                       \
        float mac[MB];                                                                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps(), mac[m] = 0.0f;     \
        const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);                                     \
        for (long i = 0; i < nb; i++) {                                                                       \
            const uint8_t *blk = w + i * ts;                                                                  \
            ak_prefetch(blk, ts);                                                                             \
            int8_t sc[16];                                                                                    \
            if (T == 11) {                                                                                    \
                q3k_scales(blk + 96, sc);                                                                     \
                _mm_storeu_si128((__m128i *)sc, _mm_sub_epi8(_mm_loadu_si128((const __m128i *)sc),            \
                                                             _mm_set1_epi8(32)));                             \
            } else {                                                                                          \
                _mm_storeu_si128((__m128i *)sc,                                                               \
                                 _mm_and_si128(_mm_loadu_si128((const __m128i *)blk), _mm_set1_epi8(15)));     \
            }                                                                                                 \
            const float dw = a2_f16(blk + (T == 11 ? 108 : 80));                                              \
            __m256i A[MB], B[MB];                                                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) A[m] = B[m] = _mm256_setzero_si256();        \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                const __m256i qb = _mm256_loadu_si256((const __m256i *)(blk + (T == 11 ? 32 : 16) + 32 * h)); \
                __m256i v[4];                                                                                 \
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                         \
                    v[t] = _mm256_and_si256(_mm256_srli_epi16(qb, 2 * t), m3);                                \
                    if (T == 11) {                                                                            \
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)blk);                          \
                        v[t] = ak_perm(_mm256_or_si256(                                                       \
                            v[t], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hb, 4 * h + t), 2), m4))); \
                    }                                                                                         \
                }                                                                                             \
                const __m256i sp = _mm256_castsi128_si256(_mm_shuffle_epi8(                                   \
                    _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * h))),                        \
                    _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15)));                    \
                const __m256i s0 = _mm256_permutevar8x32_epi32(sp, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)); \
                const __m256i s1 = _mm256_permutevar8x32_epi32(sp, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)); \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                        \
                    const int8_t *q = (T == 11 ? x->qp : x->q) + (m0 + m) * K + i * QKK + 128 * h;            \
                    __m256i r[4];                                                                             \
                    _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                     \
                        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * t));                 \
                        r[t] = _mm256_maddubs_epi16(v[t], qv);                                                \
                        if (T == 11) r[t] = _mm256_sub_epi16(r[t], _mm256_maddubs_epi16(m4, qv));             \
                    }                                                                                         \
                    A[m] = _mm256_add_epi32(A[m], _mm256_madd_epi16(_mm256_unpacklo_epi16(r[0], r[1]), s0));  \
                    B[m] = _mm256_add_epi32(B[m], _mm256_madd_epi16(_mm256_unpackhi_epi16(r[0], r[1]), s0));  \
                    A[m] = _mm256_add_epi32(A[m], _mm256_madd_epi16(_mm256_unpacklo_epi16(r[2], r[3]), s1));  \
                    B[m] = _mm256_add_epi32(B[m], _mm256_madd_epi16(_mm256_unpackhi_epi16(r[2], r[3]), s1));  \
                }                                                                                             \
            }                                                                                                 \
            if (T == 11) {                                                                                    \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(                \
                    _mm256_set1_ps(dw * x->d[(m0 + m) * nb + i]), ak_fold(A[m], B[m]), acc[m]);               \
            } else {                                                                                          \
                const float dminw = a2_f16(blk + 82);                                                         \
                const __m256i mins = _mm256_cvtepu8_epi16(                                                    \
                    _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)blk), 4), _mm_set1_epi8(15))); \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                        \
                    const long r = (m0 + m) * nb + i;                                                         \
                    const float dx = x->d[r];                                                                 \
                    const __m256i sm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x->bs + r * 16)), mins); \
                    const int32_t summs =                                                                     \
                        ak_hsum4(_mm_add_epi32(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1))); \
                    const __m256i ab = _mm256_add_epi32(A[m], B[m]);                                          \
                    const int32_t isum =                                                                      \
                        ak_hsum4(_mm_add_epi32(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1))); \
                    mac[m] += fmaf(dx * dw, (float)isum, -((dx * dminw) * (float)summs));                     \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] =                              \
            T == 11 ? ak_final(0.0f, acc[m]) : mac[m];                                                        \
    }
AK23_ROW(ak2_row_, 1, 10) AK23_ROW(ak2_row_, 2, 10) AK23_ROW(ak2_row_, 3, 10) AK23_ROW(ak2_row_, 4, 10)
AK23_ROW(ak3_row_, 1, 11) AK23_ROW(ak3_row_, 2, 11) AK23_ROW(ak3_row_, 3, 11) AK23_ROW(ak3_row_, 4, 11)

#define KBLOCK_CASE(F, MB) \
    case MB: F##MB(w, ts, nb, x, K, m0, y, ldy); break;
#define KBLOCKS_4(F)                                                                                    \
    for (long m0 = 0; m0 < M; m0 += 4) switch (M - m0 < 4 ? M - m0 : 4) {                              \
        KBLOCK_CASE(F, 1) KBLOCK_CASE(F, 2) KBLOCK_CASE(F, 3) default: F##4(w, ts, nb, x, K, m0, y, ldy);  \
        }

static void rowk_avx2(int type, long ts, const uint8_t *w, long nb, const xk_t *x, long K, long M, float *y,
                      long ldy) {
    if (type == 10) {
        KBLOCKS_4(ak2_row_)
    } else if (type == 11) {
        KBLOCKS_4(ak3_row_)
    } else if (type == 12) {
        KBLOCKS_4(ak4_row_)
    } else if (type == 13) {
        KBLOCKS_4(ak5_row_)
    } else {
        KBLOCKS_4(ak6_row_)
    }
}
#pragma GCC pop_options

/* ---- the K-quants on AVX-512 VNNI: the AVX2 path's integers and float operations (so its bits) on 512-bit vectors:
 * four 128-bit lanes of int16 pair sums, two sub-blocks paired by _mm512_unpacklo/hi_epi16 and multiplied by their
 * scales and added into int32 by _mm512_dpwssd_epi32; the four 128-bit lanes folded once per super-block into the
 * eight lanes of the AVX2 path (ak_fold), then its fmadd, min term and final sums. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")

static inline __m512i vk_perm(__m512i v) {
    const __m512i p = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
    return _mm512_shuffle_epi8(v, p);
}

/* lanes 0-3 in the four 128-bit lanes of A, 4-7 in B's -> the eight lanes, as float (exact integer sums) */
static inline __m256 vk_fold(__m512i A, __m512i B) {
    const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(A), _mm512_extracti64x4_epi64(A, 1));
    const __m256i b = _mm256_add_epi32(_mm512_castsi512_si256(B), _mm512_extracti64x4_epi64(B, 1));
    return ak_fold(a, b);
}

/* Q4_K (vk4_row_MB) and Q5_K (H5 1: vk5_row_MB, the fifth bits as in AK4_ROW: bit 2j of qh for the low nibbles of
 * chunk j, bit 2j + 1 for the high ones, each half of the vector shifted by its own count) */
#define VK4_ROW(F, MB, H5)                                                                                    \
    static void F##MB(const uint8_t *w, long ts, long nb, const xk_t *x, long K, long m0, float *y, long ldy) { \
        __m256 acc[MB];                                                                                       \
        float mac[MB];                                                                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps(), mac[m] = 0.0f;     \
        const __m512i m4 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(16);                                  \
        const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* 0 | 4 */    \
        const __m512i sh1 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1); /* 0 | 1 */  \
        (void)m16, (void)sh1;                                                                                 \
        const __m512i i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);                \
        const __m512i i23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);                \
        for (long i = 0; i < nb; i++) {                                                                       \
            const uint8_t *blk = w + i * ts;                                                                  \
            ak_prefetch(blk, ts);                                                                             \
            __m128i sc16, mv;                                                                                 \
            ak_q4k_scales(blk + 4, &sc16, &mv);                                                               \
            const float dw = a2_f16(blk), dminw = a2_f16(blk + 2);                                            \
            /* scale pairs (0, 2), (1, 3), (4, 6), (5, 7) as int32; per 128-bit lane: sub-blocks 2j, 2j, 2j+1, \
             * 2j+1 paired with those of j + 1 */                                                             \
            const __m512i sp = _mm512_castsi128_si512(                                                        \
                _mm_shuffle_epi8(sc16, _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15))); \
            const __m512i s01 = _mm512_permutexvar_epi32(i01, sp), s23 = _mm512_permutexvar_epi32(i23, sp);   \
            __m512i wv[4]; /* chunk j of qs: [low nibbles: sub-block 2j | high nibbles: 2j + 1], qp order */    \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) wv[j] = vk_perm(_mm512_and_si512(             \
                _mm512_srlv_epi16(_mm512_broadcast_i64x4(                                                     \
                                      _mm256_loadu_si256((const __m256i *)(blk + (H5 ? 48 : 16) + 32 * j))), sh), \
                m4));                                                                                         \
            if (H5) {                                                                                         \
                const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));   \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) wv[j] = _mm512_or_si512(wv[j], vk_perm(    \
                    _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(                                     \
                                         hb, _mm512_add_epi16(sh1, _mm512_set1_epi16((short)(2 * j)))), 4),   \
                                     m16)));                                                                  \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                            \
                const int8_t *q = x->qp + (m0 + m) * K + i * QKK;                                             \
                __m512i r[4];                                                                                 \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)                                          \
                    r[j] = _mm512_maddubs_epi16(wv[j], _mm512_loadu_si512((const void *)(q + 64 * j)));      \
                __m512i A = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_unpacklo_epi16(r[0], r[1]), s01); \
                __m512i B = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_unpackhi_epi16(r[0], r[1]), s01); \
                A = _mm512_dpwssd_epi32(A, _mm512_unpacklo_epi16(r[2], r[3]), s23);                           \
                B = _mm512_dpwssd_epi32(B, _mm512_unpackhi_epi16(r[2], r[3]), s23);                           \
                const long rr = (m0 + m) * nb + i;                                                            \
                const float dx = x->d[rr];                                                                    \
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), vk_fold(A, B), acc[m]);                     \
                const int32_t sumi =                                                                          \
                    ak_hsum4(_mm_madd_epi16(_mm_loadu_si128((const __m128i *)(x->bs2 + rr * 8)), mv));        \
                mac[m] = fmaf(-(dminw * dx), (float)sumi, mac[m]);                                            \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] = ak_final(mac[m], acc[m]);    \
    }
VK4_ROW(vk4_row_, 1, 0) VK4_ROW(vk4_row_, 2, 0) VK4_ROW(vk4_row_, 3, 0) VK4_ROW(vk4_row_, 4, 0)
VK4_ROW(vk5_row_, 1, 1) VK4_ROW(vk5_row_, 2, 1) VK4_ROW(vk5_row_, 3, 1) VK4_ROW(vk5_row_, 4, 1)

#define VK6_ROW(MB)                                                                                           \
    static void vk6_row_##MB(const uint8_t *w, long ts, long nb, const xk_t *x, long K, long m0, float *y,   \
                             long ldy) {                                                                      \
        __m256 acc[MB];                                                                                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();                    \
        const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), m30 = _mm512_set1_epi8(0x30);       \
        const __m512i m32 = _mm512_set1_epi8(32);                                                             \
        const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); /* 0 | 2 */    \
        const __m512i it = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);                 \
        for (long i = 0; i < nb; i++) {                                                                       \
            const uint8_t *blk = w + i * ts;                                                                  \
            ak_prefetch(blk, ts);                                                                             \
            const float dw = a2_f16(blk + 208);                                                               \
            __m512i A[MB], B[MB];                                                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) A[m] = B[m] = _mm512_setzero_si512();        \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));                           \
                const __m512i hs = _mm512_srlv_epi16(                                                         \
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h))), sh);    \
                /* values 0..63 (sub-blocks 0-3 of the half) and 64..127 (4-7), in the qp order */             \
                const __m512i v01 = vk_perm(_mm512_or_si512(_mm512_and_si512(l, m4),                          \
                                                            _mm512_slli_epi16(_mm512_and_si512(hs, m3), 4))); \
                const __m512i v23 = vk_perm(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),    \
                                                            _mm512_and_si512(hs, m30)));                      \
                /* scale pairs (t, t + 4) of the half's sub-blocks as int32, pair t in 128-bit lane t */       \
                const __m128i s16 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h))); \
                const __m512i sv = _mm512_permutexvar_epi32(                                                  \
                    it, _mm512_castsi128_si512(_mm_unpacklo_epi16(s16, _mm_srli_si128(s16, 8))));             \
                _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                        \
                    const int8_t *q = x->qp + (m0 + m) * K + i * QKK + 128 * h;                               \
                    const __m512i q0 = _mm512_loadu_si512((const void *)q);                                   \
                    const __m512i q1 = _mm512_loadu_si512((const void *)(q + 64));                            \
                    const __m512i r0 = _mm512_sub_epi16(_mm512_maddubs_epi16(v01, q0), _mm512_maddubs_epi16(m32, q0)); \
                    const __m512i r1 = _mm512_sub_epi16(_mm512_maddubs_epi16(v23, q1), _mm512_maddubs_epi16(m32, q1)); \
                    A[m] = _mm512_dpwssd_epi32(A[m], _mm512_unpacklo_epi16(r0, r1), sv);                      \
                    B[m] = _mm512_dpwssd_epi32(B[m], _mm512_unpackhi_epi16(r0, r1), sv);                      \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(                    \
                _mm256_set1_ps(dw * x->d[(m0 + m) * nb + i]), vk_fold(A[m], B[m]), acc[m]);                   \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) y[(m0 + m) * ldy] = ak_final(0.0f, acc[m]);      \
    }
VK6_ROW(1) VK6_ROW(2) VK6_ROW(3) VK6_ROW(4)

static void rowk_vnni(int type, long ts, const uint8_t *w, long nb, const xk_t *x, long K, long M, float *y,
                      long ldy) {
    if (type == 10 || type == 11) { /* the AVX2 row functions (the same bits) */
        rowk_avx2(type, ts, w, nb, x, K, M, y, ldy);
    } else if (type == 12) {
        KBLOCKS_4(vk4_row_)
    } else if (type == 13) {
        KBLOCKS_4(vk5_row_)
    } else {
        KBLOCKS_4(vk6_row_)
    }
}
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------ dispatch, threads */

static int isa_cap = 512;

static int best_isa(void) {
#if defined(Q8_X86)
    __builtin_cpu_init();
    if (isa_cap >= 512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512dq"))
        return 512;
    if (isa_cap >= 256 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return 256;
#endif
    return 0;
}

static row_fn row_for(int isa) {
#if defined(Q8_X86)
    if (isa == 512) return row_vnni;
    if (isa == 256) return row_avx2;
#endif
    (void)isa;
    return row_generic;
}

/* Cap the ISA path (512: VNNI, 256: AVX2, 0: plain C); returns the path now taken. For the tests. */
int g4h_q8_force_isa(int cap) {
    isa_cap = cap;
    return best_isa();
}

/* The path taken: 512 (AVX-512 VNNI), 256 (AVX2), 0 (plain C). */
int g4h_q8_isa(void) { return best_isa(); }

typedef struct {
    int type;
    long ts, nb, K, M, N, row_bytes, per_run;
    const uint8_t *w;
    const xq_t *x;
    float *y;
    row_fn row;
    int pairs; /* rows of W two at a time (the VNNI path, M >= 2) */
    const xk_t *xk; /* the K-quants: Q8_K rows and their row function (else NULL) */
    rowk_fn rowk;
} job_t;

static void run_rows(void *p, long run, int tid) {
    job_t *j = p;
    (void)tid;
    const long n1 = (run + 1) * j->per_run < j->N ? (run + 1) * j->per_run : j->N;
    long n = run * j->per_run;
    if (j->rowk) {
        for (; n < n1; n++) j->rowk(j->type, j->ts, j->w + n * j->row_bytes, j->nb, j->xk, j->K, j->M, j->y + n, j->N);
        return;
    }
#if defined(Q8_X86)
    if (j->pairs)
        for (; n + 1 < n1; n += 2)
            row2_vnni(j->type, j->ts, j->w + n * j->row_bytes, j->row_bytes, j->nb, j->x, j->K, j->M, j->y + n, j->N);
#endif
    for (; n < n1; n++)
        j->row(j->type, j->ts, j->w + n * j->row_bytes, j->row_bytes, j->nb, j->x, j->K, j->M, j->y + n, j->N);
}

static long type_bytes(int type) {
    switch (type) {
    case 8: return 34;
    case 2: return 18;
    case 6: return 22;
    case 10: return 84;
    case 11: return 110;
    case 12: return 144;
    case 13: return 176;
    case 14: return 210;
    default: return 0;
    }
}

static rowk_fn rowk_for(int isa) {
#if defined(Q8_X86)
    if (isa == 512) return rowk_vnni;
    if (isa == 256) return rowk_avx2;
#endif
    (void)isa;
    return rowk_generic;
}

/* The K-quant products (Q2_K 10 ... Q6_K 14): x quantized to Q8_K, then the rows of W in runs as below. */
static int linear_k(int type, long ts, const uint8_t *w, long row_bytes, long N, long K, const float *x, long M,
                    float *y, int nthreads) {
    const long nb = K / QKK;
    xk_t xk;
    void *buf = NULL;
    const size_t qbytes = (size_t)M * K, dbytes = (size_t)M * nb * sizeof(float), bbytes = (size_t)M * nb * 48;
    if (posix_memalign(&buf, 64, 2 * qbytes + dbytes + bbytes + 64) != 0) return -3;
    xk.q = buf;
    xk.qp = xk.q + qbytes;
    xk.d = (float *)(xk.qp + qbytes);
    xk.bs = (int16_t *)((uint8_t *)xk.d + dbytes);
    xk.bs2 = xk.bs + (size_t)M * nb * 16;
    for (long m = 0; m < M; m++)
        quantize_row_k(x + m * K, K, xk.q + m * K, xk.qp + m * K, xk.d + m * nb, xk.bs + m * nb * 16,
                       xk.bs2 + m * nb * 8);
    job_t j = {.type = type, .ts = ts, .nb = nb, .K = K, .M = M, .N = N, .row_bytes = row_bytes, .w = w,
               .y = y, .xk = &xk, .rowk = rowk_for(best_isa())};
    j.per_run = 131072 / row_bytes;
    if (j.per_run < 1) j.per_run = 1;
    if ((double)N * K * (M + 3) < (double)(1 << 20)) nthreads = 1;
    wp_run(run_rows, &j, (N + j.per_run - 1) / j.per_run, nthreads);
    free(buf);
    return 0;
}

/* y[M, N] = x[M, K] @ W.T as llama.cpp computes it (the header). Returns 0; -1 unknown type; -2 bad shape;
 * -3 out of memory. */
int g4h_q8_linear(int type, const uint8_t *w, long row_bytes, long N, long K, const float *x, long M, float *y,
                  int nthreads) {
    const long ts = type_bytes(type);
    if (!ts) return -1;
    if (type >= 10 && type <= 14) {
        if (M < 1 || M > MAX_M || N < 0 || K <= 0 || K % QKK || row_bytes != K / QKK * ts) return -2;
        return N == 0 ? 0 : linear_k(type, ts, w, row_bytes, N, K, x, M, y, nthreads);
    }
    if (M < 1 || M > MAX_M || N < 0 || K <= 0 || K % QK || row_bytes != K / QK * ts) return -2;
    if (N == 0) return 0;
    const long nb = K / QK;
    xq_t xq;
    void *buf = NULL;
    const size_t qbytes = (size_t)M * K, dbytes = (size_t)M * nb * sizeof(float), sbytes = (size_t)M * nb * 32;
    if (posix_memalign(&buf, 64, qbytes + dbytes + sbytes + 64) != 0) return -3;
    xq.q = buf;
    xq.d = (float *)((uint8_t *)buf + qbytes);
    xq.s = (int32_t *)((uint8_t *)buf + qbytes + dbytes);
    for (long m = 0; m < M; m++) quantize_row(x + m * K, K, xq.q + m * K, xq.d + m * nb, xq.s + m * nb * 8);
    const int isa = best_isa();
    job_t j = {.type = type, .ts = ts, .nb = nb, .K = K, .M = M, .N = N, .row_bytes = row_bytes, .w = w, .x = &xq,
               .y = y, .row = row_for(isa), .pairs = isa == 512 && M >= 2};
    j.per_run = 131072 / row_bytes;
    if (j.per_run < 1) j.per_run = 1;
    if ((double)N * K * (M + 3) < (double)(1 << 20)) nthreads = 1;
    wp_run(run_rows, &j, (N + j.per_run - 1) / j.per_run, nthreads);
    free(buf);
    return 0;
}

/* block_q8_0 of the rows of x (for the tests: the quantizer against reference/activation_quants.py):
 * d_out [M, K/32] float32 (the fp16 scale widened), q_out [M, K] int8. Returns 0 or -2. */
int g4h_q8_quantize(const float *x, long M, long K, float *d_out, int8_t *q_out) {
    if (M < 0 || K <= 0 || K % QK) return -2;
    int32_t *s = malloc((size_t)(K / QK) * 32);
    if (!s) return -3;
    for (long m = 0; m < M; m++) quantize_row(x + m * K, K, q_out + m * K, d_out + m * (K / QK), s);
    free(s);
    return 0;
}

/* block_q8_K of the rows of x (for the tests: the quantizer against the library's and reference/activation_quants.py):
 * d_out [M, K/256] float32, q_out [M, K] int8, bsums_out [M, K/256, 16] int16. Returns 0, -2 or -3. */
int g4h_q8k_quantize(const float *x, long M, long K, float *d_out, int8_t *q_out, int16_t *bsums_out) {
    if (M < 0 || K <= 0 || K % QKK) return -2;
    int8_t *qp = malloc((size_t)K);
    int16_t *bs2 = malloc((size_t)(K / QKK) * 16);
    if (!qp || !bs2) {
        free(qp);
        free(bs2);
        return -3;
    }
    for (long m = 0; m < M; m++)
        quantize_row_k(x + m * K, K, q_out + m * K, qp, d_out + m * (K / QKK), bsums_out + m * (K / QKK) * 16, bs2);
    free(qp);
    free(bs2);
    return 0;
}
