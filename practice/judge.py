"""The judge: grade an exercise's solution file against nano_engine, case by case.

    python practice/judge.py 129                    # grade practice/129_scheduler/solution.py
    python practice/judge.py --list                 # every exercise
    python practice/judge.py 129 --solution my.py   # grade another file
    python practice/judge.py 129 --reference        # grade the package's own implementation
    python practice/judge.py 129 -k preempt --timeout 10

From a notebook on the project's kernel (`practice` is installed with the project):
`from practice.judge import grade; grade(129)` shows the same verdicts as a table.

Each case runs in a child process of its own (practice/worker.py) under a time limit, so that an
infinite loop is reported as "time limit exceeded", with the line it was stuck on, and an exception
as a runtime error with the learner's own traceback lines; the judge itself never hangs. The report
has one line per case (PASS, FAIL or NOT ATTEMPTED, then indented details) and ends with
"N passed, N failed"; the exit status is non-zero on any failure, 2 on a usage error or a Python
that lacks the project's dependencies (said in one line before any child process starts).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.util
import linecache
import multiprocessing as mp
import os
import re
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `python practice/judge.py` puts practice/, not the root, first
    sys.path.insert(0, str(HERE.parent))

from practice import worker  # noqa: E402
from practice.report import CaseResult, Result  # noqa: E402

DEFAULT_TIMEOUT = 5.0  # seconds per case; the reference needs well under one
DUMP_GRACE = 2.0  # seconds a timed-out child gets to write where it was (code stuck in C never does)
STARTUP_TIMEOUT = 120.0  # a fresh process imports torch (once per judge run with forkserver)


DEPENDENCIES = ("torch", "numpy", "hypothesis", "nano_engine")  # what every case's process imports


class JudgeError(ValueError):
    """A usage error (unknown exercise, missing file): a message for the learner, not a crash."""


class MissingDependency(JudgeError):
    """The judge runs on a Python (or a notebook kernel) that is not the project's."""


def check_dependencies() -> None:
    """Raise MissingDependency, in one line with the command that fixes it, if a case could not start.

    Checked before any child process starts: a child without torch dies before it can say why.
    """
    missing = next((name for name in DEPENDENCIES if importlib.util.find_spec(name) is None), None)
    if missing is None:
        return
    root = HERE.parent
    venv = root / ".venv"
    if "ipykernel" in sys.modules:  # a notebook whose kernel is another Python
        lab = "make lab" if re.search(r"^lab:", _read(root / "Makefile"), re.M) else ".venv/bin/jupyter lab notebooks/"
        fix = (f"switch to the project's kernel (Kernel > Change Kernel...), or start JupyterLab with `{lab}` "
               f"in {root}" + ("" if venv.is_dir() else " after `make setup`"))
        raise MissingDependency(f"this kernel's Python ({sys.executable}) cannot import {missing}: {fix}")
    if Path(sys.prefix).resolve() == venv.resolve():  # the project's own Python, installed only in part
        fix = "run `make setup`" + ("" if Path.cwd() == root else f" in {root}") + " and try again"
    else:
        activate = ".venv/bin/activate" if Path.cwd() == root else venv / "bin" / "activate"
        fix = (f"run `source {activate}`"
               + ("" if (venv / "bin" / "python").exists() else " (after `make setup`)") + " and try again")
    raise MissingDependency(f"this Python ({sys.executable}) cannot import {missing}: {fix}")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def exercises() -> dict[int, Path]:
    """Exercise number -> its folder, practice/<number>_<name>/ with a cases.py."""
    found = {}
    for folder in sorted(HERE.iterdir()):
        m = re.fullmatch(r"(\d+)_\w+", folder.name)
        if m and (folder / "cases.py").is_file():
            found[int(m[1])] = folder
    return found


def title(folder: Path) -> str:
    readme = folder / "README.md"
    first = readme.read_text(encoding="utf-8").splitlines()[0] if readme.is_file() else folder.name
    return first.lstrip("# ").strip()


def listing() -> str:
    found = exercises()
    width = max(len(_show(folder / "solution.py")) for folder in found.values())
    rows = [f"  {n}  {_show(folder / 'solution.py'):{width}}  {re.sub(r'^Exercise [0-9]+: *', '', title(folder))}"
            for n, folder in found.items()]
    return "\n".join(["exercises (number, the file you edit, title):", *rows])


def _show(path: Path | str) -> str:
    """A path as the learner would type it: relative to the working directory unless far from it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(Path(path).resolve()) if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


def _context():
    # forkserver: torch is imported once, in the server, and every case forks from it (milliseconds).
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["practice.worker", "practice.scenarios", "practice.endtoend",
                                    "practice.properties"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _main_hidden():
    """Start children without the parent's __main__.

    forkserver and spawn children re-import the parent's main script, so a learner's script that
    calls grade() at top level would grade again inside every child. The children need only
    practice.worker, so multiprocessing is shown a bare __main__ while a child starts.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _run_child(ctx, folder: Path, solution: str | None, index: int | None, timeout: float) -> dict:
    reader, writer = ctx.Pipe(duplex=False)
    fd, dump = tempfile.mkstemp(prefix="judge-", suffix=".txt")
    os.close(fd)
    proc = ctx.Process(target=worker.run_case, args=(writer, str(folder), solution, index, timeout, dump),
                       daemon=True)
    try:
        with _main_hidden():
            proc.start()
        writer.close()
        if not reader.poll(STARTUP_TIMEOUT):
            return {"status": "fail", "lines": [f"the judge could not start a process within {STARTUP_TIMEOUT:g} s"]}
        reader.recv()  # ("ready",): the learner's code starts now
        if reader.poll(timeout):
            return reader.recv()
        if worker.DUMP_SIGNAL is not None and proc.is_alive():
            os.kill(proc.pid, worker.DUMP_SIGNAL)  # the child writes where it was, then exits
            proc.join(DUMP_GRACE)
        return {"status": "fail", "lines": _time_limit(timeout, dump, solution)}
    except EOFError:  # the child ended without a verdict: os._exit, a segfault, the OOM killer
        proc.join(5)
        return {"status": "fail", "lines": [
            f"the process running your code died (exit code {proc.exitcode}) without a verdict",
            "hint: look for os._exit, or memory growing without bound"]}
    finally:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join()
        reader.close()
        os.unlink(dump)


