// y = x @ W^T (+ bias) on AVX-512, with the same bits for a row at every row count: float32
// (gemm_f32), and bfloat16 with AVX512_BF16 (gemm_bf16_dot: for CPUs without AMX, such as AMD's
// Zen 4 and 5; where AMX is, gemm_amx.cpp runs instead).
//
// Batch invariance: each output element is one chain of float32 operations over K, ascending,
// from zero (the bias, if any, added once after), whatever the number of rows, the thread count or
// which rows share a register block; work is split over output columns only. Any blocking below
// only decides which chains advance side by side, never the order within one. In gemm_f32 a step
// is one fused multiply-add; in gemm_bf16_dot a step is one vdpbf16ps over a pair of K (see
// block_bf16), and the float32 result is rounded once to bfloat16, to nearest even as PyTorch does.
//
// The weight is packed once into panels of 16 output columns, K-major: panel p holds, for
// k = 0 .. K-1, the 16 values W[16p .. 16p + 15][k] (zeros past N), so a step of the chain loads one
// vector of weights and broadcasts one value of x. pack_f32 stores float32; pack_bf16_pairs stores
// bfloat16 with k and k + 1 interleaved (column n's pair in 32-bit lane n), so one 64-byte load
// carries two steps of 16 chains, as vdpbf16ps takes them.
//
// Built by kernels/build.py with -march=native: on a CPU without AVX-512 the functions are stubs and
// f32_available() says 0 (kernels/linear.py then keeps oneDNN); without AVX512_BF16 the bfloat16
// ones are, and bf16_dot_available() says 0.
#include <cstdint>
#include <cstring>

#include "simd.h"

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

// Which block<R, P> to run for R rows and P panels (one dispatch for both kernels' blocks).
template <class Kernel, int R> typename Kernel::Fn pick_panels(int P) {
    switch (P) {
    case 1: return Kernel::template block<R, 1>;
    case 2: return Kernel::template block<R, 2>;
    case 3: return Kernel::template block<R, 3>;
    default: return Kernel::template block<R, 4>;
    }
}

template <class Kernel> typename Kernel::Fn pick(int R, int P) {
    switch (R) {
    case 1: return pick_panels<Kernel, 1>(P);
    case 2: return pick_panels<Kernel, 2>(P);
    case 3: return pick_panels<Kernel, 3>(P);
    case 4: return pick_panels<Kernel, 4>(P);
    case 5: return pick_panels<Kernel, 5>(P);
    default: return pick_panels<Kernel, 6>(P);
    }
}

struct F32 {
    using Fn = void (*)(const float *, long, const float *, float *, long, const float *, int, int, int, int);
    template <int R, int P> static constexpr Fn block = ::block<R, P>;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The bfloat16 twin of `block`: one vdpbf16ps per pair of K steps. x holds the rows as pairs
// (x[k], x[k + 1]) in 32-bit words, broadcast to every lane; the instruction adds x[k + 1] W[k + 1],
// then x[k] W[k] (each product exact in float32, each sum rounded to nearest even, denormals
// flushed: Intel's definition, which AMD's Zen 4 and 5 follow).
template <int R, int P>
void block_bf16(const uint32_t *x, long ldx, const uint16_t *packed, uint16_t *y, long ldy, const float *bias, int m0,
                int p0, int N, int pairs) {
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const uint16_t *w = packed + static_cast<long>(p0) * pairs * 32;
    const uint32_t *a = x + m0 * ldx;
    for (int k = 0; k < pairs; k++) {
        __m512bh wv[P];
        for (int p = 0; p < P; p++) wv[p] = (__m512bh)_mm512_loadu_si512(w + (static_cast<long>(p) * pairs + k) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * ldx + k]));
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
        }
    }
    for (int p = 0; p < P; p++) {
        const int n0 = 16 * (p0 + p), cols = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(simd::round_bf16({v}).v), 16);  // ties to even
            _mm256_mask_storeu_epi16(y + (m0 + r) * ldy + n0, mask, _mm512_cvtepi32_epi16(h));
        }
    }
}

struct Bf16 {
    using Fn = void (*)(const uint32_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int, int);
    template <int R, int P> static constexpr Fn block = block_bf16<R, P>;
};
#endif

}  // namespace

extern "C" int f32_available() { return 1; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
extern "C" int bf16_dot_available() { return 1; }
#else
extern "C" int bf16_dot_available() { return 0; }
#endif

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
            pick<F32>(R, P)(x, ldx, packed, y, ldy, bias, m0, p0, N, K);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// w: (N, K) bfloat16 row-major; out: ceil(N / 16) panels of ceil(K / 2) pairs x 16 columns x 2.
extern "C" void pack_bf16_pairs(const uint16_t *w, uint16_t *out, int N, int K) {
    const int panels = (N + 15) / 16;
    const long KP = (K + 1) / 2 * 2;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (long k = 0; k < KP; k += 2)
            for (int n = 0; n < 16; n++)
                for (int j = 0; j < 2; j++) {
                    const int row = 16 * p + n;
                    out[(static_cast<long>(p) * KP + k) * 16 + 2 * n + j] =
                        row < N && k + j < K ? w[static_cast<long>(row) * K + k + j] : 0;
                }
}

// x: (M, K) bfloat16 rows of stride ldx; packed from pack_bf16_pairs; y: (M, N) bfloat16 of stride
// ldy; bias: N floats (the bias widened) or null.
extern "C" void gemm_bf16_dot(const uint16_t *x, long ldx, const uint16_t *packed, uint16_t *y, long ldy,
                              const float *bias, int M, int N, int K, int threads) {
    const int pairs = (K + 1) / 2;
    // The rows as 32-bit pairs: read in place when K, the row stride and the address allow it, else
    // copied (with a zero after an odd K).
    const bool copy = K % 2 || ldx % 2 || reinterpret_cast<uintptr_t>(x) % 4;
    uint16_t *xp = copy ? new uint16_t[static_cast<long>(M) * pairs * 2] : nullptr;
    for (long m = 0; copy && m < M; m++) {
        std::memcpy(xp + m * pairs * 2, x + m * ldx, static_cast<size_t>(K) * 2);
        if (K % 2) xp[m * pairs * 2 + K] = 0;
    }
    const uint32_t *rows = reinterpret_cast<const uint32_t *>(copy ? xp : x);
    const long ld = copy ? pairs : ldx / 2;
    const int panels = (N + 15) / 16, groups = (panels + NP - 1) / NP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * NP, P = panels - p0 < NP ? panels - p0 : NP;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int R = M - m0 < MR ? M - m0 : MR;
            pick<Bf16>(R, P)(rows, ld, packed, y, ldy, bias, m0, p0, N, pairs);
        }
    }
    delete[] xp;  // null when read in place
}
#else
extern "C" void pack_bf16_pairs(const uint16_t *, uint16_t *, int, int) {}
extern "C" void gemm_bf16_dot(const uint16_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int,
                              int) {}
#endif

#else  // no AVX-512 on this CPU: kernels/linear.py never calls these

extern "C" int f32_available() { return 0; }
extern "C" int bf16_dot_available() { return 0; }
extern "C" void pack_f32(const float *, float *, int, int) {}
extern "C" void gemm_f32(const float *, long, const float *, float *, long, const float *, int, int, int, int) {}
extern "C" void pack_bf16_pairs(const uint16_t *, uint16_t *, int, int) {}
extern "C" void gemm_bf16_dot(const uint16_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int,
                              int) {}

#endif
