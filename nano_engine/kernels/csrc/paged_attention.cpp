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
//   score(q, k) = (q[0] * k[0], then + q[i] * k[i] in ascending i by fused multiply-adds) * scale;
//   m = the largest score the row sees (a maximum has no order);
//   e_p = exp(score_p - m), by the polynomial in simd.h (the same few operations for every p);
//   sum = tree(16 lane sums of e_p, lane l taking the p with p % 16 == l in ascending p), where
//       tree() adds the 16 lanes pairwise: l + (l + 8), then + 4, + 2, + 1;
//   out = (sum over p, ascending, of e_p * V_p with fused multiply-adds) * (1 / sum).
// Keys past a row's last position contribute exact zeros (e_p = 0), so a row computed alongside a
// longer one, or in a tile that runs past its end, gets the same bits as alone. A fused
// multiply-add rounds once, in every instruction set, so the AVX-512, AVX2 and plain C++ versions
// of each step below give the same bits too (simd.h; tests/test_kernels.py).
//
// bfloat16 is widened to float32 on load (exact) and the output rounded once, to nearest even.
//
// Work: (sequence, KV head, up to 64 query vectors of it) per item; the nh / nkv query heads that
// share a KV head use each K and V row the item reads. Items go to PyTorch's OpenMP threads.
// Built by kernels/build.py with -march=native; loaded with ctypes by kernels/paged_attention.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#include "amx.h"  // defines NANO_AMX where tiles (or their emulation, for the tests) are there

