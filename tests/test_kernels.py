"""The compiled attention (attention_backend="c", kernels/paged_attention.py and csrc/): a row's bits
do not depend on the rows it shares a call with, the chunk it came in, the block size, the thread
count or the instruction set; generate() with the same backend and the engine give the same tokens;
input it cannot read, a dtype it cannot run and a failed build are refused with what to do."""

import ctypes
import fnmatch
import subprocess
import tomllib

import pytest
import torch

from nano_engine.attention import GatherBuffers, paged_attention, plan_attention
from nano_engine.engine import LLMEngine
from nano_engine.kernels import build as kernel_build
from nano_engine.kernels import paged_attention as kernels
from nano_engine.mini_llm import attention, generate
from nano_engine.sampling import SamplingParams
from nano_engine.tiny import tiny_model

from test_attention import random_step

DTYPES = [torch.float32, torch.bfloat16]
# (nh, nkv, hd): SmolLM2, Qwen3-0.6B, odd, tiny, and more query heads a KV head (70) than an item holds (64)
HEADS = [(9, 3, 64), (16, 8, 128), (4, 4, 12), (4, 2, 8), (70, 1, 16)]


def scattered(gen, length, nkv, hd, bs, dtype):
    """A cache holding one context of `length` tokens in shuffled blocks, and its block table."""
    nblocks = -(-length // bs)
    kc = torch.randn((nblocks + 2) * bs, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn((nblocks + 2) * bs, nkv, hd, generator=gen).to(dtype)
    table = torch.randperm(nblocks + 2, generator=gen)[:nblocks].tolist()
    return kc, vc, table, nblocks + 2


def rows_alone(q, kc, vc, table, bs, nblocks, first):
    """Each row of q (positions first, first + 1, ...) in a call of its own; bfloat16 outputs as
    float32 before their rounding (`wide`), so that a difference in any float32 step shows."""
    return torch.cat([kernels.paged_attention(q[i:i + 1], kc, vc, kernels.kernel_batch([0, 1], [first + i], [table],
                                                                                      bs, nblocks), wide=True)
                      for i in range(q.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh, nkv, hd", HEADS)
def test_a_row_gets_the_same_bits_in_any_chunk_and_any_decode_group(nh, nkv, hd, dtype):
    """The same (query, context) row computed alone, in prefill chunks of 1, 7, 128 and 512 rows
    starting anywhere, and among 1-64 decodes of other sequences, with 1 and 2 threads."""
    gen = torch.Generator().manual_seed(nh * hd)
    length, bs = 700, 16
    kc, vc, table, nblocks = scattered(gen, length, nkv, hd, bs, dtype)
    q = torch.randn(length, nh, hd, generator=gen).to(dtype)
    probe = list(range(0, length, 37)) + [length - 1]  # the rows checked alone
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            alone = {p: rows_alone(q[p:p + 1], kc, vc, table, bs, nblocks, p) for p in probe}
            for chunk in (1, 7, 128, 512):
                for start in range(0, length, chunk * 3 + 1):  # chunks starting at varied positions
                    end = min(length, start + chunk)
                    got = kernels.paged_attention(q[start:end], kc, vc,
                                                  kernels.kernel_batch([0, end - start], [start], [table], bs, nblocks),
                                                  wide=True)
                    for p in probe:
                        if start <= p < end:
                            assert torch.equal(got[p - start], alone[p][0]), (n_threads, chunk, start, p)
            for group in (1, 2, 15, 16, 17, 33, 64):  # decodes of the same context at other positions
                where = [probe[(i * 7) % len(probe)] for i in range(group)]
                batch = kernels.kernel_batch(list(range(group + 1)), where, [table] * group, bs, nblocks)
                got = kernels.paged_attention(torch.cat([q[p:p + 1] for p in where]), kc, vc, batch, wide=True)
                for i, p in enumerate(where):
                    assert torch.equal(got[i], alone[p][0]), (n_threads, group, p)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_block_size_and_the_layout_of_the_cache_change_no_bit(dtype):
    """A context in blocks of 1, 5, 16 or 128 slots, or in one piece as generate() holds it."""
    gen = torch.Generator().manual_seed(11)
    nh, nkv, hd, length = 9, 3, 64, 300
    k = torch.randn(length, nkv, hd, generator=gen).to(dtype)
    v = torch.randn(length, nkv, hd, generator=gen).to(dtype)
    q = torch.randn(20, nh, hd, generator=gen).to(dtype)
    want = kernels.contiguous_attention(q, k, v, length - 20)
    for bs in (1, 5, 16, 128):
        nblocks = -(-length // bs) + 1
        table = torch.randperm(nblocks, generator=gen)[:nblocks - 1].tolist()
        kc, vc = torch.zeros(nblocks * bs, nkv, hd, dtype=dtype), torch.zeros(nblocks * bs, nkv, hd, dtype=dtype)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        kc[slots], vc[slots] = k, v
        got = kernels.paged_attention(q, kc, vc, kernels.kernel_batch([0, 20], [length - 20], [table], bs, nblocks))
        assert torch.equal(got, want), bs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh, nkv, hd", HEADS)
def test_it_computes_attention(nh, nkv, hd, dtype):
    """Against the chapters' attention in float64: float32 to rounding, bfloat16 to its last bit."""
    gen = torch.Generator().manual_seed(hd)
    for T, cached in ((1, 0), (1, 300), (40, 0), (33, 90)):
        q = torch.randn(T, nh, hd, generator=gen).to(dtype) * 2
        k = torch.randn(cached + T, nkv, hd, generator=gen).to(dtype)
        v = torch.randn(cached + T, nkv, hd, generator=gen).to(dtype)
        got = kernels.contiguous_attention(q, k, v, cached).double()
        want = attention(q.double(), k.double(), v.double(), cached)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # float32: a score is one chain of head_dim products
        assert torch.allclose(got, want, rtol=tol, atol=tol), (T, cached, (got - want).abs().max())


def test_the_avx2_and_plain_builds_give_this_cpus_bits(tmp_path):
    """Every step rounds as IEEE says (fused multiply-adds, a fixed tree of additions, the same
    polynomial for exp), so the kernel built for an AVX2-only CPU (where this one can run it) or for
    plain x86-64 gives the bits of the one built for this CPU: a row's result does not depend on the
    machine. bfloat16 on AMX tiles or AVX512_BF16 dot products is the exception (other roundings,
    checked against float64)."""
    gen = torch.Generator().manual_seed(5)
    libs = {"native": kernels.library()}
    variants = {"plain C++": "-march=x86-64"}
    if {"avx2", "fma"} <= kernel_build.cpu_features():
        variants["AVX2"] = "-march=haswell"
    for name, march in variants.items():
        out = tmp_path / f"{march[7:]}.so"
        flags = [f for f in kernel_build.FLAGS if not f.startswith("-march")]
        subprocess.run(["g++", *flags, march, "-o", str(out), str(kernels.SOURCE)], check=True)
        libs[name] = ctypes.CDLL(str(out))
        kernels._declare(libs[name])
    for dtype in [torch.float32] if kernels.bfloat16_path() != "vector" else DTYPES:
        for nh, nkv, hd in HEADS:
            batch, kc, vc, q, *_ = random_step(gen, [(5, 1), (0, 37), (30, 1), (12, 9)], dtype=dtype)
            q = torch.randn(q.shape[0], nh, hd, generator=gen).to(dtype) * 3
            kc = torch.randn(kc.shape[0], nkv, hd, generator=gen).to(dtype)
            vc = torch.randn(kc.shape[0], nkv, hd, generator=gen).to(dtype)
            kb = kernels.kernel_batch(batch.query_start, batch.num_cached, batch.block_tables, batch.block_size,
                                      kc.shape[0] // batch.block_size)
            outs = {}
            for name, lib in libs.items():
                out = torch.empty_like(q)
                getattr(lib, "paged_attention_f32" if dtype == torch.float32 else "paged_attention_bf16")(
                    q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), kb.query_start.data_ptr(),
                    kb.num_cached.data_ptr(), kb.block_tables.data_ptr(), len(kb.num_cached),
                    kb.block_tables.shape[1], nh, nkv, hd, kb.block_size, hd ** -0.5, 2)
                outs[name] = out
            for name in variants:
                assert torch.equal(outs[name], outs["native"]), (name, dtype, hd)


def test_an_installed_package_ships_every_kernel_source_and_header():
    """pip install without -e copies only the package data that pyproject.toml names: a header left
    out there (simd.h, amx.h) would leave every kernel unbuildable on the user's machine."""
    pyproject = tomllib.loads((kernel_build.CSRC.parents[2] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["nano_engine.kernels"]
    for path in kernel_build.CSRC.iterdir():
        assert any(fnmatch.fnmatch(f"csrc/{path.name}", pattern) for pattern in shipped), path.name


@pytest.mark.parametrize("source", sorted(kernel_build.CSRC.glob("*.cpp")), ids=lambda p: p.name)
def test_every_kernel_builds_for_a_cpu_with_amx(source, tmp_path):
    """The AMX paths (and AVX512_BF16's) are compiled only where -march=native has them, so a change
    that breaks them would pass every test on an AMD or AVX2 machine and leave a Sapphire Rapids
    Xeon without its kernels. Each source is built here for that CPU, with the build's own flags."""
    flags = [f for f in kernel_build.FLAGS if not f.startswith("-march")]
    run = subprocess.run(["g++", *flags, "-march=sapphirerapids", "-o", str(tmp_path / "k.so"), str(source)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_through_the_plan_gives_each_row_what_generate_computes(dtype):
    """Decodes among prefill chunks (their rows not neighbours in the batch), through plan_attention,
    against each sequence alone through mini_llm.attention(backend="c"), generate's call."""
    gen = torch.Generator().manual_seed(7)
    specs = [(5, 1), (0, 7), (6, 1), (3, 4), (30, 1), (0, 1), (28, 1)]
    batch, kc, vc, q, k, v, full = random_step(gen, specs, dtype=dtype)
    plan = plan_attention(batch.query_start, batch.num_cached, batch.block_tables, batch.slot_mapping,
                          batch.block_size, kc.shape[1], GatherBuffers(), backend="c",
                          num_blocks=kc.shape[0] // batch.block_size)
    got = paged_attention(plan, kc, vc, q, k, v)
    for s, (ks, vs) in enumerate(full):
        a, b = batch.query_start[s], batch.query_start[s + 1]
        assert torch.equal(got[a:b], attention(q[a:b], ks, vs, batch.num_cached[s], backend="c")), s
    wide = torch.randn(q.shape[0], q.shape[1] + 2, q.shape[2], generator=gen).to(dtype)
    wide[:, :q.shape[1]] = q  # the fused q/k/v projection makes q a strided view
    assert torch.equal(paged_attention(plan, kc, vc, wide[:, :q.shape[1]], k, v), got)


def test_what_it_cannot_read_is_refused_by_name_before_the_c_code_runs():
    gen = torch.Generator().manual_seed(2)
    kc, vc, table, nblocks = scattered(gen, 9, 2, 8, 4, torch.float32)  # 3 blocks of 4 used, 5 in the cache
    q = torch.randn(2, 4, 8, generator=gen)
    good = kernels.kernel_batch([0, 1, 2], [4, 8], [table[:2], table], 4, nblocks)
    assert kernels.paged_attention(q, kc, vc, good).shape == q.shape
    with pytest.raises(ValueError, match="sequence 1: a context of 13 tokens does not fit its block table of 3 blocks of 4"):
        kernels.kernel_batch([0, 1, 2], [4, 12], [table[:2], table], 4, nblocks)
    with pytest.raises(ValueError, match="sequence 0: block 5 is outside the cache's 5 blocks"):
        kernels.kernel_batch([0, 1], [0], [[5]], 4, nblocks)
    with pytest.raises(ValueError, match="sequence 1 has 0 new tokens"):
        kernels.kernel_batch([0, 1, 1], [0, 0], [[0], [1]], 4, nblocks)
    with pytest.raises(ValueError, match="query_start needs 3 entries"):
        kernels.kernel_batch([0, 1], [0, 0], [[0], [1]], 4, nblocks)
    with pytest.raises(ValueError, match="q has 3 rows but the batch has 2"):
        kernels.paged_attention(torch.randn(3, 4, 8), kc, vc, good)
    with pytest.raises(ValueError, match="v_cache is torch.bfloat16"):
        kernels.paged_attention(q, kc, vc.bfloat16(), good)
    with pytest.raises(ValueError, match="contiguous.*k_cache"):
        kernels.paged_attention(q, torch.stack([kc, kc], dim=-1)[..., 0], vc, good)
    with pytest.raises(ValueError, match="the cache holds 16 slots, fewer than the batch's 5 blocks of 4"):
        kernels.paged_attention(q, kc[:16], vc[:16], good)
    with pytest.raises(ValueError, match="4 query heads of 8 cannot attend over 3 KV heads"):
        kernels.paged_attention(q, kc[:, :1].expand(-1, 3, -1).contiguous(), vc[:, :1].expand(-1, 3, -1).contiguous(), good)
    with pytest.raises(ValueError, match="k and v hold 5 tokens; 2 cached \\+ 2 new"):
        kernels.contiguous_attention(q, kc[:5], vc[:5], 2)
    with pytest.raises(ValueError, match='backend="c" needs num_blocks'):
        plan_attention([0, 1], [0], [[0]], torch.tensor([0]), 4, 2, backend="c")


ENGINE_CONFIGS = [
    {},
    {"max_num_batched_tokens": 16, "num_blocks": 16, "block_size": 4},  # chunks and preemptions
    {"block_size": 1, "max_num_batched_tokens": 7, "num_blocks": 400},
    {"block_size": 5, "num_blocks": 40, "max_num_seqs": 3, "enable_prefix_caching": True},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_with_the_kernel_equals_generate(dtype, monkeypatch):
    model = tiny_model(seed=4, dtype=dtype, vocab_size=256, eos_token_id=255)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 250, (9,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 30, (10,), generator=gen)]
    refs = [generate(model, p, 20, eos_token_id=255, attention_backend="c") for p in prompts]
    calls, real = [], kernels.paged_attention

    def spy(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)
    monkeypatch.setattr(kernels, "paged_attention", spy)
    preempted = 0
    for cfg in ENGINE_CONFIGS:
        engine = LLMEngine(model, attention_backend="c", **cfg)
        assert engine.runner.attention_backend == "c"
        calls.clear()
        free = engine.block_pool.num_free
        done = engine.generate(prompts, SamplingParams(max_tokens=20))
        assert len(calls) == engine.stats.steps * model.config.num_hidden_layers  # one call per layer and step
        assert [r.output_ids for r in done] == refs, cfg
        preempted += engine.stats.preemptions
        assert engine.block_pool.num_free == free  # every block given back
    assert preempted > 0  # the recompute path ran too


def test_a_backend_is_named_and_a_dtype_it_cannot_run_is_refused_before_allocation():
    with pytest.raises(ValueError, match="attention_backend='C'"):  # EngineConfig's own: test_errors.py
        LLMEngine(tiny_model(dtype=torch.float32), attention_backend="C")
    for dtype in (torch.float64, torch.float16):
        model = tiny_model(dtype=dtype)
        with pytest.raises(ValueError, match=f'attention_backend="c".* {str(dtype)[6:]} .*attention_backend="torch"'):
            LLMEngine(model, attention_backend="c")
        LLMEngine(model, attention_backend="torch")  # the chapters' path runs every dtype


def test_auto_is_the_kernel_where_it_runs_the_dtype_and_builds_else_torch(monkeypatch, tmp_path):
    for dtype in DTYPES:
        assert kernels.resolve_backend("auto", dtype) == "c"
        assert LLMEngine(tiny_model(dtype=dtype), attention_backend="auto").runner.attention_backend == "c"
    for dtype in (torch.float16, torch.float64):
        assert kernels.resolve_backend("auto", dtype) == "torch"
        assert LLMEngine(tiny_model(dtype=dtype), attention_backend="auto").runner.attention_backend == "torch"
    assert kernels.resolve_backend("torch", torch.float32) == "torch"  # a named backend stays as named
    model = tiny_model(seed=2, dtype=torch.float32)
    assert generate(model, [3, 4, 5], 6, attention_backend="auto") == generate(model, [3, 4, 5], 6, attention_backend="c")
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path))  # nothing built here yet,
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # and no compiler to build it
    assert kernels.resolve_backend("auto", torch.float32) == "torch"


def test_the_torch_backend_never_calls_the_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "paged_attention", lambda *a: pytest.fail("the kernel ran"))
    model = tiny_model(seed=4, dtype=torch.float32)
    assert len(LLMEngine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=5))[0].output_ids) == 5


def fake_compiler(folder, name, stderr="", code=0):
    """A `name` on PATH that records its arguments and writes its -o file (or fails)."""
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text("#!/bin/sh\n"
                      f'printf "%s\\n" "$@" > "{folder}/{name}.args"\n'
                      f'printf "{stderr}" >&2\n'
                      f'[ {code} -eq 0 ] || exit {code}\n'
                      'while [ "$1" != "-o" ]; do shift; done; : > "$2"\n')
    script.chmod(0o755)
    return folder / f"{name}.args"


@pytest.mark.parametrize("names", [["g++"], ["c++", "g++"]])
def test_the_compiler_is_cxx_then_cplusplus_then_gplusplus(monkeypatch, tmp_path, names):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "a" / "b"))  # parents made as needed
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    records = [fake_compiler(tmp_path / "bin", n) for n in names]
    path = kernels.build()
    assert path.exists() and path.parent == tmp_path / "a" / "b" / "kernels"
    assert records[0].read_text().splitlines()[-1] == str(kernels.SOURCE)  # the first name found compiles
    assert all(not r.exists() for r in records[1:])


def test_a_failed_build_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(kernels.KernelBuildError, match='no-such-compiler.*attention_backend="torch"'):
        kernels.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(kernels.KernelBuildError, match='c\\+\\+ or g\\+\\+.*attention_backend="torch"'):
        kernels.build()  # no compiler on PATH
    fake_compiler(tmp_path / "bin", "g++", stderr="paged_attention.cpp:3: error\\nsecond line", code=2)
    with pytest.raises(kernels.KernelBuildError, match='exit 2.*attention_backend="torch"') as e:
        kernels.build()
    assert str(e.value).endswith("paged_attention.cpp:3: error\nsecond line")  # what the compiler said
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built is left to be loaded later


def test_the_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path))
    path = kernels.build()
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert kernels.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setattr(kernel_build, "_cpu_id", lambda: "flags : another cpu")
    assert kernels.library_path() != path
    monkeypatch.delenv("NANO_ENGINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernels.library_path().parent == tmp_path / "home" / ".cache" / "nano_engine" / "kernels"


def test_the_kernel_runs_on_torchs_openmp_runtime():
    """A second libgomp would start a second thread team on the same cores (twice the threads)."""
    kernels.library()
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1 and "torch" in next(iter(gomp)), gomp
