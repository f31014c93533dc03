"""A learner-style solution of exercise 127, written from the statement alone: it passes every case.

The mutants next to it subclass it and break one thing each.
"""

from nano_engine.paged import BlockPool as BaseBlockPool


class BlockPool(BaseBlockPool):
    @property
    def num_free(self):
        return len(self.free_queue)

    def allocate(self, n):
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} are free")
        ids = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            ids.append(b)
        return ids

    def free(self, block_ids):
        block_ids = list(block_ids)
        for b in set(block_ids):
            if block_ids.count(b) > self.ref_count[b]:
                raise RuntimeError(f"block {b} is freed more often than it is held")
        front = []
        for b in block_ids:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    front.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def touch(self, block_ids):
        for b in block_ids:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1
