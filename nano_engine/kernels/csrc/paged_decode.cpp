// Decode attention that reads K and V where they are, in the paged cache.
//
// One new token per sequence (a decode), each attending to its own context through its block
// table: position p of sequence d lies in slot table[d][p / bs] * bs + p % bs of the cache. No K
// or V is gathered or padded. The loops walk a sequence's blocks in place, a slot's row of all KV
// heads at a time (nkv * hd values, contiguous), and the nh / nkv query heads that share a KV
// head use each row they read. Work goes to threads by sequence, and by (sequence, KV head) when
// sequences are fewer than threads (a decode of one request still uses every thread).
//
// Two passes with the softmax between them in PyTorch (nano_engine/kernels/paged_decode.py):
//   paged_scores:  scores[d, h, p] = q[d, h] . K[p] * scale, -inf past the context;
//   paged_values:  out[d, h] = sum_p probs[d, h, p] * V[p].
// The arithmetic is attention.decode_attention's: for bfloat16 the sums run in float64, where
// products of bfloat16 numbers are exact and so are their sums, so these passes give the very
// bits of PyTorch's float64 matmuls, whatever the order; float32 sums in float32 (to rounding).
// The softmax stays PyTorch's own function, so a bfloat16 request gets the same bits as in
// `generate`.
//
// Built by kernels/paged_decode.py with the system's C++ compiler and loaded with ctypes. Linked against the
// OpenMP runtime that PyTorch has already loaded (libgomp.so.1): it runs on PyTorch's threads.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest, ties to even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// The arithmetic type of each storage type: float32 sums in float32, bfloat16 (uint16_t bits) in float64.
template <typename T> struct Acc;
template <> struct Acc<float> {
    using type = float;
    static float load(float x) { return x; }
    static float store(float x) { return x; }
};
template <> struct Acc<uint16_t> {
    using type = double;
    static double load(uint16_t x) { return bf16_to_float(x); }
    static uint16_t store(double x) { return float_to_bf16(static_cast<float>(x)); }
};

struct Shape {
    int D, nh, nkv, hd, bs, max_blocks, width;  // width: the scores' and probs' row length
    const int32_t *tables, *lens;
};

// Runs body(d, h0, h1) for every work item, on num_threads threads.
template <typename F> void for_items(const Shape &s, int num_threads, F body) {
    const int split = s.D < num_threads ? s.nkv : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int w = 0; w < s.D * split; w++) {
        const int d = w / split, h0 = split == 1 ? 0 : w % split;
        body(d, h0, split == 1 ? s.nkv : h0 + 1);
    }
}

// Calls row(p, pointer to slot p's nkv * hd values) for p = 0 .. len - 1, block by block.
template <typename T, typename F> void for_slots(const Shape &s, int d, const T *cache, F row) {
    const int32_t *table = s.tables + static_cast<int64_t>(d) * s.max_blocks;
    const int64_t stride = static_cast<int64_t>(s.nkv) * s.hd;
    const int len = s.lens[d];
    for (int p0 = 0, b = 0; p0 < len; p0 += s.bs, b++) {
        const T *block = cache + static_cast<int64_t>(table[b]) * s.bs * stride;
        const int n = len - p0 < s.bs ? len - p0 : s.bs;
        for (int j = 0; j < n; j++) row(p0 + j, block + j * stride);
    }
}

