"""The load generator's datasets: random prompts, shared prefixes, and the W2 workload.

Each dataset is a list of `SampleRequest`s (prompt, prompt length, output length), as
`vllm bench serve` builds them in `vllm/benchmarks/datasets/` (`random.py`: RandomDataset,
`prefix_repetition.py`: PrefixRepetitionRandomDataset). A prompt is a list of token ids for
/v1/completions (the OpenAI API takes `prompt` as a list of ints, so the server counts exactly
the tokens we drew) and text for /v1/chat/completions (the ids decoded; the chat template then
adds its own tokens, and the server's usage chunk says how many).

One difference from vLLM, on purpose: vLLM sends text, so it decodes and re-encodes each prompt
until the count holds (`gen_prompt_decode_to_target_len`); token ids need no such loop. The
prefix-repetition prompts avoid special tokens as the random ones do (vLLM draws them from the
whole vocabulary there, so a prompt could hold an end-of-sequence token).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "w2", "prefix_repetition")
_REPO = Path(__file__).resolve().parents[2]  # the checkout: nano_engine/benchmarks/ is two below
# The project's own copy first (tests/test_bench.py checks it is byte for byte the one handed out).
W2_PATHS = (_REPO / "bench" / "workloads" / "w2.json", _REPO.parent / "shared" / "workloads" / "w2.json")


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: vLLM's SampleRequest, plus W2's per-request ignore_eos."""
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    ignore_eos: bool = False


def _allowed_ids(tokenizer) -> np.ndarray:
    # vLLM: every id below vocab_size except the special ones (bos, eos, pad, ...).
    special = set(int(i) for i in tokenizer.all_special_ids)
    allowed = np.array([i for i in range(int(tokenizer.vocab_size)) if i not in special])
    if allowed.size == 0:
        raise ValueError(f"the tokenizer's vocabulary ({tokenizer.vocab_size} ids) holds only special tokens")
    return allowed


