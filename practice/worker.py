"""The judge's child process: run one case of one exercise on the learner's code, send back a verdict.

Every case runs in a process of its own, so that the judge can kill an infinite loop, and an
exception or a crash in the learner's code cannot take the judge with it. This module is also the
contract between an exercise's `cases.py` and the judge:

- `cases.py` defines `CASES` (a list of `Case`), `learner(module)` (pull what the cases need out
  of the learner's module, or raise `Mismatch` saying what is missing) and `reference()` (the
  same, from the package's own implementation, for `--reference`).
- A case's `run(api)` returns on success and raises `Mismatch(lines...)` on a wrong answer.

A verdict is a dict: name, status ("pass", "fail" or "not attempted") and the lines to show.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import io
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MAX_PRINTED = 2000  # characters of the learner's own output kept for the report


class Mismatch(Exception):
    """A wrong answer. Its lines (what was expected, what came, one hint) go into the report."""

    def __init__(self, *lines: str):
        super().__init__(*lines)
        self.lines = [line for block in lines for line in str(block).splitlines()]


def require_functions(module, names):
    """The learner's module, if it defines every function in names; else a Mismatch naming the missing."""
    missing = [n for n in names if not callable(getattr(module, n, None))]
    if missing:
        raise Mismatch(f"your file must define the functions {', '.join(missing)}")
    return module


@dataclass
class Case:
    name: str
    run: Callable[[Any], None]  # raises Mismatch on a wrong answer


def load_module(path: str | Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


class _Capped(io.StringIO):
    """Keeps the first MAX_PRINTED characters that the learner's code prints, drops the rest."""

    def write(self, s):
        room = MAX_PRINTED - self.tell()
        return super().write(s[:max(room, 0)]) if room > 0 else len(s)


def _learner_frames(exc: BaseException, learner_file: str) -> list[traceback.FrameSummary]:
    here = os.path.realpath(learner_file)
    return [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == here]


def explain_exception(exc: BaseException, learner_file: str) -> tuple[str, list[str]]:
    """(status, lines) for an exception: not attempted, or a runtime error with the learner's frames."""
    frames = _learner_frames(exc, learner_file)
    # Not attempted: the learner's own `raise NotImplementedError` (the starter's). torch raises it too, for
    # an operation a dtype lacks (bincount of floats): that is a runtime error on the learner's line.
    own = frames and (frames[-1].line or "").startswith("raise NotImplementedError")
    if isinstance(exc, NotImplementedError) and own:
        return "not attempted", [f"{frames[-1].name}() raises NotImplementedError"]
    if isinstance(exc, SyntaxError):  # the file never ran: where it does not parse, not a traceback
        kind = "syntax error" if type(exc) is SyntaxError else f"syntax error ({type(exc).__name__})"
        where = f"line {exc.lineno} of {_short(exc.filename)}" if exc.filename else f"line {exc.lineno}"
        source = traceback.format_exception_only(type(exc), exc)[1:-1]  # the line and its caret
        return "fail", [f"{kind} at {where}: {exc.msg}", *(line.rstrip() for line in source)]
    lines = ["runtime error: " + traceback.format_exception_only(type(exc), exc)[-1].strip()]
    if not frames:  # raised inside nano_engine or Python: show where, so the cause can be traced
        frames = traceback.extract_tb(exc.__traceback__)[-1:]
        lines.append("  (raised outside your file, while running your code; innermost frame:)")
    for f in frames:
        lines.append(f'  File "{_short(f.filename)}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {f.line.strip()}")
    return "fail", lines


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # the judge's "time is up" (POSIX); None on Windows


def _arm_dump(dump_path: str, timeout: float) -> None:
    """Be ready to write where the learner's code is when the judge says the time is up.

    On POSIX the judge sends DUMP_SIGNAL; a Python-level handler runs between two bytecodes of the
    main thread, writes its stack (innermost frame first) and ends the process. This is safe, unlike
    faulthandler's watchdog thread, which reads another thread's frames while they change and can
    crash the process it inspects (seen as a segfault under load). Elsewhere, faulthandler it is.
    """
    if DUMP_SIGNAL is None:
        faulthandler.dump_traceback_later(max(timeout * 0.9, timeout - 0.3), file=open(dump_path, "w"))
        return

    def dump_and_exit(signum, frame):
        lines = []
        while frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
            frame = frame.f_back
        with open(dump_path, "w") as f:
            f.write("\n".join(lines) + "\n")
        os._exit(3)  # not an exception: the learner's code could catch that and go on looping

    signal.signal(DUMP_SIGNAL, dump_and_exit)


def run_case(conn, folder: str, solution: str | None, index: int | None, timeout: float,
             dump_path: str | None) -> None:
    """Child entry point: load the exercise and the learner's code, run case `index`, send a verdict.

    With index None it only loads, and sends the case names (the judge's first call).
    Sends ("ready",) once set up, so that the time limit covers the learner's code only.
    """
    try:
        import torch

        torch.set_num_threads(1)  # many short cases on a shared CPU: threads cost more than they give
    except ImportError:
        pass
    cases = load_module(Path(folder) / "cases.py", "judge_cases")
    if dump_path:  # where the learner's code was when the time ran out
        _arm_dump(dump_path, timeout)
    conn.send(("ready",))
    names = [c.name for c in cases.CASES]
    printed = _Capped()
    learner_file = solution or getattr(cases, "REFERENCE_FILE", "")
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = printed
    try:
        api = cases.reference() if solution is None else cases.learner(load_module(solution, "learner_solution"))
        if index is not None:
            cases.CASES[index].run(api)
        status, lines = "pass", []
    except Mismatch as m:
        status, lines = "fail", m.lines
    except BaseException as e:  # SystemExit and KeyboardInterrupt from the learner's code too
        status, lines = explain_exception(e, learner_file)
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        if DUMP_SIGNAL is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            signal.signal(DUMP_SIGNAL, signal.SIG_IGN)  # a late "time is up" must not cut the verdict
    if status != "pass" and printed.getvalue().strip():
        lines += ["your code printed:"] + ["  " + s for s in printed.getvalue().splitlines()[:8]]
    conn.send({"names": names, "status": status, "lines": lines})
    conn.close()
