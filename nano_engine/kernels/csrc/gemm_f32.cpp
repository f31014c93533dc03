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
#include <vector>

#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int MR = 6;  // rows per register block
constexpr int NP = 4;  // panels (of 16 columns) per register block

// The columns of panel n0 / 16 that exist (N - n0 of them, up to 16).
inline __mmask16 panel_mask(int N, int n0) {
    const int cols = N - n0 < 16 ? N - n0 : 16;
    return cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
}

// A register block's float32 results, the bias (if any) added once, into y (see block).
template <int R, int P>
inline void store_block(const __m512 (&acc)[R][P], float *y, long ldy, const float *bias, int p0, int N) {
    for (int p = 0; p < P; p++) {
        const int n0 = 16 * (p0 + p);
        const __mmask16 mask = panel_mask(N, n0);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(y + r * ldy + 16 * p, mask, bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p]);
    }
}

// Rows m0 .. m0 + R - 1 x panels p0 .. p0 + P - 1: R x P chains of K fused multiply-adds each, from
// w, which points at panel p0 (panels K x 16 apart), into y, which points at the block's first output
// (row m0, column 16 p0), rows ldy apart.
template <int R, int P>
void block(const float *x, long ldx, const float *w, float *y, long ldy, const float *bias, int m0, int p0, int N,
           int K) {
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const float *a = x + m0 * ldx;
    for (int k = 0; k < K; k++) {
        __m512 wv[P];
        for (int p = 0; p < P; p++) wv[p] = _mm512_loadu_ps(w + (static_cast<long>(p) * K + k) * 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(a[r * ldx + k]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
        }
    }
    store_block(acc, y, ldy, bias, p0, N);
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

// The work of a product: items (g, b), a group of NP panels times a block of MR rows, in that order
// (a group's blocks one after another, its panels staying in the cache), shared by `omp for` in
// contiguous runs. Rows are split as well as columns, so that a layer of few groups (576 columns:
// 9 groups) keeps every thread busy to the end at a prefill's row count; a row's bits do not depend
// on which thread computes its block.
struct Items {
    int panels, groups, blocks, M;
    Items(int M_, int N) : panels((N + 15) / 16), groups((panels + NP - 1) / NP), blocks((M_ + MR - 1) / MR), M(M_) {}
    long count() const { return static_cast<long>(groups) * blocks; }
    struct Item {
        int g, p0, P, m0, R;
    };
    Item operator[](long i) const {
        const int g = static_cast<int>(i / blocks), m0 = static_cast<int>(i % blocks) * MR, p0 = g * NP;
        return {g, p0, panels - p0 < NP ? panels - p0 : NP, m0, M - m0 < MR ? M - m0 : MR};
    }
};

struct F32 {
    using Fn = void (*)(const float *, long, const float *, float *, long, const float *, int, int, int, int);
    template <int R, int P> static constexpr Fn block = ::block<R, P>;
    static constexpr long PANEL = 16;  // values of a panel per step of the chain
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// store_block's bfloat16 twin: each result, the bias added, rounded to nearest even.
template <int R, int P>
inline void store_block_bf16(const __m512 (&acc)[R][P], uint16_t *y, long ldy, const float *bias, int p0, int N) {
    for (int p = 0; p < P; p++) {
        const int n0 = 16 * (p0 + p);
        const __mmask16 mask = panel_mask(N, n0);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(simd::round_bf16({v}).v), 16);  // ties to even
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * p, mask, _mm512_cvtepi32_epi16(h));
        }
    }
}

// The bfloat16 twin of `block`: one vdpbf16ps per pair of K steps. x holds the rows as pairs
// (x[k], x[k + 1]) in 32-bit words, broadcast to every lane; the instruction adds x[k + 1] W[k + 1],
// then x[k] W[k] (each product exact in float32, each sum rounded to nearest even, denormals
// flushed: Intel's definition, which AMD's Zen 4 and 5 follow).
template <int R, int P>
void block_bf16(const uint32_t *x, long ldx, const uint16_t *w, uint16_t *y, long ldy, const float *bias, int m0,
                int p0, int N, int pairs) {
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const uint32_t *a = x + m0 * ldx;
    for (int k = 0; k < pairs; k++) {
        __m512bh wv[P];
        for (int p = 0; p < P; p++) wv[p] = (__m512bh)_mm512_loadu_si512(w + (static_cast<long>(p) * pairs + k) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * ldx + k]));
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
        }
    }
    store_block_bf16(acc, y, ldy, bias, p0, N);
}

struct Bf16 {
    using Fn = void (*)(const uint32_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int, int);
    template <int R, int P> static constexpr Fn block = block_bf16<R, P>;
    static constexpr long PANEL = 32;
};
#endif

