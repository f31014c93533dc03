"""What a model's files must hold, checked before any weight is read.

A Hugging Face model folder is a config.json, safetensors files (one, or shards listed in
model.safetensors.index.json) and a tokenizer. Each is checked here against what the engine
needs, so that a wrong or damaged file fails at once with one line naming it and the problem
(a field of the wrong type, a truncated file), not later with "index 0 is out of bounds" from
deep inside numpy. `loading.py` runs these checks; gguf.py checks GGUF files.

Mirrors vLLM's `vllm/transformers_utils/config.py` (reading and checking config.json) and the
safetensors handling of `vllm/model_executor/model_loader/weight_utils.py`.
"""

from __future__ import annotations

import json
import pathlib

from .. import checks

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # what mini_llm implements
# Any one of these is a tokenizer transformers can load without converting a slow one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and what is wrong with it."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model path, or a file that the model needs, does not exist."""


def read_json(file: pathlib.Path):
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None


def check_config(raw, source) -> None:
    """Refuse a config the engine cannot run; the message starts with ``source`` (the file)."""
    def field(check, name, value, **limits):
        try:
            check(name, value, **limits)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: {e}") from None

    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: must be a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") not in MODEL_TYPES:
        got = f"model_type={raw['model_type']!r}" if "model_type" in raw else "no model_type"
        raise ModelLoadError(f"{source}: {got}; the engine runs {', '.join(MODEL_TYPES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads"):
        if raw.get(name) is None:
            raise ModelLoadError(f"{source}: {name} is missing")
        field(checks.integer, name, raw[name], minimum=1)
    present = {k: v for k, v in raw.items() if v is not None}
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if name in present:
            field(checks.integer, name, raw[name], minimum=1)
    for name in ("rms_norm_eps", "rope_theta"):
        if name in present:
            field(checks.number, name, raw[name], minimum=0, exclusive_minimum=True)
    for name in ("tie_word_embeddings", "attention_bias"):
        if name in present:
            field(checks.flag, name, raw[name])
    for name in ("bos_token_id", "eos_token_id"):  # one id or a list of ids
        ids = present.get(name, [])
        for i in ids if isinstance(ids, list) else [ids]:
            field(checks.integer, name, i, minimum=0)
    heads = raw["num_attention_heads"]
    if heads % (raw.get("num_key_value_heads") or heads):
        raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={raw['num_key_value_heads']}")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if (not raw.get("head_dim") and raw["hidden_size"] % heads) or head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim={head_dim} (or hidden_size / num_attention_heads "
                             "without a head_dim) must be a whole, even number")
    act = present.get("hidden_act", "silu")
    if act != "silu":  # the MLP is SwiGLU: silu(gate) * up
        raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported (the MLP computes silu)")
    # Mistral's sliding_window applies where it is given; Qwen2's only with use_sliding_window. A window
    # at least as long as the context never cuts anything; a shorter one the engine does not implement.
    window = present.get("sliding_window")
    if window is not None and present.get("use_sliding_window", True):
        field(checks.integer, "sliding_window", window, minimum=1)
        if window < present.get("max_position_embeddings", window + 1):
            raise ModelLoadError(f"{source}: sliding_window={window} is not supported: the engine attends to the "
                                 "whole context, and past the window the logits would differ")
    rope = present.get("rope_parameters", {})
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object, got {rope!r}")
    if "rope_theta" in rope:
        field(checks.number, "rope_parameters.rope_theta", rope["rope_theta"], minimum=0,
              exclusive_minimum=True)
    # transformers >= 5 keeps any scaling in rope_parameters; no type there (or "default") is none.
    scaling = present.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "default", "llama3"):
        raise ModelLoadError(f"{source}: rope scaling {kind!r} is not supported (default or llama3)")
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
    if kind == "llama3" and missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling needs {', '.join(missing)}")


def normalize_config(raw: dict, state_dict: dict) -> dict:
    """Fill the fields the engine reads, whichever transformers version wrote the config."""
    # A field written as null is a field left out (check_config reads it so too).
    cfg = {k: v for k, v in raw.items() if v is not None}
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


def _check_safetensors(file: pathlib.Path) -> None:
    """Refuse a file that is not whole safetensors from its header alone: 8 bytes of header
    length, a JSON header, then the tensors' bytes up to the largest end offset."""
    size = file.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{file}: empty file (0 bytes)")
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        if n > size - 8:  # also a file shorter than its 8 length bytes (size - 8 < 0 <= n)
            raise ModelLoadError(f"{file}: not a safetensors file, or truncated: its first 8 bytes "
                                 f"announce a {n}-byte header, the file has {size} bytes")
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                      default=0)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
            raise ModelLoadError(f"{file}: not a safetensors file (its header is not the JSON "
                                 "table of tensors)") from None
    if 8 + n + end > size:
        raise ModelLoadError(f"{file}: truncated: its tensors end at byte {8 + n + end}, "
                             f"the file has {size} bytes")


def weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The folder's safetensors files (from the index if sharded), each checked to be whole."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: has no weight_map (tensor name -> file name)")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelNotFoundError(f"{index}: lists {file.name}, which is not in {folder}")
    else:
        files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())  # a folder so named is no weight file
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = (f" (there is {others[0]}: the engine reads *.safetensors in a folder, "
                "or a .gguf file passed by its own path)") if others else ""
        raise ModelNotFoundError(f"{folder}: no weights (*.safetensors){hint}")
    for file in files:
        _check_safetensors(file)
    return files


def check_tokenizer_files(folder: pathlib.Path) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{folder}: no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
