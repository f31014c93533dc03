"""Checks for the eviction-order exercise (134): the learner's admit and release, driven by scripts of
whole requests (admit, decode, finish, preempt) on nano_engine's BlockPool.

Each script is played on two pools in step: the reference functions on one, the learner's on the
other. After every event the returned block table, the reference counts, the free queue's order
and the cached prefixes must agree. At the first difference the report shows the events before
it, both pools' calls, what differs and a hint. The hint comes from replaying the usual mistakes
(allocating before touching the hit, freeing head first, undoing a failed admit...) on a copy of
the pool as it was before the event and seeing which one gives what the learner got.
`random_script` draws scripts from a seed; `request_scripts` draws them with hypothesis for a property
case (practice/properties.py), `play_random` plays one; `check_engine` runs LLMEngine on a tiny model
with the learner's release in the scheduler.
"""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import dataclass

from nano_engine import LLMEngine, SamplingParams, Scheduler, generate
from nano_engine.paged import BlockPool, block_hashes
from nano_engine.tiny import tiny_model

from .properties import st
from .worker import Mismatch

SHOWN = 8  # earlier events listed in a report


class RecordingPool(BlockPool):
    """nano_engine's pool, noting the calls made to it (for the report)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def lookup(self, hashes):
        out = super().lookup(hashes)
        self.calls.append(f"lookup({len(hashes)} hashes) -> {out}")
        return out

    def touch(self, block_ids):
        block_ids = list(block_ids)
        self.calls.append(f"touch({block_ids})")
        super().touch(block_ids)

    def allocate(self, n):
        try:
            out = super().allocate(n)
        except ValueError:
            self.calls.append(f"allocate({n}) -> ValueError")
            raise
        self.calls.append(f"allocate({n}) -> {out}")
        return out

    def free(self, block_ids):
        block_ids = list(block_ids)
        self.calls.append(f"free({block_ids})")
        super().free(block_ids)


# ----- the reference: what the scheduler does (nano_engine/scheduler.py) -----

def admit(pool, hashes, num_blocks):
    """The scheduler's admission: the hit, room for the rest counted before anything is taken."""
    hit = pool.lookup(hashes)
    need = num_blocks - len(hit)
    if need + sum(pool.ref_count[b] == 0 for b in hit) > pool.num_free:
        return None
    pool.touch(hit)
    return hit + pool.allocate(need)


def release(pool, block_ids):
    """Scheduler.free_blocks: the table, tail first."""
    Scheduler.free_blocks(_Holder(pool), _Holder(None, list(block_ids)))


class _Holder:
    def __init__(self, pool, block_ids=None):
        self.pool, self.block_ids = pool, block_ids


# ----- the usual mistakes, replayed to name the learner's -----

def _room(pool, hit, need):
    return need + sum(pool.ref_count[b] == 0 for b in hit) <= pool.num_free


