"""The benchmark's own logic (no timing here: speed is measured by bench/run.py, never asserted).

The workloads are the ones handed out (figures compare across runs only if they are), and the
accounting that turns an engine run into matmul FLOPs counts exactly the rows the runner computed.
"""

import hashlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent / "bench"
WORKLOADS = BENCH / "workloads"
sys.path.insert(0, str(BENCH))

import run as bench_run  # noqa: E402
import workloads  # noqa: E402
from systems import Req, truncate  # noqa: E402

from nano_engine import LLMEngine, SamplingParams, mini_llm  # noqa: E402
from nano_engine.kernels.linear import can_prepack  # noqa: E402
from nano_engine.tiny import tiny_model  # noqa: E402


def test_workloads_are_the_ones_handed_out():
    w1, w2 = workloads.w1(), workloads.w2()
    assert (len(w1.requests), w1.max_new_tokens) == (6, 144)
    assert (len(w2.requests), w2.prompt_tokens, w2.max_new_tokens) == (64, 12670, 4606)
    assert all(r.ignore_eos for r in w2.requests) and not any(r.ignore_eos for r in w1.requests)


def test_workload_files_match_their_recorded_checksums():
    """The project's copy is byte for byte what was handed out: its SHA-256 sums are recorded
    in bench/workloads/SHA256SUMS (`sha256sum -c SHA256SUMS` there checks the same)."""
    recorded = dict(reversed(line.split()) for line in (WORKLOADS / "SHA256SUMS").read_text().splitlines())
    assert sorted(recorded) == ["w1.json", "w2.json"]
    for name, digest in recorded.items():
        assert hashlib.sha256((WORKLOADS / name).read_bytes()).hexdigest() == digest, name
    # Where the source is at hand, the copy must not have drifted from it either.
    shared = Path(__file__).parent.parent.parent / "shared" / "workloads"
    for name in recorded:
        if (shared / name).is_file():
            assert (shared / name).read_bytes() == (WORKLOADS / name).read_bytes(), name


def test_long_prompt_workload_needs_chunked_prefill():
    w3 = workloads.w3()
    assert all(len(r.prompt_ids) == 2000 > bench_run.S.BUDGET for r in w3.requests)
    assert w3.subset(2).requests == w3.requests[::2]


def test_truncate_cuts_after_end_of_sequence_unless_ignored():
    assert truncate([5, 2, 7], Req((1,), 8, False)) == [5, 2]
    assert truncate([5, 2, 7], Req((1,), 8, True)) == [5, 2, 7]
    assert truncate([5, 6, 7], Req((1,), 2, False)) == [5, 6]


@pytest.mark.parametrize("budget, blocks", [(7, 64), (16, 64), (64, 64), (16, 14)])
def test_replayed_steps_are_the_rows_the_runner_computed(budget, blocks, monkeypatch):
    """The FLOPs accounting must count the LM-head rows the runner really ran: decodes, and the
    last chunk of each prompt (a chunk in the middle of a prompt samples nothing)."""
    model = tiny_model()
    rows = []
    engine = LLMEngine(model, max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=blocks, block_size=4)
    real = engine.runner.forward

    def counting(batch):
        rows.append(len(batch.logits_indices))
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", counting)
    prompts = [list(range(1, 1 + n)) for n in (3, 20, 9, 31)]
    engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert bench_run.replay_steps(engine) == [(rec.num_tokens, n) for rec, n in zip(engine.step_log, rows)]
    if blocks < 64:  # recompute after preemption: its last chunk samples again
        assert engine.stats.preemptions > 0


@pytest.mark.parametrize("fused", [False, True])
def test_the_matmul_floor_runs_the_kernels_the_model_runs(fused, monkeypatch):
    """The floor replays a run's matmuls: on a prepacked model it must call the packed kernels, or the
    engine would be measured against a floor it does not stand on."""
    import roofline

    model = tiny_model(seed=4, dtype=torch.float32)
    if fused:
        model.fuse()
    model.prepack()
    calls = []
    real = roofline.linear

    def spy(x, w, b=None, p=None):
        calls.append(p is not None and p.matches(w))
        return real(x, w, b, p)

    monkeypatch.setattr(roofline, "linear", spy)
    monkeypatch.setattr(mini_llm, "linear", spy)  # o_proj and down_proj: the modules, leaf by leaf
    roofline.FloorReplay(model, [(3, 0)], "floor").run()
    block = model.model.layers[0]
    leaves = sum(len(m.leaves) - 1 if m.leaves else 1 for m in (block.self_attn.o_proj, block.mlp.down_proj))
    assert len(calls) == ((2 if fused else 5) + leaves) * model.config.num_hidden_layers and all(calls)


