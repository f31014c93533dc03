# The two commands of the README. Both set up .venv first (quick when it is already set up).
PY := .venv/bin/python

.PHONY: setup run test

setup:
	bash scripts/setup.sh

# The main job: the identity check of the scheduler chapter on the embedded model.
run: setup
	$(PY) -m nano_engine

# Every test: unit and property tests, the judge's self-checks, the notebooks under strict nbval.
# --dist loadfile keeps each notebook's cells on one worker (one kernel per notebook).
test: setup
	$(PY) -m pytest -n 2 --dist loadfile tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg
