"""A long life in bounded memory: one engine serving 20,000 requests over 100,000 steps.

    nice .venv/bin/python bench/long_life.py                       # about 4 minutes on one core
    .venv/bin/python bench/long_life.py --requests 2000 --steps 10000

A server runs one engine for days, so nothing may grow with the number of steps or requests
served: the step log keeps the last `step_log_size` records (small ones: events and counts, no
copies of the queues), the caller releases each finished request, the statistics are counts.
Requests arrive at random steps (a Poisson-like stream, sometimes bursts), prompts of 2-24
tokens, 1-12 new tokens, some stopping at the model's eos; about 5% are aborted while waiting or
running. The tiny random model (one layer) keeps the run about the engine's own bookkeeping.
Prints the resident memory (VmRSS) at the start, at each tenth of the run and at the end, with
the step log's and the request table's lengths. Not a test: nothing is asserted here
(tests/test_long_life.py checks the bounds on a short run).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nano_engine import LLMEngine, SamplingParams
from nano_engine.tiny import tiny_model


def rss_mib() -> float:
    """Resident set size of this process, from /proc/self/status (kB there)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve(engine: LLMEngine, num_requests: int, num_steps: int, seed: int = 0, report=None) -> dict:
    """Feed `num_requests` requests over the first 90% of `num_steps` steps, abort some, release every
    finished one; calls report(step, engine) at each tenth. Returns counts of what happened."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    arrivals: dict[int, int] = {}
    for _ in range(num_requests):
        step = rng.randrange(int(num_steps * 0.9))
        arrivals[step] = arrivals.get(step, 0) + 1
    live: list[str] = []  # ids of unfinished requests
    counts = {"added": 0, "aborted": 0, "finished": 0, "max_live": 0}
    for step in range(num_steps):
        for _ in range(arrivals.get(step, 0)):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 24))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.7,
                                    temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(2**32))
            live.append(engine.add_request(prompt, params))
            counts["added"] += 1
        if live and rng.random() < 0.01:  # about 5% of the requests: an abort every 100 steps
            rid = live.pop(rng.randrange(len(live)))
            engine.abort(rid)
            engine.release(rid)
            counts["aborted"] += 1
        for req in engine.step():
            live.remove(req.request_id)
            engine.release(req.request_id)
            counts["finished"] += 1
        counts["max_live"] = max(counts["max_live"], len(live))
        if report and (step + 1) % (num_steps // 10 or 1) == 0:
            report(step + 1, engine)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-log-size", type=int, default=None, help="default: EngineConfig's")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"start: RSS {rss_mib():.1f} MiB (Python, torch)")
    model = tiny_model(seed=args.seed, num_layers=1)
    kw = {} if args.step_log_size is None else {"step_log_size": args.step_log_size}
    engine = LLMEngine(model, num_blocks=128, block_size=8, max_num_batched_tokens=64, max_num_seqs=8, **kw)
    print(f"engine ready: RSS {rss_mib():.1f} MiB, step_log_size {engine.config.step_log_size}")
    print(f"{'step':>8}{'RSS MiB':>9}{'step_log':>10}{'requests':>10}{'finished':>10}{'seconds':>9}")
    t0 = time.perf_counter()

    def report(step, eng):
        print(f"{step:>8}{rss_mib():>9.1f}{len(eng.step_log):>10}{len(eng.requests):>10}"
              f"{eng.stats.num_finished:>10}{time.perf_counter() - t0:>9.1f}", flush=True)

    counts = serve(engine, args.requests, args.steps, args.seed, report)
    s = engine.stats
    print(f"end: RSS {rss_mib():.1f} MiB; {counts['added']} requests added, {counts['finished']} finished, "
          f"{counts['aborted']} aborted, at most {counts['max_live']} unfinished at once; {s.steps} steps "
          f"({len(engine.step_log)} records kept), {s.tokens} tokens, {s.preemptions} preemptions; "
          f"len(engine.requests) {len(engine.requests)}; free blocks {engine.block_pool.num_free}"
          f"/{engine.config.cache_config.num_blocks}")


if __name__ == "__main__":
    main()