namespace {

using namespace simd;

struct Batch {
    const int32_t *query_start, *num_cached, *tables;
    int max_blocks, nh, nkv, hd, bs;
    float scale;
};

struct Item {
    int seq, head, row0, row1;  // KV head `head` of sequence `seq`, its query rows row0 .. row1 - 1
    int h0, h1;                 // and of the query heads that share that KV head, h0 .. h1 - 1
    int64_t cost;
};

constexpr int TILE = 16;        // keys per tile
constexpr int MAX_VECTORS = 64;  // query vectors (rows x heads sharing a KV head) per item: four groups of 16

// An item's query vectors: vector j is row row0 + j / per_row of query head first_head + j % per_row
// (the query heads h0 .. h1 - 1 of KV head `head`), and sees keys 0 .. seen(j) - 1.
struct Vectors {
    int n, groups, end;  // how many, in groups of 16; the keys the item's last row sees
    int per_row, first_head, row0, first_seen, nh, hd;
    int64_t at(int j) const {  // where vector j starts in q and in out
        return ((static_cast<int64_t>(row0) + j / per_row) * nh + first_head + j % per_row) * hd;
    }
    int seen(int j) const { return first_seen + j / per_row; }
};

inline Vectors vectors_of(const Item &it, const Batch &b) {
    const int per_row = it.h1 - it.h0, n = (it.row1 - it.row0) * per_row;
    const int past = b.num_cached[it.seq] - b.query_start[it.seq];  // row r sits at position past + r
    return {n, (n + 15) / 16, past + it.row1, per_row, it.head * (b.nh / b.nkv) + it.h0, it.row0,
            past + it.row0 + 1, b.nh, b.hd};
}

// at[p]: where key p of the item's sequence and KV head starts in a layer's cache, p < end.
inline void locate(const Item &it, const Batch &b, int end, std::vector<int64_t> &at) {
    const int32_t *table = b.tables + static_cast<int64_t>(it.seq) * b.max_blocks;
    const int64_t stride = static_cast<int64_t>(b.nkv) * b.hd;
    at.resize(end);
    for (int p = 0, blk = 0, off = 0; p < end; p++) {
        at[p] = (static_cast<int64_t>(table[blk]) * b.bs + off) * stride + it.head * b.hd;
        if (++off == b.bs) blk++, off = 0;
    }
}

// A decode reads each row of K and V once, from blocks scattered over a cache much larger than the
// CPU's caches, and does little arithmetic with it: waiting for one row after another, a core sat
// idle most of the time (64 decodes over 1,000 keys read their 49 MB of K and V at 13 GB/s on a
// 2-core Zen 5, a quarter of what the memory delivers). So every path's loop over K asks, at each
// tile of 16 keys, for the K rows AHEAD keys further on, into L1, and for the V rows of the tile
// itself, into L2, where the loop over V that follows will find them. A hint changes no number.
constexpr int AHEAD = 64;

template <int LEVEL, typename T>  // into L1 or L2
inline void prefetch_rows(const T *cache, const int64_t *at, int p0, int p1, int hd) {
    for (int p = p0; p < p1; p++)
        for (int byte = 0; byte < hd * static_cast<int>(sizeof(T)); byte += 64)
            prefetch<LEVEL>(reinterpret_cast<const char *>(cache + at[p]) + byte);
}

// At key p0 of a loop over K (a multiple of 16): K rows p0 + AHEAD .. + 15 (the first call also
// asks for those in between), V rows p0 .. p0 + 15; none past `end`.
template <typename T>
inline void prefetch_tile(const T *k_cache, const T *v_cache, const int64_t *at, int p0, int end, int hd) {
    const int k0 = p0 == 0 ? 0 : p0 + AHEAD;
    prefetch_rows<1>(k_cache, at, std::min(k0, end), std::min(p0 + AHEAD + 16, end), hd);
    prefetch_rows<2>(v_cache, at, std::min(p0, end), std::min(p0 + 16, end), hd);
}

struct Scratch {
    std::vector<float> q, scores, kv, kt, acc, inv;
    std::vector<int64_t> at;
};

// A score is one chain whichever way it is laid out: q[0] * k[0], then + q[i] * k[i] by fused
// multiply-adds in ascending i, times scale. Two layouts compute it, with the same bits:
// keys across a vector's lanes (K^T of a tile, a query vector at a time: for items of few
// vectors, a decode), and query vectors across the lanes (for items of many, a prefill chunk).
#if defined(__AVX512F__)
constexpr int CHAINS = 12, BLOCK = 16;  // score chains in registers at once: 32 registers on AVX-512
#else
constexpr int CHAINS = 6, BLOCK = 4;  // 16 on AVX2, where a V16 takes two
#endif

// Keys across the lanes: n (<= CHAINS) vectors of q (rows of HP floats) against the 16 keys of kt
// (dim i: the 16 keys' values); scores[j * width + k].
template <int N>
inline void score_keys(const float *q, int HP, int hd, const float *kt, float *scores, int width, V16 scale) {
    V16 acc[N];
    const V16 k0 = load(kt);
    for (int j = 0; j < N; j++) acc[j] = mul(bcast(q[j * HP]), k0);
    for (int i = 1; i < hd; i++) {
        const V16 k = load(kt + 16 * i);
        for (int j = 0; j < N; j++) acc[j] = fma(bcast(q[j * HP + i]), k, acc[j]);
    }
    for (int j = 0; j < N; j++) store(scores + static_cast<size_t>(j) * width, mul(acc[j], scale));
}
using KeysFn = void (*)(const float *, int, int, const float *, float *, int, V16);
template <int... N> constexpr KeysFn keys_fns[] = {score_keys<N>...};
constexpr const KeysFn *SCORE_KEYS = keys_fns<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;  // [n - 1]

// Vectors across the lanes: NG groups of 16 (qt: group g, dim i, the 16 vectors' values) against
// R keys (krow[r]: a row of K); st[r * 64 + 16g + lane].
template <int NG, int R>
inline void score_vectors(const float *qt, int hd, const float *const *krow, float *st, V16 scale) {
    V16 acc[R][NG];
    for (int g = 0; g < NG; g++) {
        const V16 qv = load(qt + static_cast<size_t>(g) * hd * 16);
        for (int r = 0; r < R; r++) acc[r][g] = mul(bcast(krow[r][0]), qv);
    }
    for (int i = 1; i < hd; i++) {
        V16 qv[NG];
        for (int g = 0; g < NG; g++) qv[g] = load(qt + (static_cast<size_t>(g) * hd + i) * 16);
        in_registers(qv);  // loaded once for the R keys, not once per key
        for (int r = 0; r < R; r++) {
            const V16 kv = bcast(krow[r][i]);
            for (int g = 0; g < NG; g++) acc[r][g] = fma(kv, qv[g], acc[r][g]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++) store(st + r * 64 + 16 * g, mul(acc[r][g], scale));
}
template <int NG> inline void score_vectors_tile(const float *qt, int hd, const float *const *krow, float *st, V16 scale) {
    constexpr int R = BLOCK / NG >= 8 ? 8 : BLOCK / NG >= 4 ? 4 : BLOCK / NG >= 2 ? 2 : 1;  // keys, dividing TILE
    for (int r0 = 0; r0 < TILE; r0 += R) score_vectors<NG, R>(qt, hd, krow + r0, st + r0 * 64, scale);
}

// Rows row0..row1-1 of one sequence, for one KV head; C = head_dim / 16, rounded up.
template <int C, typename T, typename O>
void run_item(const Item &it, const Batch &b, const T *q, const T *k_cache, const T *v_cache, O *out, Scratch &s) {
    constexpr int HP = C * 16;  // head_dim padded
    const int hd = b.hd;
    const Vectors vs = vectors_of(it, b);
    const int nv = vs.n, groups = vs.groups, end = vs.end;
    const bool across = groups > 1;  // query vectors across the lanes
    const int tiles = (end + TILE - 1) / TILE, width = tiles * TILE;
    locate(it, b, end, s.at);  // key p's row of this head: cache + at[p]
    s.kv.resize(static_cast<size_t>(TILE + 1) * HP);  // 16 rows, then a row of zeros
    s.acc.assign(static_cast<size_t>(nv) * HP, 0.0f);
    s.inv.resize(static_cast<size_t>(groups) * 16);
    float *zeros = &s.kv[static_cast<size_t>(TILE) * HP];
    std::fill(zeros, zeros + HP, 0.0f);
    // The tile's 16 rows of K or V as floats, read in place where they already are floats of a whole
    // padded head, else widened into scratch; a row of zeros past `end`.
    const float *rows[TILE];
    auto fill_tile = [&](const T *cache, int p0) {
        for (int k = 0; k < TILE; k++) {
            if (p0 + k >= end) {
                rows[k] = zeros;
            } else if constexpr (sizeof(T) == 4) {
                if (hd == HP) {
                    rows[k] = reinterpret_cast<const float *>(cache + s.at[p0 + k]);
                    continue;
                }
            }
            if (p0 + k < end) {
                float *dst = &s.kv[static_cast<size_t>(k) * HP];
                widen_row(dst, cache + s.at[p0 + k], hd, HP);
                rows[k] = dst;
            }
        }
    };
    const V16 scale = bcast(b.scale);
    // Scores, then the weights in their place: e_p = exp(score_p - m), 0 past what the vector sees.
    // The sum: lane sums, key p into lane p % 16 in ascending p, then tree().
    if (across) {  // st: row p holds key p's score (then weight) of the 64 vectors
        s.q.assign(static_cast<size_t>(groups) * hd * 16, 0.0f);  // Q^T: group g, dim i, the 16 vectors
        for (int j = 0; j < nv; j++) {
            const T *src = q + vs.at(j);
            float *dst = &s.q[static_cast<size_t>(j / 16) * hd * 16 + j % 16];
            for (int i = 0; i < hd; i++) dst[i * 16] = widen(src[i]);
        }
        s.scores.resize(static_cast<size_t>(width) * 64);
        for (int t = 0; t < tiles; t++) {
            prefetch_tile(k_cache, v_cache, s.at.data(), t * TILE, end, hd);
            fill_tile(k_cache, t * TILE);
            float *st = &s.scores[static_cast<size_t>(t) * TILE * 64];
            switch (groups) {
            case 2: score_vectors_tile<2>(s.q.data(), hd, rows, st, scale); break;
            case 3: score_vectors_tile<3>(s.q.data(), hd, rows, st, scale); break;
            default: score_vectors_tile<4>(s.q.data(), hd, rows, st, scale); break;
            }
        }
        for (int g = 0; g < groups; g++) {
            alignas(64) float limit[16];
            int most = 0, least = 1 << 30;
            for (int n = 0; n < 16; n++) {
                const int j = 16 * g + n, k = j < nv ? vs.seen(j) : 0;
                limit[n] = static_cast<float>(k);  // exact below 2^24
                if (j < nv) least = std::min(least, k);
                most = std::max(most, k);
            }
            const V16 lim = load(limit);
            auto at = [&](int p) { return &s.scores[static_cast<size_t>(p) * 64 + 16 * g]; };
            auto sees = [&](int p, V16 a, V16 otherwise) {  // a where the vector sees key p
                return p < least ? a : select_lt(bcast(static_cast<float>(p)), lim, a, otherwise);
            };
            const V16 none = bcast(-INFINITY);
            V16 mx[4] = {none, none, none, none};  // four running parts (a maximum has no order)
            for (int p0 = 0; p0 < most; p0 += 16)  // most <= width, a multiple of 16
                for (int l = 0; l < 16; l++) mx[l % 4] = max(mx[l % 4], sees(p0 + l, load(at(p0 + l)), none));
            const V16 m = max(max(mx[0], mx[1]), max(mx[2], mx[3]));
            V16 lane[16];
            for (int l = 0; l < 16; l++) lane[l] = zero();
            for (int p0 = 0; p0 < width; p0 += 16)
                for (int l = 0; l < 16; l++) {
                    const V16 e = sees(p0 + l, exp(sub(load(at(p0 + l)), m)), zero());
                    store(at(p0 + l), e);
                    lane[l] = add(lane[l], e);
                }
            for (int w = 8; w >= 1; w /= 2)
                for (int l = 0; l < w; l++) lane[l] = add(lane[l], lane[l + w]);
            store(&s.inv[static_cast<size_t>(16 * g)], div(bcast(1.0f), lane[0]));
        }
    } else {  // scores[j * width + p]
        s.q.resize(static_cast<size_t>(nv) * HP);
        for (int j = 0; j < nv; j++) widen_row(&s.q[static_cast<size_t>(j) * HP], q + vs.at(j), hd, HP);
        s.scores.resize(static_cast<size_t>(nv) * width);
        s.kt.resize(static_cast<size_t>(HP) * 16);
        for (int t = 0; t < tiles; t++) {
            prefetch_tile(k_cache, v_cache, s.at.data(), t * TILE, end, hd);
            fill_tile(k_cache, t * TILE);
            for (int c = 0; c < C; c++) {  // K^T: dim 16c + d of the 16 keys
                V16 r[TILE];
                for (int k = 0; k < TILE; k++) r[k] = load(rows[k] + 16 * c);
                transpose16(r);
                for (int d = 0; d < 16; d++) store(&s.kt[static_cast<size_t>(16 * c + d) * 16], r[d]);
            }
            for (int j0 = 0; j0 < nv; j0 += CHAINS)
                SCORE_KEYS[std::min(CHAINS, nv - j0) - 1](&s.q[static_cast<size_t>(j0) * HP], HP, hd, s.kt.data(),
                                                          &s.scores[static_cast<size_t>(j0) * width + t * TILE], width, scale);
        }
        for (int j = 0; j < nv; j++) {
            float *sj = &s.scores[static_cast<size_t>(j) * width];
            const int k = vs.seen(j);
            V16 mv = bcast(-INFINITY);
            for (int t = 0; t < k / TILE; t++) mv = max(mv, load(sj + t * TILE));
            float m = -INFINITY, lanes[16];
            store(lanes, mv);
            for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
            for (int p = k / TILE * TILE; p < k; p++) m = sj[p] > m ? sj[p] : m;
            V16 sum = zero();
            for (int t = 0; t < tiles; t++) {
                const V16 e = keep_first(exp(sub(load(sj + t * TILE), bcast(m))), k - t * TILE);
                store(sj + t * TILE, e);
                sum = add(sum, e);
            }
            s.inv[j] = 1.0f / tree(sum);
        }
    }
    // Weights x V: each output lane is one chain of fused multiply-adds over p, ascending; NV vectors
    // x C chunks of them advance together (independent chains), tile by tile.
    constexpr int NV = C <= 4 ? 4 : C <= 8 ? 2 : 1;
    const int step = across ? 64 : 1;  // from one key's weight to the next
    auto weights = [&](int j, int p0) {
        return across ? &s.scores[static_cast<size_t>(p0) * 64 + j] : &s.scores[static_cast<size_t>(j) * width + p0];
    };
    for (int t = 0; t < tiles; t++) {
        fill_tile(v_cache, t * TILE);
        // V rows two tiles on, into L1: a decode's loop over V does too little per row to hide
        // L2's latency (64 float32 decodes over 1,000 keys: 4.5 -> 3.9 ms on a 2-core Zen 5).
        prefetch_rows<1>(v_cache, s.at.data(), std::min((t + 2) * TILE, end), std::min((t + 3) * TILE, end), hd);
        for (int j0 = 0; j0 < nv; j0 += NV) {
            const int n = nv - j0 < NV ? nv - j0 : NV;
            V16 acc[NV][C];
            const float *e[NV];
            for (int j = 0; j < NV; j++) {
                const int jj = j < n ? j0 + j : j0;  // a short group repeats its first vector, unstored
                e[j] = weights(jj, t * TILE);
                for (int c = 0; c < C; c++) acc[j][c] = load(&s.acc[static_cast<size_t>(jj) * HP + 16 * c]);
            }
            for (int k = 0; k < TILE; k++) {
                V16 v[C];
                for (int c = 0; c < C; c++) v[c] = load(rows[k] + 16 * c);
                for (int j = 0; j < NV; j++) {
                    const V16 w = bcast(e[j][k * step]);
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
        for (int i = 0; i < hd; i++) narrow(aj[i], out + vs.at(j) + i);
    }
}

template <typename T, typename O>
using ItemFn = void (*)(const Item &, const Batch &, const T *, const T *, const T *, O *, Scratch &);

template <typename T, typename O> ItemFn<T, O> item_fn(int hd) {  // head_dim up to 256
    switch ((hd + 15) / 16) {
    case 1: return run_item<1, T, O>;
    case 2: return run_item<2, T, O>;
    case 3: return run_item<3, T, O>;
    case 4: return run_item<4, T, O>;
    case 5: return run_item<5, T, O>;
    case 6: return run_item<6, T, O>;
    case 7: return run_item<7, T, O>;
    case 8: return run_item<8, T, O>;
    case 9: return run_item<9, T, O>;
    case 10: return run_item<10, T, O>;
    case 11: return run_item<11, T, O>;
    case 12: return run_item<12, T, O>;
    case 13: return run_item<13, T, O>;
    case 14: return run_item<14, T, O>;
    case 15: return run_item<15, T, O>;
    default: return run_item<16, T, O>;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NANO_PAIRS 1
// What the two bfloat16 paths below share (AMX tiles, and AVX512_BF16 dot products without AMX):
// the softmax of the scores into bfloat16 weights, and V, in the pair layout their products read.
namespace pairs {

inline __m512i load32(const uint16_t *src, int n) {  // the first n (<= 32) of 32 bfloat16, zeros after
    const __mmask32 m = n >= 32 ? 0xffffffffu : n <= 0 ? 0u : (1u << n) - 1;
    return _mm512_maskz_loadu_epi16(m, src);
}

// A softmax weight of the bfloat16 paths, for 16 scores s: 2^t, t = s c - m c = n + f with n an
// integer and |f| <= 1/2: 2^f by its Taylor polynomial of degree 5 (relative error under 3e-6),
// times 2^n; 0 in the lanes not `live` (keys past what the vector sees).
inline __m512 weight(__m512 s, __m512 c, __m512 mc, __mmask16 live) {
    const __m512 t = _mm512_fmsub_ps(s, c, mc);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.3333558e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, y, n);
}

// st: row p holds key p's scores of the item's (up to) 64 query vectors, p < width (a multiple of
// 32). Down the columns (a lane is a query vector), in base 2 with the scale folded in:
// w_p = 2^(s_p c - m c), 0 past what the vector sees; sums[j] = the w_p in four running parts, key p
// into part p % 4, then (part 0 + part 1) + (part 2 + part 3). The weights, rounded to bfloat16,
// become rows of `weights` (vector j: keys 0 .. width - 1).
void softmax_down(const float *st, const Vectors &vs, int groups, int width, float scale, std::vector<uint16_t> &weights,
                  float *sums) {
    const int nv = vs.n;
    weights.resize(static_cast<size_t>(groups) * 16 * width);
    const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
    alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(pair_idx);
    for (int g = 0; g < groups; g++) {
        alignas(64) int32_t seen[16];
        int most = 0, least = INT32_MAX;
        __mmask16 used = 0;
        for (int n = 0; n < 16; n++) {
            const int j = 16 * g + n;
            seen[n] = j < nv ? vs.seen(j) : 0;
            if (j < nv) used |= static_cast<__mmask16>(1u << n), least = std::min(least, seen[n]);
            most = std::max(most, seen[n]);
        }
        const __m512i seenv = _mm512_load_si512(seen);
        auto live = [&](int p) {  // the vectors that see key p
            return p < least ? used : _mm512_cmpgt_epi32_mask(seenv, _mm512_set1_epi32(p));
        };
        auto score = [&](int p) { return _mm512_loadu_ps(&st[static_cast<size_t>(p) * 64 + 16 * g]); };
        __m512 mx[4];  // the maximum, in four running parts (a maximum has no order)
        for (int r = 0; r < 4; r++) mx[r] = _mm512_set1_ps(-INFINITY);
        int p = 0;
        for (; p + 4 <= most; p += 4)  // four at a time: constant indices keep mx in registers
            for (int r = 0; r < 4; r++) mx[r] = _mm512_mask_max_ps(mx[r], live(p + r), mx[r], score(p + r));
        for (; p < most; p++) mx[p % 4] = _mm512_mask_max_ps(mx[p % 4], live(p), mx[p % 4], score(p));
        const __m512 mc = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3])), c);
        __m512 part[4];  // the sum in four parts, key p into part p % 4
        for (int r = 0; r < 4; r++) part[r] = _mm512_setzero_ps();
        for (int p0 = 0; p0 < width; p0 += 32) {
            __m512i pr[16];  // pr[kk], lane n: the weights of keys p0 + 2kk and p0 + 2kk + 1 for vector n
            for (int kk = 0; kk < 16; kk += 2) {
                __m512 w[4];
                for (int e = 0; e < 4; e++) {  // key p0 + 2kk + e goes into part e (p0 + 2kk is a multiple of 4)
                    const int q = p0 + 2 * kk + e;
                    w[e] = weight(score(q), c, mc, live(q));
                    part[e] = _mm512_add_ps(part[e], w[e]);
                }
                // 16-bit element 2n: key p0 + 2kk of vector n; 2n + 1: key p0 + 2kk + 1 (and kk + 1 likewise)
                pr[kk] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0])));
                pr[kk + 1] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[3], w[2])));
            }
            simd::transpose16_epi32(pr);  // pr[n]: vector 16g + n's weights of keys p0 .. p0 + 31
            for (int n = 0; n < 16; n++)
                _mm512_storeu_si512(&weights[static_cast<size_t>(16 * g + n) * width + p0], pr[n]);
        }
        _mm512_store_ps(sums + 16 * g, _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3])));
    }
}

