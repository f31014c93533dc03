// The small operations around the matmuls, one pass each instead of five to eight PyTorch operators:
//   rms_norm:  out = w * (x / sqrt(mean(x^2) + eps)), a row at a time;
//   add_rms_norm: the residual add before it, in the same pass: res = x + d (rounded to the dtype, as
//              PyTorch's add rounds), out = rms_norm(res), the bits of the two operations apart;
//   silu_mul:  out = silu(gate) * up, SwiGLU's middle, from the fused gate/up projection;
//   rope:      the rotary embedding of q and k, in place: pairs (i, i + hd / 2) of each head;
//   qk_norm_rope: Qwen3's RMSNorm of each q and k head, then rope, in place;
//   leaf_sum:  a row-parallel layer's partial products (its leaves) added in the fixed tree of
//              parallel/split.py, in float32, rounded once.
// Each row is computed alone, by the same operations in the same order whatever the number of rows
// or threads (simd.h; the sum of squares goes into 16 lanes, then the fixed tree), so a row's bits
// do not depend on the batch. Arithmetic in float32; a bfloat16 result is rounded once, but for
// rms_norm's normalised x, which is rounded before the weight multiplies it, as Hugging Face does.
// Built by kernels/build.py; loaded with ctypes by kernels/fused.py.
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace simd;

// n values from src (float32 or bfloat16) as floats into dst; n <= 16, zeros after.
template <typename T> inline V16 load_part(const T *src, int n) {
    float tmp[16] = {0};
    for (int i = 0; i < n; i++) tmp[i] = widen(src[i]);
    return load(tmp);
}

// The first n lanes of v into dst, rounded to dst's type.
template <typename T> inline void store_part(T *dst, V16 v, int n) {
    if (n == 16) return store(dst, v);
    float tmp[16];
    store(tmp, v);
    for (int i = 0; i < n; i++) narrow(tmp[i], dst + i);
}

inline V16 round_as(V16 x, const float *) { return x; }
inline V16 round_as(V16 x, const uint16_t *) { return round_bf16(x); }

constexpr long PARALLEL = 1 << 15;  // values below which one thread does it all (waking others costs more)

// out = w * (x / sqrt(sumsq / dim + eps)), the normalised x rounded to the model's dtype first.
template <typename T> inline void scale_row(const T *x, const T *w, T *out, int dim, float sumsq, float eps) {
    const float inv = 1.0f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
    for (int i = 0; i < dim; i += 16) {
        const int n = dim - i < 16 ? dim - i : 16;
        const V16 v = n == 16 ? load(x + i) : load_part(x + i, n);
        const V16 g = n == 16 ? load(w + i) : load_part(w + i, n);
        const V16 normed = round_as(mul(v, bcast(inv)), x);  // the normalised x in the model's dtype
        store_part(out + i, mul(g, normed), n);
    }
}

template <typename T>
void rms_norm(const T *x, long ldx, const T *w, T *out, long ldo, int rows, int dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(rows) * dim >= PARALLEL)
    for (int r = 0; r < rows; r++) {
        const T *xr = x + r * ldx;
        V16 sq = zero();
        for (int i = 0; i < dim; i += 16) {
            const V16 v = i + 16 <= dim ? load(xr + i) : load_part(xr + i, dim - i);
            sq = fma(v, v, sq);
        }
        scale_row(xr, w, out + r * ldo, dim, tree(sq), eps);
    }
}

template <typename T>
void add_rms_norm(const T *x, long ldx, const T *d, long ldd, const T *w, T *res, long ldr, T *out, long ldo,
                  int rows, int dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(rows) * dim >= PARALLEL)
    for (int r = 0; r < rows; r++) {
        const T *xr = x + r * ldx, *dr = d + r * ldd;
        T *rr = res + r * ldr;
        V16 sq = zero();
        for (int i = 0; i < dim; i += 16) {  // res = x + d, and the sum of squares of res as rms_norm takes it
            const int n = dim - i < 16 ? dim - i : 16;
            const V16 a = n == 16 ? load(xr + i) : load_part(xr + i, n);
            const V16 b = n == 16 ? load(dr + i) : load_part(dr + i, n);
            const V16 v = round_as(add(a, b), xr);
            store_part(rr + i, v, n);
            sq = fma(v, v, sq);
        }
        scale_row(rr, w, out + r * ldo, dim, tree(sq), eps);
    }
}