@pytest.mark.parametrize("weights", ["plain", "int8"])
def test_the_matmul_floor_runs_on_a_plain_and_a_quantized_model(weights):
    """On the plain path o_proj and down_proj take a product per KV head (their parts, as the model
    runs them); quantized, one product each (its parts and their sum are one kernel call)."""
    import roofline

    model = tiny_model(seed=4, dtype=torch.float32)
    if weights != "plain":
        model.quantize(weights)
    products = roofline.layer_linears(model)
    kv = model.config.num_key_value_heads
    per_layer = 5 + (2 * kv if weights == "plain" else 2)
    assert len(products) == per_layer * model.config.num_hidden_layers
    roofline.FloorReplay(model, [(3, 0), (1, 1)], "floor").run()


def test_the_quantization_benchmark_counts_the_bytes_a_step_reads_and_scores_a_local_text():
    import quantization as bench_quant
    import roofline

    text = bench_quant.local_text()
    assert len(text) > 100_000 and text == bench_quant.local_text()  # Python's own topics: fixed, no download
    plain = tiny_model(seed=6, dtype=torch.float32, intermediate_size=256)
    int8 = tiny_model(seed=6, dtype=torch.float32, intermediate_size=256).quantize("int8")
    head = plain.lm_head.weight.numel() * 4
    assert roofline.weight_bytes(plain) == sum(w.numel() * 4 for _, _, w in plain.linear_sites())
    assert roofline.weight_bytes(int8) - head < (roofline.weight_bytes(plain) - head) / 4 * 1.1
    ids = [i % 64 for i in range(700)]  # two windows
    assert 1.0 < bench_quant.perplexity(int8, ids) < float("inf")
    assert bench_quant.decode_ms(int8, [1, 2, 3], 4) > 0


def test_quantized_rows_are_checked_against_generate_on_their_own_weights(tmp_path, monkeypatch):
    """bench/run.py --quantization: a row on quantized weights gets generate's tokens on those
    weights as its reference (cached apart from the unquantized model's), while a peer keeps the
    unquantized reference of its dtype."""
    monkeypatch.setattr(bench_run, "CACHE", tmp_path)
    w = workloads.Workload("t", "", (Req((3, 5, 7, 9), 12, True), Req((4, 4, 8), 12, True)))
    plain = tiny_model(seed=11, dtype=torch.float32)
    quant = tiny_model(seed=11, dtype=torch.float32).quantize("int4")
    if quant.prepacked and can_prepack(torch.float32):  # so that only the quantization tells them apart
        plain.prepack()
    assert plain.prepacked == quant.prepacked
    expect = [mini_llm.generate(quant, list(r.prompt_ids), r.max_tokens, None, "torch") for r in w.requests]
    plain_ref = bench_run.reference(plain, w, False, "torch")  # cached first: must not be taken for the other
    assert plain_ref != expect  # the weights differ enough for the check below to mean something
    assert bench_run.reference(quant, w, False, "torch") == expect
    models = {"float32": plain, "float32 int4": quant}
    systems = bench_run.make_systems([], ["float32"], models, 1, w, set())
    assert [s.name for s in systems] == ["nano_engine float32", "nano_engine float32 int4"]
    refs = {"float32": plain_ref, "float32 int4": expect}
    assert bench_run.reference_of(systems[1], refs) == expect
    assert bench_run.reference_of(type("Peer", (), {"dtype": "float32"})(), refs) == plain_ref


def test_the_cached_references_are_kept_apart_by_the_kernels_build_flags(tmp_path, monkeypatch):
    """A kernel built otherwise (NANO_ENGINE_EMULATE_AMX=1 adds a flag) may give other bits: its
    references go into a file of their own instead of being taken from the other build's."""
    monkeypatch.setattr(bench_run, "CACHE", tmp_path)
    w = workloads.Workload("t", "", (Req((3, 5, 7), 4, True),))
    model = tiny_model(seed=2, dtype=torch.float32)
    first = bench_run.reference(model, w, False, "torch")
    monkeypatch.setattr(bench_run.kernel_build, "FLAGS", [*bench_run.kernel_build.FLAGS, "-DNANO_AMX_EMULATE"])
    assert bench_run.reference(model, w, False, "torch") == first
    assert len(list(tmp_path.glob("reference-*.json"))) == 2


def test_an_unknown_quantization_is_refused_by_name():
    assert bench_run.quantization_list("int8,int4") == ["int8", "int4"]
    with pytest.raises(Exception, match="fp3"):
        bench_run.quantization_list("int8,fp3")
