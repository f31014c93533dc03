"""Cases of exercise 142: the learner's quantize_int4, pack_int4, unpack_int4, dequantize and int4_linear
against nano_engine.quantization (quantize, pack_int4, unpack_int4, dequantize), exactly: integers, scales
and dequantized weights bit for bit, dtypes and shapes too.

Hand-made cases first, one rule each (all 16 values, an odd K, one column, the largest magnitude to +-7,
halves to even, a negative maximum, a scale per group, a last group shorter, a group larger than K, a
group of zeros), then random ones (practice.properties): random shapes, group sizes and magnitudes,
with exact halves and zero groups; the smallest input that differs is shown.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

import nano_engine.quantization as ref
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
NAMES = ("quantize_int4", "pack_int4", "unpack_int4", "dequantize", "int4_linear")


def _tensor(method, data, scales, group_size, k):
    return ref.QuantizedTensor(method, data, scales, group_size, (data.shape[0], k))


def ref_quantize_int4(w, group_size):
    qt = ref.quantize(w, "int4", group_size)
    return ref.int_values(qt), qt.scales


def ref_dequantize(q, scales, group_size):
    return ref.dequantize(_tensor("int4", ref.pack_int4(q), scales, group_size, q.shape[1]))


def ref_int4_linear(x, data, scales, group_size, k):
    return F.linear(x, ref.dequantize(_tensor("int4", data, scales, group_size, k)).contiguous())


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(quantize_int4=ref_quantize_int4, pack_int4=ref.pack_int4, unpack_int4=ref.unpack_int4,
                           dequantize=ref_dequantize, int4_linear=ref_int4_linear)


def _fmt(t):
    """A tensor's values, floats to 6 digits (the exact value that differs is shown apart), cut after 200 characters."""
    if t.is_floating_point():
        text = "[" + ", ".join("[" + ", ".join(f"{v:.6g}" for v in row) + "]" for row in t.tolist()) + "]"
    else:
        text = repr(t.tolist())
    return text if len(text) <= 200 else text[:200] + " ..."


def _same(call, got, expected, hint, what="the result"):
    """got equal to expected: a tensor of its dtype and shape, and the same values (bit for bit)."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(call, f"  expected {what}: a tensor, {expected.dtype} of shape {tuple(expected.shape)}",
                       f"  got {got!r}", "hint: " + hint)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise Mismatch(call, f"  expected {what}: {expected.dtype} of shape {tuple(expected.shape)}",
                       f"  got      {got.dtype} of shape {tuple(got.shape)}", "hint: " + hint)
    if not torch.equal(got, expected):
        bad = tuple((got != expected).nonzero()[0].tolist())
        raise Mismatch(call, f"  expected {what}: {_fmt(expected)}", f"  got      {_fmt(got)}",
                       f"  first difference at {list(bad)}: expected {expected[bad].item()!r}, got {got[bad].item()!r}",
                       "hint: " + hint)


def _call(api, fn, call, *args):
    """api.fn on copies of the tensors in args; a changed argument is refused."""
    given = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got = getattr(api, fn)(*given)
    if any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(given, args)):
        raise Mismatch(call, "  expected the arguments unchanged", "  got them changed",
                       "hint: compute into new tensors; do not write into the arguments")
    return got


# ----- pack and unpack -----

PACK = ("byte j of a row holds column 2j in its LOW nibble (bits 0-3) and column 2j + 1 in its HIGH nibble "
        "(bits 4-7), each value stored as q + 8 (0 .. 15); an odd K's last byte has 8 (a zero) in its high nibble")


def _nibbles(q):
    """What a byte layout would give: (q + 8 or q's two's complement nibble, padded) for a wrong-variant check."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    raw = (q.to(torch.int16) & 15).to(torch.uint8)
    if q.shape[1] % 2:
        u, raw = F.pad(u, (0, 1), value=8), F.pad(raw, (0, 1), value=0)
    return u, raw


