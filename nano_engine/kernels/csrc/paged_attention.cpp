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
// of each step below give the same bits too (simd.h; tests/test_kernels.py).
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

#include "simd.h"

namespace {

using namespace simd;

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
            const V16 e = keep_first(exp(sub(load(sj + t * TILE), bcast(m))), seen - t * TILE);
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
