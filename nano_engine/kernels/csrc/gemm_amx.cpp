// y = x @ W^T (+ bias) in bfloat16 on AMX tiles, with the same bits for a row at every row count.
//
// Batch invariance: a row's result depends on that row alone. Work is split over N only (each
// thread owns whole 32-column panels), never over K; every output element is summed over K in
// one ascending pass, 32 products at a time (one TDPBF16PS per 16 x 16 tile of outputs, fp32
// accumulation in the tile), whatever the number of rows, the thread count or the tile's height
// (rows are independent in a tile). The fp32 sum (+ the bias) is rounded once to bfloat16, to
// nearest even, as PyTorch rounds.
//
// The weight is packed once (pack_bf16), as vLLM's CPU backend prepacks for its AMX kernels: for
// each panel of 16 output columns and each 32-deep slice of K, one 16 x 64-byte tile whose row
// kk holds, for each column n, the pair W[n][2kk], W[n][2kk + 1] (the VNNI layout TDPBF16PS reads).
// N and K are padded with zeros to multiples of 32 (a zero product leaves an fp32 sum unchanged).
//
// Built by kernels/build.py with -march=native: on a CPU without AMX the functions are stubs and
// amx_available() says 0 (kernels/linear.py then keeps its other paths), unless the build emulates
// the tiles for the tests (amx.h).
#include <cstdint>
#include <cstring>

#include "amx.h"  // defines NANO_AMX where tiles (or their emulation) are there

#ifdef NANO_AMX

namespace {

// Tiles: 0-3 the outputs (two row blocks x two column panels), 4-5 x's row blocks, 6-7 the panels.
void configure(int rows_a, int rows_b) { tiles::configure({rows_a, rows_a, rows_b, rows_b, rows_a, rows_b, 16, 16}); }

// Round a tile of fp32 sums (16 columns a row) to bfloat16 and store `cols` columns of `rows` rows.
void store(const float* sums, uint16_t* y, long ldy, int rows, int cols, const float* bias) {
    const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_loadu_ps(sums + 16 * r);
        if (bias) v = _mm512_add_ps(v, b);
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

}  // namespace

extern "C" int amx_available() { return tiles::request(); }

// w: (N, K) row-major; out: (Np / 16) x (Kp / 32) tiles of 512 bfloat16, Np, Kp multiples of 32.
extern "C" void pack_bf16(const uint16_t* w, uint16_t* out, int N, int K, int Np, int Kp) {
    const int kblocks = Kp / 32;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < Np / 16; nb++)
        for (int kb = 0; kb < kblocks; kb++) {
            uint16_t* tile = out + (static_cast<long>(nb) * kblocks + kb) * 512;
            for (int kk = 0; kk < 16; kk++)
                for (int n = 0; n < 16; n++)
                    for (int j = 0; j < 2; j++) {
                        const int row = nb * 16 + n, col = kb * 32 + 2 * kk + j;
                        tile[(kk * 16 + n) * 2 + j] = row < N && col < K ? w[static_cast<long>(row) * K + col] : 0;
                    }
        }
}

// x: (M, Kp) bfloat16 rows of stride ldx; packed from pack_bf16; y: (M, N) of stride ldy; bias: N fp32 or null.
extern "C" void gemm_bf16(const uint16_t* x, long ldx, const uint16_t* packed, uint16_t* y, long ldy,
                          const float* bias, int M, int N, int Kp, int threads) {
    const int kblocks = Kp / 32, panels = (N + 31) / 32;
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float sums[4][256];
        int configured_a = -1, configured_b = -1;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint16_t* b0 = packed + static_cast<long>(2 * p) * kblocks * 512;
            const uint16_t* b1 = b0 + static_cast<long>(kblocks) * 512;
            const int n0 = 32 * p, cols0 = N - n0 < 16 ? N - n0 : 16, cols1 = N - n0 - 16;
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int rows_a = M - m0 < 16 ? M - m0 : 16;
                const int rows_b = M - m0 - 16 <= 0 ? 0 : (M - m0 - 16 < 16 ? M - m0 - 16 : 16);
                if (rows_a != configured_a || rows_b != configured_b) {
                    configure(rows_a, rows_b);
                    configured_a = rows_a, configured_b = rows_b;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t* a = x + m0 * ldx;
                for (int kb = 0; kb < kblocks; kb++) {  // K in one ascending pass
                    _tile_loadd(4, a + 32 * kb, 2 * ldx);
                    _tile_loadd(6, b0 + 512L * kb, 64);
                    _tile_loadd(7, b1 + 512L * kb, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rows_b) {
                        _tile_loadd(5, a + 16 * ldx + 32 * kb, 2 * ldx);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                uint16_t* out = y + m0 * ldy + n0;
                store(sums[0], out, ldy, rows_a, cols0, bias ? bias + n0 : nullptr);
                if (cols1 > 0) store(sums[1], out + 16, ldy, rows_a, cols1, bias ? bias + n0 + 16 : nullptr);
                if (rows_b) {
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                    store(sums[2], out + 16 * ldy, ldy, rows_b, cols0, bias ? bias + n0 : nullptr);
                    if (cols1 > 0)
                        store(sums[3], out + 16 * ldy + 16, ldy, rows_b, cols1, bias ? bias + n0 + 16 : nullptr);
                }
            }
        }
        _tile_release();
    }
}

#else  // no AMX on this CPU: kernels/linear.py never calls these

extern "C" int amx_available() { return 0; }
extern "C" void pack_bf16(const uint16_t*, uint16_t*, int, int, int, int) {}
extern "C" void gemm_bf16(const uint16_t*, long, const uint16_t*, uint16_t*, long, const float*, int, int, int,
                          int) {}

#endif
