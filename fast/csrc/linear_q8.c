/* y = x @ W.T computed as llama.cpp's CPU backend computes it: the fast engine's --compute q8.
 *
 * W: [N, K] in GGUF block layout (Q8_0 (8), Q4_0 (2), Q5_0 (6): ggml-common.h's block_q8_0 / block_q4_0 /
 * block_q5_0), x: [M, K] float32 row-major, y: [M, N] float32 row-major.
 *
 * What it computes (docs/quantized-activations.md; the weight types whose vec_dot_type is Q8_0 in ggml-cpu.c's
 * type_traits_cpu):
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
} job_t;

static void run_rows(void *p, long run, int tid) {
    job_t *j = p;
    (void)tid;
    const long n1 = (run + 1) * j->per_run < j->N ? (run + 1) * j->per_run : j->N;
    long n = run * j->per_run;
#if defined(Q8_X86)
    if (j->pairs)
        for (; n + 1 < n1; n += 2)
            row2_vnni(j->type, j->ts, j->w + n * j->row_bytes, j->row_bytes, j->nb, j->x, j->K, j->M, j->y + n, j->N);
#endif
    for (; n < n1; n++)
        j->row(j->type, j->ts, j->w + n * j->row_bytes, j->row_bytes, j->nb, j->x, j->K, j->M, j->y + n, j->N);
}

static long type_bytes(int type) { return type == 8 ? 34 : type == 2 ? 18 : type == 6 ? 22 : 0; }

/* y[M, N] = x[M, K] @ W.T as llama.cpp computes it (the header). Returns 0; -1 unknown type; -2 bad shape;
 * -3 out of memory. */
int g4h_q8_linear(int type, const uint8_t *w, long row_bytes, long N, long K, const float *x, long M, float *y,
                  int nthreads) {
    const long ts = type_bytes(type);
    if (!ts) return -1;
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