// V in the pair layout: tile (block, d), row kk, column n = V[32 block + 2kk][16d + n] and
// V[32 block + 2kk + 1][16d + n]; zeros past `end` (a weight of 0 times them adds exact zeros).
void pack_v(const uint16_t *v_cache, const int64_t *at, int end, int hd, int width, std::vector<uint16_t> &vp) {
    const int blocks = width / 32, nd = (hd + 15) / 16, nkb = (hd + 31) / 32;
    vp.resize(static_cast<size_t>(blocks) * nd * 512);
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < width; p += 2) {
        const uint16_t *r0 = p < end ? v_cache + at[p] : nullptr, *r1 = p + 1 < end ? v_cache + at[p + 1] : nullptr;
        uint16_t *dst = &vp[static_cast<size_t>(p / 32) * nd * 512 + (p % 32 / 2) * 32];
        for (int c = 0; c < nkb; c++) {
            const __m512i x0 = r0 ? load32(r0 + 32 * c, hd - 32 * c) : _mm512_setzero_si512();
            const __m512i x1 = r1 ? load32(r1 + 32 * c, hd - 32 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * c * 512, _mm512_permutex2var_epi16(x0, lo, x1));
            if (2 * c + 1 < nd) _mm512_storeu_si512(dst + (2 * c + 1) * 512, _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
}

// out = acc * (1 / sum), rounded once into the output (acc: the vectors' rows of aw floats).
template <typename O> void write_out(float *acc, int aw, const float *sums, const Vectors &vs, int hd, O *out) {
    for (int j = 0; j < vs.n; j++) {
        float *aj = acc + static_cast<size_t>(j) * aw;
        const V16 inv = bcast(1.0f / sums[j]);
        for (int c = 0; c < (hd + 15) / 16; c++) store(aj + 16 * c, mul(load(aj + 16 * c), inv));
        for (int i = 0; i < hd; i++) narrow(aj[i], out + vs.at(j) + i);
    }
}

}  // namespace pairs
#endif

#ifdef NANO_PAIRS
// bfloat16 with AVX512_BF16 dot products, where the CPU has them but no AMX (AMD Zen 4 and 5):
// the AMX path's algorithm on 16-lane vectors, with its softmax and V layout (namespace pairs).
// VDPBF16PS adds, in each float32 lane, a[1] b[1] and then a[0] b[0] of a pair of bfloat16 (each
// product exact, each sum rounded; Intel's definition, which AMD's CPUs follow). Each number of a
// row is one fixed chain, whichever layout computes it:
//   s_p = q . k_p, over the pairs of head_dim in ascending order, one VDPBF16PS a pair;
//   m, w_p = 2^(s_p c - m c) and sum as on AMX (pairs::softmax_down);
//   out = (the sum over key pairs in ascending order of bfloat16(w) V, one VDPBF16PS a pair)
//       * (1 / sum).
// Scores are computed with query vectors across the lanes for items of more than 16 vectors (a
// prefill chunk), and with keys across the lanes for the others (a decode: 16 keys of one vector a
// vector), with the same bits; the softmax likewise. head_dim must be even (pairs).
namespace dot {

struct Scratch {
    std::vector<uint16_t> qt, kt, p, vp;
    std::vector<float> st, acc;
    std::vector<int64_t> at;
};

inline __m512 dp(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

inline __m512i pair_at(const uint16_t *row, int i) {  // elements 2i and 2i + 1 of a row, in every lane
    uint32_t v;
    std::memcpy(&v, row + 2 * i, 4);
    return _mm512_set1_epi32(static_cast<int>(v));
}

// Query vectors across the lanes: NG groups of 16 (qt: group g, pair i: the 16 vectors' pairs)
// against R keys (krow[r]: a row of K); st[r * 64 + 16g + lane].
template <int NG, int R>
inline void scores_across(const uint16_t *qt, int npairs, const uint16_t *const *krow, float *st) {
    __m512 acc[R][NG];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    for (int i = 0; i < npairs; i++) {
        __m512i qv[NG];
        for (int g = 0; g < NG; g++) qv[g] = _mm512_loadu_si512(qt + (static_cast<size_t>(g) * npairs + i) * 32);
        for (int r = 0; r < R; r++) {
            const __m512i kv = pair_at(krow[r], i);
            for (int g = 0; g < NG; g++) acc[r][g] = dp(acc[r][g], qv[g], kv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(st + r * 64 + 16 * g, acc[r][g]);
}
template <int NG> void scores_across_tile(const uint16_t *qt, int npairs, const uint16_t *const *krow, float *st) {
    constexpr int R = NG == 2 ? 8 : 4;  // keys at a time, dividing 16
    for (int r0 = 0; r0 < 16; r0 += R) scores_across<NG, R>(qt, npairs, krow + r0, st + r0 * 64);
}

// Keys across the lanes: N vectors (q rows) against 16 keys (kt: pair i, the 16 keys' pairs).
template <int N>
inline void scores_keys(const uint16_t *const *qrow, int npairs, const uint16_t *kt, float *const *out) {
    __m512 acc[N];
    for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();
    for (int i = 0; i < npairs; i++) {
        const __m512i kv = _mm512_loadu_si512(kt + static_cast<size_t>(i) * 32);
        for (int j = 0; j < N; j++) acc[j] = dp(acc[j], pair_at(qrow[j], i), kv);
    }
    for (int j = 0; j < N; j++) _mm512_storeu_ps(out[j], acc[j]);
}

// One vector's softmax over its row of scores (keys across the lanes), with the bits of
// pairs::softmax_down: the same steps per key, and four running parts of the sum fed in ascending p.
inline float softmax_row(const float *sc, int seen, int width, float scale, uint16_t *w_out) {
    const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int p0 = 0; p0 < seen; p0 += 16) {
        const __mmask16 live = seen - p0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (seen - p0)) - 1);
        mv = _mm512_mask_max_ps(mv, live, mv, _mm512_loadu_ps(sc + p0));
    }
    const __m512 mc = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mv)), c);
    __m128 part = _mm_setzero_ps();  // lane r: part r of the sum, key p into part p % 4
    for (int p0 = 0; p0 < width; p0 += 16) {
        const int left = seen - p0;
        const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
        const __m512 w = pairs::weight(_mm512_loadu_ps(sc + p0), c, mc, live);
        part = _mm_add_ps(part, _mm512_extractf32x4_ps(w, 0));
        part = _mm_add_ps(part, _mm512_extractf32x4_ps(w, 1));
        part = _mm_add_ps(part, _mm512_extractf32x4_ps(w, 2));
        part = _mm_add_ps(part, _mm512_extractf32x4_ps(w, 3));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(w_out + p0), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
    }
    alignas(16) float parts[4];
    _mm_store_ps(parts, part);
    return (parts[0] + parts[1]) + (parts[2] + parts[3]);
}

