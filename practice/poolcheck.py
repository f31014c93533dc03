"""Checks for the block pool exercise (127): play a script of pool operations on two pools, and
run the engine on a tiny model with the learner's pool.

`play` runs each operation on nano_engine's BlockPool, then on the learner's, and compares what
came back (ids, errors; the learner's return value as it is, a tuple is not the list asked for)
and the state after it (reference counts, num_free, the free queue's order, which blocks hold a
cached prefix); `_hint` names the mistake behind the first difference in one sentence.
`pool_scripts` draws random scripts for a property case (practice/properties.py), which
`play_random` plays the same way. `check_engine` swaps the learner's pool into LLMEngine, as the exercise's only
change, and compares outputs with single-request generation and decisions with the reference run.
"""

from __future__ import annotations

import random
from collections import Counter

from nano_engine import LLMEngine, SamplingParams, Scheduler, generate
from nano_engine.paged import BlockPool, block_hashes
from nano_engine.tiny import tiny_model

from .endtoend import recording
from .properties import st
from .worker import Mismatch

HASH_BLOCK = 2  # tokens per block in scripts' cache(...) and hashes(...)
SHOWN = 6  # earlier operations listed in a report


def _state(pool):
    return {"ref counts": list(pool.ref_count), "free queue (next out first)": list(pool.free_queue),
            "num_free": pool.num_free, "blocks holding a cached prefix": sorted(pool.cached.values())}


def _env(pool) -> dict:
    return {"__builtins__": {}, "reversed": reversed, "allocate": pool.allocate, "free": pool.free,
            "touch": pool.touch, "lookup": pool.lookup, "hashes": lambda t: block_hashes(t, HASH_BLOCK),
            "cache": lambda ids, t: pool.cache_blocks(ids, block_hashes(t, HASH_BLOCK))}


def _do(env: dict, op: str, ref_error=None, learner=False):
    name, _, expr = op.rpartition(" = ")
    try:
        result = eval(expr, env)  # the judge's own scripts, never the learner's text
    except NotImplementedError:
        raise
    except Exception as e:
        # The learner's unexpected errors keep their traceback (a runtime error in the report).
        if learner and ref_error is None and not isinstance(e, (ValueError, RuntimeError)):
            raise
        if not learner and not isinstance(e, (ValueError, RuntimeError)):
            raise
        return None, e
    if name:
        env[name] = result
    return result, None


def _value(x) -> str:
    """A returned value with its type: `a list [0, 1]`, `a tuple (0, 1)`, `a generator`, `None`."""
    if x is None:
        return "None"
    kind = type(x).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{article} {kind} {x!r}" if isinstance(x, (list, tuple, set, frozenset, dict, int)) else f"{article} {kind}"


def _err(e) -> str:
    return "no error" if e is None else f"{type(e).__name__}: {e}"


def play(pool_cls, num_blocks: int, ops: list[str]) -> None:
    ref_pool, pool = BlockPool(num_blocks), pool_cls(num_blocks)
    ref_env, env = _env(ref_pool), _env(pool)
    done: list[str] = []
    for i, op in enumerate(ops):
        before = _state(ref_pool)
        want, want_err = _do(ref_env, op)
        got, got_err = _do(env, op, want_err, learner=True)
        rows, kind = [], None
        if type(want_err) is not type(got_err):
            rows, kind = [f"  expected {_err(want_err)}", f"  got      {_err(got_err)}"], "error"
        elif not isinstance(got, type(want)):  # the learner's own return value, never converted
            rows, kind = [f"  returned  expected {_value(want)}", f"            got      {_value(got)}"], "type"
        elif want != got:
            rows, kind = [f"  returned  expected {want}", f"            got      {got}"], "result"
        else:
            w, g = _state(ref_pool), _state(pool)
            for key in w:
                if w[key] != g[key]:
                    pad = " " * len(key)
                    rows, kind = [f"  {key}  expected {w[key]}", f"  {pad}  got      {g[key]}"], key
                    break
        if kind:
            head = [f"a pool of {num_blocks} blocks" + (", after:" if done else "")]
            if len(done) > SHOWN:
                head.append(f"  ... ({len(done) - SHOWN} earlier operations)")
            raise Mismatch(*head, *done[-SHOWN:], f"step {i + 1}: {op}", *rows,
                           "hint: " + _hint(op, kind, before, want_err, got_err, pool, ref_pool))
        shown = want if want is not None else want_err and f"raises {type(want_err).__name__}"
        done.append(f"  {op:32} -> {shown}" if shown else f"  {op}")


