"""What every subcommand shares: argument types and `guarded`, which turns every failure into one
line on stderr and an exit status (2 for a bad argument, 1 for anything else, 130 for Ctrl-C)."""

from __future__ import annotations

import argparse
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


def message(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the message is empty")
    return text


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
