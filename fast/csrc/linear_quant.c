/* y = x @ dequant(W).T and row gathers for GGUF-packed weights on the CPU: the packed decode kernels of fast/.
 *
 * W: [N, K] in GGUF block layout (row n = K / bs blocks of ts bytes; ggml-common.h's block_* structs, the
 * table in fast/quants.py), x: [M, K] float32 row-major, y: [M, N] float32 row-major. Types (GGML numbers):
 * Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14).
 *
 * How: decode is bound by reading W. Q8_0, Q4_0, Q5_0, Q4_K and Q6_K (the fused kernels, fused_* below): a
 * register block of R rows of W (R = 4 at M <= 2, else 2) against up to 8 rows of x; each group of 16 weights is
 * decoded into one vector and multiplied at once into the accumulators of every row of x, over K in chunks that
 * keep the x chunk in L1. The R rows come from R long sequential streams (W's rows cut in R contiguous parts,
 * walked row by row: qlinear_fused_run), which the hardware prefetchers follow; at more than two rows of x, where
 * the multiply-adds bound it, each block first prefetches the next row of its R streams (the prefetchers fell
 * behind there: the same product from memory ran 20-45 % slower than from L2; measured at M = 8, 1 thread, on the
 * four fused types, now within 15 % of L2). The other types: threads claim
 * runs of tiles of adjacent rows (~64 KB each); for each tile a chunk of K of R rows is dequantized into a small
 * float buffer that stays in L1, then an M x R register-blocked multiply-add runs over it (tiles of 16 rows keep
 * the x chunk in L1 while 16 weight rows pass when x does not fit in L1 whole). Either way every packed byte is
 * read from memory once per call whatever M is, and each weight is dequantized once per call and M-block.
 *
 * Numerics (no activation quantization: x stays float32):
 * - Dequantization gives gguf.quants' value for every weight, bit for bit: the fp16 fields widened to float32
 *   (F16C, or an exact software conversion), then the same float32 operations in the same order, each
 *   rounded once (compiled with -ffp-contract=off, so the compiler fuses nothing; the only explicit fusions
 *   are where the product is exact, so the value is the same: EXACT below):
 *   Q8_0 d*q; Q4_0 d*(q-8); Q5_0 d*(q-16); Q4_1/Q5_1 (d*q)+m; Q4_K/Q5_K (d*sc)*q-(dmin*m); Q6_K (d*sc)*(q-32).
 *   The 4- and 5-bit types look their values up in a 16- or 32-entry table built with exactly those
 *   operations for each scale (a permute), the others convert the integer and multiply.
 * - Accumulation order, the same for every output y[m, n] whatever M is, whatever the other rows of x hold,
 *   however the rows are split among threads and whichever ISA path below is compiled: 16 lanes
 *   A_l (l = 0..15) start at +0.0; for g = 0, 1, ..., K/16 - 1 in order, A_l = fma(w[n, 16g + l], x[m, 16g + l], A_l)
 *   (one rounding: a fused multiply-add); then the lanes are summed as a fixed tree:
 *   B_i = A_i + A_{i+8} (i < 8), C_i = B_i + B_{i+4} (i < 4), D_i = C_i + C_{i+2} (i < 2), y[m, n] = D_0 + D_1.
 *   Rows of a batch are therefore bit-identical to the same rows alone (neighbour isolation, docs/design.md).
 *
 * ISA paths (chosen at compile time; the build uses -march=native and the cache is keyed by the CPU's flags):
 * AVX-512 (F, BW, VL), AVX2 + FMA + F16C, or plain C (fmaf). All three give the same bits.
 * -DG4H_QK_GENERIC forces plain C, -DG4H_QK_NO512 skips AVX-512 (the tests compare the paths).
 * Threads: workpool.h (the caller and up to nthreads - 1 workers claim runs of packed bytes, ~256 KB (fused), ~64 KB;
 * nthreads from the caller, torch.get_num_threads()); which thread computes an output never changes it.
 * Sources of the formats: ggml-common.h (block_q4_0 ... block_q6_K), gguf-py's gguf/quants.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#include "workpool.h"

#if !defined(G4H_QK_GENERIC) && !defined(G4H_QK_NO512) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define ISA_AVX512 1
#elif !defined(G4H_QK_GENERIC) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA_AVX2 1
#endif
#if defined(ISA_AVX512) || defined(ISA_AVX2)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ scalars */

/* the fp16 at p widened (fp16.h's exact conversion, or F16C's: the same bits) */
static inline float f16_to_f32(const uint8_t *p) {
#if defined(ISA_AVX512) || defined(ISA_AVX2)
    return _cvtsh_ss((uint16_t)(p[0] | (p[1] << 8)));
#else
    return g4h_f16_load(p);
#endif
}

/* ------------------------------------------------------------------ 16-lane vectors: V (float), VI (int32) */

