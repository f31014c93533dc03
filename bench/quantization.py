"""Weight-only quantization on this machine: what int8 and int4 weights cost in perplexity and buy in
decode speed, against the same model's float32 and bfloat16 weights (prepacked: the fast path).

    .venv/bin/python bench/quantization.py                 # both dtypes, none/int8/int4, 3 reps
    .venv/bin/python bench/quantization.py --dtypes bfloat16 --reps 5

For each dtype and weight format it prints:

* perplexity on a fixed local text: the documentation topics that ship with Python itself
  (`pydoc_data.topics`, the same bytes on every install of one Python version), cut into windows of
  512 tokens, each scored alone (so a figure depends only on the model and the text);
* the bytes a batch-1 decode step reads of the matmul weights (the LM head included, which keeps
  the dtype), and the time that takes at this machine's bandwidth (reading 1 GiB, measured here);
* decode ms per step at batch 1 through the engine (one request, greedy), median and spread of
  `--reps` runs, interleaved across formats so that drift hits all alike;
* whether the engine's tokens equal `generate`'s on the same weights.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nano_engine import LLMEngine, SamplingParams, Transformer, generate  # noqa: E402
from nano_engine.kernels.linear import can_prepack  # noqa: E402
from nano_engine.models.loading import chat_prompt_ids, load_tokenizer  # noqa: E402
from roofline import read_bandwidth, weight_bytes  # noqa: E402  (bench/, the script's folder)

WINDOW = 512


def local_text() -> str:
    """Python's own documentation topics (stdlib pydoc_data), in key order: a fixed English text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@torch.inference_mode()
def perplexity(model: Transformer, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for a in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor(ids[a:a + WINDOW + 1])
        if len(window) < 2:
            break
        logits = model.compute_logits(model(window[:-1], torch.arange(len(window) - 1))).float()
        nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(nll / count)


def decode_ms(model: Transformer, prompt: list[int], tokens: int) -> float:
    """ms per decode step at batch 1: the steps after the prompt's, timed one by one, median."""
    engine = LLMEngine(model, max_num_seqs=1, attention_backend="auto")
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", default="none,int8,int4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--text-tokens", type=int, default=4096, help="tokens of the text scored")
    args = ap.parse_args()
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode(local_text())[:args.text_tokens + 1]
    prompt = chat_prompt_ids(tokenizer, "Tell me a long story about a dragon.")
    bw = read_bandwidth()
    print(f"CPU threads {torch.get_num_threads()}; memory read {bw / 1e9:.1f} GB/s; text: pydoc_data.topics, "
          f"{len(ids) - 1} tokens in windows of {WINDOW}; decode: batch 1, {args.tokens} steps, {args.reps} runs\n")
    print(f"| dtype | weights | perplexity | bytes a decode step reads | at {bw / 1e9:.0f} GB/s | decode ms a step "
          f"(median, spread) | vs the dtype's own | tokens = generate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dt in args.dtypes.split(","):
        models = {}
        for method in args.methods.split(","):
            model = Transformer.from_pretrained(dtype=dt, prepack=method == "none" and can_prepack(getattr(torch, dt)))
            models[method] = model if method == "none" else model.quantize(method)
        runs = {m: [] for m in models}
        for _ in range(args.reps):
            for method, model in models.items():
                runs[method].append(decode_ms(model, prompt, args.tokens))
        base = statistics.median(runs[next(iter(models))])
        for method, model in models.items():
            ppl = perplexity(model, ids)
            nbytes = weight_bytes(model)
            ms = statistics.median(runs[method])
            engine = LLMEngine(model)
            same = engine.generate([prompt], SamplingParams(max_tokens=24))[0].output_ids == generate(
                model, prompt, 24, eos_token_id=model.config.eos_token_id)
            print(f"| {dt} | {method} | {ppl:.2f} | {nbytes / 1e6:.0f} MB | {nbytes / bw * 1000:.1f} ms | "
                  f"{ms:.1f} ({min(runs[method]):.1f}-{max(runs[method]):.1f}) | {base / ms:.2f}x | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
