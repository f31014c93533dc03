"""`python -m nano_engine` (nano_engine/cli/main.py, cli/common.py): every failure is one line on
stderr naming the problem, exit 2 for a bad argument (before anything loads), 1 for a model that
does not load; and the library raises the same ModelLoadError. The broken models are tiny files
built in tmp_path (tiny_files.py)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from nano_engine import Transformer
from nano_engine.models import loading
from nano_engine.cli.main import main
from tiny_files import save_hf_folder, write_gguf

PREFIX = "python -m nano_engine: error: "


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NANO_ENGINE_MODEL", raising=False)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A complete tiny model folder, to copy and break."""
    folder = tmp_path_factory.mktemp("good")
    save_hf_folder(folder)
    return folder


def copy_of(good, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in good.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


# ----- bad arguments: exit 2 before anything is loaded -----

@pytest.mark.parametrize("argv, named", [
    (["--max-tokens", "0"], "--max-tokens: 0"),
    (["--max-tokens", "many"], "--max-tokens: 'many'"),
    (["--prompt", "hi", "--prompt", "  "], "--prompt: .*empty"),
    (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--dtype", "float16", "--attention-backend", "c"], "--attention-backend c .*float16"),  # it was after the load
    (["--threads", "100000"], "--threads: 100000 threads is above 1024"),  # libgomp failed, or a Rust panic
])
def test_bad_argument_exits_2_before_any_load(capsys, monkeypatch, argv, named):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "check_model", no_load)
    monkeypatch.setattr(Transformer, "from_pretrained", no_load)
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err[0].startswith("usage: python -m nano_engine") and err[-1].startswith(PREFIX)
    assert re.search(named, err[-1]), err[-1]


def test_output_too_long_for_the_smallest_pool_exits_2_before_the_model_loads_naming_what_fits(capsys, good,
                                                                                                monkeypatch):
    def no_load(*args, **kwargs):
        raise RuntimeError("the model was loaded: past the check")

    monkeypatch.setattr(Transformer, "from_pretrained", no_load)

    def run(max_tokens, block_size):
        return cli(capsys, "--model", str(good), "--prompt", "w1", "--prompt", "w1 w2 w3", "--max-tokens",
                   str(max_tokens), "--block-size", str(block_size))

    # The 10-block config holds 10 x 4 = 40 slots; the longest prompt + 40 outputs do not fit.
    code, out, err = run(40, 4)
    assert code == 2 and "--max-tokens 40" in err[-1] and "--block-size 4" in err[-1] and "40 slots" in err[-1]
    longest = len(loading.chat_prompt_ids(loading.load_tokenizer(good), "w1 w2 w3"))
    fits, bigger = (int(re.search(pattern, err[-1]).group(1)) for pattern in (r"--max-tokens <= (\d+)",
                                                                               r"--block-size >= (\d+)"))
    # A request holds prompt + max_tokens - 1 slots; what the line suggests fits, exactly.
    assert (fits, bigger) == (40 - longest + 1, math.ceil((longest + 40 - 1) / 10))
    assert [run(fits, 4)[0], run(fits + 1, 4)[0], run(40, bigger)[0], run(40, bigger - 1)[0]] == [1, 2, 1, 2]


def test_the_longest_prompt_may_fill_the_models_context_exactly(capsys, good, monkeypatch):
    from nano_engine.lab import experiments

    def stop(*args, **kwargs):
        raise RuntimeError("past the check")
    monkeypatch.setattr(experiments, "identity_check", stop)
    tok = loading.load_tokenizer(good)
    limit = json.loads((good / "config.json").read_text())["max_position_embeddings"]
    fill = limit - len(loading.chat_prompt_ids(tok, "w1"))
    code, _, err = cli(capsys, "--model", str(good), "--prompt", "w1", "--max-tokens", str(fill), "--block-size", "64")
    assert code == 1 and "past the check" in err[-1]
    code, _, err = cli(capsys, "--model", str(good), "--prompt", "w1", "--max-tokens", str(fill + 1),
                       "--block-size", "64")
    assert code == 2 and f"--max-tokens {fill + 1}" in err[-1] and f"max_position_embeddings={limit}" in err[-1]


# ----- models that do not load: exit 1, one line naming the file -----

def _folder(edit):
    def build(good, tmp_path):
        folder = copy_of(good, tmp_path)
        edit(folder)
        return folder
    return build


def _config(folder, **changes):
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **changes}))


def _no_chat_template(folder):
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))


def _gguf(keep, arch="llama"):
    def build(good, tmp_path):
        path = tmp_path / "tiny.gguf"
        write_gguf(path, arch)
        path.write_bytes(path.read_bytes()[:keep(path.stat().st_size)])
        return path
    return build


