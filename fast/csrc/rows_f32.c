/* Row-wise float32 operations of a CPU decode step, compiled by fast/cpu_kernels.py on first use.
 *
 * Why: in a decode step each of these runs on a few rows of a few hundred to a few thousand values, where torch's
 * composite F.rms_norm (pow, mean, add, rsqrt, two multiplies: six dispatches) costs 9-15 us a call against
 * ~1 us of arithmetic; a Gemma 3 270M step makes 109 of them (figures in fast/cpu_kernels.py).
 *
 * g4h_rms_norm_f32: y[r, i] = (x[r, i] * s_r) * w[i] (w NULL: x[r, i] * s_r), each product rounded to float32
 * (compiled with -ffp-contract=off: nothing is fused), where
 *   s_r = (float)(1 / sqrt(ss_r / n + eps)), computed in double and rounded once to float32, and
 *   ss_r = sum of x[r, i]^2 in double: each square is exact in double (a float32 has 24 significant bits);
 *   lane l (l < 8) adds the squares of i = l, l + 8, l + 16, ... in order, starting at +0.0; then the fixed tree
 *   B_l = A_l + A_{l+4} (l < 4), C_l = B_l + B_{l+2} (l < 2), ss = C_0 + C_1.
 * The formula is the reference's rms_norm (reference/model.py), the float64 sum of squares making the scale more
 * accurate than a float32 mean; the order is fixed, so a row's result depends on that row only (neighbour
 * isolation, docs/design.md), whatever the number of rows. tests/test_ops.py replays it in NumPy bit for bit.
 */
#include <math.h>
#include <stddef.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void g4h_rms_norm_f32(const float *x, const float *w, float *y, long rows, long n, double eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        long i = 0;
        for (; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; l++) a[l] += (double)xr[i + l] * (double)xr[i + l];
        for (int l = 0; i + l < n; l++) a[l] += (double)xr[i + l] * (double)xr[i + l];
        for (int l = 0; l < 4; l++) a[l] += a[l + 4];
        for (int l = 0; l < 2; l++) a[l] += a[l + 2];
        const float s = (float)(1.0 / sqrt((a[0] + a[1]) / (double)n + eps));
        if (w)
            for (long k = 0; k < n; k++) yr[k] = (xr[k] * s) * w[k];
        else
            for (long k = 0; k < n; k++) yr[k] = xr[k] * s;
    }
}

/* g4h_softcap_f32: y[i] = cap * tanh(x[i] / cap), evaluated in double and rounded once to float32 (Gemma's final
 * logit soft-cap: transformers Gemma4ForCausalLM.forward; llama.cpp's llm_graph ... ggml_tanh between two scales).
 * With t = x / cap and a = min(|t|, 20) (tanh(20) is 1 in double; a NaN takes the last branch below):
 *   a < 1/8:  tanh(a) = a (1 - a^2/3 + 2a^4/15 - 17a^6/315 + 62a^8/2835 - 1382a^10/155925) (Taylor; the first
 *             term left out, 21844a^13/6081075, is below 1e-13 of the value);
 *   else:     tanh(a) = 1 - 2 / (e + 1), e = exp(2a) = (sum_{k<=14} r^k / k!)^(2^6), r = 2a / 64 <= 0.625 (the
 *             series' remainder is below 1e-15, the six squarings multiply the relative error by 64).
 * Then the sign of t back (so -0 stays -0), y = (float)(cap * tanh(t)); NaN in, NaN out; +-Inf gives +-cap.
 * The double value is within 1e-13 relative of tanh's, so y is the correctly rounded float32 of
 * cap * tanh(x / cap) or, where that lies within 1e-13 of a rounding boundary, one ulp from it (torch's float32
 * tanh, Sleef's 1-ulp one, then x / cap and * cap each rounded, is no closer). Branch-free, so the compiler
 * vectorises it (8 doubles a register with AVX-512): an element's value never depends on its neighbours. */
static const double INV[15] = {0, 1.0, 1.0 / 2, 1.0 / 3, 1.0 / 4, 1.0 / 5, 1.0 / 6, 1.0 / 7, 1.0 / 8, 1.0 / 9,
                                1.0 / 10, 1.0 / 11, 1.0 / 12, 1.0 / 13, 1.0 / 14};

