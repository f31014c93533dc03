"""`python -m nano_engine bench-serve`: the load generator's command line.

The flags are `vllm bench serve`'s (`vllm/benchmarks/serve.py`, add_cli_args, and the dataset
flags of `vllm/benchmarks/datasets/`), with the same meaning, so a command line can be run by
either client against the same server. Two defaults differ, for a CPU server: --num-prompts is
64 (vLLM: 1000) and --percentile-metrics / --metric-percentiles report all four metrics at p90
and p99 (vLLM: ttft,tpot,itl at p99). `--request-rates 1,2,4,inf` runs one benchmark per rate
and writes the latency-throughput plot (PNG) and table (Markdown).

A bad argument is one line on stderr and exit 2, before anything is sent or loaded; any other
failure one line and exit 1 (--debug adds the traceback); so is a run whose every request failed.
As in vLLM, the random dataset sets --ignore-eos so that each request makes its full length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

import httpx

from .common import guarded
from ..benchmarks.metrics import METRIC_NAMES, format_metrics, parse_goodput
from ..benchmarks.serve import BACKENDS, measure
from ..benchmarks.datasets import DATASETS, get_samples
from ..benchmarks.sweep import parse_rates, plot_sweep, sweep_table

PROG = "python -m nano_engine bench-serve"


def _number(low: float, *, integer: bool = False, above: bool = False, below: float | None = None):
    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if (value <= low if above else value < low) or (below is not None and value >= below) or math.isnan(value):
            bound = f"> {low:g}" if above else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}" + (f" and < {below:g}" if below else ""))
        return value
    return parse


def _wrap(fn):
    def parse(text: str):
        try:
            return fn(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a metric; allowed: {','.join(METRIC_NAMES)}")
    return names


def _percentiles(text: str) -> list[float]:
    values = []
    for part in text.split(","):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a number") from None
        if not 0 <= values[-1] <= 100:
            raise ValueError(f"{part.strip()} is not a percentile (0 to 100)")
    return values


def _base_url(text: str) -> str:
    url = httpx.URL(text)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{text!r} is not an http:// or https:// URL with a host")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pos, nonneg, rate = _number(1, integer=True), _number(0, integer=True), _number(0, above=True)
    ap.add_argument("--backend", choices=list(BACKENDS), default="openai",
                    help="openai: /v1/completions, prompts as token ids; openai-chat: /v1/chat/completions, text")
    ap.add_argument("--base-url", type=_wrap(_base_url), help="the server (default http://HOST:PORT)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_number(1, integer=True, below=65536), default=8000)
    ap.add_argument("--model", help="the model name to request (default: the first of GET /v1/models)")
    ap.add_argument("--tokenizer", help="a model folder or .gguf whose vocabulary the random datasets draw "
                                        "from (default: $NANO_ENGINE_MODEL, else the embedded SmolLM2)")
    ap.add_argument("--dataset-name", choices=DATASETS, default="random")
    ap.add_argument("--dataset-path", help="the W2 file (default: bench/workloads/w2.json, else ../shared's)")
    ap.add_argument("--num-prompts", type=pos, default=64, help="requests to send (default 64; vLLM 1000)")
    ap.add_argument("--random-input-len", type=pos, default=1024)
    ap.add_argument("--random-output-len", type=pos, default=128)
    ap.add_argument("--random-range-ratio", type=_number(0, below=1), default=0.0,
                    help="lengths drawn uniformly from [L(1-r), L(1+r)]")
    ap.add_argument("--prefix-repetition-prefix-len", type=nonneg, default=256)
    ap.add_argument("--prefix-repetition-suffix-len", type=nonneg, default=256)
    ap.add_argument("--prefix-repetition-num-prefixes", type=pos, default=10)
    ap.add_argument("--prefix-repetition-output-len", type=pos, default=128)
    ap.add_argument("--request-rate", type=rate, default=math.inf,
                    help="requests/s; inf (default) sends all at once, else Poisson or gamma arrivals")
    ap.add_argument("--request-rates", type=_wrap(parse_rates), metavar="R1,R2,...",
                    help="a sweep, e.g. 1,2,4,inf: one run per rate, a plot and a table")
    ap.add_argument("--sweep-output", default="bench_serve_sweep", metavar="STEM",
                    help="the sweep's files: STEM.png and STEM.md (default bench_serve_sweep)")
    ap.add_argument("--burstiness", type=rate, default=1.0, help="gamma shape: 1 Poisson, <1 burstier, >1 more even")
    ap.add_argument("--max-concurrency", type=pos, help="requests in flight at most (default: no limit)")
    ap.add_argument("--num-warmups", type=nonneg, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--seed", type=nonneg, default=0)
    ap.add_argument("--goodput", nargs="+", type=_wrap(lambda t: parse_goodput([t])), metavar="KEY:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    ap.add_argument("--percentile-metrics", type=_wrap(_names), default=list(METRIC_NAMES),
                    help="metrics to report (default ttft,tpot,itl,e2el)")
    ap.add_argument("--metric-percentiles", type=_wrap(_percentiles), default=[90.0, 99.0],
                    help="percentiles to report (default 90,99)")
    ap.add_argument("--timeout", type=rate, default=600.0, help="seconds allowed per request (default 600)")
    ap.add_argument("--save-result", action="store_true", help="write the result JSON")
    ap.add_argument("--result-filename", help="its name (default {label}-{rate}qps-{model}-{date}.json)")
    ap.add_argument("--label", help="the file name's prefix (default: the backend)")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    return ap


def _result_name(args, result: dict, sweep: bool) -> str:
    if args.result_filename:
        return args.result_filename
    rate = "sweep" if sweep else f"{result['request_rate']}qps"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"{args.label or args.backend}-{rate}{conc}-{result['model_id'].split('/')[-1]}-{result['date']}.json"


def _print_metrics(metrics, selected: list[str]) -> None:
    """format_metrics' table, keeping the sections of the selected metrics only (as vLLM)."""
    keep, header, out = True, "", []
    for line in format_metrics(metrics).splitlines():
        if line.startswith("="):
            keep = True
        elif line.startswith("-"):  # a section's header; its first row names the metric
            keep, header = None, line
            continue
        elif keep is None:
            keep = line.split("(ms)")[0].split()[-1].lower() in selected
            if keep:
                out.append(header)
        if keep:
            out.append(line)
    print("\n".join(out))