def _time_limit(timeout: float, dump: str, solution: str | None) -> list[str]:
    lines = [f"time limit exceeded ({timeout:g} s): the case did not finish"]
    text = Path(dump).read_text(errors="replace") if os.path.exists(dump) else ""
    here = os.path.realpath(solution) if solution else None
    for path, lineno, func in re.findall(r'File "(.+)", line (\d+) in (\S+)', text):
        if here and os.path.realpath(path) == here:  # the innermost frame in the learner's file
            lines += [f'  it was at File "{_show(path)}", line {lineno}, in {func}',
                      f"    {linecache.getline(path, int(lineno)).strip()}"]
            break
    return lines + ["hint: look for a loop that can go round without scheduling, preempting or breaking out"]


def grade(number: int, solution: str | Path | None = None, reference: bool = False,
          timeout: float = DEFAULT_TIMEOUT, only: list[str] | str | None = None, echo: bool = False,
          exitfirst: bool = False) -> Result:
    """Grade exercise `number`: the learner's file (its solution.py, or `solution`), or the reference.

    `only` keeps the cases whose name contains one of these strings; `exitfirst` stops at the first
    case that does not pass. With echo, each line is printed as soon as it is known (the terminal);
    otherwise the Result shows it (a notebook).
    """
    check_dependencies()
    found = exercises()
    if not str(number).isdigit() or int(number) not in found:
        raise JudgeError(f"there is no exercise {number!r}.\n{listing()}")
    number, folder = int(number), found[int(number)]
    if reference and solution is not None:
        raise JudgeError("give either a solution file or reference=True (--reference), not both")
    path = None
    if not reference:
        path = Path(solution) if solution is not None else folder / "solution.py"
        if not path.is_file():
            raise JudgeError(f"there is no file {str(path)!r}; exercise {number}'s starter is "
                             f"{_show(folder / 'solution.py')}.\n{listing()}")
        path = str(path.resolve())
    emit = (lambda line: print(line, flush=True)) if echo else (lambda line: None)
    result = Result(number, f"{title(folder)}, grading "
                    + ("the reference solution" if reference else _show(path)), [])
    emit(result.header)
    ctx = _context()
    loaded = _run_child(ctx, folder, path, None, timeout)  # load the file once; learn the case names
    names = loaded.get("names") or []
    if not names:
        raise RuntimeError("the judge could not load its own cases:\n" + "\n".join(loaded["lines"]))
    keep = [only] if isinstance(only, str) else only
    chosen = [i for i, n in enumerate(names) if not keep or any(k in n for k in keep)]
    if not chosen:
        raise JudgeError(f"no case of exercise {number} matches {keep}; its cases: {', '.join(names)}")
    if loaded["status"] != "pass":  # one report of why, not one per case
        result.load_error = CaseResult(f"loading {_show(path)}", "fail", loaded["lines"])
        result.cases = [CaseResult(names[i], "not run") for i in chosen]
        for line in result.body():
            emit(line)
    else:
        for k, i in enumerate(chosen):
            verdict = _run_child(ctx, folder, path, i, timeout)
            case = CaseResult(names[i], verdict["status"], verdict["lines"])
            result.cases.append(case)
            for line in case.format():
                emit(line)
            if exitfirst and case.status != "pass" and k + 1 < len(chosen):
                result.stopped = len(chosen) - k - 1
                emit(result.stopped_line())
                break
    emit(result.summary())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="practice/judge.py", description="Grade an exercise against nano_engine.")
    p.add_argument("number", nargs="?", help="the exercise number, e.g. 129")
    p.add_argument("--list", action="store_true", help="list every exercise")
    p.add_argument("--solution", metavar="PATH", help="grade this file instead of the exercise's solution.py")
    p.add_argument("--reference", action="store_true", help="grade the package's own implementation")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"time limit per case (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("-k", dest="only", action="append", metavar="TEXT", help="only the cases whose name contains TEXT")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first case that does not pass")
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.number is None:
        print(f"judge: give an exercise number.\n{listing()}", file=sys.stderr)
        return 2
    try:
        result = grade(args.number, args.solution, args.reference, args.timeout, args.only, echo=True,
                       exitfirst=args.exitfirst)
    except JudgeError as e:
        print(f"judge: {e}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1


if __name__ == "__main__":
    status = main()
    if not hasattr(builtins, "__IPYTHON__"):  # %run in a notebook: no SystemExit traceback
        sys.exit(status)
