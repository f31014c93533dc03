// Attention of a ragged batch over the paged KV cache, with the same bits for a query row in any
// company: prefill chunks and decodes in one call, K and V read where they lie in their blocks.
//
// Sequence s owns query rows query_start[s] .. query_start[s+1] - 1; row i of it sits at
// position num_cached[s] + i and sees the keys at positions 0 .. num_cached[s] + i, which live in
// slot table[s][p / bs] * bs + p % bs of the cache. Nothing is gathered, padded or copied out of the
// blocks but the 16 rows of K or V a loop is working on.
//
// Batch invariance. Every number a row's output is made of is computed by the same chain of
// float32 operations, in an order that depends on positions alone, never on the rows that share the
// call, the chunk the row came in, the block size or the number of threads:
//   score(q, k) = tree(lane sums) * scale, where lane l (0..15) sums q[i] * k[i] over the i with
//       i % 16 == l, in ascending i, with fused multiply-adds (head_dim padded with zeros to a
//       multiple of 16), and tree() adds the 16 lanes pairwise: l + (l + 8), then + 4, + 2, + 1;
//   m = the largest score the row sees (a maximum has no order);
//   e_p = exp(score_p - m), by the polynomial below (the same few operations for every p);
//   sum = tree(16 lane sums of e_p, lane l taking the p with p % 16 == l in ascending p);
//   out = (sum over p, ascending, of e_p * V_p with fused multiply-adds) * (1 / sum).
// Keys past a row's last position contribute exact zeros (e_p = 0), so a row computed alongside a
// longer one, or in a tile that runs past its end, gets the same bits as alone. A fused
// multiply-add rounds once, in every instruction set, so the AVX-512, AVX2 and plain C++ versions
// of each step below give the same bits too (tests/test_attention_kernel.py).
//
// bfloat16 is widened to float32 on load (exact) and the output rounded once, to nearest even.
//
// Work: (sequence, KV head, up to 32 query vectors of it) per item; the nh / nkv query heads that
// share a KV head use each K and V row the item reads. Items go to PyTorch's OpenMP threads.
// Built by kernels/build.py with -march=native; loaded with ctypes by kernels/paged_attention.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// ---- 16 float lanes -------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct V16 {
    __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float *p) { return {_mm512_loadu_ps(p)}; }
inline V16 load(const uint16_t *p) {  // 16 bfloat16 widened (exactly)
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16))};
}
inline void store(float *p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 round_even(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 pow2(V16 n) {  // 2^n for integer-valued n in [-126, 127]
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline V16 keep_first(V16 a, int n) {  // lanes n.. set to 0
    return {_mm512_maskz_mov_ps(n >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1), a.v)};
}
// r[k] = tree(a[k]) for 16 vectors at once (the tree in the header: +8, +4, +2, +1).
inline V16 tree16(const V16 *a) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)  // halves: b[k] = [tree step 1 of a[2k] | of a[2k+1]]
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0x44),
                             _mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0xEE));
    for (int m = 0; m < 4; m++)  // quarters: quarter q of c[m] = step 2 of a[4m + q]
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int n = 0; n < 2; n++)  // pairs: quarter q of d[n] = [step 3 of a[8n + q], of a[8n + 4 + q]]
        d[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[2 * n]), _mm512_castps_pd(c[2 * n + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[2 * n]), _mm512_castps_pd(c[2 * n + 1]))));
    // lane 4q + e = a[q + 4e]: put a[k] in lane k.
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return {_mm512_permutexvar_ps(idx, r)};
}
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
    __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 bcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
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
inline V16 round_even(V16 a) {
    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, R), _mm256_round_ps(a.hi, R)};
}
inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 pow2(V16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline V16 keep_first(V16 a, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_epi32(n);
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    return {_mm256_and_ps(a.lo, lo), _mm256_and_ps(a.hi, hi)};
}
inline V16 tree16(const V16 *a) {
    __m256 b[16], c[8], d[4];
    for (int k = 0; k < 16; k++) b[k] = _mm256_add_ps(a[k].lo, a[k].hi);  // step 1
    for (int k = 0; k < 8; k++)  // 128-bit halves: [step 2 of a[2k] | of a[2k+1]]
        c[k] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * k], b[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(b[2 * k], b[2 * k + 1], 0x31));
    for (int m = 0; m < 4; m++)  // half h of d[m]: [step 3 of a[4m + h], of a[4m + 2 + h]]
        d[m] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(c[2 * m]), _mm256_castps_pd(c[2 * m + 1]))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(c[2 * m]), _mm256_castps_pd(c[2 * m + 1]))));
    // half h of r[n], element e = a[8n + h + 2e]: put a[k] in lane k.
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 r[2];
    for (int n = 0; n < 2; n++)
        r[n] = _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(d[2 * n], d[2 * n + 1], 0x88),
                                                      _mm256_shuffle_ps(d[2 * n], d[2 * n + 1], 0xDD)), idx);
    return {r[0], r[1]};
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
inline V16 round_even(V16 a) { return each([&](int l) { return std::nearbyint(a.x[l]); }); }
inline V16 pow2(V16 n) {
    return each([&](int l) {
        const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n.x[l]) + 127) << 23;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    });
}
inline V16 keep_first(V16 a, int n) { return each([&](int l) { return l < n ? a.x[l] : 0.0f; }); }
inline V16 tree16(const V16 *a) {
    return each([a](int k) {
        float s[16];
        std::memcpy(s, a[k].x, sizeof s);
        for (int w = 8; w >= 1; w /= 2)
            for (int l = 0; l < w; l++) s[l] = s[l] + s[l + w];
        return s[0];
    });
}
#endif