// Weights x V for vectors j0 .. j0 + NV - 1 (wrow: their bfloat16 weights; s.vp: V in pairs), dims
// 16 d0 .. 16 (d0 + DN) - 1, into s.acc: each lane one chain over the key pairs in ascending order.
// NV and DN are constants, so that the NV x DN chains stay in registers.
template <int NV, int DN>
void weights_v_dims(Scratch &s, const uint16_t *const *wrow, int j0, int width, int nd, int aw, int d0) {
    __m512 acc[NV][DN];
    for (int j = 0; j < NV; j++)
        for (int d = 0; d < DN; d++) acc[j][d] = _mm512_setzero_ps();
    for (int kp = 0; kp < width / 2; kp++) {
        const uint16_t *vb = &s.vp[(static_cast<size_t>(kp / 16) * nd + d0) * 512 + (kp % 16) * 32];
        __m512i v[DN];
        for (int d = 0; d < DN; d++) v[d] = _mm512_loadu_si512(vb + d * 512);
        for (int j = 0; j < NV; j++) {
            const __m512i w = pair_at(wrow[j], kp);
            for (int d = 0; d < DN; d++) acc[j][d] = dp(acc[j][d], w, v[d]);
        }
    }
    for (int j = 0; j < NV; j++)
        for (int d = 0; d < DN; d++) _mm512_storeu_ps(&s.acc[static_cast<size_t>(j0 + j) * aw + 16 * (d0 + d)], acc[j][d]);
}