def _hint(op: str, kind: str, before: dict, want_err, got_err, pool, ref_pool) -> str:
    verb = op.rpartition(" = ")[2].split("(")[0]
    queue = before["free queue (next out first)"]
    if kind == "type":
        if verb in ("free", "touch"):
            return f"{verb} returns nothing (None): it changes the pool, the caller reads the pool's state"
        if verb != "allocate":
            return f"{verb} returns a list, as nano_engine's BlockPool.{verb} does"
        return ("allocate returns the list of the blocks it took (-> list[int]), taken when it is called: the "
                "scheduler extends the request's block table with it")
    stale = [b for b, h in enumerate(pool.block_hash) if h is not None and pool.cached.get(h) != b]
    if stale and kind != "error":
        return (f"a reused block must lose its name in block_hash too (self.block_hash[b] = None), not only in "
                f"self.cached: block {stale[0]} keeps a stale name, so cache_blocks never names it again and free "
                "puts it at the END as if it held a prefix")
    if verb == "allocate":
        if kind == "error" and want_err is not None:
            return (f"allocate(n) with n > num_free (here {before['num_free']} free) must raise ValueError "
                    "and take no block")
        if kind == "error":
            return "allocate(n) fails only when n > num_free"
        if want_err is not None:
            return "check n > num_free before taking any block: a failed allocate changes nothing"
        if kind == "result":
            return (f"allocate hands out blocks from the FRONT of the free queue, least recently freed first "
                    f"(self.free_queue.popitem(last=False)); the free queue before this step was {queue}")
        if kind == "ref counts":
            return "an allocated block starts with reference count 1"
        if kind == "blocks holding a cached prefix":
            return ("a reused block may still hold a cached prefix: forget it (del self.cached[self.block_hash[b]]; "
                    "self.block_hash[b] = None), or a later lookup finds a block whose KV was overwritten")
    if verb == "free":
        if kind == "ref counts" and "reversed(" in op and list(pool.ref_count) == before["ref counts"]:
            return ("free was given an iterator, reversed(...), and dropped no reference: a second loop over an "
                    "iterator (after a first one that checks the counts) finds it empty; make a list of it first")
        if want_err is not None and kind != "error":
            return ("a free that raises must change nothing: check the whole call first, counting repeats (a "
                    "block named twice needs two references), and only then drop references")
        if kind == "error" and want_err is not None and " + " in op:
            return ("this call names a block more often than it is held: it must raise RuntimeError and change "
                    "nothing. Check the whole call first (count each block's repeats against its reference count)")
        if kind == "error" and want_err is not None:
            return ("freeing a block whose reference count is already 0 must raise RuntimeError: a double free "
                    "would put it in the free queue twice and hand it to two requests")
        if kind == "error":
            return "a block can be freed once for each allocate or touch that took it"
        if kind == "ref counts":
            return "free drops one reference per block: self.ref_count[b] -= 1, never straight to 0"
        if kind == "free queue (next out first)":
            busy = [b for b in pool.free_queue if pool.ref_count[b] > 0]
            if busy:
                return (f"a block returns to the free queue only when its reference count drops to 0: block "
                        f"{busy[0]} is still held (count {pool.ref_count[busy[0]]})")
            got, want = list(pool.free_queue), list(ref_pool.free_queue)
            new = [b for b in want if b not in queue]
            named = [b for b in new if ref_pool.block_hash[b] is not None]
            unnamed = [b for b in new if ref_pool.block_hash[b] is None]
            if any(got.index(b) < len(got) - len(named) for b in named if b in got):
                return ("a freed block that holds a cached prefix joins the END of the free queue "
                        "(self.free_queue[b] = None): cached prefixes are evicted last, least recently freed first")
            if any(got.index(b) >= len(unnamed) for b in unnamed if b in got):
                return ("a freed block that holds no prefix (block_hash None) goes to the FRONT of the free queue "
                        "(self.free_queue.move_to_end(b, last=False)): reusing it loses nothing, so it is reused "
                        "before any cached prefix is evicted")
            if got[:len(unnamed)] != unnamed:
                return ("blocks that hold no prefix go to the FRONT in the order given: the first of them is handed "
                        f"out first (expected the front to be {unnamed}); moving each to the front as it comes "
                        "reverses them")
            return ("freed blocks that hold a prefix join the END in the order given: the scheduler passes a "
                    "request's blocks in reverse, so that its tail blocks, the least likely to be shared, go first")
        if kind == "blocks holding a cached prefix":
            return "free keeps a block's cached prefix: it stays findable until allocate reuses the block"
    if verb == "touch":
        if kind == "error":
            return "touch never fails: it takes a reference to blocks that lookup found"
        if kind == "ref counts":
            return "touch takes one more reference to each block: self.ref_count[b] += 1"
        if kind == "free queue (next out first)":
            return ("a touched block that was free (count 0), whether it holds a prefix or not, must leave the "
                    "free queue (del self.free_queue[b]), or allocate would hand it to another request while it "
                    "is in use")
    if kind == "num_free":
        return "num_free is the number of blocks in the free queue: len(self.free_queue)"
    if verb == "lookup":
        return "lookup finds blocks by their prefix names: a block reused by allocate must lose its name"
    return "compare the state after each operation with the statement's rules"