def _gpt2_gguf(good, tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    return tmp_path / "gpt2.gguf"


BROKEN = {  # name -> (build(good, tmp_path) -> path, what the line must say after naming the file). Every
    # refusal's wording is test_loading.py's; here one model of each kind the command meets, in the order it does.
    "no tokenizer": (_folder(lambda f: (f / "tokenizer.json").unlink()), "no tokenizer"),
    "weights cut": (_folder(lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:-1000])), "truncated"),
    "config layers 0": (_folder(lambda f: _config(f, num_hidden_layers=0)), "num_hidden_layers=0"),
    "config against weights": (_folder(lambda f: _config(f, intermediate_size=96)),
                               "model.layers.0.mlp.down_proj.weight"),  # found only when the weights load
    "gguf cut in the header": (_gguf(lambda n: 500), "500 bytes"),
    "gguf cut by one byte": (_gguf(lambda n: n - 1), "truncated"),
    "gguf of gpt2": (_gpt2_gguf, "'gpt2'"),
    "tokenizer without chat template": (_folder(_no_chat_template), "chat template"),
    "safetensors file given": (lambda g, t: copy_of(g, t) / "model.safetensors", "pass the folder"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_model_is_one_line_exit_1_naming_the_file_as_the_library_raises_it(capsys, good, tmp_path, case):
    build, what = BROKEN[case]
    path = build(good, tmp_path)
    code, out, err = cli(capsys, "--model", str(path), "--max-tokens", "2")
    assert code == 1 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"{PREFIX}{path}") and what in err[0], err[0]
    if "tokenizer" not in case:  # Transformer.from_pretrained (no tokenizer involved) raises the line printed
        with pytest.raises(loading.ModelLoadError) as raised:
            Transformer.from_pretrained(path)
        assert err == [PREFIX + " ".join(str(raised.value).split())]


def test_a_missing_model_names_the_path_and_where_it_came_from(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "gone"))  # --model's: test_exit_codes_of_the_real_process
    code, _, err = cli(capsys)
    assert code == 1 and len(err) == 1 and str(tmp_path / "gone") in err[0] and "$NANO_ENGINE_MODEL" in err[0]