// A row-parallel layer's leaves (parallel/split.py, mini_llm.Linear) in one call: leaf l is the K
// range x[:, offsets[l] ..] of steps[l] steps, times its own packed weight packs[l]. Each leaf's
// product is the plain kernel's on those columns (the same chains, rounded to Y as its own call
// would round it); the products are then added in split.py's fixed tree in float32 and rounded
// once: fused.cpp's leaf_sum of the separate calls, to the bit, without their trips through memory
// and Python. A register block's leaves go to a small buffer of the thread's, then straight to y.
constexpr int MAX_LEAVES = 64;  // kernels/linear.py takes the separate calls above this

inline __m512 tree_sum(const __m512 *v, int lo, int hi) {  // split.py's Tree: first half rounded up, then the rest
    if (hi - lo == 1) return v[lo];
    const int mid = lo + (hi - lo + 1) / 2;
    return _mm512_add_ps(tree_sum(v, lo, mid), tree_sum(v, mid, hi));
}
// The same tree over leaves LO .. HI - 1 of a count known when compiling: its additions unrolled, the
// leaves loaded straight into registers (leaf(l) loads leaf l). tree_sum's recursion over a runtime
// count kept its operands on the stack and called itself for each output vector: o_proj's three
// parts cost 8-17% more than one product at 64 to 512 rows with it, 3-4% with this (float32, Zen 5).
template <int LO, int HI, class Leaf> inline __m512 tree_sum_of(Leaf leaf) {
    if constexpr (HI - LO == 1) {
        return leaf(LO);
    } else {
        constexpr int MID = LO + (HI - LO + 1) / 2;
        return _mm512_add_ps(tree_sum_of<LO, MID>(leaf), tree_sum_of<MID, HI>(leaf));
    }
}

inline __m512 widen16(const float *p) { return _mm512_loadu_ps(p); }
inline void store16(float *y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 widen16(const uint16_t *p) {  // 16 bfloat16, exactly
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store16(uint16_t *y, __mmask16 mask, __m512 v) {  // rounded to nearest even, as block_bf16 stores
    const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(simd::round_bf16({v}).v), 16);
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(h));
}
#endif

// A register block's parts (part l at buf + l * tile, rows ld apart, each as its own call would
// have rounded it), added in the tree in float32 and rounded once into y (rows m0 .. m0 + R - 1,
// panels p0 .. p0 + P - 1).
template <int LEAVES, class B, class Y>  // LEAVES: the count, or 0 where it is known at run time only
void store_tree_of(const B *buf, long tile, long ld, int leaves, int R, int P, int m0, int p0, int N, Y *y, long ldy) {
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const int n0 = 16 * (p0 + p);
            auto leaf = [&](int l) { return widen16(buf + l * tile + r * ld + 16 * p); };
            __m512 sum;
            if constexpr (LEAVES > 0) {
                sum = tree_sum_of<0, LEAVES>(leaf);
            } else {
                __m512 v[MAX_LEAVES];
                for (int l = 0; l < leaves; l++) v[l] = leaf(l);
                sum = tree_sum(v, 0, leaves);
            }
            store16(y + (m0 + r) * ldy + n0, panel_mask(N, n0), sum);
        }
}
template <class B, class Y>
void store_tree(const B *buf, long tile, long ld, int leaves, int R, int P, int m0, int p0, int N, Y *y, long ldy) {
    switch (leaves) {  // the KV heads of the models at hand: 3 (SmolLM2-135M), 8 (Qwen3-0.6B)
    case 2: return store_tree_of<2>(buf, tile, ld, leaves, R, P, m0, p0, N, y, ldy);
    case 3: return store_tree_of<3>(buf, tile, ld, leaves, R, P, m0, p0, N, y, ldy);
    case 4: return store_tree_of<4>(buf, tile, ld, leaves, R, P, m0, p0, N, y, ldy);
    case 8: return store_tree_of<8>(buf, tile, ld, leaves, R, P, m0, p0, N, y, ldy);
    default: return store_tree_of<0>(buf, tile, ld, leaves, R, P, m0, p0, N, y, ldy);
    }
}

template <class Kernel, class X, class W, class Y>
void leaves_gemm(const X *x, long ldx, const long *offsets, const int *steps, const void *const *packs, int leaves,
                 Y *y, long ldy, int M, int N, int threads) {
    constexpr long LD = NP * 16, TILE = MR * LD;  // one register block's outputs, per leaf
    const Items items(M, N);
#pragma omp parallel num_threads(threads)
    {
        Y *buf = new Y[TILE * leaves]();
#pragma omp for schedule(static)
        for (long i = 0; i < items.count(); i++) {
            const Items::Item it = items[i];
            const int p0 = it.p0, P = it.P, m0 = it.m0, R = it.R;
            const typename Kernel::Fn fn = pick<Kernel>(R, P);
            for (int l = 0; l < leaves; l++)
                fn(x + offsets[l], ldx, static_cast<const W *>(packs[l]) + static_cast<long>(p0) * steps[l] * Kernel::PANEL,
                   buf + l * TILE, LD, nullptr, m0, p0, N, steps[l]);
            store_tree(buf, TILE, LD, leaves, R, P, m0, p0, N, y, ldy);  // the blocks rounded the parts
        }
        delete[] buf;
    }
}