# ----- random scripts (property cases) -----

def prefix_tokens(num_blocks: int, family: int) -> list[int]:
    """Tokens of num_blocks blocks of a prefix family: two runs of one family share their leading blocks."""
    return [10 * family + i for i in range(HASH_BLOCK * num_blocks)]


def _operations() -> list[tuple]:
    """Every operation a script may hold, the simplest first (shrinking moves towards the front), each kind
    repeated to about equal weight. A group index k picks a held group modulo how many are held, so
    that a shrunk list still reads sensibly."""
    ks, ms = range(4), range(1, 5)
    return [("skip",),  # what an operation that does not matter shrinks to: it drops out of the script shown
            *[("allocate", m) for m in ms] * 8,
            *[("allocate_rest", extra) for extra in (0, 1)] * 6,  # every free block, or one too many
            *[("free", k, rev) for k in ks for rev in (True, False)] * 4,  # reversed (as the scheduler does) or not
            *[("cache", k, m, f) for k in ks for m in ms for f in range(3)],  # name m blocks as family f's
            *[("hit", m, k) for k in ks for m in ms] * 2,  # look up a family named before, touch the hit
            *[("share", k, m) for k in ks for m in ms],  # another request takes a held group's first m blocks
            *[("free_again", k) for k in ks] * 3,  # a double free of a group given back before
            *[("free_twice", k) for k in ks],  # a held group named twice in one call
            *[("free_with", k, j) for k in ks for j in range(2)],  # a held group and one given back, in one call
            *[("touch_free", k) for k in ks] * 2]  # a group given back, taken again (named or not)


def pool_scripts():
    """(num_blocks, operations). One draw an operation (sampled from _operations) keeps drawing and
    shrinking fast; script_of skips what cannot be done at that point."""
    return st.tuples(st.integers(1, 8), st.lists(st.sampled_from(_operations()), min_size=12, max_size=40))


