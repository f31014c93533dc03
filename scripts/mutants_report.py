"""Summarise a mutmut run (make mutants): the score per module and every surviving mutant.

mutmut's own `results` lists the survivors one per line; this groups them by module and adds the
score, killed / (killed + survived), counting a time-out as killed (the mutant looped), a crash of
the test process as killed (mutmut's "segfault", and "suspicious", its name for an exit status it
does not know, such as the abort of a kernel that wrote past its buffer: the run did not pass), and
a mutant that no test reaches as a survivor (nothing would notice it). Read a survivor with
`.venv/bin/mutmut show NAME`: either a test is missing, or the mutant is equivalent (it cannot
change any behaviour, e.g. a bound that is never reached). An equivalent one is listed, with the
reason, in scripts/mutants_equivalent.txt ("NAME: why", one per line); the report prints those
apart, and the score leaves them out ("score" counts every survivor, "explained" only the others).
A name there is checked against the mutant's diff: a reason written for an older mutant of that
number does not silently cover a new one, because mutmut numbers a function's mutants afresh when
the function changes, and the report then says the entry is stale.
"""

from __future__ import annotations

import fnmatch
import pathlib
import re
import subprocess
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "segfault", "suspicious"}
EQUIVALENT_FILE = pathlib.Path(__file__).with_name("mutants_equivalent.txt")


def equivalents() -> dict[str, tuple[str, str]]:
    """NAME -> (the changed line as mutmut shows it, why it is equivalent)."""
    out = {}
    if not EQUIVALENT_FILE.exists():
        return out
    for line in EQUIVALENT_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, change, why = (part.strip() for part in line.split(" | ", 2))
            out[name] = (change, why)
    return out


def changed_line(name: str) -> str:
    """The '+' line of a mutant's diff (what the mutant reads instead)."""
    diff = subprocess.run([".venv/bin/mutmut", "show", name], capture_output=True, text=True).stdout
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(plus)


def main(patterns: list[str]) -> int:
    out = subprocess.run([".venv/bin/mutmut", "results", "--all", "true"], capture_output=True, text=True).stdout
    status_by_name = dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+)$", out, re.M))
    if patterns:
        status_by_name = {n: s for n, s in status_by_name.items() if any(fnmatch.fnmatch(n, p) for p in patterns)}
    if not status_by_name:
        print("mutants: no results (did mutmut run?)")
        return 1
    by_module: dict[str, Counter] = defaultdict(Counter)
    survivors: dict[str, list[str]] = defaultdict(list)
    explained: dict[str, list[str]] = defaultdict(list)
    known = equivalents()
    for name, status in sorted(status_by_name.items()):
        module = name.split(".x")[0]  # mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
        by_module[module][status] += 1
        if status in KILLED or status == "not checked":
            continue
        if name in known and status == "survived":
            change, why = known[name]
            if changed_line(name) == change:
                by_module[module]["equivalent"] += 1
                explained[module].append(f"{name}: {why}")
                continue
            survivors[module].append(f"{name} ({status}; scripts/mutants_equivalent.txt has a stale entry for it)")
        else:
            survivors[module].append(f"{name} ({status})")
    print(f"{'module':<28}{'mutants':>8}{'killed':>8}{'survived':>9}{'no tests':>9}{'equiv.':>8}{'score':>8}"
          f"{'explained':>10}")
    total = Counter()
    for module, c in sorted(by_module.items()):
        total += c
        print(row(module, c))
    print(row("all", total))
    for module, names in sorted(explained.items()):
        print(f"\nequivalent survivors in {module} (scripts/mutants_equivalent.txt):")
        for n in names:
            print("  " + n)
    for module, names in sorted(survivors.items()):
        print(f"\nsurvivors in {module}:")
        for n in names:
            print("  " + n)
    return 0


def row(module: str, c: Counter) -> str:
    """killed / (killed + survived + no tests); "explained" leaves the equivalent survivors out."""
    killed = sum(c[s] for s in KILLED)
    tested = killed + c["survived"] + c["no tests"]
    score = killed / tested if tested else 0
    explained = (killed + c["equivalent"]) / tested if tested else 0
    mutants = sum(n for status, n in c.items() if status != "equivalent")  # "equivalent" is a subset of "survived"
    return (f"{module:<28}{mutants:>8}{killed:>8}{c['survived']:>9}{c['no tests']:>9}{c['equivalent']:>8}"
            f"{score:>8.0%}{explained:>10.0%}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