// The tree of one vector's lanes (the same additions as tree16, for a single row's sum).
inline float tree(V16 a) {
    float s[16];
    store(s, a);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) s[l] = s[l] + s[l + w];
    return s[0];
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, times 2^n.
// Below -87.3 it returns about 1e-38, not 0 (a weight that small adds nothing a float can hold).
inline V16 exp_neg(V16 x) {
    x = max(x, bcast(-87.3f));
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

// ---- storage types ---------------------------------------------------------------------------------
inline float widen(float x) { return x; }
inline float widen(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void narrow(float x, float *out) { *out = x; }
inline void narrow(float x, uint16_t *out) {  // to nearest, ties to even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) {
        *out = static_cast<uint16_t>((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *out = static_cast<uint16_t>(u >> 16);
}

// n values of src as floats into dst, then zeros up to `padded`.
template <typename T> inline void widen_row(float *dst, const T *src, int n, int padded) {
    int i = 0;
    for (; i + 16 <= n; i += 16) store(dst + i, load(src + i));
    for (; i < n; i++) dst[i] = widen(src[i]);
    for (; i < padded; i++) dst[i] = 0.0f;
}

struct Batch {
    const int32_t *query_start, *num_cached, *tables;
    int max_blocks, nh, nkv, hd, bs;
    float scale;
};

struct Item {
    int seq, head, row0, row1;  // KV head `head` of sequence `seq`, its query rows row0 .. row1 - 1
    int64_t cost;
};

constexpr int TILE = 16;        // keys per tile
constexpr int MAX_VECTORS = 32;  // query vectors (rows x heads sharing a KV head) per item

struct Scratch {
    std::vector<float> q, scores, kv, acc, inv;
};

// Rows row0..row1-1 of one sequence, for one KV head; C = head_dim / 16, rounded up.
template <int C, typename T>
void run_item(const Item &it, const Batch &b, const T *q, const T *k_cache, const T *v_cache, T *out, Scratch &s) {
    constexpr int HP = C * 16;  // head_dim padded
    const int G = b.nh / b.nkv, hd = b.hd;
    const int start = b.query_start[it.seq], cached = b.num_cached[it.seq];
    const int nrows = it.row1 - it.row0, nv = nrows * G;
    const int end = cached + it.row1 - start;  // keys the last row sees
    const int tiles = (end + TILE - 1) / TILE, width = tiles * TILE;
    const int32_t *table = b.tables + static_cast<int64_t>(it.seq) * b.max_blocks;
    const int64_t stride = static_cast<int64_t>(b.nkv) * hd;
    auto row_of = [&](const T *cache, int p) {
        return cache + (static_cast<int64_t>(table[p / b.bs]) * b.bs + p % b.bs) * stride + it.head * hd;
    };
    s.q.resize(static_cast<size_t>(nv) * HP);
    s.scores.resize(static_cast<size_t>(nv) * width);
    s.kv.resize(static_cast<size_t>(TILE + 1) * HP);  // 16 rows, then a row of zeros
    s.acc.resize(static_cast<size_t>(nv) * HP);
    s.inv.resize(nv);
    float *zeros = &s.kv[static_cast<size_t>(TILE) * HP];
    std::fill(zeros, zeros + HP, 0.0f);
    // Query vector j = r * G + g: row row0 + r, query head head * G + g.
    for (int r = 0; r < nrows; r++)
        for (int g = 0; g < G; g++)
            widen_row(&s.q[static_cast<size_t>(r * G + g) * HP],
                      q + (static_cast<int64_t>(it.row0 + r) * b.nh + it.head * G + g) * hd, hd, HP);
    // The tile's 16 rows of K or V as floats, read in place where they already are floats of a whole
    // padded head, else widened into scratch; a row of zeros past `end`.
    const float *rows[TILE];
    auto fill_tile = [&](const T *cache, int p0) {
        for (int k = 0; k < TILE; k++) {
            if (p0 + k >= end) {
                rows[k] = zeros;
            } else if constexpr (sizeof(T) == 4) {
                if (hd == HP) {
                    rows[k] = reinterpret_cast<const float *>(row_of(cache, p0 + k));
                    continue;
                }
            }
            if (p0 + k < end) {
                float *dst = &s.kv[static_cast<size_t>(k) * HP];
                widen_row(dst, row_of(cache, p0 + k), hd, HP);
                rows[k] = dst;
            }
        }
    };
    // Scores: 16 keys of one vector at a time, sixteen independent chains of C fused multiply-adds.
    const V16 scale = bcast(b.scale);
    for (int t = 0; t < tiles; t++) {
        fill_tile(k_cache, t * TILE);
        for (int j = 0; j < nv; j++) {
            const float *qj = &s.q[static_cast<size_t>(j) * HP];
            V16 qc[C], part[TILE];
            for (int c = 0; c < C; c++) qc[c] = load(qj + 16 * c);
            for (int k = 0; k < TILE; k++) part[k] = mul(qc[0], load(rows[k]));
            for (int c = 1; c < C; c++)
                for (int k = 0; k < TILE; k++) part[k] = fma(qc[c], load(rows[k] + 16 * c), part[k]);
            store(&s.scores[static_cast<size_t>(j) * width + t * TILE], mul(tree16(part), scale));
        }
    }
    // Softmax weights, unnormalised: e_p = exp(score_p - max), 0 past the row's last position.
    for (int j = 0; j < nv; j++) {
        float *sj = &s.scores[static_cast<size_t>(j) * width];
        const int seen = cached + (it.row0 + j / G - start) + 1;
        V16 mv = bcast(-INFINITY);
        for (int t = 0; t < seen / TILE; t++) mv = max(mv, load(sj + t * TILE));
        float m = -INFINITY, lanes[16];
        store(lanes, mv);
        for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
        for (int p = seen / TILE * TILE; p < seen; p++) m = sj[p] > m ? sj[p] : m;
        V16 sum = zero();
        for (int t = 0; t < tiles; t++) {
            const V16 e = keep_first(exp_neg(sub(load(sj + t * TILE), bcast(m))), seen - t * TILE);
            store(sj + t * TILE, e);
            sum = add(sum, e);
        }
        s.inv[j] = 1.0f / tree(sum);
    }
    // Weights x V: each output lane is one chain of fused multiply-adds over p, ascending; NV vectors
    // x C chunks of them advance together (independent chains), tile by tile.
    constexpr int NV = C <= 4 ? 4 : C <= 8 ? 2 : 1;
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    for (int t = 0; t < tiles; t++) {
        fill_tile(v_cache, t * TILE);
        for (int j0 = 0; j0 < nv; j0 += NV) {
            const int n = nv - j0 < NV ? nv - j0 : NV;
            V16 acc[NV][C];
            const float *e[NV];
            for (int j = 0; j < NV; j++) {
                const int jj = j < n ? j0 + j : j0;  // a short group repeats its first vector, unstored
                e[j] = &s.scores[static_cast<size_t>(jj) * width + t * TILE];
                for (int c = 0; c < C; c++) acc[j][c] = load(&s.acc[static_cast<size_t>(jj) * HP + 16 * c]);
            }
            for (int k = 0; k < TILE; k++) {
                V16 v[C];
                for (int c = 0; c < C; c++) v[c] = load(rows[k] + 16 * c);
                for (int j = 0; j < NV; j++) {
                    const V16 w = bcast(e[j][k]);
                    for (int c = 0; c < C; c++) acc[j][c] = fma(w, v[c], acc[j][c]);
                }
            }
            for (int j = 0; j < n; j++)
                for (int c = 0; c < C; c++) store(&s.acc[static_cast<size_t>(j0 + j) * HP + 16 * c], acc[j][c]);
        }
    }
    for (int j = 0; j < nv; j++) {
        float *aj = &s.acc[static_cast<size_t>(j) * HP];
        for (int c = 0; c < C; c++) store(aj + 16 * c, mul(load(aj + 16 * c), bcast(s.inv[j])));
        T *o = out + (static_cast<int64_t>(it.row0 + j / G) * b.nh + it.head * G + j % G) * hd;
        for (int i = 0; i < hd; i++) narrow(aj[i], o + i);
    }
}

template <typename T>
using ItemFn = void (*)(const Item &, const Batch &, const T *, const T *, const T *, T *, Scratch &);

template <typename T> ItemFn<T> item_fn(int hd) {  // head_dim up to 256
    switch ((hd + 15) / 16) {
    case 1: return run_item<1, T>;
    case 2: return run_item<2, T>;
    case 3: return run_item<3, T>;
    case 4: return run_item<4, T>;
    case 5: return run_item<5, T>;
    case 6: return run_item<6, T>;
    case 7: return run_item<7, T>;
    case 8: return run_item<8, T>;
    case 9: return run_item<9, T>;
    case 10: return run_item<10, T>;
    case 11: return run_item<11, T>;
    case 12: return run_item<12, T>;
    case 13: return run_item<13, T>;
    case 14: return run_item<14, T>;
    case 15: return run_item<15, T>;
    default: return run_item<16, T>;
    }
}

template <typename T>
void attention(const T *q, const T *k_cache, const T *v_cache, T *out, const Batch &b, int num_seqs, int threads) {
    const int G = b.nh / b.nkv, rows_per_item = std::max(1, MAX_VECTORS / G);
    std::vector<Item> items;
    for (int s = 0; s < num_seqs; s++) {
        const int a = b.query_start[s], e = b.query_start[s + 1];
        for (int r0 = a; r0 < e; r0 += rows_per_item) {
            const int r1 = std::min(e, r0 + rows_per_item);
            const int64_t keys = b.num_cached[s] + r1 - a;
            for (int h = 0; h < b.nkv; h++) items.push_back({s, h, r0, r1, keys * (r1 - r0)});
        }
    }
    // The heaviest first, so that no thread is left with a long one at the end (bits do not depend on it).
    std::stable_sort(items.begin(), items.end(), [](const Item &x, const Item &y) { return x.cost > y.cost; });
    const int n = static_cast<int>(items.size());
    const ItemFn<T> run = item_fn<T>(b.hd);
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n; i++) run(items[i], b, q, k_cache, v_cache, out, scratch);
    }
}

}  // namespace

// q, out: (T, nh, hd); k_cache, v_cache: (slots, nkv, hd); query_start: (B + 1,); num_cached: (B,);
// tables: (B, max_blocks), all int32. The K and V of the new tokens are in the cache already.
extern "C" {
void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                         const int32_t *query_start, const int32_t *num_cached, const int32_t *tables, int num_seqs,
                         int max_blocks, int nh, int nkv, int hd, int bs, float scale, int threads) {
    attention(q, k_cache, v_cache, out, Batch{query_start, num_cached, tables, max_blocks, nh, nkv, hd, bs, scale},
              num_seqs, threads);
}
void paged_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                          const int32_t *query_start, const int32_t *num_cached, const int32_t *tables, int num_seqs,
                          int max_blocks, int nh, int nkv, int hd, int bs, float scale, int threads) {
    attention(q, k_cache, v_cache, out, Batch{query_start, num_cached, tables, max_blocks, nh, nkv, hd, bs, scale},
              num_seqs, threads);
}
}