def check_pack(api, q, hint=PACK):
    call = f"pack_int4(q int8 of shape {tuple(q.shape)}: {_fmt(q)})"
    got = _call(api, "pack_int4", call, q)
    expected = ref.pack_int4(q)
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.equal(got, expected):
        u, raw = _nibbles(q)
        if torch.equal(got.to(torch.uint8), u[:, 1::2] | (u[:, 0::2] << 4)):
            hint = ("the nibbles are swapped: column 2j goes in the LOW nibble (data & 15) and column 2j + 1 in the "
                    "HIGH one (data >> 4), as nano_engine/quantization.py's pack_int4 stores them")
        elif torch.equal(got.to(torch.uint8), raw[:, 0::2] | (raw[:, 1::2] << 4)):
            hint = ("each value is stored as q + 8, an unsigned 0 .. 15 (-8 -> 0, 0 -> 8, 7 -> 15), not as its "
                    "two's complement nibble (q & 15)")
    _same(call, got, expected, hint, "the bytes, uint8")


UNPACK = ("column 2j is the low nibble minus 8, column 2j + 1 the high nibble minus 8, as int8; return exactly k "
          "columns (an odd k drops the padding in the last byte's high nibble)")


def check_unpack(api, q, hint=UNPACK):
    data, k = ref.pack_int4(q), q.shape[1]
    call = f"unpack_int4(data uint8 of shape {tuple(data.shape)}: {_fmt(data)}, k={k})"
    got = _call(api, "unpack_int4", call, data, k)
    if isinstance(got, torch.Tensor) and got.dim() == 2 and got.shape[1] == k + 1:
        hint = f"k = {k} is odd: the last byte's high nibble is padding; return the first k columns only ([:, :k])"
    _same(call, got, q, hint, "the values, int8")


@st.composite
def _ints(draw):
    n, k = draw(st.integers(1, 5)), draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    return torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)


def check_pack_unpack(api, q):
    check_pack(api, q)
    check_unpack(api, q)


# ----- quantize -----

SCALE = ("a row's scale for group g is the largest |w| of columns g * group_size .. (g + 1) * group_size - 1 "
         "(the last group may be shorter) divided by 7, a float32 division, then at least 1e-12")
ROUND = ("q = round(w / scale): a float32 division (not w * (1 / scale)), rounded to nearest with halves to even "
         "(torch.round), clamped to [-8, 7], as int8")