#if defined(ISA_AVX512)
#define MBMAX 8
typedef __m512 V;
typedef __m512i VI;
static inline V v_zero(void) { return _mm512_setzero_ps(); }
static inline V v_set1(float f) { return _mm512_set1_ps(f); }
/* the fp16 at p (little-endian) widened to float32 in every lane: broadcast, then one vector conversion */
static inline V v_set1_f16(const uint8_t *p) {
    int16_t h;
    memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16(h));
}
static inline V v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, V v) { _mm512_storeu_ps(p, v); }
static inline V v_fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V v_mul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V v_add(V a, V b) { return _mm512_add_ps(a, b); }
static inline V v_sub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V v_cvt(VI a) { return _mm512_cvtepi32_ps(a); }
static inline VI vi_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline VI vi_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline VI vi_srl(VI a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
static inline VI vi_sll(VI a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
static inline VI vi_and(VI a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
static inline VI vi_or(VI a, VI b) { return _mm512_or_si512(a, b); }
static inline VI vi_subc(VI a, int c) { return _mm512_sub_epi32(a, _mm512_set1_epi32(c)); }
/* t[idx & 15] per lane */
static inline V v_lut16(V t, VI idx) { return _mm512_permutexvar_ps(idx, t); }
/* lane i: bit i of hi set ? t1[idx & 15] : t0[idx & 15] */
static inline V v_lut16x2(V t0, V t1, VI idx, unsigned hi) {
    return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx, t0), (__mmask16)hi, idx, t1);
}
/* bit i = bit s of p[i], i < 16 */
static inline unsigned bits16(const uint8_t *p, int s) {
    return _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)(1 << s)));
}
/* out[j] = d * (float)q[j], j < 8 (q unsigned bytes); j < 16 (q signed bytes): one rounding each */
static inline void scale8_u8(const uint8_t *q, float d, float *out) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), f));
}
static inline void scale16_i8(const uint8_t *q, float d, float *out) { v_store(out, v_mul(v_set1(d), v_cvt(vi_i8(q)))); }
static inline float v_hsum(V v) {
    __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

#elif defined(ISA_AVX2)
#define MBMAX 4
typedef struct { __m256 a, b; } V;   /* lanes 0-7, 8-15 */
typedef struct { __m256i a, b; } VI;
static inline V v_zero(void) { return (V){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V v_set1(float f) { return (V){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline V v_set1_f16(const uint8_t *p) {
    int16_t h;
    memcpy(&h, p, 2);
    __m256 f = _mm256_cvtph_ps(_mm_set1_epi16(h));
    return (V){f, f};
}
static inline V v_load(const float *p) { return (V){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, V v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline V v_fma(V a, V b, V c) { return (V){_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
static inline V v_mul(V a, V b) { return (V){_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
static inline V v_add(V a, V b) { return (V){_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
static inline V v_sub(V a, V b) { return (V){_mm256_sub_ps(a.a, b.a), _mm256_sub_ps(a.b, b.b)}; }
static inline V v_cvt(VI a) { return (V){_mm256_cvtepi32_ps(a.a), _mm256_cvtepi32_ps(a.b)}; }
static inline VI vi_u8(const uint8_t *p) {
    return (VI){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline VI vi_i8(const uint8_t *p) {
    return (VI){_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline VI vi_srl(VI a, int n) {
    __m128i c = _mm_cvtsi32_si128(n);
    return (VI){_mm256_srl_epi32(a.a, c), _mm256_srl_epi32(a.b, c)};
}
static inline VI vi_sll(VI a, int n) {
    __m128i c = _mm_cvtsi32_si128(n);
    return (VI){_mm256_sll_epi32(a.a, c), _mm256_sll_epi32(a.b, c)};
}
static inline VI vi_and(VI a, int m) {
    __m256i c = _mm256_set1_epi32(m);
    return (VI){_mm256_and_si256(a.a, c), _mm256_and_si256(a.b, c)};
}
static inline VI vi_or(VI a, VI b) { return (VI){_mm256_or_si256(a.a, b.a), _mm256_or_si256(a.b, b.b)}; }
static inline VI vi_subc(VI a, int c) {
    __m256i k = _mm256_set1_epi32(c);
    return (VI){_mm256_sub_epi32(a.a, k), _mm256_sub_epi32(a.b, k)};
}
static inline __m256 lut16_half(V t, __m256i i) { /* permutevar8x32 reads bits 0-2; bit 3 picks the half */
    __m256 lo = _mm256_permutevar8x32_ps(t.a, i), hi = _mm256_permutevar8x32_ps(t.b, i);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline V v_lut16(V t, VI idx) { return (V){lut16_half(t, idx.a), lut16_half(t, idx.b)}; }
static inline __m256 bitmask8(unsigned bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel));
}
static inline V v_lut16x2(V t0, V t1, VI idx, unsigned hi) {
    V a = v_lut16(t0, idx), b = v_lut16(t1, idx);
    return (V){_mm256_blendv_ps(a.a, b.a, bitmask8(hi & 0xffu)), _mm256_blendv_ps(a.b, b.b, bitmask8((hi >> 8) & 0xffu))};
}
static inline unsigned bits16(const uint8_t *p, int s) { /* move bit s of each byte to bit 7, gather bit 7s */
    __m128i v = _mm_sll_epi16(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128(7 - s));
    return (unsigned)_mm_movemask_epi8(v) & 0xffffu;
}
static inline void scale8_u8(const uint8_t *q, float d, float *out) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), f));
}
static inline void scale16_i8(const uint8_t *q, float d, float *out) { v_store(out, v_mul(v_set1(d), v_cvt(vi_i8(q)))); }
static inline float v_hsum(V v) {
    __m256 b = _mm256_add_ps(v.a, v.b);
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

#else /* plain C: the definition the vector paths reproduce */
#define MBMAX 4
typedef struct { float f[16]; } V;
typedef struct { int32_t i[16]; } VI;
#define LANES for (int l = 0; l < 16; l++)
static inline V v_zero(void) { V r; LANES r.f[l] = 0.0f; return r; }
static inline V v_set1(float f) { V r; LANES r.f[l] = f; return r; }
static inline V v_set1_f16(const uint8_t *p) { return v_set1(f16_to_f32(p)); }
static inline V v_load(const float *p) { V r; memcpy(r.f, p, sizeof r.f); return r; }
static inline void v_store(float *p, V v) { memcpy(p, v.f, sizeof v.f); }
static inline V v_fma(V a, V b, V c) { V r; LANES r.f[l] = fmaf(a.f[l], b.f[l], c.f[l]); return r; }
static inline V v_mul(V a, V b) { V r; LANES r.f[l] = a.f[l] * b.f[l]; return r; }
static inline V v_add(V a, V b) { V r; LANES r.f[l] = a.f[l] + b.f[l]; return r; }
static inline V v_sub(V a, V b) { V r; LANES r.f[l] = a.f[l] - b.f[l]; return r; }
static inline V v_cvt(VI a) { V r; LANES r.f[l] = (float)a.i[l]; return r; }
static inline VI vi_u8(const uint8_t *p) { VI r; LANES r.i[l] = p[l]; return r; }
static inline VI vi_i8(const uint8_t *p) { VI r; LANES r.i[l] = (int8_t)p[l]; return r; }
static inline VI vi_srl(VI a, int n) { VI r; LANES r.i[l] = (int32_t)((uint32_t)a.i[l] >> n); return r; }
static inline VI vi_sll(VI a, int n) { VI r; LANES r.i[l] = (int32_t)((uint32_t)a.i[l] << n); return r; }
static inline VI vi_and(VI a, int m) { VI r; LANES r.i[l] = a.i[l] & m; return r; }
static inline VI vi_or(VI a, VI b) { VI r; LANES r.i[l] = a.i[l] | b.i[l]; return r; }
static inline VI vi_subc(VI a, int c) { VI r; LANES r.i[l] = a.i[l] - c; return r; }
static inline V v_lut16(V t, VI idx) { V r; LANES r.f[l] = t.f[idx.i[l] & 15]; return r; }
static inline V v_lut16x2(V t0, V t1, VI idx, unsigned hi) {
    V r;
    LANES r.f[l] = ((hi >> l) & 1u) ? t1.f[idx.i[l] & 15] : t0.f[idx.i[l] & 15];
    return r;
}
static inline unsigned bits16(const uint8_t *p, int s) {
    unsigned r = 0;
    for (int l = 0; l < 16; l++) r |= (unsigned)((p[l] >> s) & 1) << l;
    return r;
}
static inline void scale8_u8(const uint8_t *q, float d, float *out) {
    for (int j = 0; j < 8; j++) out[j] = d * (float)q[j];
}
static inline void scale16_i8(const uint8_t *q, float d, float *out) {
    for (int j = 0; j < 16; j++) out[j] = d * (float)(int8_t)q[j];
}
static inline float v_hsum(V v) {
    float b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = v.f[i] + v.f[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    for (int i = 0; i < 2; i++) d[i] = c[i] + c[i + 2];
    return d[0] + d[1];
}
#endif

/* ------------------------------------------------------------------ dequantization of whole blocks
 *
 * EXACT: where gguf-py multiplies and then adds (Q4_1, Q5_1: d*q + m; Q4_K, Q5_K: (d*sc)*q - dmin*m), the
 * product is exact in float32, so one fused multiply-add rounds exactly once at the same place as the two
 * separate operations and gives the same value: d is an fp16 (11 significant bits), sc and m are 6-bit
 * integers, so d*sc and dmin*m have at most 17 significant bits (exact, and no float32 overflow or underflow
 * from fp16 inputs), and times q (at most 5 bits) at most 22 bits, under float32's 24; d*q for Q4_1/Q5_1
 * has at most 16. Inf and NaN scales give Inf and NaN the same way (NaN payloads aside, as everywhere).
 * The tables therefore take one fma where gguf-py's order would take two instructions.
 */

static const float IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const float IOTA16[16] = {16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
static const float IOTA_M8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const float IOTA_M16[16] = {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1};

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Q8_0: d f16, qs[32] int8; y = d * q */
static void deq_q8_0(const uint8_t *b, long nb, float *out) {
    for (long i = 0; i < nb; i++, b += 34, out += 32) {
        V d = v_set1(f16_to_f32(b));
        v_store(out, v_mul(d, v_cvt(vi_i8(b + 2))));
        v_store(out + 16, v_mul(d, v_cvt(vi_i8(b + 18))));
    }
}

/* Q4_0: d f16, qs[16]; y[j] = low nibble of qs[j], y[j+16] = high nibble; y = d * (q - 8) */
static void deq_q4_0(const uint8_t *b, long nb, float *out) {
    const V io = v_load(IOTA_M8);
    for (long i = 0; i < nb; i++, b += 18, out += 32) {
        V t = v_mul(v_set1(f16_to_f32(b)), io);
        VI q = vi_u8(b + 2);
        v_store(out, v_lut16(t, q));
        v_store(out + 16, v_lut16(t, vi_srl(q, 4)));
    }
}

/* Q4_1: d f16, m f16, qs[16] (as Q4_0); y = (d * q) + m */
static void deq_q4_1(const uint8_t *b, long nb, float *out) {
    const V io = v_load(IOTA);
    for (long i = 0; i < nb; i++, b += 20, out += 32) {
        V t = v_fma(v_set1(f16_to_f32(b)), io, v_set1(f16_to_f32(b + 2))); /* d*q exact: see EXACT above */
        VI q = vi_u8(b + 4);
        v_store(out, v_lut16(t, q));
        v_store(out + 16, v_lut16(t, vi_srl(q, 4)));
    }
}

/* Q5_0: d f16, qh uint32 (bit j = bit 4 of y[j]), qs[16] (low 4 bits, as Q4_0); y = d * (q - 16) */
static void deq_q5_0(const uint8_t *b, long nb, float *out) {
    const V lo = v_load(IOTA_M16), hi = v_load(IOTA);
    for (long i = 0; i < nb; i++, b += 22, out += 32) {
        V d = v_set1(f16_to_f32(b));
        V t0 = v_mul(d, lo), t1 = v_mul(d, hi);
        uint32_t qh = le32(b + 2);
        VI q = vi_u8(b + 6);
        v_store(out, v_lut16x2(t0, t1, q, qh & 0xffffu));
        v_store(out + 16, v_lut16x2(t0, t1, vi_srl(q, 4), qh >> 16));
    }
}

/* Q5_1: d f16, m f16, qh, qs[16] (as Q5_0); y = (d * q) + m */
static void deq_q5_1(const uint8_t *b, long nb, float *out) {
    const V lo = v_load(IOTA), hi = v_load(IOTA16);
    for (long i = 0; i < nb; i++, b += 24, out += 32) {
        V d = v_set1(f16_to_f32(b)), m = v_set1(f16_to_f32(b + 2));
        V t0 = v_fma(d, lo, m), t1 = v_fma(d, hi, m); /* d*q exact: see EXACT above */
        uint32_t qh = le32(b + 4);
        VI q = vi_u8(b + 8);
        v_store(out, v_lut16x2(t0, t1, q, qh & 0xffffu));
        v_store(out + 16, v_lut16x2(t0, t1, vi_srl(q, 4), qh >> 16));
    }
}

/* The 12-byte Q4_K / Q5_K scale field -> 8 six-bit scales and 8 six-bit mins (gguf's Q4_K.get_scale_min):
 * bytes 0-3 low 6 bits of scales 0-3, bytes 4-7 of mins 0-3, their top 2 bits the high bits of scales / mins 4-7,
 * bytes 8-11 the low nibbles of scales 4-7 (low half) and mins 4-7 (high half). Four lanes of bytes at a time. */
static inline void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    uint32_t u0 = le32(s), u1 = le32(s + 4), u2 = le32(s + 8);
    uint32_t a = u0 & 0x3f3f3f3fu, b = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    uint32_t c = u1 & 0x3f3f3f3fu, e = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t s64 = (uint64_t)a | (uint64_t)b << 32, m64 = (uint64_t)c | (uint64_t)e << 32; /* byte j = lane j */
    memcpy(sc, &s64, 8);
    memcpy(mn, &m64, 8);
#else
    for (int j = 0; j < 4; j++) {
        sc[j] = (uint8_t)(a >> 8 * j);
        sc[j + 4] = (uint8_t)(b >> 8 * j);
        mn[j] = (uint8_t)(c >> 8 * j);
        mn[j + 4] = (uint8_t)(e >> 8 * j);
    }
#endif
}

/* Q4_K: d, dmin f16, scales[12], qs[128]; qs[32i + j]: low nibble y[64i + j], high nibble y[64i + 32 + j];
 * sub-block s (32 elements): y = (d * sc_s) * q - (dmin * m_s) */
static void deq_q4_k(const uint8_t *b, long nb, float *out) {
    const V io = v_load(IOTA);
    for (long i = 0; i < nb; i++, b += 144, out += 256) {
        uint8_t sc[8], mn[8];
        float dl[8], ml[8];
        scale_min_k4(b + 4, sc, mn);
        scale8_u8(sc, f16_to_f32(b), dl);
        scale8_u8(mn, f16_to_f32(b + 2), ml);
        for (int p = 0; p < 4; p++) {
            const uint8_t *qs = b + 16 + 32 * p;
            V t0 = v_fma(v_set1(dl[2 * p]), io, v_set1(-ml[2 * p])); /* (d*sc)*q exact: see EXACT above */
            V t1 = v_fma(v_set1(dl[2 * p + 1]), io, v_set1(-ml[2 * p + 1]));
            VI qa = vi_u8(qs), qb = vi_u8(qs + 16);
            float *o = out + 64 * p;
            v_store(o, v_lut16(t0, qa));
            v_store(o + 16, v_lut16(t0, qb));
            v_store(o + 32, v_lut16(t1, vi_srl(qa, 4)));
            v_store(o + 48, v_lut16(t1, vi_srl(qb, 4)));
        }
    }
}

/* Q5_K: d, dmin f16, scales[12], qh[32] (bit k of qh[j] = bit 4 of y[32k + j]), qs[128] (as Q4_K) */
static void deq_q5_k(const uint8_t *b, long nb, float *out) {
    const V lo = v_load(IOTA), hi = v_load(IOTA16);
    for (long i = 0; i < nb; i++, b += 176, out += 256) {
        uint8_t sc[8], mn[8];
        float dl[8], ml[8];
        scale_min_k4(b + 4, sc, mn);
        scale8_u8(sc, f16_to_f32(b), dl);
        scale8_u8(mn, f16_to_f32(b + 2), ml);
        const uint8_t *qh = b + 16;
        for (int p = 0; p < 4; p++) {
            const uint8_t *qs = b + 48 + 32 * p;
            VI qa = vi_u8(qs), qb = vi_u8(qs + 16);
            for (int h = 0; h < 2; h++) {
                int s = 2 * p + h;
                V d = v_set1(dl[s]), m = v_set1(-ml[s]);
                V t0 = v_fma(d, lo, m), t1 = v_fma(d, hi, m); /* (d*sc)*q exact: see EXACT above */
                float *o = out + 32 * s;
                v_store(o, v_lut16x2(t0, t1, h ? vi_srl(qa, 4) : qa, bits16(qh, s)));
                v_store(o + 16, v_lut16x2(t0, t1, h ? vi_srl(qb, 4) : qb, bits16(qh + 16, s)));
            }
        }
    }
}

/* Q6_K: ql[128], qh[64], scales[16] int8, d f16. y[128h + 32s + j] (j < 32): low 4 bits
 * (ql[64h + 32(s%2) + j] >> 4(s/2)) & 15, high 2 bits (qh[32h + j] >> 2s) & 3; y = (d * sc[idx/16]) * (q - 32) */
static void deq_q6_k(const uint8_t *b, long nb, float *out) {
    for (long i = 0; i < nb; i++, b += 210, out += 256) {
        float dl[16];
        scale16_i8(b + 192, f16_to_f32(b + 208), dl);
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 4; s++) {
                for (int g = 0; g < 2; g++) {
                    VI lo = vi_u8(b + 64 * h + 32 * (s & 1) + 16 * g);
                    lo = s >= 2 ? vi_srl(lo, 4) : vi_and(lo, 15);
                    VI hi = vi_and(vi_srl(vi_u8(b + 128 + 32 * h + 16 * g), 2 * s), 3);
                    VI q = vi_subc(vi_or(lo, vi_sll(hi, 4)), 32);
                    v_store(out + 128 * h + 32 * s + 16 * g, v_mul(v_set1(dl[8 * h + 2 * s + g]), v_cvt(q)));
                }
            }
        }
    }
}

typedef void (*deq_fn)(const uint8_t *, long, float *);
typedef struct { int type, bs, ts; deq_fn deq; } qtype_t;
static const qtype_t QTYPES[] = {
    {2, 32, 18, deq_q4_0},  {3, 32, 20, deq_q4_1},  {6, 32, 22, deq_q5_0},    {7, 32, 24, deq_q5_1},
    {8, 32, 34, deq_q8_0},  {12, 256, 144, deq_q4_k}, {13, 256, 176, deq_q5_k}, {14, 256, 210, deq_q6_k},
};

static const qtype_t *find_type(int type) {
    for (unsigned i = 0; i < sizeof QTYPES / sizeof QTYPES[0]; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    return NULL;
}

/* ------------------------------------------------------------------ the multiply: float rows x weights */

/* acc[r * lda + j] += sum over groups g < ng of w[r * ldw + 16g ..] * x[j * ldx + 16g ..], lane-wise fma, g in order */
typedef void (*micro_fn)(const float *w, long ldw, const float *x, long ldx, long ng, V *acc, long lda);

#define MICRO(MB, R)                                                                                   \
    static void micro_##MB##_##R(const float *w, long ldw, const float *x, long ldx, long ng, V *acc, \
                                 long lda) {                                                           \
        V a[R][MB];                                                                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < MB; j++) a[r][j] = acc[r * lda + j];           \
        for (long g = 0; g < ng; g++) {                                                                \
            V wv[R];                                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = v_load(w + r * ldw + 16 * g);  \
            _Pragma("GCC unroll 8") for (int j = 0; j < MB; j++) {                                     \
                V xv = v_load(x + j * ldx + 16 * g);                                                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a[r][j] = v_fma(wv[r], xv, a[r][j]); \
            }                                                                                          \
        }                                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < MB; j++) acc[r * lda + j] = a[r][j];           \
    }

MICRO(1, 4)
MICRO(1, 1) MICRO(2, 1) MICRO(3, 1) MICRO(4, 1)
MICRO(1, 2) MICRO(2, 2) MICRO(3, 2) MICRO(4, 2)
#if MBMAX == 8
MICRO(5, 1) MICRO(6, 1) MICRO(7, 1) MICRO(8, 1)
MICRO(5, 2) MICRO(6, 2) MICRO(7, 2) MICRO(8, 2)
static const micro_fn MICRO_R1[9] = {0, micro_1_1, micro_2_1, micro_3_1, micro_4_1, micro_5_1, micro_6_1, micro_7_1, micro_8_1};
static const micro_fn MICRO_R2[9] = {0, micro_1_2, micro_2_2, micro_3_2, micro_4_2, micro_5_2, micro_6_2, micro_7_2, micro_8_2};
static int rows_at_once(long M) { return M == 1 ? 4 : 2; }
#else
static const micro_fn MICRO_R1[5] = {0, micro_1_1, micro_2_1, micro_3_1, micro_4_1};
static const micro_fn MICRO_R2[5] = {0, micro_1_2, micro_2_2, micro_3_2, micro_4_2};
static int rows_at_once(long M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }
#endif

/* ------------------------------------------------------------------ fused kernels: dequantize in registers
 *
 * For Q8_0, Q4_0, Q5_0, Q4_K and Q6_K the weights never go through the L1 buffer: each group of 16 weights of a
 * row is decoded into one vector (the same float values as the deq_* functions give, by the same operations),
 * and multiplied at once into the accumulators of every row of x in the register block. Everything else (the
 * order of the fused multiply-adds per lane, the tree at the end) is the header's: per output, lane l adds
 * w[16g + l] * x[16g + l] for g = 0, 1, ... in order. fused_<type>_<MB>_<R>: MB rows of x, R rows of W, over
 * nb whole blocks starting at w (row r at w + r * rb) and x (row j at x + j * ldx); acc as in micro_*.
 */

#define FZ_LOAD(R, MB)                                                                                    \
    V a[R][MB];                                                                                          \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int j = 0; j < MB; j++) a[r][j] = acc[r * lda + j];
#define FZ_STORE(R, MB)                                                                                   \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int j = 0; j < MB; j++) acc[r * lda + j] = a[r][j];
/* a[r][j] += w[r] * x[j, off .. off + 15] for every row r of W and j of x: each x vector loaded once for the R rows
 * (one load per multiply-add would take as many load slots as there are multiply-add slots) */
#define FZ_ACC(MB, R, w, off)                                                                             \
    do {                                                                                                 \
        _Pragma("GCC unroll 16") for (int j = 0; j < MB; j++) {                                          \
            const V x_ = v_load(x + j * ldx + (off));                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a[r][j] = v_fma(w[r], x_, a[r][j]);      \
        }                                                                                                \
    } while (0)

typedef void (*fused_fn)(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, long lda);

#define FUSED_Q8_0(MB, R)                                                                                 \
    static void fused_q8_0_##MB##_##R(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, \
                                      long lda) {                                                        \
        FZ_LOAD(R, MB)                                                                                   \
        for (long i = 0; i < nb; i++, x += 32) {                                                         \
            V d[R];                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) d[r] = v_set1_f16(w + r * rb + 34 * i);      \
            V g[R];                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_mul(d[r], v_cvt(vi_i8(w + r * rb + 34 * i + 2))); \
            FZ_ACC(MB, R, g, 0);                                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_mul(d[r], v_cvt(vi_i8(w + r * rb + 34 * i + 18))); \
            FZ_ACC(MB, R, g, 16);                                                                        \
        }                                                                                                \
        FZ_STORE(R, MB)                                                                                  \
    }

#define FUSED_Q4_0(MB, R)                                                                                 \
    static void fused_q4_0_##MB##_##R(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, \
                                      long lda) {                                                        \
        const V io = v_load(IOTA_M8);                                                                    \
        FZ_LOAD(R, MB)                                                                                   \
        for (long i = 0; i < nb; i++, x += 32) {                                                         \
            V t[R];                                                                                      \
            VI q[R];                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                        \
                t[r] = v_mul(v_set1_f16(w + r * rb + 18 * i), io);                                            \
                q[r] = vi_u8(w + r * rb + 18 * i + 2);                                                   \
            }                                                                                            \
            V g[R];                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t[r], q[r]);              \
            FZ_ACC(MB, R, g, 0);                                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t[r], vi_srl(q[r], 4));   \
            FZ_ACC(MB, R, g, 16);                                                                        \
        }                                                                                                \
        FZ_STORE(R, MB)                                                                                  \
    }

#define FUSED_Q5_0(MB, R)                                                                                 \
    static void fused_q5_0_##MB##_##R(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, \
                                      long lda) {                                                        \
        const V lo = v_load(IOTA_M16), hi = v_load(IOTA);                                                \
        FZ_LOAD(R, MB)                                                                                   \
        for (long i = 0; i < nb; i++, x += 32) {                                                         \
            V t0[R], t1[R];                                                                              \
            VI q[R];                                                                                     \
            uint32_t qh[R];                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                        \
                const uint8_t *b = w + r * rb + 22 * i;                                                  \
                V d = v_set1_f16(b);                                                                     \
                t0[r] = v_mul(d, lo);                                                                    \
                t1[r] = v_mul(d, hi);                                                                    \
                qh[r] = le32(b + 2);                                                                     \
                q[r] = vi_u8(b + 6);                                                                     \
            }                                                                                            \
            V g[R];                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16x2(t0[r], t1[r], q[r], qh[r] & 0xffffu); \
            FZ_ACC(MB, R, g, 0);                                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                          \
                g[r] = v_lut16x2(t0[r], t1[r], vi_srl(q[r], 4), qh[r] >> 16);                            \
            FZ_ACC(MB, R, g, 16);                                                                        \
        }                                                                                                \
        FZ_STORE(R, MB)                                                                                  \
    }

/* Q4_K: per super-block the 8 scale pairs of each row; per pair of sub-blocks p two 16-entry tables
 * t = (d*sc)*q - dmin*m (one fma, EXACT) and the 32 bytes of nibbles; groups 4p .. 4p+3 in order. */
#define FUSED_Q4_K(MB, R)                                                                                 \
    static void fused_q4_k_##MB##_##R(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, \
                                      long lda) {                                                        \
        const V io = v_load(IOTA);                                                                       \
        FZ_LOAD(R, MB)                                                                                   \
        for (long i = 0; i < nb; i++, x += 256) {                                                        \
            float dl[R][8], ml[R][8];                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                        \
                const uint8_t *b = w + r * rb + 144 * i;                                                 \
                uint8_t sc[8], mn[8];                                                                    \
                scale_min_k4(b + 4, sc, mn);                                                             \
                scale8_u8(sc, f16_to_f32(b), dl[r]);                                                     \
                scale8_u8(mn, f16_to_f32(b + 2), ml[r]);                                                 \
            }                                                                                            \
            for (int p = 0; p < 4; p++) {                                                                \
                V t0[R], t1[R];                                                                          \
                VI qa[R], qb[R];                                                                         \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                    \
                    const uint8_t *qs = w + r * rb + 144 * i + 16 + 32 * p;                              \
                    t0[r] = v_fma(v_set1(dl[r][2 * p]), io, v_set1(-ml[r][2 * p]));                       \
                    t1[r] = v_fma(v_set1(dl[r][2 * p + 1]), io, v_set1(-ml[r][2 * p + 1]));               \
                    qa[r] = vi_u8(qs);                                                                   \
                    qb[r] = vi_u8(qs + 16);                                                              \
                }                                                                                        \
                V g[R];                                                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t0[r], qa[r]);        \
                FZ_ACC(MB, R, g, 64 * p);                                                                \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t0[r], qb[r]);        \
                FZ_ACC(MB, R, g, 64 * p + 16);                                                           \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t1[r], vi_srl(qa[r], 4)); \
                FZ_ACC(MB, R, g, 64 * p + 32);                                                           \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g[r] = v_lut16(t1[r], vi_srl(qb[r], 4)); \
                FZ_ACC(MB, R, g, 64 * p + 48);                                                           \
            }                                                                                            \
        }                                                                                                \
        FZ_STORE(R, MB)                                                                                  \
    }