// ----- Weights stored as int8 or int4 (nano_engine/quantization.py), dequantized inside the matmul -----
//
// A weight value is fl(q * scale) in float32: q its integer, scale its group's (a group: G columns of
// one row, counted from the layer's column 0; int8 per channel has one group a row). The product is
// gemm_f32's: one float32 chain of fused multiply-adds over K per output, from zero, the bias added
// once. So a layer gives, to the bit, what gemm_f32 gives on the dequantized weight
// (quantization.dequantize), and a row's bits do not depend on the batch. A batch of at most MR rows
// dequantizes in registers as the chain goes (block_q); a larger one has each thread dequantize the
// panels it owns once per call into a buffer of its own (pack_f32's layout), then run gemm_f32's
// blocks over every row. What is read from memory is the integers, a quarter (int8) or an eighth
// (int4) of float32's bytes. bfloat16 rows take the bfloat16 kernel's chain instead (quant_gemm_bf16).

struct QuantPack {        // kernels: quantization.py's QuantPack, field for field
    const uint8_t *q;     // panels of 16 columns: int8 [panel][k][16]; int4 [panel][k / 2][16] bytes, column n's
                          // values at k (even, low nibble) and k + 1 (high nibble), each as q + 8
    const float *scales;  // [panel][group][16]: the scale of each column's group, from group k0 / G on
    int K, group, k0, bits;  // K: the pack's columns; k0: its first column in the layer; bits: 8 or 4
};

inline int groups_of(const QuantPack &w) { return (w.k0 + w.K - 1) / w.group - w.k0 / w.group + 1; }

// Panels p0 .. p0 + P - 1 of w as floats into out ([p][k][16], pack_f32's layout): fl(q * scale).
void dequantize(const QuantPack &w, int p0, int P, float *out) {
    const int K = w.K, G = w.group, g0 = w.k0 / G, groups = groups_of(w);
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int p = 0; p < P; p++) {
        const long panel = p0 + p;
        float *o = out + p * static_cast<long>(K) * 16;
        for (int k = 0; k < K;) {
            const int g = (w.k0 + k) / G - g0, end = (g0 + g + 1) * G - w.k0 < K ? (g0 + g + 1) * G - w.k0 : K;
            const __m512 scale = _mm512_loadu_ps(w.scales + (panel * groups + g) * 16);
            if (w.bits == 8) {
                const int8_t *q = reinterpret_cast<const int8_t *>(w.q) + panel * K * 16;
                for (; k < end; k++) {
                    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q + k * 16L)));
                    _mm512_storeu_ps(o + k * 16L, _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale));
                }
            } else {
                const uint8_t *q = w.q + panel * ((K + 1) / 2) * 16;
                for (; k < end; k++) {
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q + (k / 2) * 16L)));
                    if (k % 2) v = _mm512_srli_epi32(v, 4);
                    v = _mm512_sub_epi32(_mm512_and_si512(v, low), eight);
                    _mm512_storeu_ps(o + k * 16L, _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale));
                }
            }
        }
    }
}

constexpr long QDIST = 2048;  // bytes of a panel's integers asked for ahead of their use (block_q)

