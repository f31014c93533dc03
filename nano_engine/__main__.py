"""`python -m nano_engine`: the scheduler chapter's identity check on the embedded model.

Generates each chat prompt alone with `mini_llm.generate`, then through the engine with
defaults, a 32-token budget and a 64-token budget with 10 KV blocks; prints the table, the first
steps of the 32-budget trace and one decoded answer. Exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .experiments import CHAT_PROMPTS, IDENTITY_CONFIGS, format_trace, identity_check
from .loading import chat_prompt_ids, load_tokenizer, resolve_model_path
from .mini_llm import Transformer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nano_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Hugging Face folder or a .gguf file "
                                    "(default: $NANO_ENGINE_MODEL, else the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", action="append", help="a user message (repeat for more; default: the 6 chat prompts)")
    ap.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model_path(args.model)
    t = time.perf_counter()
    model = Transformer.from_pretrained(path, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(path)
    print(f"model: {path} ({model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{args.dtype}), loaded in {time.perf_counter() - t:.1f} s")

    texts = args.prompt or CHAT_PROMPTS
    prompts = [chat_prompt_ids(tokenizer, text) for text in texts]
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} greedy tokens each\n")
    common = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=not args.no_prefix_caching)
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


if __name__ == "__main__":
    sys.exit(main())
