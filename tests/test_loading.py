"""Loading a model (nano_engine/models: loading.py, files.py, gguf.py): the embedded GGUF model and
its cache, Hugging Face folders, GGUF files written the way llama.cpp writes them, the dtypes a
model loads in, and bad files refused with an error that names the file and the problem."""

import io
import json
import sys

import gguf as gguf_py  # llama.cpp's gguf-py; `gguf` here is the engine's nano_engine.models.gguf
import numpy as np
import pytest
import torch
import transformers

from nano_engine import Transformer
from nano_engine.models import files, gguf, loading
from nano_engine.models.files import ModelLoadError, ModelNotFoundError
from tiny_files import save_hf_folder, tiny_hf_model, write_gguf

KV_CACHE_PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519,
                       28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 253,
                       659, 70, 13842, 47, 2, 198, 1, 520, 9531, 198]


def refused(call, *names, error=ModelLoadError):
    """call() raises `error` with a one-line message naming each of `names` (a file, a field)."""
    with pytest.raises(error) as e:
        call()
    text = str(e.value)
    assert "\n" not in text, text
    for name in names:
        assert str(name) in text, (name, text)
    return e.value


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A fresh cache for this module: converting the embedded model takes only ~5 s, and a
    fresh cache lets the tests see the first (converting) load, not one from an earlier run."""
    root = tmp_path_factory.mktemp("nano_engine_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANO_ENGINE_CACHE", str(root))
        mp.delenv("NANO_ENGINE_MODEL", raising=False)
        yield root


# ----- the embedded model -----

def test_the_embedded_model_is_the_default(monkeypatch):
    path = loading.embedded_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    monkeypatch.setenv("NANO_ENGINE_MODEL", "")  # set but empty: the embedded model
    assert loading.resolve_model_path() == path


def test_a_missing_embedded_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    refused(loading.embedded_model_path, loading.EMBEDDED_FILE, "scripts/setup.sh", error=ModelNotFoundError)


def test_the_embedded_model_is_smollm2_and_its_second_load_comes_from_the_cache(cache_root, monkeypatch):
    """Its logits are checked against transformers' own GGUF load in test_embedded.py."""
    path = loading.embedded_model_path()
    assert not loading.cache_dir(path).exists()
    cfg, state = loading.load_checkpoint(path)
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == ("llama", 30, 576, 49152)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert all(t.dtype == torch.float32 for t in state.values())

    def no_conversion(_):
        raise AssertionError("the GGUF file was opened again")

    monkeypatch.setattr(gguf, "convert_gguf", no_conversion)
    monkeypatch.setattr(gguf, "open_gguf", no_conversion)  # parsing it takes seconds
    assert loading.check_model(path, tokenizer=False) == path
    cfg2, state2 = loading.load_checkpoint(path)
    assert cfg2 == cfg and state2.keys() == state.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)


def test_chat_prompt_ids(cache_root):
    tok = loading.load_tokenizer()
    assert loading.chat_prompt_ids(tok, "What is a KV cache?") == KV_CACHE_PROMPT_IDS
    again = loading.load_tokenizer()  # from the cache this time
    assert loading.chat_prompt_ids(again, "What is a KV cache?") == KV_CACHE_PROMPT_IDS


# ----- Hugging Face folders -----

