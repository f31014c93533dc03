"""The paged KV cache: a pool of fixed-size blocks, shared by reference count, with prefix caching.

A request's KV does not live in one contiguous buffer sized for its longest possible output; it
lives in blocks of `block_size` token slots, listed in the request's block table, allocated as
the request grows (the PagedAttention idea, arXiv:2309.06180). Blocks are the unit of sharing:
a full block is named by a chained hash of its tokens and of the block before it, so two requests
with the same prefix can point at the same physical block (prefix caching).

Mirrors vLLM V1: `vllm/v1/core/block_pool.py` (BlockPool, FreeKVCacheBlockQueue) and
`vllm/v1/core/kv_cache_utils.py` (hash_block_tokens). As there, a freed block keeps its hash and
stays findable until it is reused; blocks that name nothing are reused first, and cached blocks are
evicted least-recently-freed first.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from . import checks


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Name of a full block: its tokens, its parent's name and extra keys, so equal names mean equal prefixes."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    if extra:
        h.update(b"|" + extra)
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (all full ones by default).

    A `cache_salt` (vLLM's per-request salt) is an extra key of the first block only; the chain
    carries it into every later block, so requests with different salts never share a block.
    """
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    out: list[bytes] = []
    for i in range(n):
        out.append(hash_block(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size],
                              salt if i == 0 else b""))
    return out


@dataclass
class CacheConfig:
    """The KV cache's settings (vLLM's `vllm/config/cache.py`, CacheConfig; `num_blocks` is its
    num_gpu_blocks_override: vLLM sizes the pool from memory unless told)."""

    block_size: int = 16  # token slots per block
    num_blocks: int = 256
    enable_prefix_caching: bool = True

    def __post_init__(self):
        self.block_size = checks.integer("block_size", self.block_size, minimum=1)
        self.num_blocks = checks.integer("num_blocks", self.num_blocks, minimum=1)
        self.enable_prefix_caching = checks.flag("enable_prefix_caching", self.enable_prefix_caching)


class BlockPool:
    """Physical KV blocks: reference counts, a free queue in eviction order, and the prefix cache."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Blocks with ref_count 0, oldest first. Each may still hold a cached prefix.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def reset(self) -> None:
        """Every block free and nothing cached, in place: whoever holds the pool sees it empty
        (LLMEngine.reset_prefix_cache, and a step that failed half-way)."""
        self.ref_count[:] = [0] * self.num_blocks
        self.block_hash[:] = [None] * self.num_blocks
        self.cached.clear()
        self.free_queue.clear()
        self.free_queue.update(OrderedDict.fromkeys(range(self.num_blocks)))

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free ones, including cached ones that would be evicted)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref_count 1), evicting the least recently freed cached ones first."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free} free")
        ids = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:  # evict: its old contents are about to be overwritten
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            ids.append(b)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds rejoins the free queue.

        Where it rejoins decides how long its contents survive. A block that names a cached prefix
        goes to the END (evicted last, least recently freed first); a block that names nothing (a
        partial tail, or any block with caching off) goes to the FRONT, in the order given: reusing
        it loses nothing, so it is reused before any cached block is evicted (vLLM's
        `BlockPool.free_blocks`). Pass a request's blocks in reverse order, as vLLM does: its tail
        blocks (least likely to be shared by another prompt) are then evicted before its head.

        A call that would drop a block below zero holders (a free block, or one named more often than
        it is held) raises before it changes anything: a double free would hand one block to two
        requests, and a half-done free would lose blocks.
        """
        block_ids = list(block_ids)  # it may be an iterator (reversed(...)): read once
        for b, times in Counter(block_ids).items():
            if self.ref_count[b] < times:
                raise RuntimeError(f"block {b} freed more often than it was allocated: {times} time(s) here, "
                                   f"held {self.ref_count[b]} time(s); nothing was freed")
        unnamed = []
        for b in block_ids:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    unnamed.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(unnamed):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix with these chained hashes (none if caching is off)."""
        hit: list[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                hit.append(b)
        return hit

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks found by `lookup` (a free one leaves the free queue)."""
        for b in block_ids:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[bytes], start: int = 0) -> None:
        """Register full blocks block_ids[start:len(hashes)] under their hashes, so later prompts find them."""
        if not self.enable_prefix_caching:
            return
        for i in range(start, len(hashes)):
            b, h = block_ids[i], hashes[i]
            if self.block_hash[b] is not None:
                continue  # already named (a shared hit)
            if h in self.cached:
                continue  # another block already holds this prefix; keep one name per prefix
            self.block_hash[b] = h
            self.cached[h] = b

    def check(self) -> None:
        """Assert the pool's invariants (used by tests)."""
        assert all(r >= 0 for r in self.ref_count)
        assert set(self.free_queue) == {b for b, r in enumerate(self.ref_count) if r == 0}
        assert all(self.block_hash[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.block_hash) == len(self.cached)


class PagedKVCache:
    """K and V for every layer, as blocks of `block_size` token slots.

    k[layer] and v[layer] have shape (num_blocks * block_size, num_kv_heads, head_dim): one row per
    slot, so slot = block_id * block_size + offset addresses a token's KV directly.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.check_fits(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def check_fits(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, where: str = "") -> None:
        """Refuse (ValueError, naming the sizes) a pool larger than memory, before allocating it: K
        and V of every layer. `where` says whose memory, if not this process's alone."""
        num_bytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim
        num_bytes *= torch.empty((), dtype=dtype).element_size()
        checks.fits_in_memory(f"a KV cache of num_blocks={num_blocks} x block_size={block_size} x {num_layers} "
                              f"layers x {num_kv_heads} KV heads x head_dim {head_dim} ({dtype}, K and V{where})",
                              num_bytes)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V (T, nkv, hd) at their slots (T,)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def slots_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of token positions start..end-1 of a sequence with this block table."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