// What `block` computes on dequantize's output, with the weights dequantized in registers as the
// chain goes (a batch of at most MR rows: decode, where the buffer's round trip would cost more than
// the weights' bytes): the same fl(q * scale) values in the same chains, so the same bits.
template <int R, int P>
void block_q(const float *x, long ldx, const QuantPack &w, float *y, long ldy, const float *bias, int m0, int p0, int N) {
    const int K = w.K, G = w.group, g0 = w.k0 / G, groups = groups_of(w);
    const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const float *a = x + m0 * ldx;
    for (int k = 0; k < K;) {
        const int g = (w.k0 + k) / G - g0, end = (g0 + g + 1) * G - w.k0 < K ? (g0 + g + 1) * G - w.k0 : K;
        __m512 scale[P];
        for (int p = 0; p < P; p++) scale[p] = _mm512_loadu_ps(w.scales + ((static_cast<long>(p0) + p) * groups + g) * 16);
        for (; k < end; k++) {
            // The integers stream from memory at a few bytes per weight, too slowly for the hardware's
            // prefetcher to run far enough ahead: each panel asks for its line QDIST bytes on, once a line.
            if (k % (w.bits == 8 ? 4 : 8) == 0) {
                const long row = w.bits == 8 ? K : (K + 1) / 2, at = w.bits == 8 ? k : k / 2;  // in 16-byte steps
                for (int p = 0; p < P; p++) simd::prefetch<1>(w.q + ((static_cast<long>(p0) + p) * row + at) * 16 + QDIST);
            }
            __m512 wv[P];
            for (int p = 0; p < P; p++) {
                __m512i v;
                if (w.bits == 8) {
                    const int8_t *q = reinterpret_cast<const int8_t *>(w.q) + ((static_cast<long>(p0) + p) * K + k) * 16;
                    v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)));
                } else {
                    const uint8_t *q = w.q + ((static_cast<long>(p0) + p) * ((K + 1) / 2) + k / 2) * 16;
                    v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)));
                    if (k % 2) v = _mm512_srli_epi32(v, 4);
                    v = _mm512_sub_epi32(_mm512_and_si512(v, low), eight);
                }
                wv[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale[p]);
            }
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_set1_ps(a[r * ldx + k]);
                for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
            }
        }
    }
    store_block(acc, y, ldy, bias, p0, N);
}

using BlockQ = void (*)(const float *, long, const QuantPack &, float *, long, const float *, int, int, int);

template <int R> BlockQ pick_q_panels(int P) {
    switch (P) {
    case 1: return block_q<R, 1>;
    case 2: return block_q<R, 2>;
    case 3: return block_q<R, 3>;
    default: return block_q<R, 4>;
    }
}

BlockQ pick_q(int R, int P) {
    switch (R) {
    case 1: return pick_q_panels<1>(P);
    case 2: return pick_q_panels<2>(P);
    case 3: return pick_q_panels<3>(P);
    case 4: return pick_q_panels<4>(P);
    case 5: return pick_q_panels<5>(P);
    default: return pick_q_panels<6>(P);
    }
}

// x (M rows of floats, stride ldx) times the packs (leaf l: x's columns bounds[l] .. bounds[l + 1] - 1;
// one leaf: the whole product, with the bias), into y. With leaves, each leaf's product is rounded to
// Y, then the leaves are added in split.py's tree in float32 and rounded once (leaves_gemm's sum).
void quant_gemm(const float *x, long ldx, const QuantPack *const *packs, const int *bounds, int leaves, float *y, long ldy,
                const float *bias, int M, int N, int threads) {
    constexpr long LD = NP * 16, TILE = MR * LD;
    const Items items(M, N);
    const long width = bounds[leaves] - bounds[0];
    const bool small = M <= MR;  // one register block of rows: dequantized in registers (block_q)
#pragma omp parallel num_threads(threads)
    {
        // This thread's panels of every leaf, dequantized, and its tiles: kept from call to call (a
        // fresh allocation this large is fresh pages, faulted in at every call), grown as needed.
        static thread_local std::vector<float> weights_buf, tiles;
        if (!small && weights_buf.size() < static_cast<size_t>(LD * width)) weights_buf.resize(LD * width);
        if (tiles.size() < static_cast<size_t>(TILE * leaves)) tiles.resize(TILE * leaves);
        float *weights = weights_buf.data(), *buf = tiles.data();
        const float *w[MAX_LEAVES];
        int have = -1;  // the group whose panels `weights` holds
#pragma omp for schedule(static)
        for (long i = 0; i < items.count(); i++) {
            const Items::Item it = items[i];
            const int g = it.g, p0 = it.p0, P = it.P, m0 = it.m0, R = it.R;
            for (long l = 0, at = 0; l < leaves && !small && g != have; at += packs[l]->K, l++) {
                dequantize(*packs[l], p0, P, weights + at * LD);
                w[l] = weights + at * LD;
            }
            have = g;
            const F32::Fn fn = pick<F32>(R, P);
            const BlockQ fq = pick_q(R, P);
            auto run = [&](int l, float *out, long ld, const float *b) {
                if (small)
                    fq(x + bounds[l], ldx, *packs[l], out, ld, b, m0, p0, N);
                else
                    fn(x + bounds[l], ldx, w[l], out, ld, b, m0, p0, N, packs[l]->K);
            };
            if (leaves == 1) {  // the blocks write y
                run(0, y + m0 * ldy + 16 * p0, ldy, bias);
                continue;
            }
            for (int l = 0; l < leaves; l++) run(l, buf + l * TILE, LD, nullptr);
            store_tree(buf, TILE, LD, leaves, R, P, m0, p0, N, y, ldy);
        }
    }
}

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
    const Items items(M, N);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < items.count(); i++) {
        const Items::Item it = items[i];
        const int p0 = it.p0, P = it.P, m0 = it.m0, R = it.R;
        pick<F32>(R, P)(x, ldx, packed + static_cast<long>(p0) * K * 16, y + m0 * ldy + 16 * p0, ldy, bias, m0, p0, N, K);
    }
}

