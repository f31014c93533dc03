"""One set of settings, two engines: our EngineConfig as vLLM's engine arguments and command line.

    >>> to_vllm(EngineConfig.from_settings(max_num_batched_tokens=64, num_blocks=32))["num_gpu_blocks_override"]
    32
    python -m nano_engine vllm-args --max-num-batched-tokens 64 --no-enable-prefix-caching

Every scheduler setting of ours is a field of vLLM's `EngineArgs` (`vllm/engine/arg_utils.py`) with
the same meaning: the token budget of a step, requests running at once, chunked prefill, prefix
caching, the block size, the number of KV blocks (vLLM sizes its pool from memory unless
`num_gpu_blocks_override` is set; on CPU from VLLM_CPU_KVCACHE_SPACE), the policy (fcfs or priority,
lower value first in both). Our "conservative" and "static" policies have no vLLM counterpart.
`SETTINGS` is the table of docs/vllm.md and chapter 4.7: each setting, vLLM's name and defaults, and
SGLang's nearest flag (`python/sglang/srt/server_args.py`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass

from ..engine import EngineConfig


@dataclass(frozen=True)
class Setting:
    ours: str  # an EngineConfig setting (EngineConfig.from_settings), or serve's extra: dtype, max_model_len
    vllm: str  # vLLM EngineArgs field; its flag is --vllm-with-dashes
    vllm_gpu: str  # vLLM's default for the OpenAI server on a GPU
    vllm_cpu: str  # ... on a CPU (vllm-cpu, this machine)
    sglang: str  # SGLang's nearest server argument


SETTINGS = (
    Setting("max_num_batched_tokens", "max_num_batched_tokens", "8192 on a GPU of >= 70 GiB but A100 (16384 at >= 160 GiB), 2048 below",
            "2048 x world size", "--chunked-prefill-size (a prefill chunk's tokens; decodes are not counted)"),
    Setting("max_num_seqs", "max_num_seqs", "1024 on a GPU of >= 70 GiB but A100, 256 below", "128 x world size",
            "--max-running-requests"),
    Setting("enable_chunked_prefill", "enable_chunked_prefill", "on", "on",
            "on unless --chunked-prefill-size -1; mixed prefill+decode steps only with --enable-mixed-chunk"),
    Setting("enable_prefix_caching", "enable_prefix_caching", "on", "on",
            "RadixAttention, on unless --disable-radix-cache"),
    Setting("block_size", "block_size", "16", "128 (multiples of 32 preferred)", "--page-size (default 1: a token per page)"),
    Setting("num_blocks", "num_gpu_blocks_override", "from --gpu-memory-utilization",
            "from VLLM_CPU_KVCACHE_SPACE (GiB)", "--max-total-tokens (tokens, not pages)"),
    Setting("policy", "scheduling_policy", "fcfs", "fcfs",
            "--schedule-policy (fcfs, lpm, ...); priority with --enable-priority-scheduling, higher value first "
            "unless --schedule-low-priority-values-first (vLLM: lower first)"),
    Setting("scheduler_reserve_full_isl", "scheduler_reserve_full_isl", "on", "on",
            "admits by the whole prompt and the estimated output always (see --schedule-conservativeness)"),
    Setting("attention_backend", "attention_backend", "auto (FLASH_ATTN on most GPUs)",
            "auto (CPU_ATTN: vllm/v1/attention/backends/cpu_attn.py, reads the paged blocks in place); "
            "ours: torch (the chapters') or c (kernels/paged_attention.py, the same idea), not passed to vLLM",
            "--attention-backend (flashinfer, triton, torch_native, ...)"),
    Setting("dtype", "dtype", "auto (the checkpoint's)", "auto (bfloat16 for a bf16/fp16 checkpoint)", "--dtype"),
    Setting("max_model_len", "max_model_len", "the model's max_position_embeddings", "the same",
            "--context-length"),
)
VLLM_NAME = {s.ours: s.vllm for s in SETTINGS}
VLLM_POLICIES = ("fcfs", "priority")
VLLM_DTYPES = ("float32", "bfloat16", "float16")


def to_vllm(config: EngineConfig, dtype: str | None = None, max_model_len: int | None = None) -> dict:
    """vLLM EngineArgs keywords for `config` (plus dtype and max_model_len when given)."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    sched, cache = config.scheduler_config, config.cache_config
    if sched.policy not in VLLM_POLICIES:
        raise ValueError(f"policy={sched.policy!r} has no vLLM counterpart (vLLM's scheduling_policy is one "
                         f"of {VLLM_POLICIES}); {sched.policy} exists here to compare with SGLang and with "
                         f"static batching")
    args = {VLLM_NAME[name]: getattr(part, name) for part, names in
            ((sched, ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")),
             (cache, ("enable_prefix_caching", "block_size", "num_blocks")),
             (sched, ("policy", "scheduler_reserve_full_isl"))) for name in names}
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):  # vLLM's names too (both default 1)
        if getattr(config.parallel_config, name) > 1:
            args[name] = getattr(config.parallel_config, name)
    if dtype is not None:
        args["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        if args["dtype"] not in VLLM_DTYPES:
            raise ValueError(f"dtype={dtype!r}: vLLM runs {', '.join(VLLM_DTYPES)} (float64 is ours only, "
                             f"for checking exactness)")
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    kv = config.kv_transfer_config
    if kv is not None:  # vLLM's SharedStorageConnector takes the same JSON
        args["kv_transfer_config"] = json.dumps(dataclasses.asdict(kv))
    spec = config.speculative_config
    if spec is not None:  # vLLM's --speculative-config takes the same JSON
        args["speculative_config"] = json.dumps(spec.to_vllm())
    return args


def vllm_command(config: EngineConfig, model: str, *, dtype: str | None = None, max_model_len: int | None = None,
                 host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
                 api_key: str | None = None) -> list[str]:
    """The command that serves `model` with vLLM under the same settings (vllm-cpu's entry point:
    its `vllm` console script does not run, see scripts/setup_vllm.sh)."""
    cmd = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port", str(port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if api_key:
        cmd += ["--api-key", api_key]
    for name, value in to_vllm(config, dtype, max_model_len).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # vLLM's boolean flags take --x / --no-x
            cmd.append(flag if value else f"--no-{flag[2:]}")
        else:
            cmd += [flag, str(value)]
    return cmd


def hf_folder(path: pathlib.Path) -> pathlib.Path:
    """The Hugging Face folder vLLM reads: for a GGUF file, the one nano_engine dequantizes it into
    (weights, config and tokenizer; written on first use), so that both engines serve the same weights."""
    from ..models.loading import cache_dir, load_checkpoint, load_tokenizer

    if path.is_dir():
        return path
    folder = cache_dir(path)
    if not (folder / "model.safetensors").is_file():
        load_checkpoint(path)
    if not (folder / "tokenizer_config.json").is_file():
        load_tokenizer(path)
    return folder


def settings_table() -> str:
    """The settings table (Markdown) of docs/vllm.md and chapter 4.7."""
    rows = ["| nano_engine | vLLM | vLLM default, GPU server | vLLM default, CPU server | SGLang nearest |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{s.ours}` | `--{s.vllm.replace('_', '-')}` | {s.vllm_gpu} | {s.vllm_cpu} | {s.sglang} |"
             for s in SETTINGS]
    return "\n".join(rows)
