// gemm_f64: y = x @ w^T (+ bias) in float64, every output one chain of fused multiply-adds over K,
// in ascending order, from zero, then the bias added. An output's bits depend on its row of x and
// its row of w only: not on how many rows or columns share the call, where they sit, or the
// threads. MKL's dgemm, which PyTorch calls, rounds a column otherwise when the call has another
// number of rows or columns (1 to 7 rows, 1 to 96 columns, measured), so a tensor-parallel rank
// holding some of a layer's columns would not give one process's bits. float64 is the dtype of
// the tests' tiny models; this is fast enough for them, not for a real model.
// Built by kernels/build.py; loaded with ctypes by kernels/linear.py.
#include <algorithm>
#include <cmath>

namespace {
constexpr int MR = 4, NR = 4;  // a tile of outputs: 16 independent chains

template <int ni, int nj>
void tile(const double *x, long ldx, const double *w, long ldw, const double *bias, double *y, long ldy, int K) {
    double acc[MR][NR] = {};
    for (int k = 0; k < K; k++)
        for (int a = 0; a < ni; a++)
            for (int b = 0; b < nj; b++) acc[a][b] = std::fma(x[a * ldx + k], w[b * ldw + k], acc[a][b]);
    for (int a = 0; a < ni; a++)
        for (int b = 0; b < nj; b++) y[a * ldy + b] = bias ? acc[a][b] + bias[b] : acc[a][b];
}

void edge(const double *x, long ldx, const double *w, long ldw, const double *bias, double *y, long ldy, int K,
          int ni, int nj) {
    for (int a = 0; a < ni; a++)
        for (int b = 0; b < nj; b++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++) acc = std::fma(x[a * ldx + k], w[b * ldw + k], acc);
            y[a * ldy + b] = bias ? acc + bias[b] : acc;
        }
}
}  // namespace

extern "C" void gemm_f64(const double *x, long ldx, const double *w, long ldw, const double *bias, double *y,
                         long ldy, int M, int N, int K, int threads) {
    const int blocks = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(M) * N * K >= (1L << 18))
    for (int jb = 0; jb < blocks; jb++) {
        const int j = jb * NR, nj = std::min(NR, N - j);
        const double *wj = w + static_cast<long>(j) * ldw, *bj = bias ? bias + j : nullptr;
        for (int i = 0; i < M; i += MR) {
            const int ni = std::min(MR, M - i);
            const double *xi = x + static_cast<long>(i) * ldx;
            double *yij = y + static_cast<long>(i) * ldy + j;
            if (ni == MR && nj == NR)
                tile<MR, NR>(xi, ldx, wj, ldw, bj, yij, ldy, K);
            else
                edge(xi, ldx, wj, ldw, bj, yij, ldy, K, ni, nj);
        }
    }
}
