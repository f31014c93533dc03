"""`python -m nano_engine`: the scheduler chapter's identity check on the embedded model.
(`python -m nano_engine serve` starts the OpenAI-compatible server, cli/serve.py;
`python -m nano_engine bench-serve` is the load generator, cli/bench_serve.py; `python -m nano_engine
vllm-args [serve's flags]` prints the vLLM command with the same settings, cli/vllm_args.py.)

Generates each chat prompt alone with `mini_llm.generate`, then through the engine with
defaults, a 32-token budget and a 64-token budget with 10 KV blocks; prints the table, the first
steps of the 32-budget trace and one decoded answer. Exits 1 if any output differs.

Every failure is one line on stderr that names the problem: exit 2 for a bad argument (checked
before anything is loaded), 1 for a model that does not load (the line names the file) or any
other failure; --debug adds the traceback. The same shape as vLLM's CLI
(`vllm/entrypoints/cli/main.py`), whose argument errors come from argparse as well.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from .common import add_quantization, check_quantization, guarded, message, positive_int, thread_count

PROG = "python -m nano_engine"


def build_parser() -> argparse.ArgumentParser:
    from ..models.loading import DTYPES

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face folder or a .gguf file "
                                    "(default: $NANO_ENGINE_MODEL, else the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", type=message,
                    help="a user message (repeat for more; default: the 6 chat prompts)")
    ap.add_argument("--max-tokens", type=positive_int, default=24, help="greedy tokens per prompt (default 24)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--max-num-seqs", type=positive_int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--attention-backend", choices=["auto", "torch", "c"], default="auto",
                    help="the engine's and generate's attention: c, the compiled kernel, or torch, the "
                         "chapters' code; auto (default): c where it runs the dtype and builds, else torch")
    ap.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                    help="run every config's engine on this many processes, each with a share of every layer "
                         "(default 1; tokens must not change)")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                    help="... or on this many processes, each with a run of the layers (default 1)")
    add_quantization(ap)
    ap.add_argument("--threads", type=thread_count, help="torch threads (default: torch's choice)")
    ap.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    return ap


def _check_fits(ap: argparse.ArgumentParser, args, prompts: list[list[int]], configs: dict) -> None:
    """Refuse, before the model loads, a --max-tokens or --block-size that leaves a config's
    KV pool too small for the longest prompt and its output (the scheduler would refuse it
    only after the reference run). A request holds prompt + max_tokens - 1 slots at most."""
    from ..paged import CacheConfig

    blocks = min(cfg.get("num_blocks", CacheConfig().num_blocks) for cfg in configs.values())
    longest = max(map(len, prompts))
    need = longest + args.max_tokens - 1
    if need > blocks * args.block_size:
        ap.error(f"--max-tokens {args.max_tokens} with --block-size {args.block_size}: the longest "
                 f"prompt ({longest} tokens) and its output need {need} KV slots, but the smallest "
                 f"config has {blocks} blocks = {blocks * args.block_size} slots; use --max-tokens "
                 f"<= {blocks * args.block_size - longest + 1} or --block-size >= {math.ceil(need / blocks)}")


def run(ap: argparse.ArgumentParser, args) -> int:
    import torch

    from ..kernels.paged_attention import resolve_backend
    from ..lab.experiments import CHAT_PROMPTS, IDENTITY_CONFIGS, format_trace, identity_check
    from ..models.loading import chat_prompt_ids, check_model, load_tokenizer
    from ..mini_llm import Transformer
    from ..executor import ParallelConfig, make_plan

    check_quantization(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention_backend == "c":  # as serve does: refused before anything loads
        from ..kernels import paged_attention as kernels
        from ..models.loading import DTYPES

        if DTYPES[args.dtype] not in kernels.DTYPES:
            ap.error(f"--attention-backend c runs float32 and bfloat16, got --dtype {args.dtype}")
    # Every file first (no weights read): a broken model fails here, in a second, with its name.
    path = check_model(args.model)
    t = time.perf_counter()
    tokenizer = load_tokenizer(path)
    texts = args.prompt or CHAT_PROMPTS
    prompts = [chat_prompt_ids(tokenizer, text) for text in texts]
    _check_fits(ap, args, prompts, IDENTITY_CONFIGS)
    model = Transformer.from_pretrained(path, dtype=args.dtype)
    if args.quantization:
        model.quantize(args.quantization)
    backend = resolve_backend(args.attention_backend, model.dtype)
    weights = f"{args.dtype}, weights {args.quantization}" if args.quantization else args.dtype
    print(f"model: {path} ({model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{weights}, attention {backend}), loaded in {time.perf_counter() - t:.1f} s")
    try:
        make_plan(model, ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size))  # before the reference run
    except ValueError as e:
        ap.error(str(e))
    longest, limit = max(map(len, prompts)) + args.max_tokens, model.config.max_position_embeddings
    if longest > limit:
        ap.error(f"--max-tokens {args.max_tokens}: the longest prompt and its output are {longest} "
                 f"tokens, above the model's max_position_embeddings={limit}")

    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} greedy tokens each\n")
    common = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=not args.no_prefix_caching, attention_backend=backend,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
    result = identity_check(model, prompts, args.max_tokens, IDENTITY_CONFIGS, **common)

    print(result.table())
    print("\nfirst 6 steps at a 32-token budget (p = prefill chunk, d = decode, r = recompute):")
    print(format_trace(result.engines["budget 32"].step_log))
    print(f"\n{texts[0]!r} ->")
    print(repr(tokenizer.decode(result.reference[0], skip_special_tokens=True)))
    if not result.all_identical:
        bad = [r.name for r in result.rows if not r.identical]
        print(f"\nFAIL: outputs differ from single-request generate under: {', '.join(bad)}")
        return 1
    print("\nidentical: every config gives the single-request tokens, token for token")
    return 0


SUBCOMMANDS = {"serve": "serve", "bench-serve": "bench_serve", "vllm-args": "vllm_args", "disagg-proxy": "disagg_proxy"}  # python -m nano_engine NAME ...


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "serve"]:  # vLLM's spelling, `vllm bench serve`
        argv = ["bench-serve", *argv[2:]]
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(f".{SUBCOMMANDS[argv[0]]}", __package__).main(argv[1:])
    return guarded(build_parser(), argv, run)

