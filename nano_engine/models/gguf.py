"""Reading a GGUF file: checked first, then dequantized to float32 with Hugging Face names.

llama.cpp's GGUF format holds the weights (quantized, here Q4_1), the model's hyperparameters
and its tokenizer as metadata, and names tensors its own way (``token_embd.weight``,
``blk.N.attn_q.weight``, ...). The engine wants a Hugging Face config dict and state dict, so
this module translates names and metadata, undoes llama.cpp's q/k row permutation and
dequantizes with the ``gguf`` package. `loading.py` writes the result to a cache once.

A damaged file is refused before any tensor is dequantized, with one line that names it: a
wrong magic number, a file cut short (or otherwise unreadable), an architecture or a tensor that
the engine does not implement, a missing hyperparameter.

Mirrors vLLM's `vllm/model_executor/model_loader/gguf.py` (name mapping) and
transformers' `modeling_gguf_pytorch_utils.py` (metadata to config, q/k permutation).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from tqdm.auto import tqdm

from .files import ModelLoadError, check_config, normalize_config

GGUF_MAGIC = b"GGUF"
GGUF_TENSORS = {  # GGUF block tensor -> Hugging Face name inside model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# Hyperparameters without which the model cannot be built (prefixed by the architecture).
_REQUIRED_KEYS = ("embedding_length", "feed_forward_length", "block_count",
                  "attention.head_count", "attention.layer_norm_rms_epsilon", "context_length")


def open_gguf(path: pathlib.Path):
    """A `gguf.GGUFReader` of ``path``, refused with a ModelLoadError unless the file is whole
    and of an architecture the engine implements. Reads the header only (the data is mmapped)."""
    import gguf

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if size == 0:
        raise ModelLoadError(f"{path}: empty file (0 bytes)")
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        # gguf maps every tensor when it opens a file, so a file cut anywhere fails here, with
        # a numpy message ("cannot reshape array ...") that does not say what happened.
        why = " ".join(str(e).split())[:160]  # a tensor type this gguf does not know says so here
        raise ModelLoadError(f"{path}: truncated or damaged ({size} bytes): the gguf reader "
                             f"cannot map its tensors ({type(e).__name__}: {why})") from e
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    for key in _REQUIRED_KEYS:
        if _field(reader, f"{arch}.{key}") is None:
            raise ModelLoadError(f"{path}: the GGUF metadata has no {arch}.{key}")
    for t in reader.tensors:
        hf_name(t.name, path)  # an unknown tensor fails here, before the dequantization
    return reader


def has_tokenizer(reader) -> bool:
    """Whether the GGUF metadata holds a tokenizer (llama.cpp writes it under tokenizer.ggml.*)."""
    return "tokenizer.ggml.tokens" in reader.fields


def hf_name(gguf_name: str, path: pathlib.Path | str = "GGUF file") -> str:
    """The Hugging Face parameter name of a GGUF tensor name."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and parts[2] in GGUF_TENSORS:
        return f"model.layers.{parts[1]}.{GGUF_TENSORS[parts[2]]}.{kind}"
    if base in GGUF_TOP:
        return f"{GGUF_TOP[base]}.{kind}"
    # e.g. rope_freqs (Llama 3.1 rope scaling): fail loudly rather than run a wrong model.
    raise ModelLoadError(f"{path}: tensor {gguf_name!r} is not supported by the engine")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, as transformers' GGUF loader does: the converter
    reorders each head's rows from HF's rotate-half layout to llama.cpp's interleaved pairs."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader, state: dict, path: pathlib.Path) -> dict:
    """A Hugging Face config dict from the GGUF metadata (checked as a config.json would be)."""
    arch = _field(reader, "general.architecture")

    def field(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = field("embedding_length"), field("attention.head_count")
    scaling_type = field("rope.scaling.type", "none")
    scaling = None if scaling_type == "none" else {
        "rope_type": scaling_type, "factor": field("rope.scaling.factor"),
        "original_max_position_embeddings": field("rope.scaling.original_context_length")}
    raw = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        # The embedding's rows are the vocabulary, whether or not vocab_size was written.
        "vocab_size": int(field("vocab_size") or state["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden, "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": field("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": field("attention.head_count_kv", heads),
        # Qwen3's head_dim is not hidden/heads; GGUF records it as the key length. Without one,
        # normalize_config takes hidden_size / num_attention_heads.
        "head_dim": field("attention.key_length"),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": field("context_length"),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
    }
    check_config(raw, f"{path} (metadata)")
    return normalize_config(raw, state)


def convert_gguf(path: pathlib.Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a GGUF file to float32 with Hugging Face names and shapes."""
    import gguf

    reader = open_gguf(path)
    state = {}
    # The first load of the embedded model takes seconds: show it (a bar in a terminal, a
    # widget in JupyterLab, nothing when stderr is not a terminal).
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=None):
        # GGUF lists dims fastest-first; the reader's t.data, and so the dequantized array, is
        # already in the HF (row-major) shape, their reverse.
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}) does not "
                                 f"dequantize: {e}") from None
        state[hf_name(t.name)] = w  # every name was checked by open_gguf
    cfg = gguf_config(reader, state, path)
    if cfg["model_type"] == "llama":  # only the llama converter permutes q/k
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name in [k for k in state if k.endswith(("q_proj.weight", "k_proj.weight"))]:
            n = heads if name.endswith("q_proj.weight") else kv_heads
            state[name] = _reverse_permute(state[name], n)
    return cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