template <int NV> void weights_v(Scratch &s, int j0, int width, int nd, int aw) {
    const uint16_t *wrow[NV];
    for (int j = 0; j < NV; j++) wrow[j] = &s.p[static_cast<size_t>(j0 + j) * width];
    for (int d0 = 0; d0 < nd; d0 += 4) {
        switch (std::min(4, nd - d0)) {
        case 1: weights_v_dims<NV, 1>(s, wrow, j0, width, nd, aw, d0); break;
        case 2: weights_v_dims<NV, 2>(s, wrow, j0, width, nd, aw, d0); break;
        case 3: weights_v_dims<NV, 3>(s, wrow, j0, width, nd, aw, d0); break;
        default: weights_v_dims<NV, 4>(s, wrow, j0, width, nd, aw, d0); break;
        }
    }
}

// The rows row0..row1-1 of one sequence, for one KV head (the same items as the other paths).
template <typename O>
void run_item(const Item &it, const Batch &b, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
              O *out, Scratch &s) {
    const int hd = b.hd, npairs = hd / 2, nd = (hd + 15) / 16;
    const Vectors vs = vectors_of(it, b);
    const int nv = vs.n, groups = vs.groups, end = vs.end;
    const int width = (end + 31) / 32 * 32;  // keys, in whole blocks of 32 (the pair layout's)
    locate(it, b, end, s.at);
    s.kt.assign(static_cast<size_t>(hd) + 32, 0);  // a row of zeros for keys past `end`
    const uint16_t *zeros = s.kt.data();
    auto key_row = [&](int p) { return p < end ? k_cache + s.at[p] : zeros; };
    alignas(64) float sums[64];
    if (groups > 1) {
        // Q^T in pairs: group g, pair i, lane n = dims 2i, 2i + 1 of vector 16g + n.
        s.qt.assign(static_cast<size_t>(groups) * npairs * 32, 0);
        for (int j = 0; j < nv; j++) {
            const uint16_t *src = q + vs.at(j);
            uint16_t *dst = &s.qt[static_cast<size_t>(j / 16) * npairs * 32 + (j % 16) * 2];
            for (int i = 0; i < hd; i++) dst[(i / 2) * 32 + i % 2] = src[i];
        }
        s.st.resize(static_cast<size_t>(width) * 64);
        const uint16_t *rows[16];
        for (int p0 = 0; p0 < width; p0 += 16) {
            prefetch_tile(k_cache, v_cache, s.at.data(), p0, end, hd);
            for (int r = 0; r < 16; r++) rows[r] = key_row(p0 + r);
            float *st = &s.st[static_cast<size_t>(p0) * 64];
            switch (groups) {
            case 2: scores_across_tile<2>(s.qt.data(), npairs, rows, st); break;
            case 3: scores_across_tile<3>(s.qt.data(), npairs, rows, st); break;
            default: scores_across_tile<4>(s.qt.data(), npairs, rows, st); break;
            }
        }
        pairs::softmax_down(s.st.data(), vs, groups, width, b.scale, s.p, sums);
    } else {
        // K^T in pairs, 16 keys at a time: pair i, lane k = dims 2i, 2i + 1 of key p0 + k.
        const int chunks = (npairs + 15) / 16;
        std::vector<uint16_t> &kt = s.qt;
        kt.resize(static_cast<size_t>(chunks) * 16 * 32);
        s.st.resize(static_cast<size_t>(nv) * width);
        const uint16_t *qrow[16];
        for (int j = 0; j < nv; j++) qrow[j] = q + vs.at(j);
        for (int p0 = 0; p0 < width; p0 += 16) {
            prefetch_tile(k_cache, v_cache, s.at.data(), p0, end, hd);
            for (int c = 0; c < chunks; c++) {
                __m512i r[16];
                for (int k = 0; k < 16; k++) r[k] = pairs::load32(key_row(p0 + k) + 32 * c, hd - 32 * c);
                simd::transpose16_epi32(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_si512(&kt[static_cast<size_t>(16 * c + i) * 32], r[i]);
            }
            for (int j0 = 0; j0 < nv; j0 += 4) {
                float *dst[4];
                for (int j = 0; j < 4 && j0 + j < nv; j++) dst[j] = &s.st[static_cast<size_t>(j0 + j) * width + p0];
                switch (std::min(4, nv - j0)) {
                case 1: scores_keys<1>(qrow + j0, npairs, kt.data(), dst); break;
                case 2: scores_keys<2>(qrow + j0, npairs, kt.data(), dst); break;
                case 3: scores_keys<3>(qrow + j0, npairs, kt.data(), dst); break;
                default: scores_keys<4>(qrow + j0, npairs, kt.data(), dst); break;
                }
            }
        }
        s.p.resize(static_cast<size_t>(nv) * width);
        for (int j = 0; j < nv; j++)
            sums[j] = softmax_row(&s.st[static_cast<size_t>(j) * width], vs.seen(j), width, b.scale,
                                  &s.p[static_cast<size_t>(j) * width]);
    }
    // P V: per vector, 16 dims a lane vector, one chain over the key pairs in ascending order.
    pairs::pack_v(v_cache, s.at.data(), end, hd, width, s.vp);
    const int aw = nd * 16;
    s.acc.resize(static_cast<size_t>(nv) * aw);
    for (int j0 = 0; j0 < nv; j0 += 4) {
        switch (std::min(4, nv - j0)) {  // as many vectors as there are (a decode of 3 query heads a KV head: 3)
        case 1: weights_v<1>(s, j0, width, nd, aw); break;
        case 2: weights_v<2>(s, j0, width, nd, aw); break;
        case 3: weights_v<3>(s, j0, width, nd, aw); break;
        default: weights_v<4>(s, j0, width, nd, aw); break;
        }
    }
    pairs::write_out(s.acc.data(), aw, sums, vs, hd, out);
}

}  // namespace dot
#endif

