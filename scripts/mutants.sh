#!/usr/bin/env bash
# Mutation testing (make mutants): mutmut changes nano_engine/ one small edit at a time (a flipped
# comparison, an off-by-one, a dropped call, a changed constant) and runs, for each mutant, the
# unit and property tests that reach the mutated function. A mutant that no test kills
# ("survived") is a behaviour the tests do not pin down. Long (hours on 2 cores: run one module at
# a time with MUTANTS), so it is not part of CI. Results are kept in mutants/; a second run only
# tests what changed.
#   make mutants                                   # every module of nano_engine/
#   make mutants MUTANTS='nano_engine.scheduler.*'  # one module (mutmut's name patterns)
#   .venv/bin/mutmut show NAME                     # the diff of one surviving mutant
#   .venv/bin/mutmut browse                        # browse the results interactively
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[mutants]'
export OMP_WAIT_POLICY=PASSIVE
# shellcheck disable=SC2086  # MUTANTS is a list of patterns
.venv/bin/mutmut run --max-children "${MUTANTS_JOBS:-2}" ${MUTANTS:-} || true
.venv/bin/python scripts/mutants_report.py ${MUTANTS:-}