def _wrong_scales(w, g, got):
    """A hint naming the wrong scales, or None."""
    n, k = w.shape
    groups = -(-k // g)
    if got.dim() == 2 and got.shape[0] == n and got.shape[1] == k // g != groups:
        if g > k:
            return (f"group_size = {g} is larger than K = {k}: ceil(K / group_size) = 1 group, the whole row, with "
                    "its own scale: scales of shape (N, 1)")
        return (f"K = {k} is not a multiple of group_size = {g}: there are ceil(K / group_size) = {groups} groups, "
                f"the last one shorter ({k - (groups - 1) * g} of {g} columns), with its own scale")
    if got.shape != (n, groups):
        return None
    amax = F.pad(w.abs(), (0, groups * g - k)).view(n, groups, g).amax(-1)
    row = (w.abs().amax(1, keepdim=True) / 7).clamp(min=ref.MIN_SCALE).expand(n, groups)
    if groups > 1 and torch.equal(got, row):
        return "one scale per GROUP of group_size columns of a row, not one per row: each group's own largest |w| / 7"
    if torch.equal(got, (amax / 8).clamp(min=ref.MIN_SCALE)):
        return ("the scale is the largest |w| / 7, not / 8: the largest magnitude must map to +-7 (symmetric), so "
                "that a negative maximum gives -7, never -8")
    return None


def check_quantize(api, w, g, hint=None):
    call = f"quantize_int4(w float32 of shape {tuple(w.shape)}: {_fmt(w)}, group_size={g})"
    got = _call(api, "quantize_int4", call, w, g)
    q, scales = ref_quantize_int4(w, g)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise Mismatch(call, "  expected a pair (q, scales)", f"  got {got!r}",
                       "hint: return (q, scales): q int8 (N, K), scales float32 (N, ceil(K / group_size))")
    got_q, got_scales = got
    if isinstance(got_scales, torch.Tensor) and got_scales.dtype == torch.float32:
        hint_scales = _wrong_scales(w, g, got_scales) or hint or SCALE
    else:
        hint_scales = hint or SCALE
    _same(call, got_scales, scales, hint_scales, "the scales, float32")
    hint_q = hint or ROUND
    if isinstance(got_q, torch.Tensor) and got_q.shape == q.shape:
        spread = scales.repeat_interleave(g, dim=1)[:, :w.shape[1]]
        ratio = w / spread
        if not torch.equal(got_q, q) and torch.equal(got_q.to(torch.int8), ratio.clamp(-8, 7).to(torch.int8)):
            hint_q = ("q is w / scale truncated toward zero (.to(torch.int8) or int() cuts the fraction): round to "
                      "nearest first, torch.round (halves to even), then clamp and convert")
        elif not torch.equal(got_q, q) and torch.equal(got_q.to(torch.int8), torch.round(
                w.double() / spread.double()).clamp(-8, 7).to(torch.int8)):
            hint_q = ("q is w / scale divided in float64: divide in float32 (the weight's dtype), where a quotient "
                      "that rounds to exactly j + 1/2 goes to the even j; float64 keeps the hair above or below")
        elif not torch.equal(got_q, q) and torch.equal(got_q.to(torch.int8), torch.round(
                w * (1 / spread)).clamp(-8, 7).to(torch.int8)):
            hint_q = ("q is w * (1 / scale): 1 / scale is rounded once more, so w * (1 / scale) can land a hair off "
                      "j + 1/2 where w / scale is exactly on it; divide, as the statement says")
    _same(call, got_q, q, hint_q, "q, int8")


def _w(n, k, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * scale


def _groups_of_magnitudes(n, k, g, seed):
    """Each group of g columns ten times louder than the one before: one scale per row would crush the quiet ones."""
    loud = 10.0 ** torch.arange(-(-k // g)).float().repeat_interleave(g)[:k]
    return _w(n, k, seed) * loud


def _halves_of_any_scale(n, k, g, gen):
    """Groups whose scale is no power of two, the other values (j + 1/2) * scale rounded to float32: many of
    them divide back to exactly j + 1/2 in float32 and not quite in float64, nor times 1 / scale."""
    groups = -(-k // g)
    top = (torch.rand(n, groups, generator=gen) + 0.5) * 7  # each group's largest |w|
    scale = (top / 7).repeat_interleave(g, dim=1)[:, :k]  # the scale that quantize computes
    w = (torch.randint(-7, 7, (n, k), generator=gen) + 0.5) * scale  # below 7 * scale: top stays the largest
    w[:, ::g] = top * (torch.randint(0, 2, top.shape, generator=gen) * 2 - 1)
    return w


@st.composite
def _weights(draw):
    n, k = draw(st.integers(1, 4)), draw(st.integers(1, 48))
    g = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32, 64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    kind = draw(st.sampled_from(["normal", "halves", "halves_any_scale", "zeros"]))
    e = draw(st.integers(-20, 20))
    if kind == "halves":  # a group whose largest |w| is 7 * 2^e and the rest multiples of 2^e / 2: exact halves
        w = torch.randint(-14, 15, (n, k), generator=gen).float() / 2
        w[:, ::g] = 7.0 * (torch.randint(0, 2, (n, len(range(0, k, g))), generator=gen) * 2 - 1)
    elif kind == "halves_any_scale":
        w = _halves_of_any_scale(n, k, g, gen)
    else:
        w = torch.randn(n, k, generator=gen) * (10.0 ** torch.randint(-3, 4, (n, k), generator=gen))
        if kind == "zeros":  # some groups all zeros
            cols = torch.arange(k) // g
            w[:, (cols % 2 == 1)] = 0.0
    return w * 2.0 ** e, g


# ----- dequantize and the matmul -----

DEQUANT = ("w[n, c] = q[n, c] (as float32) * scales[n, c // group_size]: one float32 multiplication, each column its "
           "group's scale; float32 (N, K)")
LINEAR = ("int4_linear: unpack_int4(data, k), dequantize with the scales, then torch.nn.functional.linear(x, w) on "
          "that (N, K) float32 weight, contiguous, as dequantize returns it")


def check_dequantize(api, w, g, hint=DEQUANT):
    q, scales = ref_quantize_int4(w, g)
    call = f"dequantize(q int8 of shape {tuple(q.shape)}: {_fmt(q)}, scales {tuple(scales.shape)}, group_size={g})"
    _same(call, _call(api, "dequantize", call, q, scales, g), ref_dequantize(q, scales, g), hint,
          "the weight, float32")


def check_linear(api, m, w, g, seed, hint=LINEAR):
    q, scales = ref_quantize_int4(w, g)
    data, k = ref.pack_int4(q), w.shape[1]
    x = _w(m, k, seed + 1)
    call = (f"int4_linear(x float32 of shape {tuple(x.shape)}, data uint8 {tuple(data.shape)}, scales "
            f"{tuple(scales.shape)}, group_size={g}, k={k})")
    _same(call, _call(api, "int4_linear", call, x, data, scales, g, k), ref_int4_linear(x, data, scales, g, k), hint,
          "x @ w.T, float32")


@st.composite
def _linears(draw):
    w, g = draw(_weights())
    return draw(st.integers(1, 6)), w, g, draw(st.integers(0, 1000))


def case(name, fn, *args, **kwargs):
    return Case(name, lambda api: fn(api, *args, **kwargs))


ALL_16 = torch.stack([torch.arange(-8, 8), torch.arange(7, -9, -1)]).to(torch.int8)
HALVES = torch.tensor([[3.5, -7.0, 2.5, -0.5, 1.5, 0.5, -2.5, 6.5]])

CASES = [
    case("pack_all_16_values", check_pack, ALL_16),
    case("pack_an_odd_k_pads_with_8", check_pack, ALL_16[:, :15],
         hint="15 columns: 8 bytes a row, the last byte's high nibble is 8 (the padding column's 0, stored as 0 + 8)"),
    case("pack_one_column", check_pack, torch.tensor([[-8], [0], [7]], dtype=torch.int8)),
    case("unpack_all_16_values", check_unpack, ALL_16),
    case("unpack_an_odd_k_drops_the_padding", check_unpack, ALL_16[:, :15]),
    case("unpack_one_column", check_unpack, torch.tensor([[-8], [0], [7]], dtype=torch.int8)),
    Case("random_pack_and_unpack", lambda api: check_property(_ints(), lambda q: check_pack_unpack(api, q),
                                                              examples=100)),
    case("quantize_the_largest_magnitude_to_7", check_quantize, _w(3, 8, 1), 8),
    case("quantize_halves_to_even", check_quantize, HALVES, 8,
         hint="the group's largest |w| is 7, so the scale is 1 and q = round(w): 3.5 -> 4, 2.5 -> 2, -0.5 -> 0, "
              "1.5 -> 2, 0.5 -> 0, -2.5 -> -2, 6.5 -> 6 (halves to even, torch.round)"),
    case("quantize_divides_in_float32", check_quantize,
         _halves_of_any_scale(4, 24, 8, torch.Generator().manual_seed(7)), 8,
         hint="q = round(w / scale) with w / scale one float32 division: here many w / scale are exactly j + 1/2 in "
              "float32 (halves to even), where w * (1 / scale) or a float64 division gives a hair more or less"),
    case("quantize_a_negative_maximum_to_minus_7", check_quantize, torch.tensor([[-3.0, 1.0, 2.0, -0.5]]), 4,
         hint="the largest magnitude, -3, maps to -7 (scale 3 / 7), not -8: the scale is the largest |w| / 7"),
    case("quantize_a_scale_per_group", check_quantize, _groups_of_magnitudes(3, 16, 4, 2), 4),
    case("quantize_a_last_group_shorter", check_quantize, _groups_of_magnitudes(3, 10, 4, 3), 4),
    case("quantize_group_size_larger_than_k", check_quantize, _w(2, 5, 4), 8,
         hint="group_size 8 > K = 5: one group of the 5 columns, one scale a row (scales of shape (N, 1))"),
    case("quantize_a_group_of_zeros", check_quantize, torch.cat([torch.zeros(2, 4), _w(2, 4, 5)], 1), 4,
         hint="a group of zeros has the scale 1e-12 (the largest |w| / 7 = 0, clamped below at 1e-12) and q = 0"),
    case("quantize_one_column", check_quantize, _w(3, 1, 6), 4),
    Case("random_quantize", lambda api: check_property(_weights(), lambda c: check_quantize(api, *c), examples=150)),
    case("dequantize_each_column_its_groups_scale", check_dequantize, _groups_of_magnitudes(3, 10, 4, 7), 4),
    case("dequantize_group_size_larger_than_k", check_dequantize, _w(2, 5, 8), 8),
    Case("random_dequantize", lambda api: check_property(_weights(), lambda c: check_dequantize(api, *c),
                                                         examples=100)),
    case("int4_linear_odd_k", check_linear, 3, _w(5, 11, 9), 4, 11),
    case("int4_linear_the_whole_path", check_linear, 4, _w(24, 64, 10), 16, 12),
    Case("random_int4_linear", lambda api: check_property(_linears(), lambda c: check_linear(api, *c),
                                                          examples=100)),
]
