// The decoder's layers in one call: every layer of a step, norms, matmuls, rotary embedding, the
// KV cache write, attention and SwiGLU, without a return to Python between them.
//
// Nothing here computes a number: each operation is a call of the very kernel that the model's
// layer-by-layer path (mini_llm.Block.step on a prepacked model, attention_backend="c") calls for it,
// with the same arguments, in the same order. The kernels come as function pointers out of their
// own libraries (gemm_f32.cpp or gemm_amx.cpp, fused.cpp, paged_attention.cpp), so there is one
// copy of each, and a row's bits are the layer-by-layer path's by construction (tests/test_decoder.py
// checks them equal anyway). What goes away is what lies between the kernels in Python: about 9
// ctypes calls, their argument checks and a dozen tensor allocations per layer.
//
// Built by kernels/build.py; loaded by kernels/decoder.py, which decides when it may run.
#include <cstdint>
#include <cstring>

namespace {

using Gemm = void (*)(const void *x, long ldx, const void *packed, void *y, long ldy, const float *bias, int M, int N,
                      int K, int threads);
using Norm = void (*)(const void *x, long ldx, const void *w, void *out, long ldo, int rows, int dim, float eps,
                      int threads);
using AddNorm = void (*)(const void *x, long ldx, const void *d, long ldd, const void *w, void *res, long ldr, void *out,
                         long ldo, int rows, int dim, float eps, int threads);
using SiluMul = void (*)(const void *gu, long ld, void *out, long ldo, int rows, int inter, int threads);
using Rope = void (*)(void *x, long ldx, const void *cos, const void *sin, int rows, int heads, int hd, int threads);
using QkNormRope = void (*)(void *x, long ldx, const void *wq, const void *wk, const void *cos, const void *sin, int rows,
                            int nh, int nkv, int hd, float eps, int threads);
using LeafSum = void (*)(const void *const *parts, long ldp, int leaves, void *out, long ldo, int rows, int cols,
                        int threads);
using GemmLeaves = void (*)(const void *x, long ldx, const void *const *packs, const int *bounds, int leaves, void *y,
                            long ldy, int M, int N, int threads);
using Attention = void (*)(const void *q, const void *k_cache, const void *v_cache, void *out, const int32_t *query_start,
                           const int32_t *num_cached, const int32_t *tables, int num_seqs, int max_blocks, int nh, int nkv,
                           int hd, int bs, float scale, int threads);

}  // namespace

extern "C" {

// The kernels, for the model's dtype (kernels/decoder.py takes their addresses from their libraries).
struct Kernels {
    Gemm gemm;
    Norm norm;
    AddNorm add_norm;
    SiluMul silu_mul;
    Rope rope;
    QkNormRope qk_norm_rope;
    Attention attention;
    LeafSum leaf_sum;
    GemmLeaves gemm_leaves;  // all of a row-parallel layer's leaves and their sum in one call; null: leaf by leaf
};

struct Shape {
    int layers, hidden, inter, nh, nkv, hd, elem;  // elem: bytes per value (4 float32, 2 bfloat16)
    int leaves;                                    // of o_proj and down_proj: nkv, or 1 (the plain product)
    float eps, scale;                              // RMSNorm's epsilon; attention's 1 / sqrt(hd), as a float
    const void *final_norm;
};

struct Layer {  // one layer's weights: the norms' in the model's dtype, the matmuls' packed
    const void *input_norm, *post_norm, *qkv;
    const void *const *o;  // a packed weight per leaf (Shape::leaves)
    const void *gate_up;
    const void *const *down;
    const float *qkv_bias;         // float32 (widened for bfloat16), or null
    const void *q_norm, *k_norm;   // Qwen3's norms of each q and k head, or null
};

struct Step {
    int tokens;                       // T, the step's new tokens
    const void *cos, *sin;            // (T, hd) each
    const int64_t *slots;             // (T,) the cache slot of each new token
    const int32_t *query_start, *num_cached, *tables;  // the attention kernel's batch (kernel_batch)
    int num_seqs, max_blocks, block_size;
    void *const *k_caches, *const *v_caches;  // per layer: (slots, nkv, hd)
    void *work;                       // decoder_workspace() bytes
    int threads;
};

}  // extern "C"

namespace {

constexpr long ALIGN = 64;
constexpr int MAX_LEAVES = 64;  // kernels/decoder.py makes no plan for more

struct Buffers {
    char *res[2], *h, *qkv, *q, *att, *delta, *gu, *act, *parts;
};

// The workspace's buffers in order, each rounded up to 64 bytes; its size when base is null.
long carve(const Shape &s, long T, char *base, Buffers *b) {
    const long qkv = static_cast<long>(s.nh + 2 * s.nkv) * s.hd, heads = static_cast<long>(s.nh) * s.hd;
    const long sizes[] = {T * s.hidden, T * s.hidden, T * s.hidden, T * qkv, T * heads, T * heads,
                          T * s.hidden, T * 2 * s.inter, T * s.inter, s.leaves > 1 ? s.leaves * T * s.hidden : 0};
    char **slot[] = {&b->res[0], &b->res[1], &b->h, &b->qkv, &b->q, &b->att, &b->delta, &b->gu, &b->act, &b->parts};
    long at = 0;
    for (int i = 0; i < 10; i++) {
        if (base) *slot[i] = base + at;
        at += (sizes[i] * s.elem + ALIGN - 1) / ALIGN * ALIGN;
    }
    return at;
}

}  // namespace

