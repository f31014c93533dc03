"""The compiled decode attention (attention_backend="c", kernels/paged_decode.py and csrc/): the
same results as the chapters' PyTorch attention, bit for bit in bfloat16, the same tokens as
`generate`; input it cannot read, a dtype it cannot run and a failed build refused with what to do."""

import pytest
import torch

from nano_engine.attention import GatherBuffers, paged_attention, plan_attention
from nano_engine.engine import LLMEngine
from nano_engine.kernels import build as kernel_build
from nano_engine.kernels import paged_decode
from nano_engine.mini_llm import attention, generate
from nano_engine.sampling import SamplingParams
from nano_engine.tiny import tiny_model

from test_attention import random_step


def decodes(gen, lens, nh, nkv, hd, bs, dtype, num_blocks=None):
    """A cache and one decode step: each sequence's context in scattered blocks, one query each."""
    num_blocks = num_blocks or sum(-(-n // bs) for n in lens) + 3
    kc = torch.randn(num_blocks * bs, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn(num_blocks * bs, nkv, hd, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    q = torch.randn(len(lens), nh, hd, generator=gen).to(dtype)
    return q, kc, vc, tables


def reference(q, kc, vc, tables, lens, bs):
    """Each sequence alone through mini_llm.attention over its own gathered context."""
    out = []
    for d, n in enumerate(lens):
        slots = torch.tensor([tables[d][p // bs] * bs + p % bs for p in range(n)])
        out.append(attention(q[d:d + 1], kc[slots], vc[slots], n - 1))
    return torch.cat(out)


def kernel(q, kc, vc, tables, lens, bs):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return paged_decode.paged_decode(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), bs)


CASES = [  # (context lengths, nh, nkv, hd, block size)
    ([1, 17, 40, 5, 33, 64, 2], 9, 3, 64, 16),  # the embedded model's heads; ragged, one of length 1
    ([300], 9, 3, 64, 16),  # one sequence: its KV heads split across threads
    ([7, 1, 12], 4, 2, 8, 1),  # block size 1: every slot its own block
    ([23, 9, 31, 4], 4, 4, 12, 5),  # no grouped queries (nh == nkv); head_dim not a multiple of 8
    ([130, 129, 3], 16, 8, 128, 128),  # vLLM's CPU block size, Qwen3-0.6B's heads
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens, nh, nkv, hd, bs", CASES)
def test_each_sequence_gets_what_it_gets_alone(lens, nh, nkv, hd, bs, dtype):
    """Bit for bit in bfloat16; to rounding in float32."""
    gen = torch.Generator().manual_seed(len(lens) * bs)
    q, kc, vc, tables = decodes(gen, lens, nh, nkv, hd, bs, dtype)
    got, want = kernel(q, kc, vc, tables, lens, bs), reference(q, kc, vc, tables, lens, bs)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_mixed_step_through_paged_attention_matches_the_torch_backend(dtype):
    """Decodes among prefill chunks (their rows not neighbours in the batch), through the plan."""
    gen = torch.Generator().manual_seed(7)
    specs = [(5, 1), (0, 7), (6, 1), (3, 4), (30, 1), (0, 1), (28, 1)]
    batch, kc, vc, q, k, v, _ = random_step(gen, specs, dtype=dtype)
    args = (batch.query_start, batch.num_cached, batch.block_tables, batch.slot_mapping, 4, kc.shape[1])
    got = paged_attention(plan_attention(*args, GatherBuffers(), backend="c"), kc, vc, q, k, v)
    want = paged_attention(plan_attention(*args, GatherBuffers(), backend="torch"), kc, vc, q, k, v)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_decodes_only_rows_and_a_non_contiguous_query():
    """A decode-only step passes q straight in; the fused q/k/v projection makes it a strided view."""
    gen = torch.Generator().manual_seed(3)
    batch, kc, vc, _, k, v, _ = random_step(gen, [(9, 1), (2, 1), (17, 1)], dtype=torch.bfloat16)
    wide = torch.randn(3, 6, 8, generator=gen).to(torch.bfloat16)
    q = wide[:, :4]  # (T, nh, hd), not contiguous
    args = (batch.query_start, batch.num_cached, batch.block_tables, batch.slot_mapping, 4, kc.shape[1])
    got = paged_attention(plan_attention(*args, backend="c"), kc, vc, q, k, v)
    assert torch.equal(got, paged_attention(plan_attention(*args, max_padding=1.0), kc, vc, q, k, v))


def test_paged_decode_refuses_what_it_cannot_read_by_name():
    """Direct callers get an error before the C code reads memory it was not given."""
    gen = torch.Generator().manual_seed(2)
    q, kc, vc, tables = decodes(gen, [5, 9], 4, 2, 8, 4, torch.float32)
    bt = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)  # room for 12 tokens
    lens = torch.tensor([5, 9], dtype=torch.int32)
    assert paged_decode.paged_decode(q, kc, vc, bt, lens, 4).shape == q.shape
    with pytest.raises(ValueError, match="a context of 13 tokens does not fit block tables of 3 blocks of 4"):
        paged_decode.paged_decode(q, kc, vc, bt, torch.tensor([5, 13], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="a context of 13 tokens does not fit"):
        paged_decode.paged_decode(q, kc, vc, bt, lens, 4, width=13)  # the width the engine passes is checked too
    with pytest.raises(ValueError, match="at least 1; the shortest is 0"):
        paged_decode.paged_decode(q, kc, vc, bt, torch.tensor([0, 9], dtype=torch.int32), 4)
    args = {"q": q, "k_cache": kc, "v_cache": vc, "block_tables": bt, "context_lens": lens}
    for name, t in args.items():
        strided = torch.stack([t, t], dim=-1)[..., 0]  # the same values, not contiguous
        with pytest.raises(ValueError, match=f"contiguous.*{name}"):
            paged_decode.paged_decode(**{**args, name: strided}, block_size=4)
    with pytest.raises(ValueError, match="block_tables.*int32"):
        paged_decode.paged_decode(**{**args, "block_tables": bt.long()}, block_size=4)
    with pytest.raises(ValueError, match="v_cache is torch.bfloat16"):
        paged_decode.paged_decode(**{**args, "v_cache": vc.bfloat16()}, block_size=4)


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
    refs = [generate(model, p, 20, eos_token_id=255) for p in prompts]
    calls, real = [], paged_decode.paged_decode

    def spy(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)
    monkeypatch.setattr(paged_decode, "paged_decode", spy)
    preempted = 0
    for cfg in ENGINE_CONFIGS:
        engine = LLMEngine(model, attention_backend="c", **cfg)
        assert engine.runner.attention_backend == "c"
        calls.clear()
        free = engine.block_pool.num_free
        done = engine.generate(prompts, SamplingParams(max_tokens=20))
        assert len(calls) >= 19 * model.config.num_hidden_layers  # every decode step's layers ran the kernel
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


def test_the_torch_backend_never_calls_the_kernel(monkeypatch):
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: pytest.fail("the kernel ran"))
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
    path = paged_decode.build()
    assert path.exists() and path.parent == tmp_path / "a" / "b" / "kernels"
    assert records[0].read_text().splitlines()[-1] == str(paged_decode.SOURCE)  # the first name found compiles
    assert all(not r.exists() for r in records[1:])


def test_a_failed_build_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(paged_decode.KernelBuildError, match='no-such-compiler.*attention_backend="torch"'):
        paged_decode.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(paged_decode.KernelBuildError, match='c\\+\\+ or g\\+\\+.*attention_backend="torch"'):
        paged_decode.build()  # no compiler on PATH
    fake_compiler(tmp_path / "bin", "g++", stderr="paged_decode.cpp:3: error\\nsecond line", code=2)
    with pytest.raises(paged_decode.KernelBuildError, match='exit 2.*attention_backend="torch"') as e:
        paged_decode.build()
    assert str(e.value).endswith("paged_decode.cpp:3: error\nsecond line")  # what the compiler said
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built is left to be loaded later


def test_the_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path))
    path = paged_decode.build()
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert paged_decode.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setattr(kernel_build, "_cpu_id", lambda: "flags : another cpu")
    assert paged_decode.library_path() != path
    monkeypatch.delenv("NANO_ENGINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paged_decode.library_path().parent == tmp_path / "home" / ".cache" / "nano_engine" / "kernels"


def test_the_kernel_runs_on_torchs_openmp_runtime():
    """A second libgomp would start a second thread team on the same cores (twice the threads)."""
    paged_decode.library()
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1 and "torch" in next(iter(gomp)), gomp