def script_of(num_blocks: int, ops) -> list[str]:
    """The script (in play's notation) of these operations, played on nano_engine's pool to skip the
    illegal ones: nothing held to free, name or share, a lookup that finds nothing, a double free that is
    not one. Equal prefix families name equal leading blocks, so a prefix can be named twice."""
    pool = BlockPool(num_blocks)
    held: list[tuple[str, list[int]]] = []  # (expression, blocks) of each reference still to drop
    dropped: list[tuple[str, list[int]]] = []
    out: list[str] = []
    families: list[int] = []  # the prefix families named so far, in order
    count = 0
    for kind, *args in ops:
        if kind == "skip":
            continue
        if kind in ("allocate", "allocate_rest"):
            n = args[0] if kind == "allocate" else pool.num_free + args[0]
            if n == 0:
                continue
            if n > pool.num_free:
                out.append(f"allocate({n})")
                continue
            name, count = f"b{count}", count + 1
            out.append(f"{name} = allocate({n})")
            held.append((name, pool.allocate(n)))
        elif kind == "hit":
            if not families:
                continue
            tokens = prefix_tokens(args[0], families[args[1] % len(families)])
            hit = pool.lookup(block_hashes(tokens, HASH_BLOCK))
            if hit:
                name, count = f"h{count}", count + 1
                out += [f"{name} = lookup(hashes({tokens}))", f"touch({name})"]
                pool.touch(hit)
                held.append((name, hit))
        elif kind in ("free_again", "free_twice", "free_with"):  # only where it is one
            groups = dropped if kind == "free_again" else held
            if groups and (kind != "free_with" or dropped):
                expr, blocks = groups[args[0] % len(groups)]
                if kind == "free_twice":
                    expr, blocks = f"{expr} + {expr}", blocks + blocks
                elif kind == "free_with":
                    other, more = dropped[-1]
                    expr, blocks = (f"{expr} + {other}", blocks + more) if args[1] else (f"{other} + {expr}",
                                                                                         more + blocks)
                if any(pool.ref_count[b] < n for b, n in Counter(blocks).items()):
                    out.append(f"free({expr})")  # it raises, and every pool must be left as it was
        elif kind == "touch_free":
            if dropped:
                i = args[0] % len(dropped)
                expr, blocks = dropped[i]
                if all(pool.ref_count[b] == 0 for b in blocks):  # every block still free (maybe reused since)
                    del dropped[i]
                    out.append(f"touch({expr})")
                    pool.touch(blocks)
                    held.append((expr, blocks))
        elif held:
            i = args[0] % len(held)
            expr, blocks = held[i]
            if kind == "free":
                del held[i]
                out.append(f"free(reversed({expr}))" if args[1] else f"free({expr})")
                pool.free(reversed(blocks) if args[1] else blocks)
                dropped.append((expr, blocks))
                continue
            m = min(args[1], len(blocks))
            part = expr if m == len(blocks) else f"{expr}[:{m}]"
            if kind == "cache":
                f = args[2]
                tokens = prefix_tokens(m, f)
                out.append(f"cache({part}, {tokens})")
                families += [] if f in families else [f]
                pool.cache_blocks(blocks[:m], block_hashes(tokens, HASH_BLOCK))
            else:  # share
                out.append(f"touch({part})")
                pool.touch(blocks[:m])
                held.append((part, blocks[:m]))
    return out


def play_random(pool_cls, value) -> None:
    num_blocks, ops = value
    play(pool_cls, num_blocks, script_of(num_blocks, ops))


# ----- end to end -----