template <typename T>
void scores(const T *q, const T *k_cache, float *out, const Shape &s, double scale, int num_threads) {
    using A = typename Acc<T>::type;
    const int G = s.nh / s.nkv, hd = s.hd;
    for_items(s, num_threads, [&](int d, int h0, int h1) {
        const int nq = (h1 - h0) * G, len = s.lens[d];
        std::vector<A> qa(static_cast<size_t>(nq) * hd), k(hd);
        const T *qd = q + (static_cast<int64_t>(d) * s.nh + h0 * G) * hd;
        for (int i = 0; i < nq * hd; i++) qa[i] = Acc<T>::load(qd[i]);
        float *o = out + (static_cast<int64_t>(d) * s.nh + h0 * G) * s.width;
        for_slots(s, d, k_cache, [&](int p, const T *slot) {
            for (int h = h0; h < h1; h++) {
                const T *kh = slot + h * hd;
#pragma omp simd
                for (int i = 0; i < hd; i++) k[i] = Acc<T>::load(kh[i]);
                for (int g = 0; g < G; g++) {
                    const int r = (h - h0) * G + g;
                    const A *qg = qa.data() + static_cast<int64_t>(r) * hd;
                    A dot = 0;
#pragma omp simd reduction(+ : dot)
                    for (int i = 0; i < hd; i++) dot += qg[i] * k[i];
                    o[static_cast<int64_t>(r) * s.width + p] = static_cast<float>(dot * static_cast<A>(scale));
                }
            }
        });
        for (int r = 0; r < nq; r++)
            for (int p = len; p < s.width; p++) o[static_cast<int64_t>(r) * s.width + p] = -INFINITY;
    });
}

template <typename T>
void values(const T *probs, const T *v_cache, T *out, const Shape &s, int num_threads) {
    using A = typename Acc<T>::type;
    const int G = s.nh / s.nkv, hd = s.hd;
    for_items(s, num_threads, [&](int d, int h0, int h1) {
        const int nq = (h1 - h0) * G;
        std::vector<A> acc(static_cast<size_t>(nq) * hd, A(0)), v(hd);
        const T *pr = probs + (static_cast<int64_t>(d) * s.nh + h0 * G) * s.width;
        for_slots(s, d, v_cache, [&](int p, const T *slot) {
            for (int h = h0; h < h1; h++) {
                const T *vh = slot + h * hd;
#pragma omp simd
                for (int i = 0; i < hd; i++) v[i] = Acc<T>::load(vh[i]);
                for (int g = 0; g < G; g++) {
                    const int r = (h - h0) * G + g;
                    const A w = Acc<T>::load(pr[static_cast<int64_t>(r) * s.width + p]);
                    A *a = acc.data() + static_cast<int64_t>(r) * hd;
#pragma omp simd
                    for (int i = 0; i < hd; i++) a[i] += w * v[i];
                }
            }
        });
        T *o = out + (static_cast<int64_t>(d) * s.nh + h0 * G) * hd;
        for (int i = 0; i < nq * hd; i++) o[i] = Acc<T>::store(acc[i]);
    });
}

}  // namespace

// q: (D, nh, hd); k_cache, v_cache: (slots, nkv, hd); tables: (D, max_blocks) int32; lens: (D,)
// int32; scores: (D, nh, width) float32; probs: (D, nh, width) in the model's dtype; out: (D, nh, hd).
#define SHAPE Shape{D, nh, nkv, hd, bs, max_blocks, width, tables, lens}
extern "C" {
void paged_scores_f32(const float *q, const float *k_cache, const int32_t *tables, const int32_t *lens, float *scores,
                      int D, int nh, int nkv, int hd, int bs, int max_blocks, int width, double scale, int threads) {
    ::scores(q, k_cache, scores, SHAPE, scale, threads);
}
void paged_scores_bf16(const uint16_t *q, const uint16_t *k_cache, const int32_t *tables, const int32_t *lens,
                       float *scores, int D, int nh, int nkv, int hd, int bs, int max_blocks, int width, double scale,
                       int threads) {
    ::scores(q, k_cache, scores, SHAPE, scale, threads);
}
void paged_values_f32(const float *probs, const float *v_cache, const int32_t *tables, const int32_t *lens, float *out,
                      int D, int nh, int nkv, int hd, int bs, int max_blocks, int width, int threads) {
    ::values(probs, v_cache, out, SHAPE, threads);
}
void paged_values_bf16(const uint16_t *probs, const uint16_t *v_cache, const int32_t *tables, const int32_t *lens,
                       uint16_t *out, int D, int nh, int nkv, int hd, int bs, int max_blocks, int width, int threads) {
    ::values(probs, v_cache, out, SHAPE, threads);
}
}
