"""Prefill/decode disaggregation: one engine computes a prompt's KV, another loads it and decodes.

A long prompt's prefill is compute: it takes a step's whole budget and makes every decode in that
step wait (chapter 4's budget trade-off). Disaggregated serving runs prefills on one engine (the
producer) and decodes on another (the consumer): the producer computes the prompt and one token,
its KV goes through a *connector*, and the consumer, given the same request, loads that KV into its
own blocks instead of computing it, and decodes.

After vLLM's KV connector (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`,
KVConnectorBase_V1, with a scheduler side and a worker side) and the simplest of its connectors,
`shared_storage_connector.py` (SharedStorageConnector: KV in files under a shared folder, keyed by
the prompt's tokens), configured by a `KVTransferConfig` (`vllm/config/kv_transfer.py`):

* scheduler side, `get_num_new_matched_tokens(request, num_computed)`: how many of the prompt's
  tokens beyond the local prefix-cache hit the consumer can load rather than compute: whole blocks
  of its own size, leaving at least the last prompt token to compute (its logits give the first
  token);
* worker side, `save_kv` (producer: after the step that completes a prompt) and `load_kv`
  (consumer: before the step that follows the load).

The file holds every layer's K and V for every prompt token, token after token, whatever the
block size: the producer reads them out of its blocks and the consumer writes them into its own,
each by `transfer_plan` (runs of slots consecutive on both sides, one copy each), so engines with
other block sizes exchange KV without a conversion step. What is loaded is what the consumer would have computed (the kernels give a
token's KV the same bits in any batch), so its tokens are one engine's (tests/test_kv_transfer.py).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from dataclasses import dataclass, field

import torch

from . import checks
from .paged import PagedKVCache
from .request import Request

__all__ = ["KVTransferConfig", "SharedStorageConnector", "make_connector", "transfer_plan"]

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("SharedStorageConnector",)


@dataclass
class KVTransferConfig:
    """vLLM's names: `--kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role":
    "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'`."""

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"  # kv_producer: saves prompts' KV; kv_consumer: loads it; kv_both: both
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        self.kv_connector = checks.choice("kv_connector", self.kv_connector, CONNECTORS)
        self.kv_role = checks.choice("kv_role", self.kv_role, ROLES)
        if not isinstance(self.kv_connector_extra_config, dict):
            raise TypeError(f"kv_connector_extra_config must be a dict, got {self.kv_connector_extra_config!r}")
        path = self.kv_connector_extra_config.get("shared_storage_path")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"{self.kv_connector} needs kv_connector_extra_config={{'shared_storage_path': "
                             f"FOLDER}}, got {self.kv_connector_extra_config!r}")

    @classmethod
    def of(cls, value) -> "KVTransferConfig | None":
        """None, a KVTransferConfig, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"kv_transfer_config must be a KVTransferConfig, a dict or None, got {value!r}")
        unknown = sorted(set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown fields {unknown} (kv_connector, kv_role, "
                             f"kv_connector_extra_config)")
        return cls(**value)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def transfer_plan(src_blocks, src_block_size: int, dst_blocks, dst_block_size: int, start: int,
                  end: int) -> list[tuple[int, int, int]]:
    """The copies that move tokens start .. end - 1 from one engine's slots to another's, each side
    with its own block table and block size: (src_slot, dst_slot, length) runs in token order, each
    as long as both sides' slots stay consecutive (exercise 140)."""
    runs: list[tuple[int, int, int]] = []
    for p in range(start, end):
        s = src_blocks[p // src_block_size] * src_block_size + p % src_block_size
        d = dst_blocks[p // dst_block_size] * dst_block_size + p % dst_block_size
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class SharedStorageConnector:
    """KV through files in a folder that both engines see (vLLM's SharedStorageConnector)."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config, self.block_size = config, block_size
        self.folder = pathlib.Path(config.kv_connector_extra_config["shared_storage_path"])
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_saved = self.num_loaded_tokens = 0

    def path_of(self, req: Request) -> pathlib.Path:
        """The file of this request's prompt (its tokens and cache salt, hashed)."""
        key = hashlib.sha256(repr((req.prompt_ids, req.cache_salt)).encode()).hexdigest()[:32]
        return self.folder / f"{key}.kv"

    # ----- scheduler side -----
    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        """Prompt tokens past `num_computed` this engine can load: whole blocks, never the last token."""
        if not self.config.is_consumer or req.sampling_params.prompt_logprobs is not None:
            return 0
        loadable = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        if loadable <= num_computed or not self.path_of(req).is_file():
            return 0
        return loadable - num_computed

    # ----- worker side -----
    def save_kv(self, req: Request, cache: PagedKVCache) -> None:
        """Write the prompt's K and V (every layer, every prompt token) from their blocks to the file."""
        if not self.config.is_producer or self.path_of(req).is_file():
            return
        n = req.num_prompt_tokens  # the file is one block of n slots: token p at p
        plan = transfer_plan(req.block_ids, cache.block_size, [0], n, 0, n)
        kv = {"k": torch.empty((len(cache.k), n, *cache.k[0].shape[1:]), dtype=cache.k[0].dtype)}
        kv["v"] = torch.empty_like(kv["k"])
        for layer in range(len(cache.k)):
            for src, dst, length in plan:  # one copy per run of consecutive slots
                kv["k"][layer, dst:dst + length] = cache.k[layer][src:src + length]
                kv["v"][layer, dst:dst + length] = cache.v[layer][src:src + length]
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".part")  # whole or not at all: renamed when written
        os.close(fd)
        try:
            torch.save(kv, tmp)
            os.replace(tmp, self.path_of(req))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.num_saved += 1

    def load_kv(self, req: Request, cache: PagedKVCache, start: int, end: int) -> None:
        """Write prompt tokens start .. end - 1's K and V from the file into this request's blocks."""
        kv = torch.load(self.path_of(req), mmap=True, weights_only=True)
        k = kv["k"]
        if k.shape[0] != len(cache.k) or k.shape[2:] != cache.k[0].shape[1:] or k.shape[1] < end or \
                k.dtype != cache.k[0].dtype:
            raise ValueError(f"{self.path_of(req)} holds KV of shape {tuple(k.shape)} in {k.dtype}; this engine "
                             f"needs {len(cache.k)} layers x {end} tokens x {tuple(cache.k[0].shape[1:])} in "
                             f"{cache.k[0].dtype}: another model or dtype wrote it")
        plan = transfer_plan([0], k.shape[1], req.block_ids, cache.block_size, start, end)
        for layer in range(len(cache.k)):
            for src, dst, length in plan:  # one copy per run of consecutive slots
                cache.k[layer][dst:dst + length] = kv["k"][layer, src:src + length]
                cache.v[layer][dst:dst + length] = kv["v"][layer, src:src + length]
        self.num_loaded_tokens += end - start


def make_connector(config: KVTransferConfig | None, block_size: int) -> SharedStorageConnector | None:
    return None if config is None else SharedStorageConnector(config, block_size)