// A row-parallel layer's leaves in one call (leaves_gemm): leaf l is x's columns bounds[l] ..
// bounds[l + 1] - 1 times packs[l] (from pack_f32 of the weight's same columns); y: their tree sum.
extern "C" void gemm_leaves_f32(const float *x, long ldx, const void *const *packs, const int *bounds, int leaves,
                                float *y, long ldy, int M, int N, int threads) {
    long offsets[MAX_LEAVES];
    int steps[MAX_LEAVES];
    for (int l = 0; l < leaves; l++) offsets[l] = bounds[l], steps[l] = bounds[l + 1] - bounds[l];
    leaves_gemm<F32, float, float>(x, ldx, offsets, steps, packs, leaves, y, ldy, M, N, threads);
}

// Weights stored as int8 or int4 (quant_gemm): packs[l] is leaf l's QuantPack (one leaf: the whole
// weight, and bounds {0, K}); x (M, bounds[leaves]) float32; y (M, N) float32; bias: N floats or null.
extern "C" void gemm_quant_f32(const float *x, long ldx, const void *const *packs, const int *bounds, int leaves,
                               float *y, long ldy, const float *bias, int M, int N, int threads) {
    quant_gemm(x, ldx, reinterpret_cast<const QuantPack *const *>(packs), bounds, leaves, y, ldy, bias, M, N, threads);
}

// The same for the one-call decoder (csrc/decoder.cpp), in the signatures of its gemm and gemm_leaves:
// `packed` is a QuantLayer (a layer's packs and bounds; kernels/decoder.py makes them), and a
// row-parallel layer's parts come as the packs themselves.
struct QuantLayer {
    int leaves;
    const void *const *packs;
    const int *bounds;
};

extern "C" void gemm_quant_layer_f32(const float *x, long ldx, const void *packed, float *y, long ldy,
                                     const float *bias, int M, int N, int, int threads) {
    const QuantLayer &q = *static_cast<const QuantLayer *>(packed);
    gemm_quant_f32(x, ldx, q.packs, q.bounds, q.leaves, y, ldy, bias, M, N, threads);
}

extern "C" void gemm_leaves_quant_f32(const float *x, long ldx, const void *const *packs, const int *bounds, int leaves,
                                      float *y, long ldy, int M, int N, int threads) {
    gemm_quant_f32(x, ldx, packs, bounds, leaves, y, ldy, nullptr, M, N, threads);
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

namespace {

// x's rows as 32-bit pairs (x[k], x[k + 1]), as block_bf16 reads them, each part's (columns bounds[l] ..
// bounds[l + 1] - 1) from its own first column: read in place when every bound, the row stride and
// the address are even, else each part's columns copied after the last's, with a zero after an odd
// count. One part (bounds {0, K}): the whole row.
struct PairRows {
    const uint32_t *rows;
    long ld;                   // pairs from one row to the next
    long offsets[MAX_LEAVES];  // part l's first pair in a row
    int steps[MAX_LEAVES];     // part l's pairs
    uint16_t *copy = nullptr;

    PairRows(const uint16_t *x, long ldx, const int *bounds, int leaves, int M) {
        bool copied = ldx % 2 || reinterpret_cast<uintptr_t>(x) % 4;
        for (int l = 0; l <= leaves; l++) copied = copied || bounds[l] % 2;
        long total = 0;
        for (int l = 0; l < leaves; l++) {
            steps[l] = (bounds[l + 1] - bounds[l] + 1) / 2;
            offsets[l] = copied ? total : bounds[l] / 2;
            total += steps[l];
        }
        if (copied) {
            copy = new uint16_t[static_cast<long>(M) * total * 2]();
            for (long m = 0; m < M; m++)
                for (int l = 0; l < leaves; l++)
                    std::memcpy(copy + (m * total + offsets[l]) * 2, x + m * ldx + bounds[l],
                                static_cast<size_t>(bounds[l + 1] - bounds[l]) * 2);
        }
        rows = reinterpret_cast<const uint32_t *>(copied ? copy : x);
        ld = copied ? total : ldx / 2;
    }
    ~PairRows() { delete[] copy; }
    PairRows(const PairRows &) = delete;
    PairRows &operator=(const PairRows &) = delete;
};

// ----- bfloat16 rows on int8 or int4 weights -----
//
// The function of gemm_bf16_dot on the model's own bfloat16 weight, bf16(fl(q * scale)) (what
// Transformer.quantize stores), to the bit: a pair of weights is dequantized in float32 as above,
// rounded to bfloat16 by vcvtne2ps2bf16 (to nearest even; it flushes denormals, and fl(q * scale)
// never is one: every scale is at least quantization.py's MIN_SCALE), and laid out as
// pack_bf16_pairs lays it, then block_bf16's chain runs on it.

// Column k's group, for k = 0, 1, 2, ... in turn (a pack's columns, from its first).
struct GroupCursor {
    int group, k0, K, g = 0, end;
    explicit GroupCursor(const QuantPack &w) : group(w.group), k0(w.k0), K(w.K) { end = limit(); }
    int limit() const {
        const int e = (k0 / group + g + 1) * group - k0;
        return e < K ? e : K;
    }
    int at(int k) {
        while (k >= end) g++, end = limit();
        return g;
    }
};

// Panel `panel` of w at columns k (even) and k + 1, in bfloat16 pairs: lane n holds (W[n][k], W[n][k + 1]),
// zero past K. s0, s1: the scales of k's and k + 1's groups.
template <int BITS>
__attribute__((always_inline)) inline __m512i quant_pair(const QuantPack &w, long panel, int k, __m512 s0, __m512 s1) {
    const __mmask16 second = k + 1 < w.K ? 0xffff : 0;
    __m512i a, b;
    if constexpr (BITS == 8) {
        const int8_t *q = reinterpret_cast<const int8_t *>(w.q) + (panel * w.K + k) * 16;
        a = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)));
        b = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(second, q + 16));  // nothing read past K
    } else {  // k's value in the low nibble of a byte, k + 1's in the high one
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(w.q + (panel * ((w.K + 1) / 2) + k / 2) * 16)));
        const __m512i eight = _mm512_set1_epi32(8);
        a = _mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), eight);
        b = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight);
    }
    const __m512 fa = _mm512_mul_ps(_mm512_cvtepi32_ps(a), s0);
    const __m512 fb = _mm512_maskz_mul_ps(second, _mm512_cvtepi32_ps(b), s1);  // +0 past K, as the pack's padding
    alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(fb, fa));  // fa's 16 values, then fb's
    return _mm512_permutexvar_epi16(_mm512_load_si512(order), h);
}

