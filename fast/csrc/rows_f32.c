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