def _allocate_first(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    if not _room(pool, hit, num_blocks - len(hit)):
        return None
    new = pool.allocate(num_blocks - len(hit))
    pool.touch(hit)
    return hit + new


def _no_lookup(pool, hashes, num_blocks):
    return pool.allocate(num_blocks) if num_blocks <= pool.num_free else None


def _allocates_all(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    if not _room(pool, hit, num_blocks):
        return None
    pool.touch(hit)
    return hit + pool.allocate(num_blocks)


def _new_first(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    if not _room(pool, hit, num_blocks - len(hit)):
        return None
    pool.touch(hit)
    return pool.allocate(num_blocks - len(hit)) + hit


def _undo_on_failure(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    pool.touch(hit)
    if num_blocks - len(hit) > pool.num_free:
        pool.free(reversed(hit))
        return None
    return hit + pool.allocate(num_blocks - len(hit))


def _no_touch(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    if not _room(pool, hit, num_blocks - len(hit)):
        return None
    return hit + pool.allocate(num_blocks - len(hit))


ADMIT_MISTAKES = [
    (_allocate_first, "touch the hit BEFORE allocating: allocate takes blocks from the front of the free queue and "
                      "can evict a block you have just found (it is handed out again, its prefix lost)"),
    (_no_lookup, "look up the cached prefix first: hit = pool.lookup(hashes); those blocks are shared (touched), "
                 "only num_blocks - len(hit) are new"),
    (_allocates_all, "allocate only the blocks the hit does not cover: num_blocks - len(hit)"),
    (_new_first, "the block table is the hit blocks first (they hold the prefix, in order), then the new ones"),
    (_undo_on_failure, "a failed admit must leave the pool as it was: decide before touching anything. A free hit "
                       "block touched and freed again moves to the END of the free queue, as if just used"),
    (_no_touch, "touch the hit: each hit block gets one more reference (pool.touch(hit)), and a free one leaves "
                "the free queue, or it could be evicted while this request reads it"),
]


def _forward(pool, block_ids):
    pool.free(list(block_ids))


def _skip_shared(pool, block_ids):
    pool.free([b for b in reversed(list(block_ids)) if pool.ref_count[b] == 1])


def _sorted(pool, block_ids):
    pool.free(sorted(block_ids, reverse=True))


def _one_at_a_time(pool, block_ids):
    for b in reversed(list(block_ids)):
        pool.free([b])


RELEASE_MISTAKES = [
    (_forward, "release frees the table TAIL FIRST, pool.free(reversed(block_ids)): a request's last blocks, the "
               "least likely to be shared, are then evicted first, and its head (a shared system prompt) survives"),
    (_skip_shared, "release drops this request's reference to EVERY block of its table, shared ones too: a block "
                   "another request still holds stays out of the free queue by its reference count alone"),
    (_sorted, "free the table in its own order reversed (the prefix order), not sorted by block id"),
    (_one_at_a_time, "release frees the whole table in ONE call, pool.free(reversed(block_ids)): the blocks that "
                     "name no prefix (the partial tail, a block whose prefix another block already names) go to "
                     "the front in the order given, the tail first; freed one call at a time, each goes ahead of "
                     "the one before, and the tail ends up behind them"),
]


# ----- playing a script -----

@dataclass
class Event:
    kind: str  # "admit", "grow", "finish" or "preempt"
    rid: str
    tokens: tuple = ()  # admit: the request's tokens; grow: the new tokens


def snapshot(pool) -> dict:
    return {"ref counts": list(pool.ref_count), "free queue (next out first)": list(pool.free_queue),
            "cached prefixes (block: prefix)": {b: h for h, b in sorted(pool.cached.items(), key=lambda kv: kv[1])}}


class Play:
    """One script on one pool with one pair of functions."""

    def __init__(self, api, num_blocks, block_size):
        self.api, self.bs = api, block_size
        self.pool = RecordingPool(num_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def do(self, ev: Event):
        """Run the event; returns (what the learner-facing function returned, error or None)."""
        self.pool.calls = []
        if ev.kind == "admit":
            self.tokens[ev.rid] = list(ev.tokens)
            n = len(ev.tokens)
            hashes = block_hashes(list(ev.tokens), self.bs, (n - 1) // self.bs)
            return self._call(self.api.admit, self.pool, list(hashes), math.ceil(n / self.bs))
        if ev.kind == "grow":
            toks = self.tokens[ev.rid]
            toks.extend(ev.tokens)
            table = self.tables[ev.rid]
            table.extend(self.pool.allocate(math.ceil(len(toks) / self.bs) - len(table)))
            self.name(ev.rid)
            return None, None
        table = self.tables.pop(ev.rid)
        return self._call(self.api.release, self.pool, list(table))

    def _call(self, fn, *args):
        try:
            return fn(*args), None
        except NotImplementedError:
            raise
        except (ValueError, RuntimeError) as e:  # raised by the pool on the learner's behalf
            return None, e

    def name(self, rid):
        """The engine's step: full blocks of computed tokens get their prefix names."""
        self.pool.cache_blocks(self.tables[rid], block_hashes(self.tokens[rid], self.bs))


def describe(ev: Event, play: Play) -> str:
    bs = play.bs
    if ev.kind == "admit":
        n, share = len(ev.tokens), ""
        best = max(((_common(ev.tokens, t), rid) for rid, t in play.tokens.items() if rid != ev.rid), default=(0, ""))
        if best[0] == n == len(play.tokens[best[1]]):
            share = f", {best[1]}'s tokens again"
        elif best[0] >= bs:
            share = f", the first {best[0]} as {best[1]}'s"
        return (f"admit {ev.rid}: {n} tokens{share}; admit(pool, {(n - 1) // bs} hashes, "
                f"num_blocks={math.ceil(n / bs)})")
    if ev.kind == "grow":
        return f"{ev.rid} decodes {len(ev.tokens)} token(s), now {len(play.tokens[ev.rid]) + len(ev.tokens)}"
    return f"{ev.kind} {ev.rid}: release(pool, {play.tables.get(ev.rid)})"


def _common(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _show_state(key, value, names) -> str:
    if key.startswith("free queue"):
        return "[" + ", ".join(f"{b} ({names[h]})" if (h := value[1].get(b)) else str(b) for b in value[0]) + "]"
    if key.startswith("cached"):
        return "{" + ", ".join(f"{b}: {names.get(h, h.hex()[:8])}" for b, h in value.items()) + "}"
    return str(value)


def play_script(api, reference_api, num_blocks, block_size, events: list[Event], title: str = "") -> None:
    ref, got = Play(reference_api, num_blocks, block_size), Play(api, num_blocks, block_size)
    names: dict[bytes, str] = {}  # prefix hash -> "r1[:8]", the first request that computed it
    done: list[str] = []
    for k, ev in enumerate(events):
        text = describe(ev, ref)
        before = copy.deepcopy(ref.pool)
        table = list(ref.tables.get(ev.rid, [])) if ev.kind in ("finish", "preempt") else None
        want, want_err = ref.do(ev)
        assert want_err is None, f"the reference failed on its own script at event {k}: {want_err}"
        out, err = got.do(ev)
        rows, what = _compare(ev, want, out, err, ref.pool, got.pool, names)
        if rows:
            head = [f"{title}: " if title else "", f"a pool of {num_blocks} blocks of {block_size} tokens"]
            head = ["".join(head) + (", after:" if done else "")]
            if len(done) > SHOWN:
                head.append(f"  ... ({len(done) - SHOWN} earlier events)")
            calls = [f"  calls to the pool  expected  {'; '.join(ref.pool.calls) or 'none'}",
                     f"                     yours     {'; '.join(got.pool.calls) or 'none'}"]
            raise Mismatch(*head, *done[-SHOWN:], f"event {k + 1}: {text}", *rows, *calls,
                           "hint: " + _hint(ev, what, before, want, out, err, got.pool, block_size, table))
        if ev.kind == "admit" and want is not None:
            ref.tables[ev.rid], got.tables[ev.rid] = list(want), list(out)
            for p in (ref, got):
                p.name(ev.rid)
        for h, b in ref.pool.cached.items():
            if h not in names:
                i = next(i for i, x in enumerate(block_hashes(ref.tokens[ev.rid], block_size)) if x == h)
                names[h] = f"{ev.rid}[:{(i + 1) * block_size}]"
        state = ref.pool
        queue = _show_state("free queue", (list(state.free_queue), {b: h for h, b in state.cached.items()}), names)
        result = f" -> {want}" if ev.kind == "admit" else ""
        done.append(f"  {text}{result}")
        held = ", ".join(f"{b}: {r}" for b, r in enumerate(state.ref_count) if r)
        done.append(f"      free queue {queue}; held (block: ref count) {{{held}}}")


def _compare(ev, want, out, err, ref_pool, pool, labels):
    """Rows that show the first difference, and what differs; ([], None) if none."""
    if err is not None:
        return ([f"  expected  {'None' if ev.kind == 'admit' and want is None else 'no error'}",
                 f"  got       {type(err).__name__}: {err}"], "error")
    if ev.kind == "admit":
        ok = out is None or (isinstance(out, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in out))
        if not ok:  # the learner's own return value, never converted
            kind = type(out).__name__
            return [f"  returned  expected {'None' if want is None else f'a list {want}'}",
                    f"            got      {'an' if kind[:1] in 'aeiou' else 'a'} {kind} {out!r:.80}"], "type"
        if out != want:
            return [f"  returned  expected {want}", f"            got      {out}"], "result"
    names = {h: labels.get(h, h.hex()[:8]) for h in [*ref_pool.cached, *pool.cached]}
    w, g = snapshot(ref_pool), snapshot(pool)
    for key in w:
        if w[key] != g[key]:
            if key.startswith("free queue"):
                wq = _show_state(key, (w[key], w["cached prefixes (block: prefix)"]), names)
                gq = _show_state(key, (g[key], g["cached prefixes (block: prefix)"]), names)
            else:
                wq, gq = _show_state(key, w[key], names), _show_state(key, g[key], names)
            return [f"  {key} after it", f"    expected  {wq}", f"    got       {gq}"], key
    return [], None


def _same(pool, other) -> bool:
    return snapshot(pool) == snapshot(other)


def _hint(ev, what, before, want, out, err, pool, bs, table) -> str:
    mistakes = ADMIT_MISTAKES if ev.kind == "admit" else RELEASE_MISTAKES
    if ev.kind == "admit" and out is None and err is None and _same(before, pool):
        mistakes = []  # a refusal that changed nothing: many mistakes look alike, the numbers tell more
    # A mistake that gives the same result and pool names the learner's; one that also made the same
    # calls to the pool names it better (a small input can make two mistakes look alike).
    for same_calls in (True, False):
        for fn, hint in mistakes:
            trial = copy.deepcopy(before)
            trial.calls = []
            try:
                if ev.kind == "admit":
                    n = len(ev.tokens)
                    res, e = fn(trial, block_hashes(list(ev.tokens), bs, (n - 1) // bs), math.ceil(n / bs)), None
                else:
                    res, e = fn(trial, table), None
            except (ValueError, RuntimeError) as x:
                res, e = None, x
            if (type(e) is type(err)) and (ev.kind != "admit" or res == out) and _same(trial, pool) and (
                    trial.calls == pool.calls or not same_calls):
                return hint
    if ev.kind == "admit":
        n = len(ev.tokens)
        hit = before.lookup(block_hashes(list(ev.tokens), bs, (n - 1) // bs))
        need, free_hits = math.ceil(n / bs) - len(hit), sum(before.ref_count[b] == 0 for b in hit)
        room = (f"here the hit is {hit}, {need} new block(s) + {free_hits} free hit block(s) against "
                f"{before.num_free} free")
        if what == "error" or (want is None and out is not None):
            return ("admit returns None, taking nothing, when need + (hit blocks that are free) > num_free: "
                    "touching a free hit block takes it out of the free queue; " + room)
        if out is None and want is not None:
            return ("the pool can supply this request: the hit needs no new blocks, only its free blocks leave the "
                    "free queue when touched; return None only when need + (free hit blocks) > num_free; " + room)
        if what == "type":
            return "admit returns the block table, a list of block ids, or None"
        if what == "result":
            return "the block table is hit + pool.allocate(num_blocks - len(hit)), the hit touched first; " + room
        if want is None:
            return "a failed admit must change nothing: no touch, no allocate, no free"
        return "admit: lookup, check the room, touch(hit), allocate(num_blocks - len(hit)), nothing else"
    if what == "error":
        return "release drops one reference to each block of the table, once: pool.free(reversed(block_ids))"
    return "release is pool.free(reversed(block_ids)): the pool decides where each freed block goes"


# ----- scripts -----

def random_script(seed: int, num_blocks: int, block_size: int, length: int) -> list[Event]:
    """Requests that share system prompts arrive, are admitted (or not: no room), decode, finish
    and are preempted (the newest running one, when a decode finds no free block), at random."""
    rng = random.Random(seed)
    bs, cap = block_size, (num_blocks - 1) * block_size
    systems = [[rng.randrange(1, 40) for _ in range(rng.randint(1, 3) * bs + rng.randrange(bs))] for _ in range(3)]
    ref = Play(_Ref, num_blocks, bs)
    waiting: deque = deque()
    running: list[str] = []
    finished: list[list[int]] = []
    events: list[Event] = []
    count = 0
    while len(events) < length:
        roll = rng.random()
        if roll < 0.2 or not (waiting or running):
            system = rng.choice(systems)
            for _ in range(rng.choice([1, 1, 2, 3])):  # now and then a burst on one system prompt
                if finished and rng.random() < 0.25:
                    tokens = list(rng.choice(finished))
                else:
                    longest = rng.choice([2 * bs, 2 * bs, cap])  # now and then one that fills most of the pool
                    tokens = system + [rng.randrange(40, 80) for _ in range(rng.randint(0, longest))]
                waiting.append((f"r{count}", tokens[:cap] or [1]))
                count += 1
        elif roll < 0.4 and waiting:
            rid, tokens = waiting[0]
            ev = Event("admit", rid, tuple(tokens))
            events.append(ev)
            table, _ = ref.do(ev)
            if table is not None:
                ref.tables[rid] = table
                ref.name(rid)
                waiting.popleft()
                running.append(rid)
        elif roll < 0.85 and running:
            rid = rng.choice(running)
            new = [rng.randrange(40, 80) for _ in range(rng.randint(1, bs))]
            total = len(ref.tokens[rid]) + len(new)
            if total > cap:
                events.append(Event("finish", rid))
                ref.do(events[-1])
                running.remove(rid)
                finished.append(ref.tokens[rid])
                continue
            need = math.ceil(total / bs) - len(ref.tables[rid])
            while need > ref.pool.num_free and rid in running:
                victim = running.pop()  # the newest: the scheduler's preemption victim
                events.append(Event("preempt", victim))
                ref.do(events[-1])
                waiting.appendleft((victim, ref.tokens[victim]))
            if rid in running:
                events.append(Event("grow", rid, tuple(new)))
                ref.do(events[-1])
        elif running:
            rid = running.pop(rng.randrange(len(running)))
            events.append(Event("finish", rid))
            ref.do(events[-1])
            finished.append(ref.tokens[rid])
    return events


class _Ref:
    admit = staticmethod(admit)
    release = staticmethod(release)


def _request_ops() -> list[tuple]:
    """Every operation of a drawn script, the simplest first (shrinking moves towards the front), each
    kind repeated to about equal weight. k picks a request modulo how many there are of its kind."""
    ks = range(4)
    return [("skip",),  # what an operation that does not matter shrinks to: it drops out of the script shown
            *[("arrive", f, cut, own) for f in (0, 1) for cut in (3, 2, 1, 0) for own in range(4)] * 2,
            *[("again", k) for k in ks] * 8,  # a new request with the tokens of an earlier one
            *[("admit", k) for k in ks] * 6,  # a waiting request, again
            *[("grow", k, n, x) for k in ks for n in (1, 2, 3) for x in (0, 1)] * 2,  # a running one decodes
            *[("finish", k, together) for k in ks for together in (1, 2, 3)] * 3,  # 1 to 3 in a row
            *[("preempt", k) for k in ks] * 3]


def request_scripts():
    """(num_blocks, block_size, operations): one draw an operation keeps drawing and shrinking fast."""
    return st.tuples(st.integers(3, 10), st.integers(1, 4),
                     st.lists(st.sampled_from(_request_ops()), min_size=10, max_size=36))


def events_of(num_blocks: int, block_size: int, ops) -> list[Event]:
    """The events of these operations, played with the scheduler's rules to skip the ones that cannot
    happen at that point (nobody waiting, running or finished; a decode with no free block left).

    A request is the first `cut` blocks of system prompt f less a token or not, and `own` tokens of its
    own from two values, so that equal prompts, and blocks computed twice (one named, its duplicate
    not), come up; a decode appends n equal tokens. "finish" finishes `together` running requests in a
    row, as in a step where several end."""
    bs = block_size
    systems = [[100 * (f + 1) + i for i in range(3 * bs)] for f in (0, 1)]
    ref = Play(_Ref, num_blocks, bs)
    waiting: list[str] = []
    running: list[str] = []
    known: list[str] = []  # every request so far, in order
    events: list[Event] = []
    for kind, *args in ops:
        if kind == "arrive" or kind == "again" and known:  # a new request, admitted at once if it fits
            if kind == "arrive":
                f, cut, own = args
                tokens = systems[f][:max(cut * bs - (own % 2), 0)] + [50 + (own + i) % 2 for i in range(own)]
            else:
                tokens = list(ref.tokens[known[args[0] % len(known)]])
            rid = f"r{len(known)}"
            ref.tokens[rid] = tokens or [50]
            known.append(rid)
            waiting.append(rid)
            kind, args = "admit", [len(waiting) - 1]
        if kind == "admit" and waiting:
            rid = waiting[args[0] % len(waiting)]
            ev = Event("admit", rid, tuple(ref.tokens[rid]))
            events.append(ev)
            table, _ = ref.do(ev)
            if table is not None:
                ref.tables[rid] = table
                ref.name(rid)
                waiting.remove(rid)
                running.append(rid)
        if kind == "grow" and running:
            k, n, x = args
            rid = running[k % len(running)]
            ev = Event("grow", rid, tuple([60 + x] * n))
            if math.ceil((len(ref.tokens[rid]) + n) / bs) - len(ref.tables[rid]) <= ref.pool.num_free:
                events.append(ev)
                ref.do(ev)
        elif kind in ("finish", "preempt") and running:
            for _ in range(args[1] if kind == "finish" else 1):
                if running:
                    rid = running.pop(args[0] % len(running))
                    events.append(Event(kind, rid))
                    ref.do(events[-1])
                    if kind == "preempt":
                        waiting.insert(0, rid)
    return events


def play_random(api, value) -> None:
    num_blocks, block_size, ops = value
    play_script(api, _Ref, num_blocks, block_size, events_of(num_blocks, block_size, ops), "random requests")


def script(*steps) -> list[Event]:
    """Events from tuples: ("admit", rid, tokens), ("grow", rid, tokens), ("finish", rid), ("preempt", rid)."""
    return [Event(s[0], s[1], tuple(s[2]) if len(s) > 2 else ()) for s in steps]


# ----- the engine -----

def check_engine(api, seed: int = 4) -> None:
    """LLMEngine on a tiny model with the learner's release in Scheduler.free_blocks (finishes and
    preemptions), a tight pool and prompts sharing a system prompt: outputs as generating alone,
    the same steps, free blocks and prefix-cache hits as with nano_engine's own."""

    class LearnerRelease(Scheduler):
        def free_blocks(self, req):
            api.release(self.pool, list(req.block_ids))
            req.block_ids = []

    model = tiny_model(seed)
    rng = random.Random(seed)
    v = model.config.vocab_size
    system = [rng.randrange(1, v) for _ in range(10)]
    work = [(system + [rng.randrange(1, v) for _ in range(n)], m, t)
            for n, m, t in ((3, 9, 0), (5, 10, 0), (2, 8, 1), (6, 9, 2), (1, 7, 6), (4, 8, 9), (0, 6, 12))]
    settings = dict(max_num_batched_tokens=16, num_blocks=13, block_size=4)

    def run(cls):
        engine = LLMEngine(model, scheduler_cls=cls, **settings)
        pending, reqs = list(range(len(work))), {}
        while pending or engine.has_unfinished():
            while pending and work[pending[0]][2] <= engine.stats.steps:
                i = pending.pop(0)
                p, m, _ = work[i]
                rid = engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), request_id=f"r{i}")
                reqs[rid] = engine.requests[rid]
            if engine.stats.steps > 500:
                raise Mismatch("requests were still unfinished after 500 steps",
                               "hint: release must give every block of the table back (one reference each)")
            engine.step()
        trace = [(r.step, r.scheduled, r.preempted, r.num_free_blocks) for r in engine.step_log]
        return engine, reqs, trace

    ref_engine, want_reqs, want_trace = run(Scheduler)
    assert ref_engine.stats.preemptions > 0, "the engine case should preempt"
    _, got_reqs, got_trace = run(LearnerRelease)
    head = [f"the engine on a tiny model ({settings['num_blocks']} blocks of 4, budget 16) with your release for "
            f"finishes and preemptions; {len(work)} requests sharing a 10-token system prompt"]
    for i, (p, m, _) in enumerate(work):
        want, got = generate(model, p, m), got_reqs[f"r{i}"].output_ids
        if got != want:
            raise Mismatch(*head, f"r{i} differs from generating it alone", f"  expected  {want}",
                           f"  got       {got}", "hint: a block still held by a request was freed: release drops "
                           "one reference per block, and the pool frees a block only when its count reaches 0")
    for a, b in zip(want_trace, got_trace):
        if a != b:
            raise Mismatch(*head, f"step {a[0]}: expected {a[1]}, preempted {a[2]}, {a[3]} free blocks",
                           f"{' ' * len(str(a[0]))}       got      {b[1]}, preempted {b[2]}, {b[3]} free blocks",
                           "hint: the scripted cases above show which release differs")
    hits = {rid: q.num_cached_tokens for rid, q in want_reqs.items()}
    got_hits = {rid: q.num_cached_tokens for rid, q in got_reqs.items()}
    if hits != got_hits or len(want_trace) != len(got_trace):
        raise Mismatch(*head, "prefix-cache hits (tokens) at admission", f"  expected  {hits}",
                       f"  got       {got_hits}",
                       "hint: release frees the table tail first (pool.free(reversed(block_ids))), so that the "
                       "shared head blocks are evicted last")