def test_any_other_failure_is_one_line_and_debug_adds_the_traceback(capsys, good, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("out of\nmemory")

    monkeypatch.setattr(Transformer, "from_pretrained", boom)
    code, _, err = cli(capsys, "--model", str(good), "--max-tokens", "2")
    assert code == 1 and len(err) == 1 and "RuntimeError: out of memory" in err[0] and "--debug" in err[0]
    code, _, err = cli(capsys, "--model", str(good), "--max-tokens", "2", "--debug")
    assert code == 1 and err[0] == "Traceback (most recent call last):" and "boom" in "\n".join(err)
    assert "RuntimeError: out of memory" in err[-1]


def test_exit_codes_of_the_real_process(tmp_path):
    """The codes a shell sees, from a real `python -m nano_engine` (the only subprocesses here)."""
    def run(*argv):
        env = {k: v for k, v in os.environ.items() if k != "NANO_ENGINE_MODEL"}
        return subprocess.run([sys.executable, "-m", "nano_engine", *argv], capture_output=True,
                              text=True, env={**env, "NANO_ENGINE_CACHE": str(tmp_path)})

    bad_arg = run("--threads", "0")
    assert bad_arg.returncode == 2 and "--threads" in bad_arg.stderr.splitlines()[-1]
    missing = run("--model", str(tmp_path / "nope"))
    assert missing.returncode == 1 and missing.stdout == ""
    assert len(missing.stderr.splitlines()) == 1 and str(tmp_path / "nope") in missing.stderr


# ----- what a run does and prints -----

def test_tiny_model_runs_end_to_end_and_prints_the_table_the_trace_and_the_first_answer(capsys, good, monkeypatch):
    from nano_engine import generate
    from nano_engine.lab import experiments

    threads, got, real = [], {}, experiments.identity_check
    monkeypatch.setattr("torch.set_num_threads", lambda n: threads.append(n))

    def capture(model, prompts, max_tokens, configs, **common):
        result = got["result"] = real(model, prompts, max_tokens, configs, **common)
        got["dtype"], got["eos"] = model.dtype, model.config.eos_token_id
        result.reference[0] = result.reference[0] + [got["eos"]]  # as if the answer had stopped on EOS
        return result
    monkeypatch.setattr(experiments, "identity_check", capture)
    code, out, err = cli(capsys, "--model", str(good), "--dtype", "float64", "--max-tokens", "3",
                         "--prompt", "w1 w2 w3", "--prompt", "w4", "--threads", "2", "--block-size", "8")
    assert code == 0 and err == [] and threads == [2] and got["dtype"] == torch.float64
    assert out.startswith(f"model: {good} (llama, 2 layers, float64, attention torch)") and "2 prompts of " in out
    rows = {line.split()[0] for line in out.splitlines() if line.endswith("True")}
    assert {"defaults", "budget"} <= rows  # the table: every config identical to generate
    assert experiments.format_trace(got["result"].engines["budget 32"].step_log) in out
    tok = loading.load_tokenizer(good)
    first = generate(Transformer.from_pretrained(good, dtype="float64"), loading.chat_prompt_ids(tok, "w1 w2 w3"), 3,
                     tok.eos_token_id)
    answer = out.split("'w1 w2 w3' ->\n", 1)[1].splitlines()[0]  # decoded without special tokens
    assert answer == repr(tok.decode(first, skip_special_tokens=True)) and tok.decode([got["eos"]]) not in answer
    assert out.rstrip().endswith("token for token")


def test_run_fails_with_the_configs_that_differ_on_the_chapters_prompts(capsys, good, monkeypatch):
    from nano_engine.lab import experiments

    real = experiments.identity_check
    seen = {}

    def differing(model, prompts, max_tokens, configs, **common):
        seen.update(common, prompts=prompts, max_tokens=max_tokens, configs=configs)
        result = real(model, prompts, max_tokens, configs, **common)
        for row in result.rows:
            row.identical = row.name == "defaults"
        return result
    monkeypatch.setattr(experiments, "identity_check", differing)
    code, out, _ = cli(capsys, "--model", str(good), "--max-tokens", "2", "--no-prefix-caching",
                       "--max-num-seqs", "5", "--block-size", "8")
    assert code == 1
    last = out.splitlines()[-1]
    assert last.startswith("FAIL") and all(name in last for name in experiments.IDENTITY_CONFIGS if name != "defaults")
    assert "defaults" not in last
    tok = loading.load_tokenizer(good)
    assert seen == {"block_size": 8, "max_num_seqs": 5, "enable_prefix_caching": False, "max_tokens": 2,
                    "attention_backend": "c",  # auto: the kernel runs float32 and builds here
                    "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                    "configs": experiments.IDENTITY_CONFIGS,
                    "prompts": [loading.chat_prompt_ids(tok, t) for t in experiments.CHAT_PROMPTS]}


@pytest.mark.parametrize("name, module", [("serve", "cli.serve"), ("bench-serve", "cli.bench_serve"),
                                          ("bench serve", "cli.bench_serve"),  # as vLLM spells it
                                          ("vllm-args", "cli.vllm_args")])
def test_subcommands_hand_the_rest_of_the_line_to_their_module(monkeypatch, name, module):
    import importlib

    from nano_engine.cli import main as entry

    mod = importlib.import_module(f"nano_engine.{module}")
    got = []
    monkeypatch.setattr(mod, "main", lambda argv: got.append(argv) or 7)
    assert entry.main([*name.split(), "--x", "1"]) == 7 and got == [["--x", "1"]]
    monkeypatch.setattr(entry.sys, "argv", ["nano_engine", *name.split(), "--y"])
    assert entry.main() == 7 and got[-1] == ["--y"]


@pytest.mark.parametrize("error, status, says", [(KeyboardInterrupt, 130, "interrupted"),
                                                (ValueError, 1, "ValueError: (no message)")])
def test_ctrl_c_is_exit_130_and_an_error_without_a_message_still_says_something(capsys, good, monkeypatch, error,
                                                                                status, says):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(loading, "check_model", fail)
    code, out, err = cli(capsys, "--model", str(good))
    assert (code, out, len(err)) == (status, "", 1) and says in err[0]


def test_guarded_passes_an_int_exit_code_through_and_maps_any_other_to_2(capsys):
    from nano_engine.cli.common import guarded
    from nano_engine.cli.main import build_parser

    assert guarded(build_parser(), [], lambda ap, args: sys.exit(3)) == 3
    assert guarded(build_parser(), [], lambda ap, args: sys.exit("bye")) == 2
    assert guarded(build_parser(), [], lambda ap, args: 0) == 0
    assert main(["--max-tokens", "x"]) == 2  # argparse's own exit code, passed through
    assert main(["--help"]) == 0 and "usage: python -m nano_engine " in capsys.readouterr().out


def test_a_failure_inside_argparse_is_one_line_too(capsys):
    # A library caller's int in argv fails inside argparse, before any args exist (so --debug is unknown).
    assert main(["--debug", "--max-tokens", 3]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{PREFIX}TypeError")


def test_the_identity_check_runs_at_two_ranks_and_a_degree_the_model_cannot_take_exits_2(capsys, good):
    code, out, err = cli(capsys, "--model", str(good), "--dtype", "float64", "--max-tokens", "3",
                         "--prompt", "w1 w2 w3", "--tensor-parallel-size", "2")
    assert code == 0 and err == [] and out.rstrip().endswith("token for token")
    code, out, err = cli(capsys, "--model", str(good), "--max-tokens", "3", "-tp", "3")
    assert code == 2 and "tensor_parallel_size=3" in err[-1] and "2 KV heads" in err[-1]


def test_the_identity_check_runs_on_quantized_weights_and_what_they_cannot_run_with_exits_2(capsys, good):
    for method in ("int8", "int4"):
        code, out, err = cli(capsys, "--model", str(good), "--max-tokens", "3", "--prompt", "w1 w2 w3",
                             "--quantization", method)
        assert code == 0 and err == [] and f"weights {method}" in out and out.rstrip().endswith("token for token")
    code, out, err = cli(capsys, "--model", str(good), "-q", "int8", "--dtype", "float64")
    assert code == 2 and "--quantization" in err[-1] and "float64" in err[-1]
    code, out, err = cli(capsys, "--model", str(good), "-q", "int4", "-tp", "2")
    assert code == 2 and "--quantization" in err[-1]