/* Q6_K: the 6-bit values of a super-block made signed bytes q - 32 first (byte vectors, q6_bytes), then per
 * group of 16 the Q8_0 path with the group's scale d*sc. */
typedef uint8_t u8x32 __attribute__((vector_size(32), aligned(1)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(1)));
/* The 256 values q - 32 of a Q6_K block as signed bytes, in element order (deq_q6_k's layout). 16-bit lanes
 * shift two bytes at once; every mask keeps only bits that came from the byte itself. */
static inline void q6_bytes(const uint8_t *b, int8_t *out) {
    const u16x16 m15 = (u16x16){0} + 0x0f0f, m3 = (u16x16){0} + 0x3030;
    const u8x32 c32 = (u8x32){0} + 32;
    for (int h = 0; h < 2; h++) {
        u16x16 l0, l1, q;
        memcpy(&l0, b + 64 * h, 32);
        memcpy(&l1, b + 64 * h + 32, 32);
        memcpy(&q, b + 128 + 32 * h, 32);
        u16x16 y[4] = {(l0 & m15) | ((q << 4) & m3), (l1 & m15) | ((q << 2) & m3),
                       ((l0 >> 4) & m15) | (q & m3), ((l1 >> 4) & m15) | ((q >> 2) & m3)};
        for (int s = 0; s < 4; s++) {
            u8x32 v;
            memcpy(&v, &y[s], 32);
            v -= c32;
            memcpy(out + 128 * h + 32 * s, &v, 32);
        }
    }
}

