"""Summarise a mutmut run (make mutants): the score per module and every surviving mutant.

mutmut's own `results` lists the survivors one per line; this groups them by module and adds the
score, killed / (killed + survived), counting a time-out as killed (the mutant looped) and a mutant
that no test reaches as a survivor (nothing would notice it). Read a survivor with
`.venv/bin/mutmut show NAME`: either a test is missing, or the mutant is equivalent (it cannot
change any behaviour, e.g. a bound that is never reached) and the note in the README says so.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout"}


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
    for name, status in sorted(status_by_name.items()):
        module = name.split(".x")[0]  # mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
        by_module[module][status] += 1
        if status not in KILLED and status != "not checked":
            survivors[module].append(f"{name} ({status})")
    print(f"{'module':<28}{'mutants':>8}{'killed':>8}{'survived':>9}{'no tests':>9}{'score':>8}")
    total = Counter()
    for module, c in sorted(by_module.items()):
        total += c
        killed = sum(c[s] for s in KILLED)
        tested = killed + c["survived"] + c["no tests"]
        print(f"{module:<28}{sum(c.values()):>8}{killed:>8}{c['survived']:>9}{c['no tests']:>9}"
              f"{killed / tested if tested else 0:>8.0%}")
    killed = sum(total[s] for s in KILLED)
    tested = killed + total["survived"] + total["no tests"]
    print(f"{'all':<28}{sum(total.values()):>8}{killed:>8}{total['survived']:>9}{total['no tests']:>9}"
          f"{killed / tested if tested else 0:>8.0%}")
    for module, names in sorted(survivors.items()):
        print(f"\nsurvivors in {module}:")
        for n in names:
            print("  " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
