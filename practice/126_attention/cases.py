"""Cases of exercise 126: the learner's rotary embedding and causal grouped-query attention.

Each function first runs on random float64 tensors (attention also once on float32 ones: the output
keeps the inputs' dtype) and is compared with nano_engine.mini_llm's; on a mismatch the output is
also compared with the usual mistakes (rotation the wrong way, pairs taken side by side, a mask that
is not causal or ignores the cached prefix, query heads mapped to KV heads with repeat instead of
repeat_interleave, no 1/sqrt(hd) scale) to name the one made. Then
the tiny model generates with the learner's two functions patched into mini_llm, in this case's
own process, and must give the tokens of nano_engine.generate. Last, property cases draw shapes,
positions, cached prefixes, score spreads and dtypes at random (practice/properties.py) and run the
same comparisons; the smallest input that differs is the one shown.
"""

import math
from types import SimpleNamespace

import torch

import nano_engine.mini_llm as ref
from nano_engine.tiny import tiny_model
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__


def learner(module):
    return require_functions(module, ("apply_rope", "attention"))


def reference():
    return SimpleNamespace(apply_rope=ref.apply_rope, attention=ref.attention)


RTOL, ATOL = 1e-7, 1e-9  # float64 inputs: a float64 computation is far closer than this, a float32 one is not
TOLERANCE = {torch.float64: (RTOL, ATOL), torch.float32: (1e-5, 1e-6)}  # (rtol, atol) by the inputs' dtype


def _close(got, want) -> bool:
    rtol, atol = TOLERANCE[want.dtype]
    return got.shape == want.shape and torch.allclose(got.to(want.dtype), want, rtol=rtol, atol=atol)


def _first_difference(got, want) -> tuple[int, int]:
    rtol, atol = TOLERANCE[want.dtype]
    return tuple(torch.nonzero(~torch.isclose(got, want, rtol=rtol, atol=atol))[0, :2].tolist())


def _difference(got, want) -> tuple[list[str], str | None]:
    """The largest difference and the tolerance, printed in full (4 decimals can hide it), and a hint
    if the result is right only to float32 precision."""
    rtol, atol = TOLERANCE[want.dtype]
    diff = (got - want).abs().nan_to_num(float("inf"))
    at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    lines = [f"  largest difference {diff[at].item():.3g} at index {list(at)}: expected {want[at].item():.17g}, "
             f"got {got[at].item():.17g}", f"  tolerance: |got - expected| <= {atol:g} + {rtol:g} x |expected|"]
    hint = None
    if want.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        hint = (f"your result is right only to float32 precision: keep the input dtype ({want.dtype}) through "
                "the whole computation: no .float(), no tensors made with dtype=torch.float32, and masks, "
                "scales and softmax in the inputs' dtype")
    return lines, hint


def _row(t: torch.Tensor) -> str:
    vals = ", ".join(f"{x:.4f}" for x in t.flatten()[:4].tolist())
    return f"[{vals}{', ...' if t.numel() > 4 else ''}]"


def _checked_output(got, want, call: str, shape_hint: str):
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{call} returned {type(got).__name__}", f"  expected a tensor of shape {tuple(want.shape)}",
                       "hint: return a torch.Tensor")
    if got.shape != want.shape:
        raise Mismatch(f"{call} returned shape {tuple(got.shape)}", f"  expected shape {tuple(want.shape)}",
                       "hint: " + shape_hint)
    if got.dtype != want.dtype:
        raise Mismatch(f"{call} returned {got.dtype}", f"  expected {want.dtype}, the dtype of its inputs",
                       "hint: keep the inputs' dtype: compute in it, or cast the result back (a .double() or "
                       ".float() on the inputs leaves the output in that dtype); create masks and constants with "
                       "dtype=x.dtype, or use bool masks")
    return got


# ----- rotary embedding -----