template <typename T> void silu_mul(const T *gu, long ld, T *out, long ldo, int rows, int inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(rows) * inter >= PARALLEL)
    for (int r = 0; r < rows; r++) {
        const T *g = gu + r * ld, *u = g + inter;
        for (int i = 0; i < inter; i += 16) {
            const int n = inter - i < 16 ? inter - i : 16;
            const V16 gv = n == 16 ? load(g + i) : load_part(g + i, n);
            const V16 uv = n == 16 ? load(u + i) : load_part(u + i, n);
            const V16 s = div(gv, add(bcast(1.0f), exp(sub(zero(), gv))));  // silu(g) = g / (1 + e^-g)
            store_part(out + r * ldo + i, mul(s, uv), n);
        }
    }
}

// One head of hd values, rotated in place by its row's cos and sin (hd each).
template <typename T> inline void rotate_head(T *v, const T *c, const T *s, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i += 16) {
        const int n = half - i < 16 ? half - i : 16;
        auto get = [n](const T *p) { return n == 16 ? load(p) : load_part(p, n); };
        const V16 x1 = get(v + i), x2 = get(v + half + i);
        const V16 c1 = get(c + i), c2 = get(c + half + i), s1 = get(s + i), s2 = get(s + half + i);
        store_part(v + i, sub(mul(x1, c1), mul(x2, s1)), n);         // x1 cos - x2 sin
        store_part(v + half + i, add(mul(x2, c2), mul(x1, s2)), n);  // x2 cos + x1 sin
    }
}

// x: rows of `heads` heads of hd values (row stride ldx), rotated in place by each row's cos, sin (hd).
template <typename T>
void rope(T *x, long ldx, const T *cos, const T *sin, int rows, int heads, int hd, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(rows) * heads * hd >= PARALLEL)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rotate_head(x + r * ldx + static_cast<long>(h) * hd, cos + static_cast<long>(r) * hd,
                        sin + static_cast<long>(r) * hd, hd);
}

// Qwen3's q and k: rows of nh query heads then nkv key heads (row stride ldx); each head normalised
// in place (rms_norm's arithmetic over its hd values, weight wq for a query head, wk for a key
// head), then rotated as rope does.
template <typename T>
void qk_norm_rope(T *x, long ldx, const T *wq, const T *wk, const T *cos, const T *sin, int rows, int nh, int nkv,
                  int hd, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (static_cast<long>(rows) * (nh + nkv) * hd >= PARALLEL)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < nh + nkv; h++) {
            T *v = x + r * ldx + static_cast<long>(h) * hd;
            V16 sq = zero();
            for (int i = 0; i < hd; i += 16) {
                const V16 a = i + 16 <= hd ? load(v + i) : load_part(v + i, hd - i);
                sq = fma(a, a, sq);
            }
            scale_row(v, h < nh ? wq : wk, v, hd, tree(sq), eps);  // in place: each 16 read before written
            rotate_head(v, cos + static_cast<long>(r) * hd, sin + static_cast<long>(r) * hd, hd);
        }
}

// Leaves lo .. hi - 1 of one row's partials, summed into acc (cols floats) in parallel/split.py's
// Tree: a node splits into its first half, rounded up, and the rest; each node's sum is
// left + right, elementwise. `spare` holds a row per level below (the recursion reuses them).
template <typename T>
void tree_row(const T *const *parts, long at, int lo, int hi, int cols, float *acc, float *spare) {
    if (hi - lo == 1) {
        for (int i = 0; i < cols; i++) acc[i] = widen(parts[lo][at + i]);
        return;
    }
    const int mid = lo + (hi - lo + 1) / 2;
    tree_row(parts, at, lo, mid, cols, acc, spare + cols);
    tree_row(parts, at, mid, hi, cols, spare, spare + cols);
    for (int i = 0; i < cols; i++) acc[i] += spare[i];
}

