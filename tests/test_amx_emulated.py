"""The AMX kernels, run where the CPU has no AMX.

Their code (csrc/gemm_amx.cpp, and the tiles of csrc/paged_attention.cpp) runs only on Intel
Sapphire Rapids and later, which a session does not always get; a change could break it and pass
every test elsewhere. Built with NANO_ENGINE_EMULATE_AMX=1 (kernels/build.py), the tile
instructions run on a software model of the tiles (csrc/amx.h) on any CPU with AVX512_BF16, so
here the bfloat16 tests of the matmul, the attention and the one-call decoder run again in a child
process on that model: every line of the AMX code, its packing, tiles, tails and configuration,
under the same row invariance, agreement with float64 and identity with `generate`.
"""

import os
import subprocess
import sys
import textwrap

from nano_engine.kernels import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATED = {**os.environ, "NANO_ENGINE_EMULATE_AMX": "1"}
# The bfloat16 tests of the kernels AMX replaces: on the model, each takes the AMX path. Left out
# for time (the model is slower than the hardware): the identity check on the embedded model over
# every scheduling setting (47 s here; the logprobs test runs the engine on it under four settings).
# The whole suite passes on the model too: NANO_ENGINE_EMULATE_AMX=1 make test.
TESTS = ["tests/test_linear_kernels.py", "tests/test_kernels.py", "tests/test_decoder.py"]
SELECTION = ("(bfloat16 or amx) and not bf16_dot and not avx2_and_plain and not builds_for "
             "and not engine_on_packed_weights")

PATHS = """
import torch
from nano_engine.kernels import build, linear, paged_attention
print(build.EMULATE_AMX, linear.amx_library() is not None, linear.packed_kind(torch.bfloat16),
      paged_attention.bfloat16_path())
"""


def child(args, **kw):
    return subprocess.run(args, env=EMULATED, cwd=ROOT, capture_output=True, text=True, **kw)


def test_the_amx_kernels_pass_the_bfloat16_tests_on_emulated_tiles():
    paths = child([sys.executable, "-c", textwrap.dedent(PATHS)], check=True).stdout.split()
    if "avx512_bf16" not in build.cpu_features():  # nothing for the model to run on: no AMX path
        assert paths[1] == "False" and "amx" not in paths[2:], paths
        return
    assert paths == ["True", "True", "amx", "amx"], paths  # the children below run the AMX code
    run = child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECTION, *TESTS])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]  # (5: none selected)