// Panels p0 .. p0 + P - 1 of w as bfloat16 pairs into out ([p][pair][32], pack_bf16_pairs' layout).
void dequantize_pairs(const QuantPack &w, int p0, int P, uint16_t *out) {
    const int pairs = (w.K + 1) / 2, groups = groups_of(w);
    for (int p = 0; p < P; p++) {
        const long panel = p0 + p;
        GroupCursor cur(w);
        for (int j = 0; j < pairs; j++) {
            const int k = 2 * j, g0 = cur.at(k), g1 = k + 1 < w.K ? cur.at(k + 1) : g0;
            const __m512 s0 = _mm512_loadu_ps(w.scales + (panel * groups + g0) * 16);
            const __m512 s1 = g1 == g0 ? s0 : _mm512_loadu_ps(w.scales + (panel * groups + g1) * 16);
            _mm512_storeu_si512(out + (p * static_cast<long>(pairs) + j) * 32,
                                w.bits == 8 ? quant_pair<8>(w, panel, k, s0, s1) : quant_pair<4>(w, panel, k, s0, s1));
        }
    }
}

// What block_bf16 computes on dequantize_pairs' output, the weights dequantized in registers as the
// chain goes (a batch of at most MR rows), so the same bits.
template <int R, int P, int BITS>
void block_qbf16(const uint32_t *x, long ldx, const QuantPack &w, uint16_t *y, long ldy, const float *bias, int m0,
                 int p0, int N) {
    const int pairs = (w.K + 1) / 2, groups = groups_of(w);
    const long stride = 16L * (BITS == 8 ? w.K : (w.K + 1) / 2);  // a panel's bytes
    __m512 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    const uint32_t *a = x + m0 * ldx;
    GroupCursor cur(w);
    int loaded = -1;
    __m512 scale[P];
    for (int j = 0; j < pairs; j++) {
        const int k = 2 * j, g0 = cur.at(k), g1 = k + 1 < w.K ? cur.at(k + 1) : g0;
        const long at = BITS == 8 ? 32L * j : 16L * j;  // the pair's first byte in its panel
        if (at % 64 == 0)  // a line a panel: see QDIST
            for (int p = 0; p < P; p++) simd::prefetch<1>(w.q + (static_cast<long>(p0) + p) * stride + at + QDIST);
        if (g0 != loaded)
            for (int p = 0; p < P; p++) scale[p] = _mm512_loadu_ps(w.scales + ((static_cast<long>(p0) + p) * groups + g0) * 16);
        loaded = g0;
        __m512bh wv[P];
        for (int p = 0; p < P; p++) {
            const __m512 s1 = g1 == g0 ? scale[p]
                                       : _mm512_loadu_ps(w.scales + ((static_cast<long>(p0) + p) * groups + g1) * 16);
            wv[p] = reinterpret_cast<__m512bh>(quant_pair<BITS>(w, p0 + p, k, scale[p], s1));
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * ldx + j]));
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
        }
    }
    store_block_bf16(acc, y, ldy, bias, p0, N);
}