def served_model_path(base_url: str) -> str | None:
    """Where the served model was loaded from, if that is on this machine: /v1/models' root (vLLM's and
    ours give the path). The prompts drawn are token ids, so they must be that model's vocabulary's;
    None (the server says no path here) leaves the default model's tokenizer."""
    try:
        root = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["root"]
    except Exception:  # no server yet, or another shape: the benchmark itself will say
        return None
    return root if isinstance(root, str) and root and Path(root).exists() else None


def run(ap: argparse.ArgumentParser, args) -> int:
    if args.request_rates and args.request_rate != math.inf:
        ap.error("--request-rate and --request-rates: give one or the other")
    if args.dataset_path and args.dataset_name != "w2":
        ap.error(f"--dataset-path is for --dataset-name w2, not {args.dataset_name}")
    if args.dataset_name == "prefix_repetition" and args.num_prompts < args.prefix_repetition_num_prefixes:
        ap.error(f"--num-prompts {args.num_prompts} is below --prefix-repetition-num-prefixes "
                 f"{args.prefix_repetition_num_prefixes}: each prefix needs a prompt")
    # Where the results go, checked before anything is sent: a run is minutes long
    outputs = ([("--sweep-output", args.sweep_output)] if args.request_rates else []) + (
        [("--result-filename", args.result_filename or "the current folder's file")] if args.save_result else [])
    for flag, name in outputs:
        folder = Path(name).parent  # the default result name is a file of the current folder
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            ap.error(f"{flag} {name}: {folder} is not a folder this process can write to")
    if args.dataset_name == "random":
        args.ignore_eos = True  # vLLM does the same: every request makes its full length
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = None
    if args.dataset_name != "w2":
        from ..models.loading import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer or served_model_path(base_url))
    try:
        requests = get_samples(
            args.dataset_name, args.num_prompts, tokenizer=tokenizer, as_text=args.backend == "openai-chat",
            seed=args.seed, dataset_path=args.dataset_path, random_input_len=args.random_input_len,
            random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
            prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
            prefix_repetition_output_len=args.prefix_repetition_output_len)
    except ValueError as e:  # a dataset's flags that cannot go together, or a --dataset-path file's contents
        ap.error(f"--dataset-path: {e}" if args.dataset_path else str(e))
    except OSError as e:
        if not args.dataset_path:  # the project's own W2 file is missing: not the user's argument
            raise
        ap.error(f"--dataset-path: {e}")
    goodput = {k: v for d in args.goodput or [] for k, v in d.items()}
    results = []
    for rate in args.request_rates or [args.request_rate]:
        print(f"{len(requests)} requests ({args.dataset_name}) to {base_url}{BACKENDS[args.backend]}; "
              f"request rate {rate:g}/s, burstiness {args.burstiness:g} "
              f"({'Poisson process' if args.burstiness == 1 else 'gamma distribution'}), "
              f"max concurrency {args.max_concurrency}")
        result, metrics = asyncio.run(measure(
            requests, base_url, backend=args.backend, model=args.model, request_rate=rate,
            burstiness=args.burstiness, max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
            ignore_eos=args.ignore_eos, seed=args.seed, goodput=goodput, percentiles=args.metric_percentiles,
            percentile_metrics=args.percentile_metrics, timeout=args.timeout, disable_tqdm=args.disable_tqdm))
        _print_metrics(metrics, args.percentile_metrics)
        result["label"] = args.label
        result["tokenizer_id"] = args.tokenizer
        results.append(result)
        if metrics.completed == 0:
            first = next(e for e in result["errors"] if e)
            hint = ("; the prompts are token ids of the tokenizer's vocabulary: pass the served model's folder "
                    "as --tokenizer" if "vocabulary" in first and tokenizer is not None else "")
            print(f"{PROG}: error: all {metrics.failed} requests failed; the first: {first}{hint}", file=sys.stderr)
            return 1
    if args.request_rates:
        stem = Path(args.sweep_output)
        table = sweep_table(results)
        stem.with_suffix(".md").write_text(table + "\n")
        plot_sweep(results, stem.with_suffix(".png"), title=f"{args.dataset_name}, {results[0]['model_id']}")
        print(f"\n{table}\n\nwrote {stem.with_suffix('.md')} and {stem.with_suffix('.png')}")
    if args.save_result:
        name = _result_name(args, results[0], bool(args.request_rates))
        Path(name).write_text(json.dumps(results if args.request_rates else results[0]))
        print(f"wrote {name}")
    return 0


def main(argv: list[str] | None = None) -> int:

    return guarded(build_parser(), argv, run)