extern "C" long decoder_workspace(const Shape *s, int tokens) {
    Buffers b;
    return carve(*s, tokens, nullptr, &b);
}

// x: the embeddings (T, hidden); out: the hidden states after the final norm (T, hidden).
// Block.step's order: h = norm(x); per layer: q, k, v = h Wqkv (+ bias); rotate q and k (Qwen3:
// normalise each of their heads first); write k and v to their slots; attention; x, h = x + o,
// norm(...); x + down(silu(gate) * up) goes into the next layer's first norm (or the final one) as
// the pending delta.
extern "C" void decoder_forward(const Kernels *kn, const Shape *sp, const Layer *layers, const Step *st,
                                const void *x, void *out) {
    const Shape &s = *sp;
    const int T = st->tokens, D = s.hidden, I = s.inter, th = st->threads;
    const long W = static_cast<long>(s.nh + 2 * s.nkv) * s.hd, heads = static_cast<long>(s.nh) * s.hd;
    const long kv = static_cast<long>(s.nkv) * s.hd, e = s.elem;
    Buffers b;
    carve(s, T, static_cast<char *>(st->work), &b);
    int next = 0;  // the residual stream alternates between two buffers (an add reads one, writes the other)
    auto add_norm = [&](const void *w, void *normed) {
        char *res = b.res[next];
        next ^= 1;
        kn->add_norm(x, D, b.delta, D, w, res, D, normed, D, T, D, s.eps, th);
        x = res;
    };
    // A row-parallel product (o_proj, down_proj) into b.delta: with leaves, each leaf's product over
    // its K columns (K * i / leaves .. K * (i + 1) / leaves, parallel/split.py's bounds, as mini_llm's),
    // then their tree sum (fused.cpp's leaf_sum), or both in one call where the gemm's library has it,
    // as mini_llm.Linear calls them.
    auto row_parallel = [&](const char *in, long K, const void *const *packs) {
        if (s.leaves == 1) {
            kn->gemm(in, K, packs[0], b.delta, D, nullptr, T, D, static_cast<int>(K), th);
            return;
        }
        if (kn->gemm_leaves) {  // the same products and tree sum in one call (gemm_f32.cpp's leaves_gemm)
            int bounds[MAX_LEAVES + 1];
            for (int i = 0; i <= s.leaves; i++) bounds[i] = static_cast<int>(K * i / s.leaves);
            kn->gemm_leaves(in, K, packs, bounds, s.leaves, b.delta, D, T, D, th);
            return;
        }
        const void *parts[MAX_LEAVES];
        for (int i = 0; i < s.leaves; i++) {
            const long a = K * i / s.leaves, z = K * (i + 1) / s.leaves;
            char *dst = b.parts + i * T * D * e;
            kn->gemm(in + a * e, K, packs[i], dst, D, nullptr, T, D, static_cast<int>(z - a), th);
            parts[i] = dst;
        }
        kn->leaf_sum(parts, D, s.leaves, b.delta, D, T, D, th);
    };
    for (int l = 0; l < s.layers; l++) {
        const Layer &L = layers[l];
        if (l == 0)
            kn->norm(x, D, L.input_norm, b.h, D, T, D, s.eps, th);
        else
            add_norm(L.input_norm, b.h);
        kn->gemm(b.h, D, L.qkv, b.qkv, W, L.qkv_bias, T, static_cast<int>(W), D, th);
        if (L.q_norm)
            kn->qk_norm_rope(b.qkv, W, L.q_norm, L.k_norm, st->cos, st->sin, T, s.nh, s.nkv, s.hd, s.eps, th);
        else
            kn->rope(b.qkv, W, st->cos, st->sin, T, s.nh + s.nkv, s.hd, th);
        char *kc = static_cast<char *>(st->k_caches[l]), *vc = static_cast<char *>(st->v_caches[l]);
        for (long t = 0; t < T; t++) {
            const char *row = b.qkv + t * W * e;
            std::memcpy(kc + st->slots[t] * kv * e, row + heads * e, kv * e);
            std::memcpy(vc + st->slots[t] * kv * e, row + (heads + kv) * e, kv * e);
            std::memcpy(b.q + t * heads * e, row, heads * e);
        }
        kn->attention(b.q, kc, vc, b.att, st->query_start, st->num_cached, st->tables, st->num_seqs, st->max_blocks,
                      s.nh, s.nkv, s.hd, st->block_size, s.scale, th);
        row_parallel(b.att, heads, L.o);
        add_norm(L.post_norm, b.h);
        kn->gemm(b.h, D, L.gate_up, b.gu, 2L * I, nullptr, T, 2 * I, D, th);
        kn->silu_mul(b.gu, 2L * I, b.act, I, T, I, th);
        row_parallel(b.act, I, L.down);
    }
    if (s.layers == 0)
        kn->norm(x, D, s.final_norm, out, D, T, D, s.eps, th);
    else
        add_norm(s.final_norm, out);
}