using BlockQB = void (*)(const uint32_t *, long, const QuantPack &, uint16_t *, long, const float *, int, int, int);

template <int R, int BITS> BlockQB pick_qb_panels(int P) {
    switch (P) {
    case 1: return block_qbf16<R, 1, BITS>;
    case 2: return block_qbf16<R, 2, BITS>;
    case 3: return block_qbf16<R, 3, BITS>;
    default: return block_qbf16<R, 4, BITS>;
    }
}

template <int BITS> BlockQB pick_qb_rows(int R, int P) {
    switch (R) {
    case 1: return pick_qb_panels<1, BITS>(P);
    case 2: return pick_qb_panels<2, BITS>(P);
    case 3: return pick_qb_panels<3, BITS>(P);
    case 4: return pick_qb_panels<4, BITS>(P);
    case 5: return pick_qb_panels<5, BITS>(P);
    default: return pick_qb_panels<6, BITS>(P);
    }
}

BlockQB pick_qb(int R, int P, int bits) { return bits == 8 ? pick_qb_rows<8>(R, P) : pick_qb_rows<4>(R, P); }

// quant_gemm's bfloat16 twin: block_bf16's chains on the parts' dequantized pairs (in registers for
// at most MR rows, else a buffer of the thread's), each part rounded to bfloat16 as its own call
// would round it, the parts' tree sum in float32 rounded once (gemm_leaves_bf16_dot's).
void quant_gemm_bf16(const PairRows &x, const QuantPack *const *packs, int leaves, uint16_t *y, long ldy,
                     const float *bias, int M, int N, int threads) {
    constexpr long LD = NP * 16, TILE = MR * LD;
    const Items items(M, N);
    long pairs = 0;
    for (int l = 0; l < leaves; l++) pairs += x.steps[l];
    const bool small = M <= MR;
#pragma omp parallel num_threads(threads)
    {
        static thread_local std::vector<uint16_t> weights_buf, tiles;  // as in quant_gemm
        if (!small && weights_buf.size() < static_cast<size_t>(2 * LD * pairs)) weights_buf.resize(2 * LD * pairs);
        if (tiles.size() < static_cast<size_t>(TILE * leaves)) tiles.resize(TILE * leaves);
        uint16_t *weights = weights_buf.data(), *buf = tiles.data();
        const uint16_t *w[MAX_LEAVES];
        int have = -1;  // the group whose panels `weights` holds
#pragma omp for schedule(static)
        for (long i = 0; i < items.count(); i++) {
            const Items::Item it = items[i];
            const int g = it.g, p0 = it.p0, P = it.P, m0 = it.m0, R = it.R;
            for (long l = 0, at = 0; l < leaves && !small && g != have; at += x.steps[l], l++) {
                dequantize_pairs(*packs[l], p0, P, weights + at * 2 * LD);
                w[l] = weights + at * 2 * LD;
            }
            have = g;
            const Bf16::Fn fn = pick<Bf16>(R, P);
            auto run = [&](int l, uint16_t *out, long ld, const float *b) {
                if (small)
                    pick_qb(R, P, packs[l]->bits)(x.rows + x.offsets[l], x.ld, *packs[l], out, ld, b, m0, p0, N);
                else
                    fn(x.rows + x.offsets[l], x.ld, w[l], out, ld, b, m0, p0, N, x.steps[l]);
            };
            if (leaves == 1) {
                run(0, y + m0 * ldy + 16 * p0, ldy, bias);
                continue;
            }
            for (int l = 0; l < leaves; l++) run(l, buf + l * TILE, LD, nullptr);
            store_tree(buf, TILE, LD, leaves, R, P, m0, p0, N, y, ldy);  // the blocks rounded the parts
        }
    }
}

}  // namespace

// x: (M, K) bfloat16 rows of stride ldx; packed from pack_bf16_pairs; y: (M, N) bfloat16 of stride
// ldy; bias: N floats (the bias widened) or null.
extern "C" void gemm_bf16_dot(const uint16_t *x, long ldx, const uint16_t *packed, uint16_t *y, long ldy,
                              const float *bias, int M, int N, int K, int threads) {
    const int whole[2] = {0, K};
    const PairRows rows(x, ldx, whole, 1, M);
    const Items items(M, N);
    const int pairs = rows.steps[0];
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < items.count(); i++) {
        const Items::Item it = items[i];
        const int p0 = it.p0, P = it.P, m0 = it.m0, R = it.R;
        pick<Bf16>(R, P)(rows.rows, rows.ld, packed + static_cast<long>(p0) * pairs * 32, y + m0 * ldy + 16 * p0, ldy,
                         bias, m0, p0, N, pairs);
    }
}