#define FUSED_Q6_K(MB, R)                                                                                 \
    static void fused_q6_k_##MB##_##R(const uint8_t *w, long rb, long nb, const float *x, long ldx, V *acc, \
                                      long lda) {                                                        \
        FZ_LOAD(R, MB)                                                                                   \
        for (long i = 0; i < nb; i++, x += 256) {                                                        \
            int8_t q[R][256] __attribute__((aligned(64)));                                               \
            float dl[R][16];                                                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                        \
                const uint8_t *b = w + r * rb + 210 * i;                                                 \
                q6_bytes(b, q[r]);                                                                       \
                scale16_i8(b + 192, f16_to_f32(b + 208), dl[r]);                                         \
            }                                                                                            \
            _Pragma("GCC unroll 2") for (int gi = 0; gi < 16; gi++) {                                    \
                V g[R];                                                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                      \
                    g[r] = v_mul(v_set1(dl[r][gi]), v_cvt(vi_i8((const uint8_t *)q[r] + 16 * gi)));      \
                FZ_ACC(MB, R, g, 16 * gi);                                                               \
            }                                                                                            \
        }                                                                                                \
        FZ_STORE(R, MB)                                                                                  \
    }

#define FUSED_ALL(T)                                                                                      \
    T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1)                                       \
    T(1, 2) T(2, 2) T(3, 2) T(4, 2) T(5, 2) T(6, 2) T(7, 2) T(8, 2) T(1, 4) T(2, 4)