template <typename T>
void leaf_sum(const T *const *parts, long ldp, int leaves, T *out, long ldo, int rows, int cols, int threads) {
    int depth = 0;
    for (int n = leaves; n > 1; n = (n + 1) / 2) depth++;
#pragma omp parallel num_threads(threads) if (static_cast<long>(rows) * cols * leaves >= PARALLEL)
    {
        std::vector<float> rowbuf(static_cast<size_t>(depth + 2) * cols);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            float *acc = rowbuf.data();
            tree_row(parts, r * ldp, 0, leaves, cols, acc, acc + cols);
            for (int i = 0; i < cols; i++) narrow(acc[i], out + r * ldo + i);
        }
    }
}

}  // namespace

extern "C" {
void rms_norm_f32(const float *x, long ldx, const float *w, float *out, long ldo, int rows, int dim, float eps,
                  int threads) {
    rms_norm(x, ldx, w, out, ldo, rows, dim, eps, threads);
}
void rms_norm_bf16(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *out, long ldo, int rows, int dim,
                   float eps, int threads) {
    rms_norm(x, ldx, w, out, ldo, rows, dim, eps, threads);
}
void add_rms_norm_f32(const float *x, long ldx, const float *d, long ldd, const float *w, float *res, long ldr,
                      float *out, long ldo, int rows, int dim, float eps, int threads) {
    add_rms_norm(x, ldx, d, ldd, w, res, ldr, out, ldo, rows, dim, eps, threads);
}
void add_rms_norm_bf16(const uint16_t *x, long ldx, const uint16_t *d, long ldd, const uint16_t *w, uint16_t *res,
                       long ldr, uint16_t *out, long ldo, int rows, int dim, float eps, int threads) {
    add_rms_norm(x, ldx, d, ldd, w, res, ldr, out, ldo, rows, dim, eps, threads);
}
void silu_mul_f32(const float *gu, long ld, float *out, long ldo, int rows, int inter, int threads) {
    silu_mul(gu, ld, out, ldo, rows, inter, threads);
}
void silu_mul_bf16(const uint16_t *gu, long ld, uint16_t *out, long ldo, int rows, int inter, int threads) {
    silu_mul(gu, ld, out, ldo, rows, inter, threads);
}
void rope_f32(float *x, long ldx, const float *cos, const float *sin, int rows, int heads, int hd, int threads) {
    rope(x, ldx, cos, sin, rows, heads, hd, threads);
}
void rope_bf16(uint16_t *x, long ldx, const uint16_t *cos, const uint16_t *sin, int rows, int heads, int hd,
               int threads) {
    rope(x, ldx, cos, sin, rows, heads, hd, threads);
}
void qk_norm_rope_f32(float *x, long ldx, const float *wq, const float *wk, const float *cos, const float *sin,
                      int rows, int nh, int nkv, int hd, float eps, int threads) {
    qk_norm_rope(x, ldx, wq, wk, cos, sin, rows, nh, nkv, hd, eps, threads);
}
void qk_norm_rope_bf16(uint16_t *x, long ldx, const uint16_t *wq, const uint16_t *wk, const uint16_t *cos,
                       const uint16_t *sin, int rows, int nh, int nkv, int hd, float eps, int threads) {
    qk_norm_rope(x, ldx, wq, wk, cos, sin, rows, nh, nkv, hd, eps, threads);
}
void leaf_sum_f32(const float *const *parts, long ldp, int leaves, float *out, long ldo, int rows, int cols,
                  int threads) {
    leaf_sum(parts, ldp, leaves, out, ldo, rows, cols, threads);
}
void leaf_sum_bf16(const uint16_t *const *parts, long ldp, int leaves, uint16_t *out, long ldo, int rows, int cols,
                   int threads) {
    leaf_sum(parts, ldp, leaves, out, ldo, rows, cols, threads);
}
}
