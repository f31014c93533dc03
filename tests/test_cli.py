"""`python -m nano_engine`: every failure is one line on stderr naming the problem, exit 2 for a
bad argument (before anything loads), 1 for a model that does not load; and the library raises
the same ModelLoadError. The broken models are tiny files built in tmp_path (tiny_files.py)."""

import json
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

@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "argument --max-tokens: 0 must be at least 1"),
    (["--max-tokens", "-3"], "argument --max-tokens: -3 must be at least 1"),
    (["--max-tokens", "many"], "argument --max-tokens: 'many' is not an integer"),
    (["--block-size", "0"], "argument --block-size: 0 must be at least 1"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 must be at least 1"),
    (["--threads", "0"], "argument --threads: 0 must be at least 1"),
    (["--prompt", ""], "argument --prompt: the message is empty"),
    (["--prompt", "hi", "--prompt", "  "], "argument --prompt: the message is empty"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from 'float32', 'fp32', "
                          "'bfloat16', 'bf16', 'float16', 'fp16', 'float64')"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_argument_exits_2_before_any_load(capsys, monkeypatch, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "check_model", no_load)
    monkeypatch.setattr(Transformer, "from_pretrained", no_load)
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err[0].startswith("usage: python -m nano_engine") and err[-1] == PREFIX + message


def test_output_too_long_for_the_smallest_pool_exits_2_before_the_model_loads(capsys, good, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Transformer, "from_pretrained", no_load)
    # The 10-block config holds 10 x 4 = 40 slots; a prompt of a few tokens + 40 outputs does not fit.
    code, out, err = cli(capsys, "--model", str(good), "--prompt", "w1 w2", "--max-tokens", "40",
                         "--block-size", "4")
    assert code == 2
    assert re.fullmatch(PREFIX + r"--max-tokens 40 with --block-size 4: the longest prompt \((\d+) "
                        r"tokens\) and its output need \d+ KV slots, but the smallest config has 10 "
                        r"blocks = 40 slots; use --max-tokens <= \d+ or --block-size >= \d+", err[-1])


def test_output_beyond_the_models_context_exits_2(capsys, good):
    code, out, err = cli(capsys, "--model", str(good), "--prompt", "w1", "--max-tokens", "300",
                         "--block-size", "64")
    assert code == 2
    assert re.fullmatch(PREFIX + r"--max-tokens 300: the longest prompt and its output are \d+ tokens, "
                        r"above the model's max_position_embeddings=256", err[-1])


# ----- models that do not load: exit 1, one line naming the file -----

def _config_edit(**changes):
    def build(good, tmp_path):
        folder = copy_of(good, tmp_path)
        raw = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if value is _DELETE:
                raw.pop(key)
            else:
                raw[key] = value
        (folder / "config.json").write_text(json.dumps(raw))
        return folder
    return build


def _replace(name, data):
    def build(good, tmp_path):
        folder = copy_of(good, tmp_path)
        (folder / name).write_bytes(data(folder / name) if callable(data) else data)
        return folder
    return build


def _remove(*names):
    def build(good, tmp_path):
        folder = copy_of(good, tmp_path)
        for name in names:
            (folder / name).unlink()
        return folder
    return build


def _gguf(cut=None, data=None, arch="llama"):
    def build(good, tmp_path):
        path = tmp_path / "tiny.gguf"
        if data is not None:
            path.write_bytes(data)
            return path
        write_gguf(path, arch)
        if cut is not None:
            path.write_bytes(path.read_bytes()[:cut(path.stat().st_size)])
        return path
    return build


def _sharded(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    return folder


_DELETE = object()
GARBAGE = bytes(range(7, 256)) * 20

BROKEN = {  # name -> (build(good, tmp_path) -> path, regex of the message after "<path>: ")
    "no config.json": (_remove("config.json"), r"no config\.json in this folder .*"),
    "no weights": (_remove("model.safetensors"), r"no weights \(\*\.safetensors\)"),
    "no tokenizer": (_remove("tokenizer.json"),
                     r"no tokenizer \(none of tokenizer\.json, tokenizer\.model, vocab\.json\)"),
    "garbage weights": (_replace("model.safetensors", GARBAGE),
                        r"not a safetensors file, or truncated: its first 8 bytes announce a \d+-byte "
                        r"header, the file has 4980 bytes"),
    "weights cut in the header": (_replace("model.safetensors", lambda f: f.read_bytes()[:100]),
                                  r"not a safetensors file, or truncated: .*, the file has 100 bytes"),
    "weights cut in the data": (_replace("model.safetensors", lambda f: f.read_bytes()[:-1000]),
                                r"truncated: its tensors end at byte (\d+), the file has \d+ bytes"),
    "empty weights": (_replace("model.safetensors", b""), r"empty file \(0 bytes\)"),
    "missing shard": (_sharded, r"lists model-00002-of-00002\.safetensors, which is not in .*"),
    "config not JSON": (_replace("config.json", b'{"model_type": "llama",'), r"not valid JSON \(.*\)"),
    "config a list": (_replace("config.json", b"[1, 2]"), r"must be a JSON object, got list"),
    "config without hidden_size": (_config_edit(hidden_size=_DELETE), r"hidden_size is missing"),
    "config hidden_size a string": (_config_edit(hidden_size="64"),
                                    r"hidden_size='64' must be an integer.*"),
    "config layers 0": (_config_edit(num_hidden_layers=0), r"num_hidden_layers=0 must be .*>= 1.*"),
    "config flag a string": (_config_edit(tie_word_embeddings="no"),
                             r"tie_word_embeddings='no' must be True or False.*"),
    "config gpt2": (_config_edit(model_type="gpt2"),
                    r"model_type='gpt2'; the engine runs llama, mistral, qwen2, qwen3"),
    "config linear rope": (_config_edit(rope_scaling={"rope_type": "linear", "factor": 2.0}),
                           r"rope scaling 'linear' is not supported \(default or llama3\)"),
    "config against weights": (_config_edit(intermediate_size=96),
                               r"the weights do not match config\.json: "
                               r"model\.layers\.0\.mlp\.down_proj\.weight is \(64, 128\), the config says "
                               r"\(64, 96\), .*"),
    "garbage gguf": (_gguf(data=GARBAGE), r"not a GGUF file \(it starts with .*, not b'GGUF'\)"),
    "gguf cut in the header": (_gguf(cut=lambda n: 500),
                               r"truncated or damaged \(500 bytes\): the gguf reader cannot map its tensors"),
    "gguf cut in the data": (_gguf(cut=lambda n: n // 2), r"truncated or damaged \(\d+ bytes\): .*"),
    "gguf cut by one byte": (_gguf(cut=lambda n: n - 1), r"truncated or damaged \(\d+ bytes\): .*"),
    "gguf without tokenizer": (_gguf(), r"no tokenizer in the GGUF metadata \(tokenizer\.ggml\.\*\)"),
    "safetensors file given": (lambda g, t: copy_of(g, t) / "model.safetensors",
                               r"one file of a model folder: pass the folder that holds it"),
}


def _which_file(path, message):
    """The file the message must name: the folder, or the file in it that is broken."""
    for name in ("config.json", "model.safetensors.index.json", "model.safetensors"):
        if f"{path}/{name}" in message:
            return f"{path}/{name}"
    return str(path)


@pytest.mark.parametrize("case", BROKEN)
def test_broken_model_is_one_line_exit_1(capsys, good, tmp_path, case):
    build, pattern = BROKEN[case]
    path = build(good, tmp_path)
    code, out, err = cli(capsys, "--model", str(path), "--max-tokens", "2")
    assert code == 1 and out == "" and len(err) == 1, err
    named = _which_file(path, err[0])
    assert err[0].startswith(f"{PREFIX}{named}"), err[0]
    assert re.fullmatch(re.escape(f"{PREFIX}{named}") + r"(\s\(metadata\))?: " + pattern, err[0]), err[0]


@pytest.mark.parametrize("case", [c for c in BROKEN if "tokenizer" not in c])
def test_library_raises_the_same_model_load_error(good, tmp_path, case, capsys):
    """Transformer.from_pretrained (no tokenizer involved) fails with the line the CLI prints."""
    build, _ = BROKEN[case]
    path = build(good, tmp_path)
    with pytest.raises(loading.ModelLoadError) as raised:
        Transformer.from_pretrained(path)
    code, _, err = cli(capsys, "--model", str(path), "--max-tokens", "2")
    assert err == [PREFIX + " ".join(str(raised.value).split())]


def test_bin_only_folder_says_what_it_reads(capsys, good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    code, _, err = cli(capsys, "--model", str(folder))
    assert code == 1 and err == [f"{PREFIX}{folder}: no weights (*.safetensors) (there is pytorch_model.bin: the "
                                 "engine reads *.safetensors in a folder, or a .gguf file passed by its own path)"]


def test_missing_paths(capsys, tmp_path, monkeypatch):
    code, _, err = cli(capsys, "--model", str(tmp_path / "nope"))
    assert code == 1 and err == [f"{PREFIX}no model at {tmp_path / 'nope'}: no such file or folder"]
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "gone"))
    code, _, err = cli(capsys)
    assert code == 1 and err == [f"{PREFIX}no model at {tmp_path / 'gone'} (from $NANO_ENGINE_MODEL): "
                                 "no such file or folder"]
    with pytest.raises(FileNotFoundError):  # a ModelNotFoundError is also a FileNotFoundError
        loading.resolve_model_path()


def test_gguf_of_an_unsupported_architecture(capsys, tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    code, _, err = cli(capsys, "--model", str(tmp_path / "gpt2.gguf"))
    assert code == 1 and err == [f"{PREFIX}{tmp_path / 'gpt2.gguf'}: GGUF architecture 'gpt2' is not "
                                 "supported (supported: llama, qwen2, qwen3)"]


def test_tokenizer_without_chat_template(capsys, good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    code, _, err = cli(capsys, "--model", str(folder))
    assert code == 1 and err == [f"{PREFIX}{folder}: the tokenizer has no chat template "
                                 "(chat_template.jinja, or chat_template in tokenizer_config.json)"]


def test_any_other_failure_is_one_line_and_debug_adds_the_traceback(capsys, good, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("out of\nmemory")

    monkeypatch.setattr(Transformer, "from_pretrained", boom)
    code, _, err = cli(capsys, "--model", str(good), "--max-tokens", "2")
    assert code == 1 and err == [f"{PREFIX}RuntimeError: out of memory (--debug shows the traceback)"]
    code, _, err = cli(capsys, "--model", str(good), "--max-tokens", "2", "--debug")
    assert code == 1 and err[0] == "Traceback (most recent call last):" and "boom" in "\n".join(err)
    assert err[-1] == f"{PREFIX}RuntimeError: out of memory"


def test_tiny_model_runs_end_to_end(capsys, good):
    code, out, err = cli(capsys, "--model", str(good), "--dtype", "float64", "--max-tokens", "3",
                         "--prompt", "w1 w2 w3", "--prompt", "w4")
    assert code == 0, err
    assert out.startswith(f"model: {good} (llama, 2 layers, float64), loaded in ")
    assert "2 prompts of " in out and out.rstrip().endswith("token for token")


def test_exit_codes_of_the_real_process(tmp_path):
    """The codes a shell sees, from a real `python -m nano_engine` (the only subprocesses here)."""
    def run(*argv):
        env = {k: v for k, v in os.environ.items() if k != "NANO_ENGINE_MODEL"}
        return subprocess.run([sys.executable, "-m", "nano_engine", *argv], capture_output=True,
                              text=True, env={**env, "NANO_ENGINE_CACHE": str(tmp_path)})

    bad_arg = run("--threads", "0")
    assert bad_arg.returncode == 2
    assert bad_arg.stderr.splitlines()[-1] == PREFIX + "argument --threads: 0 must be at least 1"
    missing = run("--model", str(tmp_path / "nope"))
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.splitlines() == [f"{PREFIX}no model at {tmp_path / 'nope'}: no such file or folder"]


# ----- __main__'s own parts: flags, the fit check, what run() prints, the subcommands -----
def test_flags_and_their_defaults():
    from nano_engine.cli.main import build_parser

    assert vars(build_parser().parse_args([])) == {
        "model": None, "prompt": None, "max_tokens": 24, "dtype": "float32", "block_size": 16, "max_num_seqs": 16,
        "no_prefix_caching": False, "threads": None, "debug": False}
    args = build_parser().parse_args(["--model", "m", "--prompt", "a", "--prompt", " b ", "--max-tokens", "2",
                                      "--dtype", "bf16", "--block-size", "4", "--max-num-seqs", "3",
                                      "--no-prefix-caching", "--threads", "1", "--debug"])
    assert vars(args) == {"model": "m", "prompt": ["a", " b "], "max_tokens": 2, "dtype": "bf16", "block_size": 4,
                          "max_num_seqs": 3, "no_prefix_caching": True, "threads": 1, "debug": True}


def test_help_says_what_it_runs(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m nano_engine ")
    for phrase in ["`python -m nano_engine`: the scheduler chapter's identity check on the embedded model.",
                   "a Hugging Face folder or a .gguf file (default: $NANO_ENGINE_MODEL, else the embedded "
                   "SmolLM2-135M-Instruct)", "a user message (repeat for more; default: the 6 chat prompts)",
                   "greedy tokens per prompt (default 24)", "torch threads (default: torch's choice)",
                   "print the traceback of a failure"]:
        assert f" {phrase} " in f" {text} ", phrase  # whole: nothing glued to either end
    from nano_engine.cli import main as entry

    assert entry.__doc__.strip() in entry.build_parser().format_help()  # the description as written, line by line


class _Refused(Exception):
    pass


class _Parser:
    def error(self, message):
        raise _Refused(message)


@pytest.mark.parametrize("lengths, max_tokens, block_size, message", [
    ([5, 10], 40, 4, "--max-tokens 40 with --block-size 4: the longest prompt (10 tokens) and its output need 49 KV "
                     "slots, but the smallest config has 10 blocks = 40 slots; use --max-tokens <= 31 or "
                     "--block-size >= 5"),
    ([10], 32, 4, "--max-tokens 32 with --block-size 4: the longest prompt (10 tokens) and its output need 41 KV "
                  "slots, but the smallest config has 10 blocks = 40 slots; use --max-tokens <= 31 or --block-size >= 5"),
    ([10], 31, 4, None),  # 10 + 31 - 1 = 40 slots: exactly full
    ([3], 38, 4, None),
])
def test_check_fits_uses_the_smallest_pool(lengths, max_tokens, block_size, message):
    from types import SimpleNamespace

    from nano_engine.cli.main import _check_fits

    args = SimpleNamespace(max_tokens=max_tokens, block_size=block_size)
    configs = {"defaults": {}, "small": {"num_blocks": 10}, "big": {"num_blocks": 99}}
    prompts = [[0] * n for n in lengths]
    if message is None:
        assert _check_fits(_Parser(), args, prompts, configs) is None
    else:
        with pytest.raises(_Refused) as e:
            _check_fits(_Parser(), args, prompts, configs)
        assert str(e.value) == message
    # With no num_blocks anywhere, the engine's default pool (256 blocks) is the limit.
    assert _check_fits(_Parser(), SimpleNamespace(max_tokens=256 * 4 - 9, block_size=4), [[0] * 10], {"d": {}}) is None
    with pytest.raises(_Refused):
        _check_fits(_Parser(), SimpleNamespace(max_tokens=256 * 4 - 8, block_size=4), [[0] * 10], {"d": {}})


def test_run_prints_the_table_the_trace_and_the_first_answer(capsys, good, monkeypatch):
    from nano_engine import generate

    threads = []
    monkeypatch.setattr("torch.set_num_threads", lambda n: threads.append(n))
    code, out, err = cli(capsys, "--model", str(good), "--dtype", "float64", "--max-tokens", "3",
                         "--prompt", "w1 w2 w3", "--prompt", "w4", "--threads", "2", "--block-size", "8")
    assert code == 0 and err == [] and threads == [2]
    tok = loading.load_tokenizer(good)
    ids = [loading.chat_prompt_ids(tok, t) for t in ("w1 w2 w3", "w4")]
    model = Transformer.from_pretrained(good, dtype="float64")
    first = generate(model, ids[0], 3, model.config.eos_token_id)
    lines = out.splitlines()
    assert re.fullmatch(rf"model: {re.escape(str(good))} \(llama, 2 layers, float64\), loaded in \d+\.\d s", lines[0])
    assert lines[1] == f"2 prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, 3 greedy tokens each"
    assert lines[2] == "" and lines[3].split() == ["config", "steps", "preempt", "seconds", "identical"]
    assert [line.split()[0] for line in lines[4:8]] == ["alone", "defaults", "budget", "budget"]
    assert all(line.endswith("True") for line in lines[5:8])
    i = lines.index("first 6 steps at a 32-token budget (p = prefill chunk, d = decode, r = recompute):")
    assert lines[i - 1] == "" and i == 9
    j = lines.index("'w1 w2 w3' ->")
    assert lines[j + 1] == repr(tok.decode(first, skip_special_tokens=True)) and lines[j - 1] == ""
    assert lines[-2:] == ["", "identical: every config gives the single-request tokens, token for token"]


def test_run_loads_in_its_dtype_and_prints_the_trace_and_an_answer_without_special_tokens(capsys, good, monkeypatch):
    import time

    from nano_engine.lab import experiments

    real = experiments.identity_check
    got = {}

    def capture(model, prompts, max_tokens, configs, **common):
        result = got["result"] = real(model, prompts, max_tokens, configs, **common)
        got["dtype"], got["eos"] = model.dtype, model.config.eos_token_id
        result.reference[0] = result.reference[0] + [got["eos"]]  # an answer that stopped on EOS
        return result
    monkeypatch.setattr(experiments, "identity_check", capture)
    start = time.perf_counter()
    code, out, err = cli(capsys, "--model", str(good), "--dtype", "float64", "--max-tokens", "3", "--prompt", "w1")
    took = time.perf_counter() - start
    assert code == 0 and got["dtype"] == torch.float64
    loaded = float(re.search(r", loaded in (\d+\.\d) s$", out.splitlines()[0]).group(1))
    assert 0 <= loaded <= took + 0.05  # the time since the load began, not a clock reading
    header = "first 6 steps at a 32-token budget (p = prefill chunk, d = decode, r = recompute):"
    trace = experiments.format_trace(got["result"].engines["budget 32"].step_log)
    assert f"\n{header}\n{trace}\n\n'w1' ->\n" in out
    tok = loading.load_tokenizer(good)
    answer = out.split("'w1' ->\n", 1)[1].splitlines()[0]
    ref = got["result"].reference[0]
    assert answer == repr(tok.decode(ref, skip_special_tokens=True)) != repr(tok.decode(ref))
    assert tok.decode([got["eos"]]) not in answer


def test_the_longest_prompt_may_fill_the_models_context_exactly(capsys, good, monkeypatch):
    from nano_engine.lab import experiments

    def stop(*args, **kwargs):
        raise RuntimeError("past the check")
    monkeypatch.setattr(experiments, "identity_check", stop)
    tok = loading.load_tokenizer(good)
    limit = json.loads((good / "config.json").read_text())["max_position_embeddings"]
    fill = limit - len(loading.chat_prompt_ids(tok, "w1"))
    code, _, err = cli(capsys, "--model", str(good), "--prompt", "w1", "--max-tokens", str(fill), "--block-size", "64")
    assert code == 1 and err[-1].endswith("RuntimeError: past the check (--debug shows the traceback)")
    code, _, err = cli(capsys, "--model", str(good), "--prompt", "w1", "--max-tokens", str(fill + 1),
                       "--block-size", "64")
    assert code == 2 and err[-1].endswith(f"the longest prompt and its output are {limit + 1} tokens, above the "
                                          f"model's max_position_embeddings={limit}")


def test_run_fails_with_the_configs_that_differ(capsys, good, monkeypatch):
    from nano_engine.lab import experiments

    real = experiments.identity_check
    seen = {}

    def differing(model, prompts, max_tokens, configs, **common):
        seen.update(common, max_tokens=max_tokens, configs=configs)
        result = real(model, prompts, max_tokens, configs, **common)
        for row in result.rows:
            row.identical = row.name == "defaults"
        return result
    monkeypatch.setattr(experiments, "identity_check", differing)
    code, out, _ = cli(capsys, "--model", str(good), "--max-tokens", "2", "--prompt", "w1", "--no-prefix-caching",
                       "--max-num-seqs", "5", "--block-size", "8")
    assert code == 1
    assert out.splitlines()[-2:] == ["", "FAIL: outputs differ from single-request generate under: budget 32, "
                                         "budget 64, 10 blocks"]
    assert seen == {"block_size": 8, "max_num_seqs": 5, "enable_prefix_caching": False, "max_tokens": 2,
                    "configs": experiments.IDENTITY_CONFIGS}


def test_the_default_prompts_are_the_chapters(capsys, good, monkeypatch):
    from nano_engine.lab import experiments

    asked = []

    def record_and_stop(model, prompts, *args, **kwargs):
        asked.append(prompts)
        raise RuntimeError("stop here")
    monkeypatch.setattr(experiments, "identity_check", record_and_stop)
    code, _, err = cli(capsys, "--model", str(good), "--max-tokens", "2")
    tok = loading.load_tokenizer(good)
    assert code == 1 and asked == [[loading.chat_prompt_ids(tok, t) for t in experiments.CHAT_PROMPTS]]
    assert err == [f"{PREFIX}RuntimeError: stop here (--debug shows the traceback)"]


@pytest.mark.parametrize("name, module", [("serve", "cli.serve"), ("bench-serve", "cli.bench_serve"),
                                          ("vllm-args", "cli.vllm_args")])
def test_subcommands_hand_the_rest_of_the_line_to_their_module(monkeypatch, name, module):
    import importlib

    from nano_engine.cli import main as entry

    mod = importlib.import_module(f"nano_engine.{module}")
    got = []
    monkeypatch.setattr(mod, "main", lambda argv: got.append(argv) or 7)
    assert entry.main([name, "--x", "1"]) == 7 and got == [["--x", "1"]]
    monkeypatch.setattr(entry.sys, "argv", ["nano_engine", name, "--y"])
    assert entry.main() == 7 and got[-1] == ["--y"]


def test_interrupted_is_exit_130(capsys, good, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(loading, "check_model", interrupted)
    code, out, err = cli(capsys, "--model", str(good))
    assert (code, out, err) == (130, "", ["python -m nano_engine: interrupted"])


def test_an_error_without_a_message_still_says_something(capsys, good, monkeypatch):
    def silent(*a, **k):
        raise ValueError()
    monkeypatch.setattr(loading, "check_model", silent)
    code, _, err = cli(capsys, "--model", str(good))
    assert (code, err) == (1, [f"{PREFIX}ValueError: (no message) (--debug shows the traceback)"])
    assert main(["--max-tokens", "x"]) == 2  # argparse's own exit code, passed through


def test_guarded_passes_an_int_exit_code_through_and_maps_any_other_to_2():
    import sys as _sys

    from nano_engine.cli.main import build_parser, guarded

    assert guarded(build_parser(), [], lambda ap, args: _sys.exit(3)) == 3
    assert guarded(build_parser(), [], lambda ap, args: _sys.exit("bye")) == 2
    assert guarded(build_parser(), [], lambda ap, args: 0) == 0


def test_guarded_reports_a_failure_inside_argparse_in_one_line(capsys):
    from nano_engine.cli.main import build_parser, guarded

    def never(ap, args):
        raise AssertionError("run after a failed parse")
    # A library caller's int in argv fails inside argparse, before any args exist (so --debug is unknown).
    for argv in (["--max-tokens", 3], ["--debug", "--max-tokens", 3]):
        assert guarded(build_parser(), argv, never) == 1
        assert capsys.readouterr().err.splitlines() == [
            f"{PREFIX}TypeError: 'int' object is not subscriptable (--debug shows the traceback)"]