#ifdef NANO_AMX
// bfloat16 on AMX tiles (Sapphire Rapids and later). Scores come out transposed, keys x query
// vectors (S^T = K Q^T), so that K is read straight from its block as a tile's 16 rows, without a
// copy; the weights are rounded to bfloat16 and multiplied into V the same way. Each number of a
// row is again one fixed chain:
//   s_p = q . k_p, the tiles' sum over head_dim, 32 products per TDPBF16PS in ascending slices (a
//       product of two bfloat16 is exact in float32);
//   m = the largest s_p the row sees; c = scale * log2(e), rounded to float;
//   w_p = 2^(s_p c - m c) (one fused multiply-subtract, then a polynomial, below), 0 past the
//       row's last position; sum = the w_p in four running parts, key p into part p % 4, then
//       (part 0 + part 1) + (part 2 + part 3);
//   out = (the tiles' sum over p of bfloat16(w_p) * V_p, 32 positions per TDPBF16PS, ascending)
//       * (1 / sum).
// A tile's element depends on one row of its left operand and one column of its right one, never
// on the rows or columns beside it, so a row's bits do not depend on its company here either.
// They differ from the vector code's bits (whose weights stay float32): on a CPU with AMX every
// bfloat16 call runs this code, generate() included.
namespace amx {

bool permitted() {  // asked once per process
    static const bool ok = tiles::request();
    return ok;
}

struct Scratch {
    std::vector<uint16_t> qt, kg, p, vp;
    std::vector<float> st, acc;
    std::vector<int64_t> at;
};

// The rows row0..row1-1 of one sequence, for one KV head (the same items as the vector code).
template <typename O>
void run_item(const Item &it, const Batch &b, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
              O *out, Scratch &s) {
    const int hd = b.hd;
    const Vectors vs = vectors_of(it, b);
    const int nv = vs.n, groups = vs.groups, end = vs.end;
    const int blocks = (end + 31) / 32, width = blocks * 32;            // 32 keys a block
    const int nkb = (hd + 31) / 32, nd = (hd + 15) / 16, kw = nkb * 32;  // 32-wide slices, 16-wide dims
    const int64_t stride = static_cast<int64_t>(b.nkv) * hd;
    locate(it, b, end, s.at);  // key p's row of this head: cache + at[p]
    auto row_of = [&](const uint16_t *cache, int p) { return cache + s.at[p]; };
    // Q^T in the pair layout TDPBF16PS reads: tile (g, kb), row kk, column n = dims 32kb + 2kk, +1 of vector 16g + n.
    s.qt.assign(static_cast<size_t>(groups) * nkb * 512, 0);
    for (int j = 0; j < nv; j++) {
        const uint16_t *src = q + vs.at(j);
        uint16_t *dst = &s.qt[static_cast<size_t>(j / 16) * nkb * 512 + (j % 16) * 2];
        for (int i = 0; i < hd; i++) dst[(i / 32) * 512 + (i % 32 / 2) * 32 + i % 2] = src[i];
    }
    // Scores, S^T: for each 16 keys, one tile of K (read in place where its 16 rows lie in one block
    // and head_dim is whole 32-wide slices, else copied, with zeros past `end`) times the Q^T of each
    // group, one output tile per group.
    s.st.resize(static_cast<size_t>(width) * 64);
    s.kg.resize(static_cast<size_t>(16) * kw);
    const bool slices = hd % 32 == 0;
    for (int p0 = 0; p0 < width; p0 += 16) {
        prefetch_tile(k_cache, v_cache, s.at.data(), p0, end, hd);
        const uint16_t *a;
        long lda;
        if (slices && p0 < end && p0 % b.bs + 16 <= b.bs) {  // keys past `end` here are masked below
            a = row_of(k_cache, p0), lda = stride * 2;
        } else {
            uint16_t *dst = s.kg.data();
            std::fill(dst, dst + 16 * kw, 0);
            for (int r = 0; r < 16 && p0 + r < end; r++) std::memcpy(dst + r * kw, row_of(k_cache, p0 + r), 2 * hd);
            a = dst, lda = 2 * kw;
        }
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int kb = 0; kb < nkb; kb++) {  // head_dim in ascending slices; tile 4 + g: group g
            const uint16_t *qt = &s.qt[static_cast<size_t>(kb) * 512];
            _tile_loadd(0, a + 32 * kb, lda);
            _tile_loadd(1, qt, 64);
            _tile_dpbf16ps(4, 0, 1);
            if (groups > 1) {
                _tile_loadd(2, qt + nkb * 512, 64);
                _tile_dpbf16ps(5, 0, 2);
            }
            if (groups > 2) {
                _tile_loadd(3, qt + 2 * nkb * 512, 64);
                _tile_dpbf16ps(6, 0, 3);
            }
            if (groups > 3) {
                _tile_loadd(1, qt + 3 * nkb * 512, 64);
                _tile_dpbf16ps(7, 0, 1);
            }
        }
        float *st = &s.st[static_cast<size_t>(p0) * 64];  // row p: the 64 vectors' scores of key p
        _tile_stored(4, st, 256);
        if (groups > 1) _tile_stored(5, st + 16, 256);
        if (groups > 2) _tile_stored(6, st + 32, 256);
        if (groups > 3) _tile_stored(7, st + 48, 256);
    }
    // Softmax down the columns, the weights rounded to bfloat16 in rows of P; V in the pair layout.
    alignas(64) float sums[64];
    pairs::softmax_down(s.st.data(), vs, groups, width, b.scale, s.p, sums);
    pairs::pack_v(v_cache, s.at.data(), end, hd, width, s.vp);
    // P V, per group of 16 vectors and four 16-wide column tiles at a time, keys in ascending blocks.
    const int aw = nd * 16;
    s.acc.resize(static_cast<size_t>(groups) * 16 * aw);
    for (int g = 0; g < groups; g++) {
        for (int d0 = 0; d0 < nd; d0 += 4) {
            const int n = std::min(4, nd - d0);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int blk = 0; blk < blocks; blk++) {
                const uint16_t *vb = &s.vp[(static_cast<size_t>(blk) * nd + d0) * 512];
                _tile_loadd(0, &s.p[static_cast<size_t>(16 * g) * width + 32 * blk], 2 * width);
                _tile_loadd(1, vb, 64);
                _tile_dpbf16ps(4, 0, 1);
                if (n > 1) {
                    _tile_loadd(2, vb + 512, 64);
                    _tile_dpbf16ps(5, 0, 2);
                }
                if (n > 2) {
                    _tile_loadd(3, vb + 1024, 64);
                    _tile_dpbf16ps(6, 0, 3);
                }
                if (n > 3) {
                    _tile_loadd(1, vb + 1536, 64);
                    _tile_dpbf16ps(7, 0, 1);
                }
            }
            float *acc = &s.acc[static_cast<size_t>(16 * g) * aw + 16 * d0];
            _tile_stored(4, acc, 4 * aw);
            if (n > 1) _tile_stored(5, acc + 16, 4 * aw);
            if (n > 2) _tile_stored(6, acc + 32, 4 * aw);
            if (n > 3) _tile_stored(7, acc + 48, 4 * aw);
        }
    }
    pairs::write_out(s.acc.data(), aw, sums, vs, hd, out);
}

}  // namespace amx
#endif

