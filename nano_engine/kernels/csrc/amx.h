// What every AMX kernel needs before its first tile instruction: the OS's permission to use the
// tile registers (Linux hands them out on request, once per process) and a tile configuration
// (palette 1; each tile `rows` rows of 64 bytes: 16 x 32 bfloat16, or up to 16 x 16 float).
//
// Defines NANO_AMX where the kernels may use tiles: a CPU with AMX and AVX512_BF16 (Intel Sapphire
// Rapids and later), or, built with -DNANO_AMX_EMULATE, any CPU with AVX512_BF16, where the tile
// instructions below run on a software model of the tiles. The model is for the tests, on the
// machines we have without AMX (kernels/build.py: NANO_ENGINE_EMULATE_AMX=1): it runs every line of
// the AMX kernels, their packing, tiling, tails and configuration, and stops the process on what
// the hardware would fault on (a tile used unconfigured, shapes that do not fit together). It
// computes each sum as the Intel Intrinsics Guide describes TDPBF16PS (per output, the even product
// of each pair and then the odd one, each rounded to nearest even, denormals flushed to zero);
// real tiles may round otherwise, so under the model a test checks invariance and agreement within
// bfloat16's rounding, never a hardware bit.
#pragma once

#if defined(__AVX512BF16__) && (defined(NANO_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define NANO_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef NANO_AMX_EMULATE
namespace tiles::emulated {

struct State {  // a thread's tile registers, as the hardware keeps them per thread
    bool configured = false;
    uint8_t rows[8];
    uint16_t colsb[8];
    alignas(64) uint8_t data[8][16 * 64];
};

inline State &state() {
    static thread_local State s;
    return s;
}

[[noreturn]] inline void fault(const char *what, int tile) {
    std::fprintf(stderr, "emulated AMX: %s (tile %d); the hardware would fault here\n", what, tile);
    std::abort();
}

inline State &ready(int tile) {
    State &s = state();
    if (!s.configured) fault("a tile instruction with no tile configuration loaded", tile);
    if (tile < 0 || tile > 7) fault("no such tile", tile);
    return s;
}

inline void loadconfig(const void *config) {
    const uint8_t *c = static_cast<const uint8_t *>(config);
    State &s = state();
    if (c[0] == 0) {  // palette 0: no tiles, as after a release
        s.configured = false;
        return;
    }
    if (c[0] != 1) fault("a palette other than 0 or 1", -1);
    for (int t = 0; t < 8; t++) {
        std::memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
        s.rows[t] = c[48 + t];
        if (s.rows[t] > 16 || s.colsb[t] > 64) fault("more than 16 rows of 64 bytes", t);
    }
    std::memset(s.data, 0, sizeof s.data);  // loading a configuration zeroes the tiles
    s.configured = true;
}

inline void release() { state().configured = false; }

inline void zero(int t) { std::memset(ready(t).data[t], 0, sizeof State::data[0]); }

inline __mmask64 bytes(int n) { return n >= 64 ? ~0ull : (1ull << n) - 1; }

inline void load(int t, const void *base, long stride) {  // rows past the configured ones are zero
    State &s = ready(t);
    const __mmask64 m = bytes(s.colsb[t]);
    for (int r = 0; r < 16; r++) {
        const char *row = static_cast<const char *>(base) + r * stride;
        const __m512i v = r < s.rows[t] ? _mm512_maskz_loadu_epi8(m, row) : _mm512_setzero_si512();
        _mm512_store_si512(s.data[t] + 64 * r, v);
    }
}

inline void store(int t, void *base, long stride) {
    State &s = ready(t);
    const __mmask64 m = bytes(s.colsb[t]);
    for (int r = 0; r < s.rows[t]; r++)
        _mm512_mask_storeu_epi8(static_cast<char *>(base) + r * stride, m, _mm512_load_si512(s.data[t] + 64 * r));
}

// 16 bfloat16 of a register's 32, widened to float (exact), denormals as zero: the even-numbered
// (odd = false) or the odd-numbered ones.
inline __m512 widen(__m512i pairs, bool odd) {
    const __m512i x = odd ? _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))
                          : _mm512_slli_epi32(pairs, 16);
    const __mmask16 tiny = _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x7f800000));  // no exponent bit set
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(x, tiny, x, sign));
}

inline __m512 flush(__m512 x) {  // a denormal sum becomes a zero of its sign
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ);
    return _mm512_mask_and_ps(x, tiny, x, sign);
}

// c += a b: a is M rows of K pairs of bfloat16, b is K rows of N pairs, c is M x N float.
inline void dpbf16ps(int c, int a, int b) {
    State &s = ready(c);
    ready(a), ready(b);
    const int M = s.rows[c], K = s.colsb[a] / 4, N = s.colsb[c] / 4;
    if (s.rows[a] != M || s.rows[b] != K || s.colsb[b] != s.colsb[c] || s.colsb[a] % 4 || s.colsb[c] % 4)
        fault("tiles whose shapes do not fit together", c);
    const __mmask16 cols = N == 16 ? 0xffff : static_cast<__mmask16>((1u << N) - 1);
    __m512 even[16], odd[16];  // row k of b: its pairs' first and second halves
    for (int k = 0; k < K; k++) {
        const __m512i row = _mm512_load_si512(s.data[b] + 64 * k);
        even[k] = widen(row, false), odd[k] = widen(row, true);
    }
    for (int m = 0; m < M; m++) {
        float *out = reinterpret_cast<float *>(s.data[c] + 64 * m);
        const __m512i arow = _mm512_load_si512(s.data[a] + 64 * m);
        alignas(64) float a0[16], a1[16];
        _mm512_store_ps(a0, widen(arow, false));
        _mm512_store_ps(a1, widen(arow, true));
        __m512 sum = _mm512_maskz_loadu_ps(cols, out);
        for (int k = 0; k < K; k++) {  // per output: the pair's first product, then its second (each exact)
            sum = flush(_mm512_add_ps(sum, _mm512_mul_ps(_mm512_set1_ps(a0[k]), even[k])));
            sum = flush(_mm512_add_ps(sum, _mm512_mul_ps(_mm512_set1_ps(a1[k]), odd[k])));
        }
        _mm512_mask_storeu_ps(out, cols, sum);
    }
}

}  // namespace tiles::emulated

// The intrinsics' names, taken over (the kernels read as they run on the hardware).
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) tiles::emulated::loadconfig(config)
#define _tile_release() tiles::emulated::release()
#define _tile_loadd(t, base, stride) tiles::emulated::load(t, base, stride)
#define _tile_stored(t, base, stride) tiles::emulated::store(t, base, stride)
#define _tile_zero(t) tiles::emulated::zero(t)
#define _tile_dpbf16ps(c, a, b) tiles::emulated::dpbf16ps(c, a, b)
#endif  // NANO_AMX_EMULATE

namespace tiles {

inline bool request() {
#ifdef NANO_AMX_EMULATE
    return true;
#else
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
}

// rows[t]: the rows of tile t (1 to 16; 0 counts as 1).
inline void configure(const int (&rows)[8]) {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = rows[t] > 0 ? rows[t] : 1;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

}  // namespace tiles

#endif  // NANO_AMX