#define FUSED_TABLE(name)                                                                                 \
    {{0, name##_1_1, name##_2_1, name##_3_1, name##_4_1, name##_5_1, name##_6_1, name##_7_1, name##_8_1}, \
     {0, name##_1_2, name##_2_2, name##_3_2, name##_4_2, name##_5_2, name##_6_2, name##_7_2, name##_8_2}, \
     {0, name##_1_4, name##_2_4, 0, 0, 0, 0, 0, 0}}
#if defined(ISA_AVX512) || defined(ISA_AVX2) /* plain C keeps the buffer path: the definition, compiled fast */
FUSED_ALL(FUSED_Q8_0)
FUSED_ALL(FUSED_Q4_0)
FUSED_ALL(FUSED_Q5_0)
FUSED_ALL(FUSED_Q4_K)
FUSED_ALL(FUSED_Q6_K)
#define FUSED_MB 8
/* [0: one row of W | 1: two rows | 2: four rows (mb <= 2)][mb] */
static const fused_fn FUSED_Q8_0_T[3][9] = FUSED_TABLE(fused_q8_0);
static const fused_fn FUSED_Q4_0_T[3][9] = FUSED_TABLE(fused_q4_0);
static const fused_fn FUSED_Q5_0_T[3][9] = FUSED_TABLE(fused_q5_0);
static const fused_fn FUSED_Q4_K_T[3][9] = FUSED_TABLE(fused_q4_k);
static const fused_fn FUSED_Q6_K_T[3][9] = FUSED_TABLE(fused_q6_k);
/* Rows of W in a register block: four for one or two rows of x, else two (the accumulators fill the registers). */
static int fused_rows(long m) { return m <= 2 ? 4 : 2; }
static const fused_fn (*fused_for(int type))[9] { /* [3][9] */
    switch (type) {
    case 8: return FUSED_Q8_0_T;
    case 2: return FUSED_Q4_0_T;
    case 6: return FUSED_Q5_0_T;
    case 12: return FUSED_Q4_K_T;
    case 14: return FUSED_Q6_K_T;
    default: return NULL;
    }
}
#else
#define FUSED_MB 8
static int fused_rows(long m) { return m <= 2 ? 4 : 2; }
static const fused_fn (*fused_for(int type))[9] {
    (void)type;
    return NULL;
}
#endif

#define TILE_ROWS 16   /* weight rows sharing one x chunk in L1 when x does not fit there whole */
#define PREFETCH_AHEAD 2048  /* bytes: software prefetch distance in the packed stream (measured: 1-4 KB best) */

static inline void prefetch_range(const uint8_t *p, long n) {
    for (long i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}
#define MAX_M 64

/* Per-thread scratch that grows on demand and is freed when the thread ends (NULL when out of memory). */
typedef struct { void *buf[2]; size_t cap[2]; } scratch_t;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_free(void *p) {
    scratch_t *s = p;
    free(s->buf[0]);
    free(s->buf[1]);
    free(s);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

static void *scratch(int i, size_t n) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ok) return NULL;
    scratch_t *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        if (pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->cap[i] < n) {
        void *p = NULL;
        if (posix_memalign(&p, 64, n) != 0) return NULL;
        free(s->buf[i]);
        s->buf[i] = p;
        s->cap[i] = n;
    }
    return s->buf[i];
}

typedef struct {
    const qtype_t *t;
    const uint8_t *w;
    const float *x;
    float *y;
    long row_bytes, N, K, M, kc, tile, ntiles, run;
    int R;
    const fused_fn (*fused)[9]; /* fused kernels of the type, or NULL: the L1 buffer path */
    _Atomic int err;
} qlinear_job;

/* The fused kernels' layout: the R rows of W in a register block come from R streams, each a contiguous quarter
 * (or half) of W walked row after row (rows ti, ti + Q, ..., ti + (R-1)Q for Q = N / R), so that the weights are
 * read as R long sequential streams, which the hardware prefetchers follow, rather than R adjacent rows side by
 * side, short streams they learn too late (measured: half the read bandwidth at one row of x). The N - R*Q
 * rows left over go one at a time at the end. Which rows share a register block never changes a row's result. */
static void qlinear_fused_run(void *p, long run, int tid) {
    qlinear_job *j = p;
    (void)tid;
    const qtype_t *t = j->t;
    const long bs = t->bs, ts = t->ts, M = j->M, K = j->K, N = j->N, kc = j->kc, rb = j->row_bytes;
    const long S = j->R, Q = N / S;
    V *acc = scratch(1, (size_t)S * M * sizeof(V));
    if (!acc) {
        atomic_store(&j->err, -3);
        return;
    }
    const long t1 = (run + 1) * j->run < j->ntiles ? (run + 1) * j->run : j->ntiles;
    for (long ti = run * j->run; ti < t1; ti++) {
        const int streams = ti < Q;
        const long row0 = streams ? ti : S * Q + (ti - Q), nr = streams ? S : 1, step = streams ? Q * rb : rb;
        for (long i = 0; i < nr * M; i++) acc[i] = v_zero();
        if (M > 2 && streams && ti + 1 < Q) /* compute-bound rows: fetch the next row of each stream now */
            for (long r = 0; r < S; r++) prefetch_range(j->w + (row0 + 1 + r * Q) * rb, rb);
        for (long k0 = 0; k0 < K; k0 += kc) {
            const long kn = K - k0 < kc ? K - k0 : kc;
            const uint8_t *src = j->w + row0 * rb + k0 / bs * ts;
            for (long m0 = 0; m0 < M; m0 += FUSED_MB) {
                const long mb = M - m0 < FUSED_MB ? M - m0 : FUSED_MB;
                j->fused[nr == 4 ? 2 : nr == 2 ? 1 : 0][mb](src, step, kn / bs, j->x + m0 * K + k0, K, acc + m0, M);
            }
        }
        for (long r = 0; r < nr; r++)
            for (long m = 0; m < M; m++) j->y[m * N + row0 + r * (streams ? Q : 1)] = v_hsum(acc[r * M + m]);
    }
}

/* Tiles [run * job->run, ...) of one product: see the header comment for the order of operations. */
static void qlinear_run(void *p, long run, int tid) {
    qlinear_job *j = p;
    (void)tid;
    const qtype_t *t = j->t;
    const long bs = t->bs, ts = t->ts, M = j->M, K = j->K, N = j->N, kc = j->kc, row_bytes = j->row_bytes;
    float *wbuf = scratch(0, (size_t)j->R * kc * sizeof(float));
    V *acc = scratch(1, (size_t)j->tile * M * sizeof(V));
    if (!wbuf || !acc) {
        atomic_store(&j->err, -3);
        return;
    }
    const long t1 = (run + 1) * j->run < j->ntiles ? (run + 1) * j->run : j->ntiles;
    for (long ti = run * j->run; ti < t1; ti++) {
        const long n0 = ti * j->tile, nr = N - n0 < j->tile ? N - n0 : j->tile;
        for (long i = 0; i < nr * M; i++) acc[i] = v_zero();
        for (long k0 = 0; k0 < K; k0 += kc) {
            const long kn = K - k0 < kc ? K - k0 : kc;
            const uint8_t *wb = j->w + n0 * row_bytes + k0 / bs * ts;
            for (long r = 0; r < nr;) {
                const int rr = nr - r >= j->R ? j->R : 1;
                for (int q = 0; q < rr; q++) {
                    const uint8_t *src = wb + (r + q) * row_bytes;
                    prefetch_range(src + PREFETCH_AHEAD, kn / bs * ts);
                    t->deq(src, kn / bs, wbuf + q * kc);
                }
                for (long m0 = 0; m0 < M; m0 += MBMAX) {
                    const long mb = M - m0 < MBMAX ? M - m0 : MBMAX;
                    micro_fn f = rr == 4 ? micro_1_4 : rr == 2 ? MICRO_R2[mb] : MICRO_R1[mb];
                    f(wbuf, kc, j->x + m0 * K + k0, K, kn / 16, acc + r * M + m0, M);
                }
                r += rr;
            }
        }
        for (long r = 0; r < nr; r++)
            for (long m = 0; m < M; m++) j->y[m * N + n0 + r] = v_hsum(acc[r * M + m]);
    }
}

/* y[M, N] = x[M, K] @ dequant(w).T. Returns 0; -1 unknown type; -2 bad shape; -3 out of memory. */
int g4h_qlinear(int type, const uint8_t *w, long row_bytes, long N, long K, const float *x, long M, float *y,
                int nthreads) {
    const qtype_t *t = find_type(type);
    if (!t) return -1;
    if (M < 1 || M > MAX_M || N < 0 || K <= 0 || K % t->bs || row_bytes != K / t->bs * t->ts) return -2;
    if (N == 0) return 0;
    qlinear_job j = {.t = t, .w = w, .x = x, .y = y, .row_bytes = row_bytes, .N = N, .K = K, .M = M};
    j.fused = fused_for(type);
    atomic_init(&j.err, 0);
    /* Small products run on one thread: waking another costs more than it saves. Work ~ weights x (M + 3). */
    if ((double)N * K * (M + 3) < (double)(1 << 20)) nthreads = 1;
    if (j.fused) {
        j.R = fused_rows(M);
        j.kc = (6144 / (M < FUSED_MB ? M : FUSED_MB)) / t->bs * t->bs; /* the x chunk stays <= 24 KB */
        if (j.kc < t->bs) j.kc = t->bs;
        if (j.kc > K) j.kc = K;
        j.ntiles = N / j.R + N % j.R; /* register blocks of R streams, then the rows left over one by one */
        j.run = 262144 / (j.R * row_bytes); /* tiles per run: ~256 KB of packed bytes (64 KB: -25 % at 2 threads) */
        if (j.run < 1) j.run = 1;
        wp_run(qlinear_fused_run, &j, (j.ntiles + j.run - 1) / j.run, nthreads);
        return atomic_load(&j.err);
    }
    j.R = rows_at_once(M);
    j.kc = (4096 / (M > j.R ? M : j.R)) / t->bs * t->bs; /* x chunk and weight buffer stay <= 16 KB each */
    if (j.kc < t->bs) j.kc = t->bs;
    if (j.kc > K) j.kc = K;
    j.tile = M * K * 4 <= 32768 ? j.R : TILE_ROWS;
    j.ntiles = (N + j.tile - 1) / j.tile;
    j.run = 65536 / (j.tile * row_bytes); /* tiles per run: about 64 KB of packed bytes */
    if (j.run < 1) j.run = 1;
    wp_run(qlinear_run, &j, (j.ntiles + j.run - 1) / j.run, nthreads);
    return atomic_load(&j.err);
}

typedef struct {
    const qtype_t *t;
    const uint8_t *w;
    const int64_t *ids; /* NULL: rows r0 + i */
    float *out;
    long row_bytes, K, r0, n, per_run;
} rows_job;

static void rows_run(void *p, long run, int tid) {
    rows_job *j = p;
    (void)tid;
    const long i1 = (run + 1) * j->per_run < j->n ? (run + 1) * j->per_run : j->n;
    for (long i = run * j->per_run; i < i1; i++) {
        const uint8_t *src = j->w + (j->ids ? j->ids[i] : j->r0 + i) * j->row_bytes;
        if (i + 1 < i1) prefetch_range(j->w + (j->ids ? j->ids[i + 1] : j->r0 + i + 1) * j->row_bytes, j->row_bytes);
        j->t->deq(src, j->K / j->t->bs, j->out + i * j->K);
    }
}

static int rows(int type, const uint8_t *w, long row_bytes, long K, const int64_t *ids, long r0, long n, float *out,
                int nthreads) {
    const qtype_t *t = find_type(type);
    if (!t) return -1;
    if (n < 0 || K <= 0 || K % t->bs || row_bytes != K / t->bs * t->ts) return -2;
    rows_job j = {.t = t, .w = w, .ids = ids, .out = out, .row_bytes = row_bytes, .K = K, .r0 = r0, .n = n};
    j.per_run = 65536 / (K * 4); /* about 64 KB of output a run */
    if (j.per_run < 1) j.per_run = 1;
    if (n * K < (1L << 16)) nthreads = 1;
    wp_run(rows_run, &j, (n + j.per_run - 1) / j.per_run, nthreads);
    return 0;
}

/* out[i, :] = dequant(w[ids[i], :]) for i < n (ids already checked to lie in [0, N)). Returns 0, -1, -2. */
int g4h_qtake_rows(int type, const uint8_t *w, long row_bytes, long K, const int64_t *ids, long n, float *out,
                   int nthreads) {
    return rows(type, w, row_bytes, K, ids, 0, n, out, nthreads);
}

/* out[i - r0, :] = dequant(w[i, :]) for r0 <= i < r1: contiguous rows, for the large-M fallback. Returns 0, -1, -2. */
int g4h_qdequant_rows(int type, const uint8_t *w, long row_bytes, long K, long r0, long r1, float *out,
                      int nthreads) {
    if (r0 < 0 || r1 < r0) return -2;
    return rows(type, w, row_bytes, K, NULL, r0, r1 - r0, out, nthreads);
}

/* Which vector path this build took: 512 (AVX-512), 256 (AVX2), 0 (plain C). */
int g4h_qk_isa(void) {
#if defined(ISA_AVX512)
    return 512;
#elif defined(ISA_AVX2)
    return 256;
#else
    return 0;
#endif
}
