"""Tests of nano_engine.loading: the embedded GGUF model, its cache, Hugging Face folders."""

import io
import json
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from nano_engine import Transformer, gguf_loader, loading
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