void g4h_softcap_f32(const float *x, float *y, long n, double cap) {
    for (long i = 0; i < n; i++) {
        const double t = (double)x[i] / cap;
        const double a0 = fabs(t), a = a0 < 20.0 ? a0 : 20.0;
        const double z = a * a;
        const double small =
            a * (1.0 + z * (-1.0 / 3 + z * (2.0 / 15 + z * (-17.0 / 315 + z * (62.0 / 2835 + z * (-1382.0 / 155925))))));
        const double r = a * (2.0 / 64);
        double e = 1.0; /* Horner: 1 + r/1 (1 + r/2 (1 + ... (1 + r/14))), 1/k rounded to double */
        _Pragma("GCC unroll 14") for (int k = 14; k >= 1; k--) e = 1.0 + r * INV[k] * e;
        e *= e; e *= e; e *= e; e *= e; e *= e; e *= e;
        const double big = 1.0 - 2.0 / (e + 1.0);
        const double th = a < 0.125 ? small : big;
        const double v = copysign(th, t);
        y[i] = t != t ? (float)t : (float)(cap * v);
    }
}

/* g4h_argmax_f32: out[r] = the first index of the largest value of row r of x [rows, n] (n < 2^31), as torch.argmax
 * gives it for a row of finite values; returns 1 when every value of x is finite, else 0 (then out[] is
 * meaningless: the caller raises). One pass in 16 lanes: lane l keeps the largest value of i = l, l + 16, ... and
 * the first index it was seen at; the lanes' largest value, then the smallest index among the lanes holding it.
 * With AVX-512 the pass is written with intrinsics (the same lanes, one register each). */
int g4h_argmax_f32(const float *x, long rows, long n, long *out) {
    int finite = 1;
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float m[16];
        int idx[16], bad[16];
        for (int l = 0; l < 16; l++) {
            m[l] = -INFINITY;
            idx[l] = -1;
            bad[l] = 0;
        }
        long i = 0;
#if defined(__AVX512F__)
        if (n >= 16) { /* the same lanes in one register each: m, idx, and the lanes that saw a non-finite value */
            __m512 vm = _mm512_set1_ps(-INFINITY);
            __m512i vi = _mm512_set1_epi32(-1), at16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                           13, 14, 15);
            const __m512i step = _mm512_set1_epi32(16);
            const __m512 fmax = _mm512_set1_ps(3.4028234663852886e38f);
            __mmask16 nonfinite = 0;
            for (; i + 16 <= n; i += 16) {
                const __m512 v = _mm512_loadu_ps(xr + i);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vm, _CMP_GT_OQ);
                vm = _mm512_mask_mov_ps(vm, gt, v);
                vi = _mm512_mask_mov_epi32(vi, gt, at16);
                nonfinite |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), fmax, _CMP_NLE_UQ);
                at16 = _mm512_add_epi32(at16, step);
            }
            _mm512_storeu_ps(m, vm);
            _mm512_storeu_si512(idx, vi);
            for (int l = 0; l < 16; l++) bad[l] = (nonfinite >> l) & 1;
        }
#endif
        for (; i + 16 <= n; i += 16)
            for (int l = 0; l < 16; l++) {
                const float v = xr[i + l];
                const int gt = v > m[l];
                m[l] = gt ? v : m[l];
                idx[l] = gt ? (int)(i + l) : idx[l];
                bad[l] |= !(fabsf(v) <= 3.4028234663852886e38f);
            }
        for (int l = 0; i + l < n; l++) {
            const float v = xr[i + l];
            if (v > m[l]) {
                m[l] = v;
                idx[l] = (int)(i + l);
            }
            bad[l] |= !(fabsf(v) <= 3.4028234663852886e38f);
        }
        float best = -INFINITY;
        long at = 0;
        for (int l = 0; l < 16; l++) {
            finite &= !bad[l];
            if (m[l] > best || (m[l] == best && idx[l] >= 0 && idx[l] < at)) {
                best = m[l];
                at = idx[l];
            }
        }
        out[r] = at;
    }
    return finite;
}
