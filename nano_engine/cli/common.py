"""What every subcommand shares: argument types and `guarded`, which turns every failure into one
line on stderr and an exit status (2 for a bad argument, 1 for anything else, 130 for Ctrl-C)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


MAX_THREADS = 1024  # far above any CPU here; 100,000 made libgomp or the tokenizers' Rust pool crash


def thread_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{value} threads is above {MAX_THREADS} (this machine has {os.cpu_count()} CPUs)")
    return value


def message(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the message is empty")
    return text


QUANTIZATION = ("int8", "int4")  # quantization.METHODS (not imported here: --help stays fast)


def add_quantization(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quantization", "-q", choices=QUANTIZATION,
                    help="weight-only quantization at load time (nano_engine/quantization.py): int8, a scale per "
                         "output row, or int4, a scale per 128 columns of a row; the LM head keeps the dtype "
                         "(default: none)")


def check_quantization(ap: argparse.ArgumentParser, args) -> None:
    """Refuse, before anything loads, what --quantization cannot run with."""
    if args.quantization is None:
        return
    if args.dtype not in ("float32", "fp32", "bfloat16", "bf16"):
        ap.error(f"--quantization {args.quantization} runs --dtype float32 or bfloat16, got --dtype {args.dtype}")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        ap.error(f"--quantization {args.quantization} runs on one process (tensor and pipeline parallel sizes 1)")


def guarded(ap: argparse.ArgumentParser, argv, run_fn) -> int:
    """Parse argv and run; every failure becomes one line on stderr and an exit status."""
    args = None
    prog = ap.prog
    try:
        args = ap.parse_args(argv)
        return run_fn(ap, args)
    except SystemExit as e:  # argparse has printed the usage and the error (2), or the help (0)
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from ..models.files import ModelLoadError

        debug = getattr(args, "debug", False)
        if debug:
            traceback.print_exc()
        # A ModelLoadError's message names the file already; anything else also gets its type.
        text = " ".join(str(e).split()) or "(no message)"
        hint = "" if debug else " (--debug shows the traceback)"
        what = text if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {text}{hint}"
        print(f"{prog}: error: {what}", file=sys.stderr)
        return 1
