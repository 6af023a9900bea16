/* y = x @ w.T in float32 for a few rows of x: the CPU decode kernel of fast/.
 *
 * x: [M, K] row-major, w: [N, K] row-major (a torch Linear weight), y: [M, N].
 * Decode reads every weight once per step and does M multiply-adds per weight,
 * so for small M it is bound by memory bandwidth; a BLAS GEMM at M = 2..16 packs
 * and blocks for large M and reaches a fraction of that. Here each thread walks
 * two weight rows at a time and keeps 2 x MB accumulators of 16 lanes in
 * registers, so the weights stream from memory exactly once.
 *
 * Every output y[m, n] is computed by the same sequence of operations whatever
 * M is and whatever the other rows of x hold (lane-wise fused multiply-adds
 * over k in steps of 16, then a fixed-order sum of the 16 lanes), so a sequence's
 * result does not depend on its neighbours in a batch, bit for bit.
 *
 * Needs K % 16 == 0 and N % 2 == 0 (the Python side checks and falls back).
 */
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum16(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

#define ROWS_BLOCK(MB)                                                                       \
    static void block_##MB(const float *x, const float *w0, const float *w1, float *y,       \
                           long N, long K, long m0, long n) {                                \
        v16 a0[MB], a1[MB];                                                                  \
        for (int j = 0; j < MB; j++) {                                                       \
            a0[j] = (v16){0};                                                                \
            a1[j] = (v16){0};                                                                \
        }                                                                                    \
        for (long k = 0; k < K; k += 16) {                                                   \
            v16 u = load16(w0 + k), v = load16(w1 + k);                                      \
            for (int j = 0; j < MB; j++) {                                                   \
                v16 xv = load16(x + (m0 + j) * K + k);                                       \
                a0[j] += u * xv; /* contracted to one FMA (-ffp-contract=fast) */            \
                a1[j] += v * xv;                                                             \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < MB; j++) {                                                       \
            y[(m0 + j) * N + n] = sum16(a0[j]);                                              \
            y[(m0 + j) * N + n + 1] = sum16(a1[j]);                                          \
        }                                                                                    \
    }

ROWS_BLOCK(1)
ROWS_BLOCK(2)
ROWS_BLOCK(4)
ROWS_BLOCK(6)

void g4h_linear_f32(const float *x, const float *w, float *y, long M, long N, long K, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long n = 0; n < N; n += 2) {
        const float *w0 = w + n * K, *w1 = w + (n + 1) * K;
        long m = 0;
        for (; m + 6 <= M; m += 6) block_6(x, w0, w1, y, N, K, m, n);
        for (; m + 4 <= M; m += 4) block_4(x, w0, w1, y, N, K, m, n);
        for (; m + 2 <= M; m += 2) block_2(x, w0, w1, y, N, K, m, n);
        for (; m < M; m++) block_1(x, w0, w1, y, N, K, m, n);
    }
}