@pytest.mark.parametrize("config_class, extra", [
    (transformers.LlamaConfig, {"tie_word_embeddings": False}),
    (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    (transformers.Qwen3Config, {"head_dim": 32, "tie_word_embeddings": False}),
])
def test_hf_folder_round_trip(tmp_path, config_class, extra):
    model = tiny_hf_model(config_class, **extra)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, state = loading.load_checkpoint(tmp_path)
    expected = {k: v for k, v in model.state_dict().items()
                if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")}
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    ref = model.config
    for key in ("model_type", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["head_dim"] == (getattr(ref, "head_dim", None) or 64 // 4)  # Qwen2 has none
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    assert cfg["attention_bias"] == (ref.model_type == "qwen2")


def test_old_style_config(tmp_path):
    """transformers 4 configs: rope_theta/rope_scaling at the top, head_dim often absent."""
    tiny_hf_model(transformers.LlamaConfig).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters"), raw.pop("head_dim")
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}
    raw.update(rope_theta=5e5, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, _ = loading.load_checkpoint(tmp_path)
    assert (cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"]) == (16, 5e5, scaling)


def test_a_config_that_leaves_fields_out_or_writes_them_as_null_gets_transformers_defaults():
    """config.json files in the wild say `"max_position_embeddings": null`: the default, not None
    (which would fail deep in add_request, or give every RMSNorm torch's own eps)."""
    nulls = dict.fromkeys(("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                           "rope_theta", "tie_word_embeddings", "attention_bias"))
    files.check_config({**BASE_CONFIG, **nulls}, "config.json")
    cfg = files.normalize_config({**BASE_CONFIG, **nulls}, {})
    hf = transformers.LlamaConfig(**{k: v for k, v in BASE_CONFIG.items() if k != "model_type"})
    for key in ("head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "attention_bias"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    # No tie_word_embeddings (old configs): the checkpoint says, by having a head or not; Qwen2 has q/k/v biases
    assert cfg["tie_word_embeddings"] is True
    cfg = files.normalize_config({**BASE_CONFIG, "model_type": "qwen2"}, {"lm_head.weight": 0})
    assert (cfg["tie_word_embeddings"], cfg["attention_bias"]) == (False, True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    save_hf_folder(folder, tokenizer=False)
    return folder


@pytest.mark.parametrize("dtype, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
    ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
    ("float64", torch.float64), (torch.bfloat16, torch.bfloat16),
])
def test_from_pretrained_takes_dtype_names(hf_folder, dtype, expected):
    model = Transformer.from_pretrained(hf_folder, dtype=dtype)
    assert model.dtype == expected and {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("dtype, error", [("half", ValueError), (torch.int8, ValueError), (None, TypeError)])
def test_from_pretrained_refuses_other_dtypes_before_loading(hf_folder, monkeypatch, dtype, error):
    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was read first"))
    with pytest.raises(error, match=f"^dtype={dtype}|^dtype='{dtype}'") as e:
        Transformer.from_pretrained(hf_folder, dtype=dtype)
    assert "bfloat16" in str(e.value)  # and what it may be instead


def test_a_folders_weights_are_cast_or_refused_by_name(tmp_path):
    """A tied checkpoint's stored head is dropped: test_mini_llm's test_from_pretrained_gives_a_fused_..."""
    from safetensors.torch import load_file as read, save_file

    save_hf_folder(tmp_path, tokenizer=False, tie_word_embeddings=False)
    weights = tmp_path / "model.safetensors"
    state = read(weights)
    save_file({**state, "model.extra_ids": torch.arange(3)}, weights)  # an integer tensor keeps its dtype
    half = loading.load_checkpoint(tmp_path, dtype="bf16")[1]
    assert half["model.extra_ids"].dtype == torch.int64 and half["lm_head.weight"].dtype == torch.bfloat16
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, weights)  # untied, no head
    refused(lambda: loading.load_checkpoint(tmp_path), tmp_path, "tie_word_embeddings", "lm_head.weight")
    weights.write_bytes(safetensors_bytes({"w": {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    e = refused(lambda: loading.load_checkpoint(tmp_path), weights)  # a whole header, but safetensors refuses it
    assert e.__cause__ is not None


# ----- GGUF files -----

@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.x.attn_q.weight", "blk.1.unknown.weight"])
def test_a_gguf_tensor_the_engine_does_not_run_is_refused_by_name(name):
    refused(lambda: gguf.hf_name(name, "f.gguf"), "f.gguf", name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(tmp_path, monkeypatch, arch):
    """A tiny GGUF written the way llama.cpp writes it (q/k rows permuted, llama.cpp's names) loads
    back as the HF model, in float32; its cache is a Hugging Face folder that transformers can read too."""
    from safetensors import safe_open

    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    hf = write_gguf(tmp_path / "tiny.gguf", arch)
    cfg, state = loading.load_checkpoint(tmp_path / "tiny.gguf")
    assert (cfg["model_type"], cfg["num_key_value_heads"]) == (arch, 2)
    assert cfg["head_dim"] == (16 if arch == "qwen2" else 32)
    assert cfg["tie_word_embeddings"] is ("lm_head.weight" not in hf)
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert state.keys() == hf.keys()
    assert all(state[k].dtype == torch.float32 and np.array_equal(state[k].numpy(), hf[k]) for k in hf)
    folder = loading.cache_dir(tmp_path / "tiny.gguf")
    assert json.loads((folder / "config.json").read_text()) == cfg
    with safe_open(folder / "model.safetensors", "pt") as f:  # transformers wants format=pt to load it
        assert f.metadata() == {"format": "pt"}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_first_gguf_load_shows_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    n = len(write_gguf(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(sys, "stderr", _Terminal())
    loading.load_checkpoint(tmp_path / "tiny.gguf")
    assert "tiny.gguf" in sys.stderr.getvalue() and f"{n}/{n}" in sys.stderr.getvalue()
    monkeypatch.undo()
    # Not a terminal (a log file, a pipe, pytest's capture): quiet.
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "other_cache"))
    loading.load_checkpoint(tmp_path / "tiny.gguf")
    assert capsys.readouterr().err == ""


GGUF_META = {  # key (after "<arch>.") -> (writer method, value): what llama.cpp's converter writes
    "block_count": ("add_uint32", 2), "context_length": ("add_uint32", 256), "embedding_length": ("add_uint32", 64),
    "feed_forward_length": ("add_uint32", 128), "attention.head_count": ("add_uint32", 4),
    "attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
}


def meta_gguf(path, arch="llama", drop=(), extra=None, tensors=(), tokenizer=False):
    """A GGUF file of metadata (GGUF_META minus drop, plus extra) and, optionally, small tensors."""
    writer = gguf_py.GGUFWriter(path, arch)
    for key, (method, value) in {**GGUF_META, **(extra or {})}.items():
        if key not in drop:
            getattr(writer, method)(f"{arch}.{key}", value)
    if tokenizer:
        writer.add_token_list(["a", "b", "c"])
        writer.add_bos_token_id(1), writer.add_eos_token_id(2)
    for name in tensors:
        writer.add_tensor(name, np.zeros((2, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file()
    writer.write_tensors_to_file(), writer.close()
    return path


def test_a_gguf_config_comes_from_its_metadata(tmp_path):
    """Rope scaling and theta as llama.cpp records them; without a vocab_size, the embedding's rows."""
    extra = {"rope.freq_base": ("add_float32", 5e5), "rope.scaling.type": ("add_string", "llama3"),
             "rope.scaling.factor": ("add_float32", 8.0), "rope.scaling.original_context_length": ("add_uint32", 128)}
    path = meta_gguf(tmp_path / "m.gguf", "qwen3", extra=extra)
    cfg = gguf.gguf_config(gguf.open_gguf(path), {"model.embed_tokens.weight": np.zeros((90, 64))}, path)
    assert (cfg["rope_theta"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (5e5, 90, 256)
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and type(cfg["rms_norm_eps"]) is float


@pytest.mark.parametrize("key", ["block_count", "attention.layer_norm_rms_epsilon"])
def test_a_gguf_without_a_hyperparameter_is_refused_by_name(tmp_path, key):
    path = meta_gguf(tmp_path / "m.gguf", "qwen2", drop=(key,))
    refused(lambda: gguf.open_gguf(path), path, f"qwen2.{key}")


def test_a_bad_gguf_file_is_refused_naming_it_before_dequantizing(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    empty, other = tmp_path / "e.gguf", tmp_path / "o.gguf"
    empty.write_bytes(b"")
    other.write_bytes(b"GGU")
    refused(lambda: gguf.open_gguf(empty), empty, "empty")
    refused(lambda: gguf.open_gguf(other), other, "not a GGUF file")
    path = meta_gguf(tmp_path / "kv.gguf", extra={"attention.head_count_kv": ("add_uint32", 3)},
                     tensors=["token_embd.weight"])
    refused(lambda: gguf.convert_gguf(path), path, "num_key_value_heads=3")  # checked as a config.json is
    path = meta_gguf(tmp_path / "m.gguf", tensors=["token_embd.weight", "rope_freqs.weight"])
    monkeypatch.setattr(gguf_py.quants, "dequantize", lambda *a: pytest.fail("a tensor was dequantized"))
    refused(lambda: loading.load_checkpoint(path), path, "rope_freqs.weight")


def test_a_cache_folder_that_cannot_be_written_is_named_with_its_variable(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf", "qwen2")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "a-file"))  # NotADirectoryError from deep inside
    refused(lambda: loading.load_checkpoint(tmp_path / "tiny.gguf"), tmp_path / "a-file", "$NANO_ENGINE_CACHE")


def test_a_gguf_the_reader_cannot_map_says_what_the_reader_said(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf", "qwen2")

    def unknown(path):
        raise ValueError("99 is not a valid GGMLQuantizationType")
    monkeypatch.setattr(gguf_py, "GGUFReader", unknown)
    refused(lambda: gguf.open_gguf(tmp_path / "tiny.gguf"), tmp_path / "tiny.gguf", "99 is not a valid")


def test_a_tensor_that_does_not_dequantize_is_named(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf", "qwen2")

    def refuse(data, kind):
        raise NotImplementedError(f"no dequantization for {kind.name}")
    monkeypatch.setattr(gguf_py.quants, "dequantize", refuse)
    first = gguf_py.GGUFReader(tmp_path / "tiny.gguf").tensors[0].name
    refused(lambda: gguf.convert_gguf(tmp_path / "tiny.gguf"), tmp_path / "tiny.gguf", first,
            "no dequantization for F32")


def test_cache_dir_is_keyed_on_content_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    data = bytes(range(256)) * 8192  # 2 MiB
    for folder, content in (("a", data), ("b", data), ("c", data[:-1]), ("d", b"\1" + data[1:])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.gguf").write_bytes(content)
    key = loading.cache_dir(tmp_path / "a" / "m.gguf")
    assert key.parent == tmp_path / "cache"
    assert loading.cache_dir(str(tmp_path / "b" / "m.gguf")) == key  # a copy elsewhere shares the cache
    assert loading.cache_dir(tmp_path / "c" / "m.gguf") != key != loading.cache_dir(tmp_path / "d" / "m.gguf")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANO_ENGINE_CACHE", "")  # set but empty: the default
    assert loading.cache_dir(tmp_path / "a" / "m.gguf") == tmp_path / "home" / ".cache" / "nano_engine" / key.name


def test_a_cache_write_is_whole_or_absent(tmp_path, monkeypatch):
    """The last file (model.safetensors) is moved in last: a reader that sees it sees every file;
    an interrupted write leaves nothing, and a second writer replaces the first."""
    import os

    def interrupted(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        loading._publish(interrupted, tmp_path / "model", last="model.safetensors")
    assert list((tmp_path / "model").iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["model"]
    moved, real_replace = [], os.replace
    monkeypatch.setattr(loading.os, "replace", lambda a, b: moved.append(os.path.basename(b)) or real_replace(a, b))
    loading._publish(lambda f: [(f / n).write_text(n) for n in ("z.json", "model.safetensors", "a.json")],
                     tmp_path / "model", last="model.safetensors")
    assert moved[-1] == "model.safetensors" and sorted(moved) == ["a.json", "model.safetensors", "z.json"]
    loading._publish(lambda f: (f / "model.safetensors").write_text("again"), tmp_path / "model",
                     last="model.safetensors")
    assert (tmp_path / "model" / "model.safetensors").read_text() == "again"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp folder left


# ----- tokenizers -----

def test_a_gguf_without_a_tokenizer_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf")
    for load in (loading.load_tokenizer, loading.check_model):
        refused(lambda: load(tmp_path / "tiny.gguf"), tmp_path / "tiny.gguf", "no tokenizer")


def test_a_tokenizer_error_names_the_model_first_load_or_cached(tmp_path, monkeypatch):
    """A tokenizer is read from local files only (never the model hub); transformers' several-line
    complaint becomes one line naming the folder or the GGUF file, whether converted or cached."""
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    asked = []

    def from_pretrained(folder, **kwargs):
        asked.append(kwargs)
        raise OSError("cannot\n   read   it")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    save_hf_folder(tmp_path / "hf", tokenizer=False)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    refused(lambda: loading.load_tokenizer(tmp_path / "hf"), tmp_path / "hf", "cannot read it")
    path = meta_gguf(tmp_path / "m.gguf", tokenizer=True)
    refused(lambda: loading.load_tokenizer(path), path)
    loading.cache_dir(path).mkdir(parents=True)
    (loading.cache_dir(path) / "tokenizer_config.json").write_text("{}")  # converted before: read from the cache
    refused(lambda: loading.load_tokenizer(path), path)
    assert all(kw["local_files_only"] is True for kw in asked)


def test_chat_prompt_ids_needs_a_template_and_returns_ints():
    from types import SimpleNamespace

    refused(lambda: loading.chat_prompt_ids(SimpleNamespace(name_or_path="tok", chat_template=None), "hi"),
            "tok", "chat template")
    tok = SimpleNamespace(name_or_path="t", chat_template="x",  # transformers 5: a BatchEncoding (it has keys)
                          apply_chat_template=lambda messages, **kw: {"input_ids": [np.int64(5), 6]})
    ids = loading.chat_prompt_ids(tok, "hi")
    assert ids == [5, 6] and all(type(i) is int for i in ids)
    tok.apply_chat_template = lambda messages, **kwargs: [7, 8]  # transformers 4: a list
    assert loading.chat_prompt_ids(tok, "x") == [7, 8]


# ----- paths, and checking a model without loading it -----

def test_model_paths_and_what_is_not_a_model(tmp_path, monkeypatch):
    monkeypatch.delenv("NANO_ENGINE_MODEL", raising=False)
    refused(lambda: loading.load_checkpoint(tmp_path / "gone"), tmp_path / "gone", error=ModelNotFoundError)
    (tmp_path / "empty" / "config.json").mkdir(parents=True)  # a folder named config.json is not the file
    refused(lambda: loading.resolve_model_path(tmp_path / "empty"), tmp_path / "empty", "config.json",
            error=ModelNotFoundError)
    for name in ("model.safetensors", "model.bin"):  # one file of a folder; not a model at all
        (tmp_path / name).write_text("{}")
        refused(lambda: loading.resolve_model_path(tmp_path / name), tmp_path / name)
    with pytest.raises(TypeError, match="^path=3 "):
        loading.resolve_model_path(3)
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loading.resolve_model_path("~/m.gguf") == tmp_path / "m.gguf"  # ~ is the user's home
    tiny_hf_model(transformers.LlamaConfig).save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "hf"))
    assert loading.resolve_model_path() == tmp_path / "hf"
    assert loading.resolve_model_path(tmp_path / "m.gguf") == tmp_path / "m.gguf"  # a path given wins over the env
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "gone"))
    refused(loading.resolve_model_path, tmp_path / "gone", "$NANO_ENGINE_MODEL", error=ModelNotFoundError)
    refused(lambda: loading.resolve_model_path(""), "empty", error=ModelNotFoundError)  # not the current folder
    monkeypatch.setenv("NANO_ENGINE_MODEL", " ")
    refused(loading.resolve_model_path, "empty", "$NANO_ENGINE_MODEL", error=ModelNotFoundError)


def test_check_model_reads_no_weights(tmp_path, monkeypatch):
    save_hf_folder(tmp_path / "hf", tokenizer=False)
    monkeypatch.setattr(loading, "load_file", lambda *a: pytest.fail("a weight was read"))
    assert loading.check_model(tmp_path / "hf", tokenizer=False) == tmp_path / "hf"
    refused(lambda: loading.check_model(tmp_path / "hf"), tmp_path / "hf", "tokenizer", error=ModelNotFoundError)
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    refused(lambda: loading.check_model(tmp_path / "hf", tokenizer=False), tmp_path / "hf" / "model.safetensors",
            "empty")
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "hf" / "model.safetensors").mkdir()  # a folder by that name: no weights (an IsADirectoryError before)
    refused(lambda: loading.check_model(tmp_path / "hf", tokenizer=False), tmp_path / "hf", "no weights",
            error=ModelNotFoundError)


# ----- config.json and the other files of a folder (files.py) -----

BASE_CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4}
CONFIG_REFUSALS = [  # (changes to BASE_CONFIG, "delete" to delete a key; what the message must name): one per rule
    ({"model_type": "gpt2"}, "gpt2"), ({"model_type": "delete"}, "model_type"),
    ({"hidden_size": "delete"}, "hidden_size"), ({"vocab_size": None}, "vocab_size"),  # required, null or not
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"), ({"head_dim": 0}, "head_dim=0"), ({"hidden_size": "64"}, "hidden_size"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"), ({"rope_theta": "big"}, "rope_theta"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    ({"eos_token_id": [2, -3]}, "eos_token_id=-3"), ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"head_dim": 15}, "head_dim=15"), ({"hidden_size": 66}, "head_dim"),
    ({"rope_parameters": [1]}, "rope_parameters"), ({"rope_parameters": {"rope_theta": 0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ({"rope_scaling": {"rope_type": "dynamic", "type": "llama3"}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "original_max_position_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),  # the logits would be silu's
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),  # no context given: it may bite
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_position_embeddings": 128},
     "sliding_window=64"),
    ({"model_type": "mistral", "sliding_window": "4k"}, "sliding_window"),
]


def edited(changes):
    raw = dict(BASE_CONFIG)
    for key, value in changes.items():
        if value == "delete":
            raw.pop(key)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("changes, names", CONFIG_REFUSALS)
def test_a_config_the_engine_cannot_run_is_refused_naming_the_field(changes, names):
    e = refused(lambda: files.check_config(edited(changes), "cfg.json"), names)
    assert str(e).startswith("cfg.json: ")


@pytest.mark.parametrize("changes", [
    {}, {"model_type": "qwen3"}, {"model_type": "mistral"}, {"model_type": "qwen2"},
    {"hidden_size": 66, "head_dim": 16},  # hidden_size need not divide
    {"rms_norm_eps": 1e-9, "rope_theta": 1, "tie_word_embeddings": False, "attention_bias": True},
    {"bos_token_id": 0, "eos_token_id": [0, 2]}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    {"rope_scaling": {"type": None}}, {"hidden_act": "silu"},
    {"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False,  # Qwen2.5's: off
     "max_position_embeddings": 32768},
    {"model_type": "mistral", "sliding_window": None},  # Mistral v0.3's: none
    {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 4096},  # as long as the context
    {"model_type": "qwen3", "sliding_window": None, "use_sliding_window": False},
    {"rope_scaling": {}, "rope_parameters": {"rope_type": "llama3", "factor": 8,
                                            "original_max_position_embeddings": 8}},
])
def test_a_config_the_engine_runs_passes(changes):
    assert files.check_config(edited(changes), "c") is None


def test_a_config_or_index_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path):
    refused(lambda: files.check_config([1, 2], "c.json"), "c.json", "JSON object")
    f = tmp_path / "c.json"
    for bad in (b"{", b"\xff\xfe"):
        f.write_bytes(bad)
        refused(lambda: files.read_json(f), f, "not valid JSON")
    # What a caller catches: a missing model is a FileNotFoundError, any bad one a ValueError
    assert issubclass(ModelNotFoundError, ModelLoadError) and issubclass(ModelNotFoundError, FileNotFoundError)
    assert issubclass(ModelLoadError, ValueError)


def safetensors_bytes(header, data=b"", length=None):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


TWO = {"w": {"data_offsets": [0, 8]}, "v": {"data_offsets": [8, 12]}}


@pytest.mark.parametrize("content, problem", [
    (b"", "empty"),
    (b"\x05" + b"\0" * 6, "truncated"),
    (safetensors_bytes({}, length=3), "truncated"),
    (safetensors_bytes(b"\xff\xfe"), "not a safetensors file"),
    (safetensors_bytes({"w": {"data_offsets": [0]}}), "not a safetensors file"),
    (safetensors_bytes(TWO, b"\0" * 11), "truncated"),
    (safetensors_bytes(TWO, b"\0" * 12), None),  # whole
    (safetensors_bytes({"__metadata__": {"data_offsets": [0, 99]}}), None),  # metadata is not a tensor
])
def test_a_damaged_safetensors_file_is_refused_naming_it_before_any_read(tmp_path, content, problem):
    (tmp_path / "model.safetensors").write_bytes(content)
    if problem is None:
        assert files.weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    else:
        refused(lambda: files.weight_files(tmp_path), tmp_path / "model.safetensors", problem)


def test_weight_files_from_the_index_or_the_folder(tmp_path):
    for name in ("b.safetensors", "a.safetensors", "c.safetensors"):
        (tmp_path / name).write_bytes(safetensors_bytes({}))
    assert files.weight_files(tmp_path) == [tmp_path / f"{n}.safetensors" for n in "abc"]
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "c.safetensors", "y": "b.safetensors", "z": "c.safetensors"}}))
    assert files.weight_files(tmp_path) == [tmp_path / "b.safetensors", tmp_path / "c.safetensors"]
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": None}}))
    refused(lambda: files.weight_files(tmp_path), index, "weight_map")
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "gone.safetensors"}}))
    refused(lambda: files.weight_files(tmp_path), index, "gone.safetensors", error=ModelNotFoundError)
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    (tmp_path / "a.safetensors").write_bytes(b"")  # a listed file is checked too
    refused(lambda: files.weight_files(tmp_path), tmp_path / "a.safetensors", "empty")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.Q4.gguf", "notes.txt"])
def test_a_folder_without_safetensors_names_the_weights_it_has(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    e = refused(lambda: files.weight_files(tmp_path), tmp_path, "*.safetensors", error=ModelNotFoundError)
    assert (name in str(e)) is (name != "notes.txt")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model", "vocab.json"])
def test_any_one_tokenizer_file_will_do(tmp_path, name):
    refused(lambda: files.check_tokenizer_files(tmp_path), tmp_path, name, error=ModelNotFoundError)
    (tmp_path / name).mkdir()  # a folder of that name is not the file
    refused(lambda: files.check_tokenizer_files(tmp_path), tmp_path, error=ModelNotFoundError)
    (tmp_path / name).rmdir()
    (tmp_path / name).write_text("{}")
    assert files.check_tokenizer_files(tmp_path) is None
