// 16 float lanes with the same arithmetic on every x86 instruction set: AVX-512 (one register),
// AVX2 + FMA (two) and plain C++ (an array, std::fma). Each operation rounds as IEEE says, so a
// kernel written with these gives the same bits on every CPU (build with -ffp-contract=off, as
// kernels/build.py does). Also the storage types' conversions: bfloat16 widened exactly, rounded
// to nearest even.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace simd {

#if defined(__AVX512F__)
struct V16 {
    __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float *p) { return {_mm512_loadu_ps(p)}; }
// Keeps N (1-4) values in registers: the compiler would otherwise read each from memory again for
// every instruction that uses it, and a loop of fused multiply-adds would wait on loads. One
// statement for all of them: a statement per value made GCC keep a copy of each in memory too, a
// store per value per loop pass (a float32 prefill chunk's scores ran 15% slower). No arithmetic.
template <int N> inline void in_registers(V16 (&a)[N]) {
    static_assert(1 <= N && N <= 4);
    if constexpr (N == 1) __asm__("" : "+v"(a[0].v));
    if constexpr (N == 2) __asm__("" : "+v"(a[0].v), "+v"(a[1].v));
    if constexpr (N == 3) __asm__("" : "+v"(a[0].v), "+v"(a[1].v), "+v"(a[2].v));
    if constexpr (N == 4) __asm__("" : "+v"(a[0].v), "+v"(a[1].v), "+v"(a[2].v), "+v"(a[3].v));
}
inline V16 load(const uint16_t *p) {  // 16 bfloat16 widened (exactly)
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16))};
}
inline void store(float *p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 round_even(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 pow2(V16 n) {  // 2^n for integer-valued n in [-126, 127]
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// To the nearest bfloat16, ties to even, as a float (the low 16 bits zero); NaN stays NaN.
inline V16 round_bf16(V16 a) {
    const __m512i u = _mm512_castps_si512(a.v);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
    const __m512i q = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));  // a quiet NaN, as narrow() makes it
    return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(nan, r, q), _mm512_set1_epi32(-65536)))};
}
inline void store(uint16_t *p, V16 a) {  // rounded to bfloat16
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(a).v), 16)));
}
inline V16 select_lt(V16 x, V16 y, V16 a, V16 b) {  // a where x < y, else b
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, y.v, _CMP_LT_OQ), b.v, a.v)};
}
inline V16 keep_first(V16 a, int n) {  // lanes n.. set to 0
    return {_mm512_maskz_mov_ps(n >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1), a.v)};
}
// r[i] holds row i of a 16 x 16 matrix of 32-bit elements; afterwards, column i.
inline void transpose16_epi32(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int b = 0; b < 4; b++) {  // u[4b + c], 128-bit lane L: column 4L + c of rows 4b .. 4b + 3
        u[4 * b] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
        u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
        u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i xl = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), xh = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i yl = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), yh = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(xl, yl, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(xl, yl, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(xh, yh, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(xh, yh, 0xDD);
    }
}
inline void transpose16(V16 *r) {  // r[i]: row i of a 16 x 16 matrix; afterwards, column i
    __m512i x[16];
    for (int i = 0; i < 16; i++) x[i] = _mm512_castps_si512(r[i].v);
    transpose16_epi32(x);
    for (int i = 0; i < 16; i++) r[i].v = _mm512_castsi512_ps(x[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
    __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 bcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// Here a statement per value: the 16 registers cannot hold four V16 besides the accumulators, and
// one statement for all of them ran a float32 prefill chunk 4% slower.
template <int N> inline void in_registers(V16 (&a)[N]) {
    for (int i = 0; i < N; i++) __asm__("" : "+x"(a[i].lo), "+x"(a[i].hi));
}
inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16));
}
inline V16 load(const uint16_t *p) { return {load8(p), load8(p + 8)}; }
inline void store(float *p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 round_even(V16 a) {
    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, R), _mm256_round_ps(a.hi, R)};
}
inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 pow2(V16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline __m256 round_bf16_8(__m256 a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    const __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    const __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan);
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(-65536)));
}
inline V16 round_bf16(V16 a) { return {round_bf16_8(a.lo), round_bf16_8(a.hi)}; }
inline void store(uint16_t *p, V16 a) {
    const V16 r = round_bf16(a);
    const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(r.lo), 16), hi = _mm256_srli_epi32(_mm256_castps_si256(r.hi), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}
inline V16 select_lt(V16 x, V16 y, V16 a, V16 b) {
    return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, y.lo, _CMP_LT_OQ)),
            _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, y.hi, _CMP_LT_OQ))};
}
inline V16 keep_first(V16 a, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_epi32(n);
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    return {_mm256_and_ps(a.lo, lo), _mm256_and_ps(a.hi, hi)};
}
inline void transpose8(__m256 *r) {  // r[i]: row i of an 8 x 8 matrix; afterwards, column i
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int b = 0; b < 8; b += 4) {  // u[b + c]: column c | column 4 + c of rows b .. b + 3
        u[b] = _mm256_shuffle_ps(t[b], t[b + 2], 0x44);
        u[b + 1] = _mm256_shuffle_ps(t[b], t[b + 2], 0xEE);
        u[b + 2] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0x44);
        u[b + 3] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}