def _as_prompt(ids: list[int], as_text: bool, tokenizer) -> str | list[int]:
    return tokenizer.decode(ids) if as_text else ids


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def random_requests(tokenizer, num_requests: int, input_len: int = 1024, output_len: int = 128,
                    range_ratio: float = 0.0, seed: int = 0, as_text: bool = False) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths drawn uniformly from [floor(L(1-r)), ceil(L(1+r))], each
    prompt a run of consecutive allowed ids starting at a random offset (cheap, reproducible,
    and no two prompts share a prefix by accident)."""
    num_requests = _positive("num_prompts", num_requests)
    input_len = _positive("random_input_len", input_len)
    output_len = _positive("random_output_len", output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio!r}")
    # Same draws, in the same order, from the same generator as vLLM's get_sampling_params.
    rng = np.random.default_rng(seed)
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_hi = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if in_lo < 1:
        raise ValueError(f"random_input_len={input_len} with random_range_ratio={range_ratio} can draw an "
                         f"empty prompt (the shortest is floor({input_len} x {1 - range_ratio:g}) = {in_lo})")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = _allowed_ids(tokenizer)
    out = []
    for i in range(num_requests):
        ids = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        out.append(SampleRequest(_as_prompt(ids, as_text, tokenizer), len(ids), int(output_lens[i])))
    return out


def prefix_repetition_requests(tokenizer, num_requests: int, prefix_len: int = 256,
                               suffix_len: int = 256, num_prefixes: int = 10, output_len: int = 128,
                               seed: int = 0, as_text: bool = False) -> list[SampleRequest]:
    """vLLM's PrefixRepetitionRandomDataset: `num_prefixes` random prefixes, each shared by
    num_requests // num_prefixes prompts that end in their own random suffix; shuffled. As in
    vLLM, a num_requests that num_prefixes does not divide gives the largest multiple below it."""
    num_requests = _positive("num_prompts", num_requests)
    prefix_len = _positive("prefix_repetition_prefix_len", prefix_len, minimum=0)
    suffix_len = _positive("prefix_repetition_suffix_len", suffix_len, minimum=0)
    num_prefixes = _positive("prefix_repetition_num_prefixes", num_prefixes)
    output_len = _positive("prefix_repetition_output_len", output_len)
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_repetition_prefix_len + prefix_repetition_suffix_len must be >= 1, got 0")
    per_prefix = num_requests // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"num_prompts ({num_requests}) must be >= prefix_repetition_num_prefixes "
                         f"({num_prefixes}): each prefix needs at least one prompt")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    out = []
    for _ in range(num_prefixes):
        prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
        for _ in range(per_prefix):
            ids = prefix + allowed[rng.integers(0, len(allowed), size=suffix_len)].tolist()
            out.append(SampleRequest(_as_prompt(ids, as_text, tokenizer), len(ids), output_len))
    return [out[i] for i in rng.permutation(len(out))]


def find_w2(path: str | Path | None = None) -> Path:
    """The W2 workload file: `path` if given, else the project's copy, else ../shared's."""
    candidates = [Path(path)] if path is not None else list(W2_PATHS)
    for p in candidates:
        if p.is_file():
            return p
    raise FileNotFoundError(f"W2 workload not found; looked for {', '.join(map(str, candidates))}")


def w2_requests(num_requests: int | None = None, path: str | Path | None = None,
                as_text: bool = False) -> list[SampleRequest]:
    """The benchmark's W2 (64 prompts of 25-388 tokens, 16-128 new tokens, end of sequence
    ignored): token ids as recorded, or the recorded text for chat. More requests than the
    file holds cycle through it in order (vLLM oversamples at random; a fixed order keeps two
    runs comparable)."""
    reqs = _read_w2(find_w2(path), as_text)
    n = len(reqs) if num_requests is None else _positive("num_prompts", num_requests)
    out = []
    for i in range(n):
        r = reqs[i % len(reqs)]
        prompt = r["prompt"] if as_text else list(r["prompt_ids"])
        out.append(SampleRequest(prompt, len(r["prompt_ids"]), r["max_tokens"], r.get("ignore_eos", False)))
    return out


def _read_w2(path: Path, as_text: bool) -> list[dict]:
    """The requests of a W2 file, each checked: a ValueError names the file and the entry."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    reqs = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(reqs, list) or not reqs:
        raise ValueError(f"{path} must be a JSON object whose 'requests' is a non-empty list")
    for i, r in enumerate(reqs):
        where = f"{path}: requests[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{where} must be an object, got {r!r:.60}")
        ids, max_tokens = r.get("prompt_ids"), r.get("max_tokens")
        if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError(f"{where}.prompt_ids must be a non-empty list of token ids (ints >= 0), got {ids!r:.60}")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"{where}.max_tokens must be an integer >= 1, got {max_tokens!r:.60}")
        if as_text and not isinstance(r.get("prompt"), str):
            raise ValueError(f"{where}.prompt must be the prompt's text (the chat backend sends it), "
                             f"got {r.get('prompt')!r:.60}")
        if not isinstance(r.get("ignore_eos", False), bool):
            raise ValueError(f"{where}.ignore_eos must be true or false, got {r['ignore_eos']!r:.60}")
    return reqs


def get_samples(dataset_name: str, num_prompts: int | None, *, tokenizer=None, as_text: bool = False,
                seed: int = 0, dataset_path: str | None = None, random_input_len: int = 1024,
                random_output_len: int = 128, random_range_ratio: float = 0.0,
                prefix_repetition_prefix_len: int = 256, prefix_repetition_suffix_len: int = 256,
                prefix_repetition_num_prefixes: int = 10,
                prefix_repetition_output_len: int = 128) -> list[SampleRequest]:
    """The requests of one dataset, by vLLM's dataset name and flags (vLLM's get_samples)."""
    if dataset_name not in DATASETS:
        raise ValueError(f"dataset_name must be one of {', '.join(DATASETS)}, got {dataset_name!r}")
    if dataset_name == "w2":
        return w2_requests(num_prompts, dataset_path, as_text)
    if dataset_path is not None:  # vLLM refuses it too: these datasets are drawn, not read
        raise ValueError(f"dataset_path is for the w2 dataset only, got {dataset_path!r} with {dataset_name!r}")
    if tokenizer is None:
        raise ValueError(f"the {dataset_name} dataset needs a tokenizer (its vocabulary and special ids)")
    if dataset_name == "random":
        return random_requests(tokenizer, num_prompts, random_input_len, random_output_len,
                               random_range_ratio, seed, as_text)
    return prefix_repetition_requests(tokenizer, num_prompts, prefix_repetition_prefix_len,
                                      prefix_repetition_suffix_len, prefix_repetition_num_prefixes,
                                      prefix_repetition_output_len, seed, as_text)