// Inside a parallel region: run(i) for every item, a unit (items unit_start[u] .. unit_start[u + 1] - 1)
// to a thread at a time.
template <typename Run> void each_unit(const std::vector<int> &unit_start, Run run) {
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < static_cast<int>(unit_start.size()) - 1; u++)
        for (int i = unit_start[u]; i < unit_start[u + 1]; i++) run(i);
}

// out: T, or float for a bfloat16 call that keeps the outputs unrounded (paged_attention_bf16_wide).
template <typename T, typename O>
void attention(const T *q, const T *k_cache, const T *v_cache, O *out, const Batch &b, int num_seqs, int threads) {
    const int G = b.nh / b.nkv, rows_per_item = std::max(1, MAX_VECTORS / G);
    std::vector<Item> items;
    for (int s = 0; s < num_seqs; s++) {
        const int a = b.query_start[s], e = b.query_start[s + 1];
        for (int r0 = a; r0 < e; r0 += rows_per_item) {
            const int r1 = std::min(e, r0 + rows_per_item);
            const int64_t keys = b.num_cached[s] + r1 - a;
            for (int h = 0; h < b.nkv; h++)
                for (int h0 = 0; h0 < G; h0 += MAX_VECTORS)  // more query heads a KV head than that: rare
                    items.push_back({s, h, r0, r1, h0, std::min(G, h0 + MAX_VECTORS), keys * (r1 - r0)});
        }
    }
    // The heaviest first, so that no thread is left with a long one at the end (bits do not depend on it).
    std::stable_sort(items.begin(), items.end(), [](const Item &x, const Item &y) { return x.cost > y.cost; });
    // Where there are enough of them to share out, a thread takes the KV heads of one group of rows
    // together (a unit): their rows of K and V lie side by side in the same blocks, so the second
    // and third heads find much of theirs already on its way from memory (64 decodes over 1,000
    // keys: 1.9 -> 1.6 ms in bfloat16 on a 2-core Zen 5). Bits do not depend on it.
    std::vector<int> unit_start;
    for (int i = 0; i < static_cast<int>(items.size()); i++)
        if (i == 0 || items[i].seq != items[i - 1].seq || items[i].row0 != items[i - 1].row0) unit_start.push_back(i);
    if (static_cast<int>(unit_start.size()) < 4 * threads) {  // too few: an item each
        unit_start.resize(items.size());
        for (int i = 0; i < static_cast<int>(items.size()); i++) unit_start[i] = i;
    }
    unit_start.push_back(static_cast<int>(items.size()));
#ifdef NANO_AMX
    if constexpr (sizeof(T) == 2) {
        if (amx::permitted()) {
#pragma omp parallel num_threads(threads)
            {
                amx::Scratch scratch;
                tiles::configure({16, 16, 16, 16, 16, 16, 16, 16});  // 16 x 32 bfloat16 or 16 x 16 float each
                each_unit(unit_start, [&](int i) { amx::run_item(items[i], b, q, k_cache, v_cache, out, scratch); });
                _tile_release();
            }
            return;
        }
    }
#endif
#ifdef NANO_PAIRS
    if constexpr (sizeof(T) == 2) {
        if (b.hd % 2 == 0) {
#pragma omp parallel num_threads(threads)
            {
                dot::Scratch scratch;
                each_unit(unit_start, [&](int i) { dot::run_item(items[i], b, q, k_cache, v_cache, out, scratch); });
            }
            return;
        }
    }
#endif
    const ItemFn<T, O> run = item_fn<T, O>(b.hd);
#pragma omp parallel num_threads(threads)
    {
        Scratch scratch;
        each_unit(unit_start, [&](int i) { run(items[i], b, q, k_cache, v_cache, out, scratch); });
    }
}

}  // namespace

// Where bfloat16 runs here, for a head_dim that is even: 2 on AMX tiles, 1 on AVX512_BF16 dot
// products, 0 on the vector code (each with its own bits; an odd head_dim takes the vector code).
extern "C" int paged_attention_bf16_path() {
#ifdef NANO_AMX
    if (amx::permitted()) return 2;
#endif
#ifdef NANO_PAIRS
    return 1;
#else
    return 0;
#endif
}

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
// The same, with each output left in float32 before its one rounding: every bit of every chain
// shows, which the tests compare (a bfloat16 output hides most float32 differences).
void paged_attention_bf16_wide(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, float *out,
                               const int32_t *query_start, const int32_t *num_cached, const int32_t *tables,
                               int num_seqs, int max_blocks, int nh, int nkv, int hd, int bs, float scale, int threads) {
    attention(q, k_cache, v_cache, out, Batch{query_start, num_cached, tables, max_blocks, nh, nkv, hd, bs, scale},
              num_seqs, threads);
}
}