inline void transpose16(V16 *r) {  // four 8 x 8 blocks: [A B; C D] -> [A' C'; B' D']
    __m256 a[8], b[8], c[8], d[8];
    for (int k = 0; k < 8; k++) a[k] = r[k].lo, b[k] = r[k].hi, c[k] = r[8 + k].lo, d[k] = r[8 + k].hi;
    transpose8(a), transpose8(b), transpose8(c), transpose8(d);
    for (int k = 0; k < 8; k++) r[k] = {a[k], c[k]}, r[8 + k] = {b[k], d[k]};
}
#else
struct V16 {
    float x[16];
};
template <typename F> inline V16 each(F f) {
    V16 r;
    for (int l = 0; l < 16; l++) r.x[l] = f(l);
    return r;
}
inline V16 zero() { return each([](int) { return 0.0f; }); }
inline V16 bcast(float x) { return each([x](int) { return x; }); }
inline V16 load(const float *p) { return each([p](int l) { return p[l]; }); }
template <int N> inline void in_registers(V16 (&)[N]) {}
inline V16 load(const uint16_t *p) {
    return each([p](int l) {
        const uint32_t u = static_cast<uint32_t>(p[l]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    });
}
inline void store(float *p, V16 a) { std::memcpy(p, a.x, sizeof a.x); }
inline V16 add(V16 a, V16 b) { return each([&](int l) { return a.x[l] + b.x[l]; }); }
inline V16 sub(V16 a, V16 b) { return each([&](int l) { return a.x[l] - b.x[l]; }); }
inline V16 mul(V16 a, V16 b) { return each([&](int l) { return a.x[l] * b.x[l]; }); }
inline V16 fma(V16 a, V16 b, V16 c) { return each([&](int l) { return std::fma(a.x[l], b.x[l], c.x[l]); }); }
inline V16 max(V16 a, V16 b) { return each([&](int l) { return a.x[l] > b.x[l] ? a.x[l] : b.x[l]; }); }
inline V16 min(V16 a, V16 b) { return each([&](int l) { return a.x[l] < b.x[l] ? a.x[l] : b.x[l]; }); }
inline V16 div(V16 a, V16 b) { return each([&](int l) { return a.x[l] / b.x[l]; }); }
inline V16 round_even(V16 a) { return each([&](int l) { return std::nearbyint(a.x[l]); }); }
inline V16 pow2(V16 n) {
    return each([&](int l) {
        const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n.x[l]) + 127) << 23;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    });
}
inline V16 select_lt(V16 x, V16 y, V16 a, V16 b) { return each([&](int l) { return x.x[l] < y.x[l] ? a.x[l] : b.x[l]; }); }
inline V16 keep_first(V16 a, int n) { return each([&](int l) { return l < n ? a.x[l] : 0.0f; }); }
inline uint16_t to_bf16(float x);
inline float from_bf16(uint16_t b);
inline V16 round_bf16(V16 a) { return each([&](int l) { return from_bf16(to_bf16(a.x[l])); }); }
inline void store(uint16_t *p, V16 a) {
    for (int l = 0; l < 16; l++) p[l] = to_bf16(a.x[l]);
}
inline void transpose16(V16 *r) {
    for (int i = 0; i < 16; i++)
        for (int j = i + 1; j < 16; j++) std::swap(r[i].x[j], r[j].x[i]);
}
#endif

// The tree of one vector's lanes: l + (l + 8), then + 4, + 2, + 1.
inline float tree(V16 a) {
    float s[16];
    store(s, a);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) s[l] = s[l] + s[l + w];
    return s[0];
}

// exp(x): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, times 2^n. x is
// clamped to [-87.3, 88]: below, about 1e-38 instead of less (a softmax weight that small adds
// nothing a float can hold); above, about 1.7e38 instead of more.
inline V16 exp(V16 x) {
    x = min(max(x, bcast(-87.3f)), bcast(88.0f));
    const V16 n = round_even(mul(x, bcast(1.44269504088896341f)));
    V16 r = fma(n, bcast(-0.693359375f), x);
    r = fma(n, bcast(2.12194440e-4f), r);
    V16 y = bcast(1.9875691500e-4f);
    y = fma(y, r, bcast(1.3981999507e-3f));
    y = fma(y, r, bcast(8.3334519073e-3f));
    y = fma(y, r, bcast(4.1665795894e-2f));
    y = fma(y, r, bcast(1.6666665459e-1f));
    y = fma(y, r, bcast(5.0000001201e-1f));
    y = add(fma(y, mul(r, r), r), bcast(1.0f));
    return mul(y, pow2(n));
}

inline uint16_t to_bf16(float x) {  // to nearest, ties to even; NaN stays NaN (quiet)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return static_cast<uint16_t>((u | 0x400000u) >> 16);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float widen(float x) { return x; }
inline float widen(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void narrow(float x, float *out) { *out = x; }
inline void narrow(float x, uint16_t *out) { *out = to_bf16(x); }

// n values of src as floats into dst, then zeros up to `padded`.
template <typename T> inline void widen_row(float *dst, const T *src, int n, int padded) {
    int i = 0;
    for (; i + 16 <= n; i += 16) store(dst + i, load(src + i));
    for (; i < n; i++) dst[i] = widen(src[i]);
    for (; i < padded; i++) dst[i] = 0.0f;
}

// Asks for the cache line at p ahead of its use, into L1 (LEVEL 1) or L2 (LEVEL 2); changes no
// value. On x86 as an asm statement: GCC deletes a loop of __builtin_prefetch or _mm_prefetch
// (it counts them as having no effect), so that a loop over a row's lines would vanish.
template <int LEVEL> inline void prefetch(const void *p) {
    static_assert(LEVEL == 1 || LEVEL == 2);
#if defined(__x86_64__) || defined(__i386__)
    if constexpr (LEVEL == 1)
        __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char *>(p)));
    else
        __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char *>(p)));
#else
    __builtin_prefetch(p, 0, LEVEL == 1 ? 3 : 2);
#endif
}

}  // namespace simd