// gemm_leaves_f32's bfloat16 twin (packs[l] from pack_bf16_pairs of the leaf's columns): each leaf's
// product rounded to bfloat16 as gemm_bf16_dot rounds it, their tree sum in float32, rounded once.
extern "C" void gemm_leaves_bf16_dot(const uint16_t *x, long ldx, const void *const *packs, const int *bounds,
                                     int leaves, uint16_t *y, long ldy, int M, int N, int threads) {
    const PairRows rows(x, ldx, bounds, leaves, M);
    leaves_gemm<Bf16, uint32_t, uint16_t>(rows.rows, rows.ld, rows.offsets, rows.steps, packs, leaves, y, ldy, M, N,
                                          threads);
}

// gemm_quant_f32 for bfloat16 x and y: gemm_bf16_dot's (gemm_leaves_bf16_dot's) bits on the weight
// as the bfloat16 model stores it, bf16(fl(q * scale)) (quant_gemm_bf16).
extern "C" void gemm_quant_bf16(const uint16_t *x, long ldx, const void *const *packs, const int *bounds, int leaves,
                                uint16_t *y, long ldy, const float *bias, int M, int N, int threads) {
    const PairRows rows(x, ldx, bounds, leaves, M);
    quant_gemm_bf16(rows, reinterpret_cast<const QuantPack *const *>(packs), leaves, y, ldy, bias, M, N, threads);
}

extern "C" void gemm_quant_layer_bf16(const uint16_t *x, long ldx, const void *packed, uint16_t *y, long ldy,
                                      const float *bias, int M, int N, int, int threads) {
    const QuantLayer &q = *static_cast<const QuantLayer *>(packed);
    gemm_quant_bf16(x, ldx, q.packs, q.bounds, q.leaves, y, ldy, bias, M, N, threads);
}

extern "C" void gemm_leaves_quant_bf16(const uint16_t *x, long ldx, const void *const *packs, const int *bounds,
                                       int leaves, uint16_t *y, long ldy, int M, int N, int threads) {
    gemm_quant_bf16(x, ldx, packs, bounds, leaves, y, ldy, nullptr, M, N, threads);
}
#else
extern "C" void pack_bf16_pairs(const uint16_t *, uint16_t *, int, int) {}
extern "C" void gemm_bf16_dot(const uint16_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int,
                              int) {}
extern "C" void gemm_leaves_bf16_dot(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long, int,
                                     int, int) {}
extern "C" void gemm_quant_bf16(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long,
                                const float *, int, int, int) {}
extern "C" void gemm_quant_layer_bf16(const uint16_t *, long, const void *, uint16_t *, long, const float *, int, int,
                                      int, int) {}
extern "C" void gemm_leaves_quant_bf16(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long,
                                       int, int, int) {}
#endif

#else  // no AVX-512 on this CPU: kernels/linear.py never calls these

extern "C" int f32_available() { return 0; }
extern "C" int bf16_dot_available() { return 0; }
extern "C" void pack_f32(const float *, float *, int, int) {}
extern "C" void gemm_f32(const float *, long, const float *, float *, long, const float *, int, int, int, int) {}
extern "C" void pack_bf16_pairs(const uint16_t *, uint16_t *, int, int) {}
extern "C" void gemm_bf16_dot(const uint16_t *, long, const uint16_t *, uint16_t *, long, const float *, int, int, int,
                              int) {}

extern "C" void gemm_leaves_f32(const float *, long, const void *const *, const int *, int, float *, long, int, int, int) {}
extern "C" void gemm_leaves_bf16_dot(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long, int,
                                     int, int) {}
extern "C" void gemm_quant_f32(const float *, long, const void *const *, const int *, int, float *, long, const float *,
                               int, int, int) {}
extern "C" void gemm_quant_bf16(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long,
                                const float *, int, int, int) {}
extern "C" void gemm_quant_layer_f32(const float *, long, const void *, float *, long, const float *, int, int, int, int) {}
extern "C" void gemm_leaves_quant_f32(const float *, long, const void *const *, const int *, int, float *, long, int, int,
                                      int) {}
extern "C" void gemm_quant_layer_bf16(const uint16_t *, long, const void *, uint16_t *, long, const float *, int, int,
                                      int, int) {}
extern "C" void gemm_leaves_quant_bf16(const uint16_t *, long, const void *const *, const int *, int, uint16_t *, long,
                                       int, int, int) {}

#endif