def _run(pool_cls, model, prompts, workload, settings, max_steps):
    """Run the workload; returns the engine, its requests by id and each step's (scheduled, preempted, free)."""
    # The scheduler allocates, frees and touches the learner's pool; the engine caches blocks in it.
    engine = LLMEngine(model, scheduler_cls=recording(Scheduler), block_pool_cls=pool_cls, **settings)
    pending = sorted(range(len(workload)), key=lambda i: workload[i][2])
    reqs, trace = {}, []
    while pending or engine.has_unfinished():
        while pending and workload[pending[0]][2] <= engine.stats.steps:
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=workload[i][1], ignore_eos=True),
                                     request_id=f"r{i}")
            reqs[rid] = engine.requests[rid]
        if engine.stats.steps >= max_steps:
            raise Mismatch(f"requests were still unfinished after {max_steps} steps",
                           "  expected every request to finish, as with nano_engine's pool",
                           "hint: num_free must count the free queue, and free must put blocks back")
        engine.step()
        out = engine.scheduler.last
        trace.append(([(c.request.request_id, c.n, c.kind) for c in out.chunks],
                      [r.request_id for r in out.preempted], engine.block_pool.num_free))
    return engine, reqs, trace


def _first_difference(ref_trace, trace) -> list[str]:
    for step, (a, b) in enumerate(zip(ref_trace, trace)):
        if a != b:
            return [f"step {step}: expected {a[0]}, preempted {a[1]}, {a[2]} free blocks",
                    f"{' ' * len(str(step))}       got      {b[0]}, preempted {b[1]}, {b[2]} free blocks"]
    return []


def check_engine(pool_cls, ref_cls, settings: dict, workload, seed: int = 0, shared_prefix: int = 0) -> None:
    """workload: (prompt length, max_tokens, arrival step) per request; prompts share `shared_prefix` tokens."""
    model = tiny_model(seed)
    rng = random.Random(seed)
    common = [rng.randrange(1, model.config.vocab_size) for _ in range(shared_prefix)]
    prompts = [common + [rng.randrange(1, model.config.vocab_size) for _ in range(n - shared_prefix)]
               for n, _, _ in workload]
    ref, ref_reqs, ref_trace = _run(ref_cls, model, prompts, workload, settings, max_steps=10_000)
    hits = {rid: r.num_cached_tokens for rid, r in ref_reqs.items()}
    assert ref.stats.preemptions > 0 and (any(hits.values()) or not shared_prefix), "the case should preempt and hit"
    engine, reqs, trace = _run(pool_cls, model, prompts, workload, settings, max_steps=3 * ref.stats.steps + 20)
    setting = ", ".join(f"{k}={v}" for k, v in settings.items())
    head = f"the engine({setting}) with your pool, {len(workload)} requests" + (
        f" sharing a {shared_prefix}-token prefix" if shared_prefix else "")
    diff = _first_difference(ref_trace, trace)
    where = ["the first step that differs from the run with nano_engine's pool:", *diff] if diff else []
    for i, (p, (_, m, _)) in enumerate(zip(prompts, workload)):
        want, got = generate(model, p, m), reqs[f"r{i}"].output_ids
        if got != want:
            raise Mismatch(f"{head}: request r{i} differs from generating it alone",
                           f"  expected  {want}", f"  got       {got}",
                           *where,
                           "hint: a block still held by one request was handed to another, or a reused block kept its "
                           "prefix name, so its KV was overwritten: run the scripted cases above first")
    if diff:
        raise Mismatch(f"{head}: outputs are right, but the run differs from the one with nano_engine's pool", *diff,
                       "hint: the scheduler's decisions depend on num_free and on which freed blocks keep their "
                       "prefix: the scripted cases above show which operation differs")
    got_hits = {rid: r.num_cached_tokens for rid, r in reqs.items()}
    if got_hits != hits:
        raise Mismatch(f"{head}: prefix-cache hits (tokens) differ", f"  expected  {hits}", f"  got       {got_hits}",
                       "hint: freed blocks that hold a prefix join the END of the free queue, a request's tail "
                       "first, so shared head blocks are evicted last; blocks that hold none go to the FRONT")
