"""The fused small operations of the prepacked fast path (kernels/fused.py, csrc/fused.cpp): RMSNorm
(alone and with the residual add before it), silu(gate) * up and the rotary embedding (alone and
after Qwen3's norm of each q and k head) compute what
PyTorch computes, give a row the same bits in any batch and with any thread count, leave layouts
they do not take to the plain path, and come and go with Transformer.prepack / unpack. The add
fused into the norm keeps the bits of the two apart, in the model too."""

import ctypes
import subprocess

import pytest
import torch
import torch.nn.functional as F

from nano_engine.kernels import build as kernel_build
from nano_engine.kernels import fused
from nano_engine.mini_llm import RMSNorm, apply_rope, rope_cos_sin
from nano_engine.tiny import tiny_model

DTYPES = [torch.float32, torch.bfloat16]
ROWS = (1, 2, 15, 16, 17, 33, 64, 100, 512, 600)
NAMES = ["rms_norm", "add_rms_norm", "silu_mul", "rope", "qk_norm_rope"]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)


def ops(dtype, dim=576, inter=1536, hd=64, heads=12, rows=700):
    """The three operations on random inputs, each as f(rows slice) -> output, with its PyTorch reference."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    norm = norm.to(dtype)
    d = torch.randn(rows, dim, generator=gen).to(dtype) * 0.3  # a sublayer's output, added to x
    gu = torch.randn(rows, 2 * inter, generator=gen).to(dtype) * 3
    qk = torch.randn(rows, heads, hd, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.rand(hd // 2, generator=gen), torch.arange(rows) * 7, dtype)

    def rope(a, b):
        y = qk[a:b].clone()
        assert fused.rope_(y, cos[a:b], sin[a:b])
        return y

    nh = heads * 2 // 3  # query heads, then key heads (Qwen3's q and k after their projection)
    head_norms = [RMSNorm(hd, 1e-6) for _ in range(2)]
    with torch.no_grad():
        for n in head_norms:
            n.weight.copy_(torch.rand(hd, generator=gen) + 0.5)
    wq, wk = (n.to(dtype) for n in head_norms)

    def qk_norm_rope(a, b):
        y = qk[a:b].clone()
        assert fused.qk_norm_rope_(y, nh, wq.weight, wk.weight, wq.eps, cos[a:b], sin[a:b])
        return y

    def qk_norm_rope_reference(a, b):
        q, k = wq(qk[a:b, :nh]), wk(qk[a:b, nh:])
        return apply_rope(torch.cat((q, k), 1).float(), cos[a:b].float(), sin[a:b].float()).to(dtype)

    return {
        "rms_norm": (lambda a, b: fused.rms_norm(x[a:b], norm.weight, norm.eps), lambda a, b: norm(x[a:b])),
        "add_rms_norm": (lambda a, b: torch.cat(fused.add_rms_norm(x[a:b], d[a:b], norm.weight, norm.eps), 1),
                         lambda a, b: torch.cat((x[a:b] + d[a:b], norm(x[a:b] + d[a:b])), 1)),
        "silu_mul": (lambda a, b: fused.silu_mul(gu[a:b]),
                     lambda a, b: (F.silu(gu[a:b, :inter].float()) * gu[a:b, inter:].float()).to(dtype)),
        "rope": (rope, lambda a, b: apply_rope(qk[a:b].float(), cos[a:b].float(), sin[a:b].float()).to(dtype)),
        "qk_norm_rope": (qk_norm_rope, qk_norm_rope_reference),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_each_computes_what_pytorch_computes(name, dtype):
    kernel, reference = ops(dtype)[name]
    got, want = kernel(0, 300), reference(0, 300)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), **tol(dtype)), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_a_row_gets_the_same_bits_in_any_batch(name, dtype):
    kernel, _ = ops(dtype, dim=100, inter=70, hd=24, heads=3)[name]  # sizes that are not multiples of 16 too
    probe = [0, 1, 15, 16, 17, 99, 511, 599]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            alone = {p: kernel(p, p + 1)[0] for p in probe}
            for rows in ROWS:
                for start in (0, 5):
                    got = kernel(start, start + rows)
                    for p in probe:
                        if start <= p < start + rows:
                            assert torch.equal(got[p - start], alone[p]), (n_threads, rows, start, p)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 100, 7])
def test_the_add_fused_into_the_norm_keeps_the_bits_of_the_two_apart(dim, dtype):
    """add_rms_norm(x, d) is (x + d as PyTorch adds, rms_norm of that) to the last bit."""
    gen = torch.Generator().manual_seed(dim)
    x, d = (torch.randn(33, dim, generator=gen) * 4).to(dtype), torch.randn(33, dim, generator=gen).to(dtype)
    w = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    res, out = fused.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(res, x + d) and torch.equal(out, fused.rms_norm(x + d, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [128, 24])
def test_qwen3s_head_norm_is_rms_norm_then_rope_to_the_bit(hd, dtype):
    """Each q and k head normalised with rms_norm's arithmetic, then rotated as rope_ rotates."""
    gen = torch.Generator().manual_seed(hd)
    qk = torch.randn(9, 6, hd, generator=gen).to(dtype)
    wq, wk = ((torch.rand(hd, generator=gen) + 0.5).to(dtype) for _ in range(2))
    cos, sin = rope_cos_sin(torch.rand(hd // 2, generator=gen), torch.arange(9) * 3, dtype)
    got = qk.clone()
    assert fused.qk_norm_rope_(got, 4, wq, wk, 1e-6, cos, sin)
    want = torch.cat((fused.rms_norm(qk[:, :4].reshape(-1, hd), wq, 1e-6).view(9, 4, hd),
                      fused.rms_norm(qk[:, 4:].reshape(-1, hd), wk, 1e-6).view(9, 2, hd)), 1)
    assert fused.rope_(want, cos, sin)
    assert torch.equal(got, want)


def test_layouts_they_do_not_take_go_back_to_the_plain_path():
    x = torch.randn(4, 8)
    assert fused.rms_norm(x.t(), torch.ones(4), 1e-5) is None  # columns not contiguous
    assert fused.rms_norm(x.double(), torch.ones(8).double(), 1e-5) is None  # float64
    assert fused.rms_norm(x, torch.ones(8).bfloat16(), 1e-5) is None  # weight of another dtype
    assert fused.add_rms_norm(x, x[:2], torch.ones(8), 1e-5) is None  # shapes that differ
    assert fused.add_rms_norm(x, x.bfloat16(), torch.ones(8), 1e-5) is None  # dtypes that differ
    assert fused.add_rms_norm(x, x.t().contiguous().t(), torch.ones(8), 1e-5) is None  # columns not contiguous
    assert fused.silu_mul(torch.randn(4, 7)) is None  # no even split into gate and up
    q, cos = torch.randn(3, 2, 8), torch.randn(3, 8)
    assert not fused.rope_(q.transpose(0, 1), cos, cos)
    assert not fused.rope_(q, cos[:2], cos[:2])


def test_prepack_turns_them_on_and_unpack_off(monkeypatch):
    model = tiny_model(seed=5, dtype=torch.float32)
    ids, positions = torch.tensor([3, 9, 4, 1]), torch.arange(4)
    calls = {"rms_norm": 0, "add_rms_norm": 0}

    def spy(name):
        real = getattr(fused, name)

        def counted(*args):
            calls[name] += 1
            return real(*args)
        return counted

    with torch.inference_mode():
        plain = model(ids, positions)
    model.prepack()
    assert all(m.fused for m in model.modules() if isinstance(m, RMSNorm))
    for name in calls:
        monkeypatch.setattr(fused, name, spy(name))
    with torch.inference_mode():
        packed = model(ids, positions)
    # the first block's first norm alone; every other norm with the residual add before it
    assert calls == {"rms_norm": 1, "add_rms_norm": 2 * model.config.num_hidden_layers}
    assert torch.allclose(packed, plain, rtol=1e-4, atol=1e-4)
    model.unpack()
    calls.update(rms_norm=0, add_rms_norm=0)
    with torch.inference_mode():
        assert torch.equal(model(ids, positions), plain) and calls == {"rms_norm": 0, "add_rms_norm": 0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_gets_the_same_bits_with_the_adds_fused_or_apart(dtype, monkeypatch):
    """The fast path's hidden states, with each residual add fused into the norm after it, and with
    the adds done apart (PyTorch's add, then the fused norm)."""
    model = tiny_model(seed=6, dtype=dtype)
    model._fuse(True)  # the fused small operations alone (bfloat16 prepacks only where a kernel is)
    ids, positions = torch.tensor([3, 9, 4, 1, 7, 2]), torch.arange(6)
    with torch.inference_mode():
        together = model(ids, positions)
        monkeypatch.setattr(fused, "add_rms_norm", lambda *args: None)  # the layout refused: adds apart
        apart = model(ids, positions)
    assert torch.equal(together, apart)


def test_the_avx2_and_plain_builds_give_this_cpus_bits(tmp_path, monkeypatch):
    """simd.h's operations round alike on every instruction set, the bfloat16 rounding included."""
    variants = {"plain C++": "-march=x86-64"}
    if {"avx2", "fma"} <= kernel_build.cpu_features():
        variants["AVX2"] = "-march=haswell"
    results = {}
    for name, march in [("native", None), *variants.items()]:
        if march:
            out = tmp_path / f"{march[7:]}.so"
            flags = [f for f in kernel_build.FLAGS if not f.startswith("-march")]
            subprocess.run(["g++", *flags, march, "-o", str(out), str(fused.SOURCE)], check=True)
            lib = ctypes.CDLL(str(out))
            fused._declare(lib)
            monkeypatch.setattr(fused, "library", lambda lib=lib: lib)
        results[name] = [fn(0, 40) for dtype in DTYPES for fn, _ in ops(dtype, dim=100, inter=70, hd=40).values()]
    for name in variants:
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["native"])), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leaf_sum_adds_in_the_trees_order_and_rounds_once(dtype):
    """fused.leaf_sum has the bits of mini_llm.leaf_sum (the torch additions in parallel/split.py's
    tree) then one rounding, for 1 to 9 leaves, one row and many (several threads), odd widths."""
    from nano_engine.mini_llm import leaf_sum
    from nano_engine.parallel.split import Tree

    torch.manual_seed(0)
    for leaves in range(1, 10):
        for rows, cols in ((1, 576), (300, 131)):
            parts = [(torch.randn(rows, cols) * 10 ** (i % 4)).to(dtype) for i in range(leaves)]
            want = leaf_sum(parts, Tree(0, leaves)).to(dtype)
            assert torch.equal(fused.leaf_sum(parts), want), (leaves, rows, cols)
