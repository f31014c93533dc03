#!/usr/bin/env bash
# Start JupyterLab on the chapters with the project's kernel: `make lab` (after the set-up).
#
# The server's root is the repository, so that a chapter's links to ../practice/ open the
# exercises, and the file browser starts in notebooks/. The kernel is the .venv's Python, which
# imports nano_engine and practice (both installed with the project). JupyterLab prints the URL
# with its token; open it in a browser.
#
#   LAB_HOST  address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)
#   LAB_PORT  port (default 8888; JupyterLab takes the next free one if it is busy)
#   LAB_ROOT  the folder served (default: the repository; the browser test serves a copy)
# Further arguments go to `jupyter lab` (an option given twice is an error there).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "${LAB_ROOT:-$here}" 2>/dev/null && pwd) || root=${LAB_ROOT}
cd "$here"
host=${LAB_HOST:-127.0.0.1}
port=${LAB_PORT:-8888}

[ -x .venv/bin/python ] || { echo "lab: no .venv here: run \`make setup\` first" >&2; exit 1; }
[[ "$port" =~ ^[0-9]+$ ]] || { echo "lab: LAB_PORT must be a port number, got '$port'" >&2; exit 1; }
[ -d "$root/notebooks" ] || { echo "lab: LAB_ROOT must hold notebooks/, got '$root'" >&2; exit 1; }

# Kernels of the .venv before any the user has installed under ~/.local/share/jupyter: a user-wide
# "python3" kernel would otherwise run the chapters with a Python that lacks the project.
export JUPYTER_PREFER_ENV_PATH=1
# OpenMP threads that spin while another process holds the cores slow every step many-fold.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

if [ "$host" != 127.0.0.1 ] && [ "$host" != localhost ]; then
  echo "lab: listening on $host: anyone who can reach port $port and has the token can run code here"
fi
echo "lab: the chapters are in notebooks/ (start with 01_model.ipynb); stop with Ctrl-C"
# preferred_dir is relative to the root: the file browser opens in the root's notebooks/.
args=(--no-browser --ip="$host" --port="$port"
      --ServerApp.root_dir="$root" --FileContentsManager.preferred_dir=notebooks)
[ "$(id -u)" -ne 0 ] || args+=(--allow-root)  # containers often run as root
exec .venv/bin/python -m jupyter lab "${args[@]}" "$@"