def _rotate_halves(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_mistakes(x, cos, sin):
    """(what the output equals, hint) for the usual wrong rotations."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # GPT-J's (2i, 2i+1) pairs
    return [
        (x * c - _rotate_halves(x) * s, "the rotation goes the wrong way: rotate_half(x) is cat(-x2, x1), "
                                        "where x1, x2 are the first and second halves of each head"),
        (x * c + torch.cat((-x1, x2), -1) * s, "rotate_half must swap the halves: cat(-x2, x1), not cat(-x1, x2)"),
        (x * s + _rotate_halves(x) * c, "cos and sin are swapped: x * cos + rotate_half(x) * sin"),
        (x * c + pairs * s, "the pairs are (i, i + head_dim/2), the two halves of a head, as in Llama's "
                            "checkpoints, not the neighbours (2i, 2i + 1)"),
    ]


def _drawn(seed, scales) -> str:
    """How a random case's tensors were made, if any was scaled (the hand-made cases are plain randn)."""
    scaled = ", ".join(f"{name} times {factor:g}" for name, factor in scales if factor != 1)
    return f"  (torch.randn, Generator seed {seed}{', ' + scaled if scaled else ''})"


def _unchanged(call, tensors, instead) -> None:
    """The caller's tensors as they were: the model reads q, k and x again after these calls."""
    changed = [name for name, given, original in tensors if not torch.equal(given, original)]
    if changed:
        raise Mismatch(call, f"  expected {', '.join(changed)} unchanged after the call", "  got it written into",
                       f"hint: compute new tensors ({instead}), do not write into your inputs (mul_, +=, "
                       "masked_fill_): the caller still reads them")


def _check_rope(api, T, nh, hd, positions, seed, magnitude=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, nh, hd, generator=gen, dtype=torch.float64) * magnitude
    cfg = SimpleNamespace(head_dim=hd, rope_theta=10000.0, rope_scaling=None)
    cos, sin = ref.rope_cos_sin(ref.rope_inv_freq(cfg), torch.tensor(positions), torch.float64)
    want = ref.apply_rope(x, cos, sin)
    call = f"apply_rope(x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin, positions {positions})"
    if magnitude != 1:
        call += "\n" + _drawn(seed, [("x", magnitude)])
    given = x.clone()
    out = api.apply_rope(given, cos, sin)
    _unchanged(call, [("x", given, x)], "x * cos + rotate_half(x) * sin")
    got = _checked_output(out, want, call,
                          "the output has the shape of x, (T, nh, hd): cos and sin (T, hd) broadcast over the heads "
                          "as cos[:, None, :]")
    if _close(got, want):
        return
    t, h = _first_difference(got, want)
    difference, precision = _difference(got, want)
    lines = [call, f"  token {t} (position {positions[t]}), head {h}:",
             f"  expected {_row(want[t, h])}", f"  got      {_row(got[t, h])}", *difference]
    hint = next((h for alt, h in _rope_mistakes(x, cos, sin) if _close(got, alt)), precision)
    if hint is None and all(p == 0 for p in positions):
        hint = "at position 0 every angle is 0 (cos 1, sin 0): the rotation must give x back unchanged"
    if hint is None and not torch.allclose(got.norm(dim=-1), x.norm(dim=-1)):
        hint = "a rotation keeps the length of each head's vector: out = x * cos + rotate_half(x) * sin"
    raise Mismatch(*lines, "hint: " + (hint or "out = x * cos + rotate_half(x) * sin, with cos and sin "
                                       "broadcast over the heads and rotate_half(x) = cat(-x2, x1)"))


# ----- attention -----

def _attend(q, k, v, mask, kv_head, scale):
    """A plain reference loop over heads, for the variants below."""
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kk, vv = k[:, kv_head(h)], v[:, kv_head(h)]  # (L, hd)
        scores = (q[:, h] @ kk.T) * scale
        out[:, h] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    return out


def _attention_mistakes(q, k, v, c):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    g = nh // nkv

    def mask(diagonal):
        return torch.ones(T, L, dtype=torch.bool).tril(diagonal=diagonal)

    def right(h):
        return h // g

    variants = [
        (mask(L), right, hd ** -0.5, "not causal: query i sits at position num_cached + i and must not see the keys "
                                     "after it; mask the scores with tril(diagonal=num_cached)"),
        (mask(0), right, hd ** -0.5, "the mask ignores the cached prefix: query i sits at position num_cached + i, "
                                     "so it sees keys 0..num_cached + i, tril(diagonal=num_cached)"),
        (mask(c - 1), right, hd ** -0.5, "the mask's offset is off by one: query i also sees its own key, "
                                         "keys 0..num_cached + i, tril(diagonal=num_cached)"),
        (mask(c + 1), right, hd ** -0.5, "the mask's offset is off by one: query i sees keys 0..num_cached + i, "
                                         "not the one after, tril(diagonal=num_cached)"),
        (mask(c), lambda h: h % nkv, hd ** -0.5,
         f"GQA head mapping: query head h uses KV head h // (nh // nkv) (here {nh} query heads, {nkv} KV heads: "
         f"heads 0..{g - 1} share KV head 0), that is k.repeat_interleave(nh // nkv, dim=1), not k.repeat"),
        (mask(c), right, 1.0, "scale the scores q . k by 1 / sqrt(head_dim) before the softmax"),
        (mask(c), right, 1 / hd, "scale the scores by 1 / sqrt(head_dim), not 1 / head_dim"),
    ]
    return [(_attend(q, k, v, m, kv, s), hint) for m, kv, s, hint in variants if g * nkv == nh]


def _check_attention(api, T, c, nh, nkv, hd, seed, dtype=torch.float64, spread=1.0, magnitude=1.0):
    """spread scales q, so the scores (softmax's inputs) spread that much wider; magnitude scales v."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nh, hd, generator=gen, dtype=dtype) * spread
    k = torch.randn(c + T, nkv, hd, generator=gen, dtype=dtype)
    v = torch.randn(c + T, nkv, hd, generator=gen, dtype=dtype) * magnitude
    want = ref.attention(q, k, v, c)
    kind = "" if dtype == torch.float64 else f", all {dtype}"
    call = f"attention(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, num_cached={c}{kind})"
    top = _largest_score(q, k)
    if spread != 1 or magnitude != 1:
        call += "\n" + _drawn(seed, [("q", spread), ("v", magnitude)]) + f"; the largest |score| is {top:.3g}"
    given = q.clone(), k.clone(), v.clone()
    out = api.attention(*given, c)
    _unchanged(call, list(zip("qkv", given, (q, k, v))), "scores = q @ k.T * scale")
    got = _checked_output(out, want, call,
                          "one output row per query and one head per query head: (T, nh, hd), "
                          "even though k and v have nkv heads")
    if _close(got, want):
        return
    t, h = _first_difference(got, want)
    difference, precision = _difference(got, want)
    lines = [call, f"  query {t} (position {c + t}), head {h}:",
             f"  expected {_row(want[t, h])}", f"  got      {_row(got[t, h])}", *difference]
    hint = next((h for alt, h in _attention_mistakes(q, k, v, c) if _close(got, alt)), precision)
    if hint is not None and top > 1000 and (hint.startswith("not causal") or "off by one" in hint):
        hint = None  # with scores this large a finite mask value is no mask, or lets one hidden key in: said below
    overflow = math.log(torch.finfo(dtype).max)  # exp of a larger score is inf
    if hint is None and not got.isfinite().all() and top > overflow:
        hint = (f"{'NaN' if got.isnan().any() else 'inf'} where the scores reach {top:.3g}: exp of a score over "
                f"{overflow:.0f} is inf in {dtype}, and inf / inf is NaN: subtract each row's largest score before exp "
                "(torch.softmax does), which changes nothing else")
    if hint is None and got.isnan().any():
        hint = ("NaN: a query whose every score is masked has nothing to attend to; query i sees keys "
                "0..num_cached + i, itself included")
    if hint is None and top > 1000:
        hint = (f"the scores here reach {top:.3g}: a finite mask value (-1e4, even -1e9) can lose to scores this "
                "large, so a key after the query still gets weight (as if there were no mask): fill the hidden "
                "scores with -inf (masked_fill), and let the softmax subtract each row's largest score "
                "(torch.softmax does)")
    raise Mismatch(*lines, "hint: " + (hint or f"row i of head h is softmax(q[i, h] . k[:p+1, h // (nh // nkv)] / "
                                                f"sqrt(hd)) @ v[:p+1, h // (nh // nkv)], with p = num_cached + i"))


def _largest_score(q, k) -> float:
    """max |q . k| / sqrt(hd) over every query head and the KV head it reads (the mask aside)."""
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,lhd->htl", q.double(), k.double().repeat_interleave(g, dim=1))
    return (scores.abs().max() * q.shape[2] ** -0.5).item()


# ----- random inputs (property cases) -----

@st.composite
def _rope_inputs(draw):
    """(T, nh, hd, positions, seed, magnitude): one token or several, one head or many, positions
    anywhere (a batch's tokens come from many sequences: not consecutive), x small or large."""
    positions = draw(st.lists(st.one_of(st.integers(0, 64), st.integers(1000, 1_000_000)), min_size=1, max_size=8))
    nh = draw(st.integers(1, 8))
    hd = draw(st.sampled_from([2, 4, 8, 16, 64, 128]))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    return len(positions), nh, hd, positions, draw(st.integers(0, 2 ** 16)), magnitude


@st.composite
def _attention_inputs(draw):
    """(T, c, nh, nkv, hd, seed, dtype, spread, magnitude): a prompt, a chunk on a short or long cached
    prefix, one decode query; one KV head or several, 1 to 8 query heads per KV head; float64 with the
    scores spread up to 1e10 and v small or large, or float32 (whose tolerance allows only
    scores of a few units: its rounding grows with them)."""
    T = draw(st.integers(1, 12))
    c = draw(st.one_of(st.just(0), st.integers(1, 8), st.integers(64, 200)))
    nkv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4, 8]))
    hd = draw(st.sampled_from([2, 4, 8, 16, 64]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    if dtype == torch.float64:
        spread, magnitude = (draw(st.sampled_from([1.0, 10.0, 100.0, 1e4, 1e6, 1e10])),
                             draw(st.sampled_from([1.0, 1e-3, 1e3])))
    else:
        spread, magnitude = draw(st.sampled_from([1.0, 2.0])), draw(st.sampled_from([1.0, 0.01]))
    return T, c, nkv * group, nkv, hd, draw(st.integers(0, 2 ** 16)), dtype, spread, magnitude


# ----- end to end -----

def check_generate(api, seed, qk_norm, prompt_lens, max_new_tokens=6):
    model = tiny_model(seed, qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    wanted = [ref.generate(model, p, max_new_tokens) for p in prompts]
    saved = ref.apply_rope, ref.attention
    ref.apply_rope, ref.attention = api.apply_rope, api.attention  # what Attention.forward and the cache call
    try:
        got = [ref.generate(model, p, max_new_tokens) for p in prompts]
    finally:
        ref.apply_rope, ref.attention = saved
    kind = "Qwen3-style (RMSNorm on q and k)" if qk_norm else "Llama-style"
    for p, w, g in zip(prompts, wanted, got):
        if g != w:
            at = next(i for i, (a, b) in enumerate(zip(w, g)) if a != b)
            where = (f"the prefill (T={len(p)} queries, num_cached=0)" if at == 0 else
                     f"decode pass {at} (T=1 query, num_cached={len(p) + at - 1})")
            raise Mismatch(f"the tiny {kind} model, greedy from a {len(p)}-token prompt, with your apply_rope and "
                           f"attention: output token {at} differs; it comes from {where}",
                           f"  expected  {w}", f"  got       {g}",
                           "hint: the cases above test each function alone, fix those first; if they pass, "
                           "check that nothing depends on T == num_cached + T or on a fixed number of heads")


def rope(name, T, nh, hd, positions, seed):
    return Case(name, lambda api: _check_rope(api, T, nh, hd, positions, seed))


def attention(name, T, c, nh, nkv, hd, seed, dtype=torch.float64):
    return Case(name, lambda api: _check_attention(api, T, c, nh, nkv, hd, seed, dtype))


CASES = [
    rope("rope_at_position_0_is_the_identity", 1, 2, 8, [0], 0),
    rope("rope_several_tokens_and_heads", 5, 4, 8, [0, 1, 2, 3, 4], 1),
    rope("rope_a_chunk_further_along", 3, 2, 16, [7, 8, 9], 2),
    rope("rope_one_decode_token_far_along", 1, 8, 64, [1000], 3),
    attention("attention_prefill_is_causal", 5, 0, 2, 2, 8, 10),
    attention("attention_over_a_cached_prefix", 3, 4, 2, 2, 8, 11),
    attention("attention_single_decode_query", 1, 9, 4, 2, 8, 12),
    attention("attention_grouped_query_heads", 4, 3, 8, 2, 8, 13),
    attention("attention_one_kv_head_for_all", 3, 2, 4, 1, 16, 14),
    attention("attention_keeps_float32_inputs_in_float32", 4, 3, 4, 2, 16, 15, torch.float32),
    # scores of about 1e10: a hidden key filled with -1e9 (or given -1e9 more) still outweighs the visible ones
    Case("attention_scores_of_1e10_beat_any_finite_mask",
         lambda api: _check_attention(api, 4, 2, 2, 1, 8, 16, spread=1e10)),
    Case("end_to_end_generate_llama_style", lambda api: check_generate(api, 0, False, [7, 1, 12])),
    Case("end_to_end_generate_qwen3_style", lambda api: check_generate(api, 1, True, [5, 16])),
    Case("rope_random_shapes_and_positions",
         lambda api: check_property(_rope_inputs(), lambda a: _check_rope(api, *a), examples=60)),
    Case("attention_random_shapes_prefixes_and_score_spreads",
         lambda api: check_property(_attention_inputs(), lambda a: _check_attention(api, *a), examples=100)),
]
