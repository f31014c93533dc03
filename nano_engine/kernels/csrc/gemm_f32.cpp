// y = x @ W^T (+ bias) in float32 on AVX-512, with the same bits for a row at every row count.
//
// Batch invariance: each output element is one chain of fused multiply-adds over K, ascending,
// from zero (the bias, if any, added once after), whatever the number of rows, the thread count or
// which rows share a register block; work is split over output columns only. Any blocking below
// only decides which chains advance side by side, never the order within one.
//
// The weight is packed once (pack_f32) into panels of 16 output columns, K-major: panel p holds, for
// k = 0 .. K-1, the 16 values W[16p .. 16p + 15][k] (zeros past N), so a step of the chain loads one
// vector of weights and broadcasts one value of x.
//
// Built by kernels/build.py with -march=native: on a CPU without AVX-512 the functions are stubs and
// f32_available() says 0 (kernels/linear.py then keeps oneDNN).
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int MR = 6;  // rows per register block
constexpr int NP = 4;  // panels (of 16 columns) per register block

// Rows m0 .. m0 + R - 1 x panels p0 .. p0 + P - 1: R x P chains of K fused multiply-adds each.
template <int R, int P>
void block(const float *x, long ldx, const float *packed, float *y, long ldy, const float *bias, int m0, int p0,
           int N, int K) {
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const float *w = packed + static_cast<long>(p0) * K * 16;
    const float *a = x + m0 * ldx;
    for (int k = 0; k < K; k++) {
        __m512 wv[P];
        for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_ps(w + (static_cast<long>(p) * K + k) * 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(a[r * ldx + k]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
        }
    }
    for (int p = 0; p < P; p++) {
        const int n0 = 16 * (p0 + p), cols = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, mask, v);
        }
    }
}

using BlockFn = void (*)(const float *, long, const float *, float *, long, const float *, int, int, int, int);

template <int R> BlockFn pick(int P) {
    switch (P) {
    case 1: return block<R, 1>;
    case 2: return block<R, 2>;
    case 3: return block<R, 3>;
    default: return block<R, 4>;
    }
}

BlockFn pick(int R, int P) {
    switch (R) {
    case 1: return pick<1>(P);
    case 2: return pick<2>(P);
    case 3: return pick<3>(P);
    case 4: return pick<4>(P);
    case 5: return pick<5>(P);
    default: return pick<6>(P);
    }
}

}  // namespace

extern "C" int f32_available() { return 1; }

// w: (N, K) row-major; out: ceil(N / 16) panels of K x 16 floats.
extern "C" void pack_f32(const float *w, float *out, int N, int K) {
    const int panels = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int n = 0; n < 16; n++) {
                const int row = 16 * p + n;
                out[(static_cast<long>(p) * K + k) * 16 + n] = row < N ? w[static_cast<long>(row) * K + k] : 0.0f;
            }
}

// x: (M, K) rows of stride ldx; packed from pack_f32; y: (M, N) of stride ldy; bias: N or null.
extern "C" void gemm_f32(const float *x, long ldx, const float *packed, float *y, long ldy, const float *bias, int M,
                         int N, int K, int threads) {
    const int panels = (N + 15) / 16, groups = (panels + NP - 1) / NP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * NP, P = panels - p0 < NP ? panels - p0 : NP;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int R = M - m0 < MR ? M - m0 : MR;
            pick(R, P)(x, ldx, packed, y, ldy, bias, m0, p0, N, K);
        }
    }
}

#else  // no AVX-512 on this CPU: kernels/linear.py never calls these

extern "C" int f32_available() { return 0; }
extern "C" void pack_f32(const float *, float *, int, int) {}
extern "C" void gemm_f32(const float *, long, const float *, float *, long, const float *, int, int, int, int) {}

#endif
