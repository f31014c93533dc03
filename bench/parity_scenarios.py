"""Seeded scheduling scenarios, and nano_engine's decisions on them step by step (no vLLM needed).

A scenario is a small workload and the scheduler settings: block size, a KV pool that is tight or
ample, budget, max_num_seqs, chunked prefill and prefix caching on or off, fcfs or priority, and
requests with prompts that may share a prefix, max_tokens, a priority and an arrival step. A trace
is one record per step: which request got how many tokens from which position (`start`: for a
request just admitted, its prefix-cache hit), and whom the step preempted, in order.

bench/vllm_parity.py runs vLLM's scheduler on the same scenarios; tests/test_vllm_parity.py
replays recorded vLLM traces against `run_nano` without vLLM.
"""

from __future__ import annotations

import math
import random

TOKEN = 7  # every sampled token: requests end at max_tokens in both engines, never at an EOS
MAX_STEPS = 1000  # a scenario still running after this many steps is a livelock: reported


# ----- scenarios -----
def random_scenario(seed: int, chunked: bool, caching: bool, policy: str, reserve_full_isl: bool = False) -> dict:
    """A small seeded workload: budget, block size, a pool that is tight or ample, shared prefixes,
    arrivals over time, max_tokens and (under "priority") priorities per request."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8, 16])
    budget = rng.choice([8, 12, 16, 24, 32, 64])
    max_num_seqs = rng.choice([2, 3, 4, 8])
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(1, 3) * bs + rng.randrange(bs))] for _ in range(2)]
    requests = []
    for i in range(rng.randint(3, 8)):
        max_tokens = rng.randint(1, 12)
        length = rng.randint(1, 40)
        if not chunked:  # vLLM without chunking: prompt + max_tokens <= max_model_len = the budget
            max_tokens = min(max_tokens, budget - 1)
            length = min(length, budget - max_tokens)
        prompt = []
        if rng.random() < 0.6:  # a shared prefix, cut anywhere (cached only in full blocks)
            prompt = prefixes[rng.randrange(2)][:rng.randint(1, length)]
        prompt += [rng.randrange(1000, 2000) for _ in range(length - len(prompt))]
        requests.append({"id": f"r{i}", "prompt": prompt, "max_tokens": max_tokens,
                         "priority": rng.randint(0, 2) if policy == "priority" else 0,
                         "arrival_step": 0 if rng.random() < 0.4 else rng.randint(0, 12)})
    requests.sort(key=lambda r: r["arrival_step"])  # arrival order = add order = arrival_time
    for i, r in enumerate(requests):
        r["id"] = f"r{i}"
    need = [math.ceil((len(r["prompt"]) + r["max_tokens"] - 1) / bs) for r in requests]
    tight = rng.random() < 0.6
    num_blocks = rng.randint(max(need), max(max(need), sum(need) // 2)) if tight else sum(need) + 2
    return {"seed": seed, "block_size": bs, "num_blocks": num_blocks, "max_num_batched_tokens": budget,
            "max_num_seqs": max_num_seqs, "enable_chunked_prefill": chunked, "enable_prefix_caching": caching,
            "policy": policy, "scheduler_reserve_full_isl": reserve_full_isl, "requests": requests}


def _arrivals(sc: dict):
    by_step: dict[int, list[dict]] = {}
    for i, r in enumerate(sc["requests"]):
        by_step.setdefault(r["arrival_step"], []).append((i, r))
    return by_step, max(by_step)


# ----- nano_engine -----
def run_nano(sc: dict, scheduler_cls=None, pool_cls=None) -> list[dict]:
    """nano_engine's decisions, step by step: [{"scheduled": [[id, n, start], ...], "preempted": [id, ...]}]."""
    from nano_engine import BlockPool, Request, SamplingParams, SchedulerConfig, scheduler_class

    extra = {}  # the day ours has vLLM's later admission rule, the scenario's setting reaches it
    if "scheduler_reserve_full_isl" in SchedulerConfig.__dataclass_fields__:
        extra["scheduler_reserve_full_isl"] = sc["scheduler_reserve_full_isl"]
    cfg = SchedulerConfig(max_num_batched_tokens=sc["max_num_batched_tokens"], max_num_seqs=sc["max_num_seqs"],
                          enable_chunked_prefill=sc["enable_chunked_prefill"], policy=sc["policy"], **extra)
    bs = sc["block_size"]
    pool = (pool_cls or BlockPool)(sc["num_blocks"], sc["enable_prefix_caching"])
    s = (scheduler_cls or scheduler_class(cfg.policy))(cfg, pool, bs)
    by_step, last = _arrivals(sc)
    trace = []
    for step in range(MAX_STEPS):
        for i, r in by_step.get(step, []):
            s.add_request(Request(r["id"], list(r["prompt"]), SamplingParams(max_tokens=r["max_tokens"]),
                                  arrival_time=float(i), priority=r["priority"], seq=i))
        if not s.has_unfinished() and step > last:
            return trace
        out = s.schedule()
        trace.append({"scheduled": [[c.request.request_id, c.n, c.start] for c in out.chunks],
                      "preempted": [r.request_id for r in out.preempted]})
        for c in out.chunks:  # what LLMEngine._update does after the forward pass
            req = c.request
            req.num_computed = c.start + c.n
            pool.cache_blocks(req.block_ids, s.hashes(req, req.num_computed // bs), c.start // bs)
            if req.num_computed == req.num_tokens:
                req.output_ids.append(TOKEN)
                if len(req.output_ids) >= req.sampling_params.max_tokens:
                    s.finish(req, "length")
    raise RuntimeError(f"scenario seed {sc['seed']}: nano_engine still running after {MAX_STEPS} steps")


# ----- comparing traces -----
def step_key(step: dict):
    """What must agree in a step: each request's (tokens, start), and the preemptions in order."""
    return {rid: (n, start) for rid, n, start in step["scheduled"]}, step["preempted"]


def first_difference(ours: list[dict], theirs: list[dict]) -> int | None:
    for i in range(max(len(ours), len(theirs))):
        if i >= len(ours) or i >= len(theirs) or step_key(ours[i]) != step_key(theirs[i]):
            return i
    return None


def admissions(trace: list[dict]) -> list[tuple[int, str, int]]:
    """(step, request, start) of each admission (first chunk, or first after a preemption): start is its hit."""
    running, out = set(), []
    for i, st in enumerate(trace):
        for rid, n, start in st["scheduled"]:
            if rid not in running:
                running.add(rid)
                out.append((i, rid, start))
        running -= set(st["preempted"])
    return out


def features(trace: list[dict], sc: dict) -> set[str]:
    """What a trace exercises: chunked prompts, preemptions, prefix-cache hits."""
    prompt = {r["id"]: len(r["prompt"]) for r in sc["requests"]}
    out = {"preemption"} if any(st["preempted"] for st in trace) else set()
    if any(start + n < prompt[rid] for st in trace for rid, n, start in st["scheduled"]):
        out.add("chunking")
    if any(start for _, _, start in admissions(trace)):
        out.add("prefix_hit")
    return out
