"""Checks for the prefix-hashing exercise (133): the learner's hash chain and longest cached prefix,
called directly, then plugged into the scheduler and into the engine.

Direct checks compare `hash_chain` with `nano_engine.paged.block_hashes` and `longest_cached_prefix`
with the scheduler's own lookup (`BlockPool.lookup` over `(len - 1) // block_size` hashes); the
first difference is explained in one sentence by trying the usual mistakes on the same input.
`check_play` runs the scheduler without a model on scripted requests that share prefixes (system
prompts, salts, repeats, multi-turn chats), with the learner's functions naming and finding the
blocks; every lookup is checked as it happens, then every step (chunk starts, block tables of the
admitted requests) is compared with the reference run. `check_engine` does the same on the tiny
model, where a wrongly shared block shows as a wrong output token.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from nano_engine import LLMEngine, Request, SamplingParams, Scheduler, SchedulerConfig, generate
from nano_engine.paged import BlockPool, block_hashes, hash_block
from nano_engine.tiny import tiny_model

from .properties import st
from .worker import Mismatch


def salt_key(cache_salt) -> bytes:
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode()


def reference_lookup(token_ids, block_size, cached, cache_salt=None) -> list[int]:
    """The scheduler's admission lookup: BlockPool.lookup over the hashes it may use."""
    limit = max((len(token_ids) - 1) // block_size, 0)
    pool = SimpleNamespace(enable_prefix_caching=True, cached=cached)
    return BlockPool.lookup(pool, block_hashes(token_ids, block_size, limit, cache_salt))


def _short(h) -> str:
    return h.hex()[:8] if isinstance(h, bytes) else repr(h)


def _hashes(hs) -> str:
    return "[" + ", ".join(_short(h) for h in hs) + "]"


def _tokens(t) -> str:
    return str(list(t)) if len(t) <= 24 else f"[{', '.join(map(str, t[:20]))}, ... ({len(t)} tokens)]"


def _call(name, token_ids, block_size, cache_salt, extra="") -> str:
    salt = "" if cache_salt is None else f", cache_salt={cache_salt!r}"
    return f"{name}({_tokens(token_ids)}, block_size={block_size}{extra}{salt})"


# ----- hash_chain -----

LISTS = ("both functions return a list (hash_chain -> list[bytes], longest_cached_prefix -> list[int]), not a {}: "
         "the request keeps its hashes and its block table as lists")


def _shown(x, show=repr) -> str:
    """A learner's return value as it came: a list as `show` writes it, anything else with its type."""
    if isinstance(x, list):
        return show(x)
    if x is None:
        return "None"
    kind = type(x).__name__
    body = "(" + show(list(x))[1:-1] + ("," if len(x) == 1 else "") + ")" if isinstance(x, tuple) else f"{x!r:.80}"
    return ("an " if kind[:1] in "aeiou" else "a ") + f"{kind} {body}"


def expected_got(want, got, show=repr) -> list[str]:
    """The two report rows; where got is not a list, both name their type (`a list [...]`, `a tuple (...)`)."""
    typed = not isinstance(got, list)
    return [f"  expected  {'a list ' if typed else ''}{show(want)}", f"  got       {_shown(got, show)}"]


def chain_hint(token_ids, block_size, cache_salt, want, got) -> str:
    """One sentence naming the mistake behind got != want (want = block_hashes(...))."""
    n, bs = len(token_ids), block_size
    if not isinstance(got, list) and isinstance(got, (tuple, range)) and list(got) == want:
        return LISTS.format(type(got).__name__)
    if not isinstance(got, list) or not all(isinstance(h, bytes) for h in got):
        return "return a list of bytes: one hash_block(parent, tokens, extra) per full block"
    if len(got) != len(want):
        if len(got) == math.ceil(n / bs):
            return (f"only FULL blocks are hashed: {n} tokens make {n // bs} full block(s) of {bs}; the last "
                    f"{n % bs} token(s) are a partial block, never cached, so it has no hash")
        return f"one hash per full block: len(token_ids) // block_size = {n // bs} here"
    i = next(k for k in range(len(want)) if want[k] != got[k])
    block = list(token_ids[i * bs:(i + 1) * bs])
    key = salt_key(cache_salt)
    if i == 0:
        if cache_salt is not None and got[0] == hash_block(None, block):
            return ("the salt is missing: the first block's extra key is b'salt:' + cache_salt.encode(), so requests "
                    "with different salts never share a block")
        if cache_salt is not None and got[0] in (hash_block(None, block, cache_salt.encode()),
                                                 hash_block(None, block, key + b"|")):
            return "the first block's extra key is exactly b'salt:' + cache_salt.encode()"
        extra = "no extra key without a salt" if cache_salt is None else "extra = b'salt:' + cache_salt.encode()"
        return (f"block 0 is hash_block(None, token_ids[0:{bs}], ...) with nano_engine.paged.hash_block, so that "
                f"your hashes are the engine's ({extra})")
    parent = want[i - 1]
    if got[i] in (hash_block(None, block), hash_block(None, block, key)):
        return (f"the hashes are not chained: block {i}'s parent is the hash of block {i - 1}, so equal hashes mean "
                "equal PREFIXES, not only equal blocks (a block's KV depends on every token before it)")
    if cache_salt is not None and got[i] == hash_block(parent, block, key):
        return (f"the salt is an extra key of the FIRST block only (block {i} got it too); later blocks carry it "
                "through their parent's hash")
    return (f"block {i} is hash_block(hash of block {i - 1}, token_ids[{i * bs}:{(i + 1) * bs}]): its parent is the "
            "previous hash, its tokens the next block_size tokens")


def check_chain(api, token_ids, block_size, cache_salt=None, head=()):
    want = block_hashes(token_ids, block_size, cache_salt=cache_salt)
    got = api.hash_chain(list(token_ids), block_size, cache_salt)
    if not isinstance(got, list) or got != want:  # exactly as returned: a tuple is not the list asked for
        rows = expected_got(want, got, _hashes)
        raise Mismatch(*head, _call("hash_chain", token_ids, block_size, cache_salt),
                       rows[0] + f"  ({len(want)} hashes, first 8 hex digits)",
                       rows[1] + (f"  ({len(got)} hashes)" if isinstance(got, (list, tuple)) else ""),
                       "hint: " + chain_hint(token_ids, block_size, cache_salt, want, got))


# ----- longest_cached_prefix -----

def prefix_hint(token_ids, block_size, cached, cache_salt, want, got, hashes=None) -> str:
    """One sentence naming the mistake behind got != want. `hashes`: the chain to look up (the
    learner's own in a play, so that a wrong chain does not read as a wrong lookup)."""
    n, bs = len(token_ids), block_size
    limit = max((n - 1) // bs, 0)
    full = block_hashes(token_ids, bs, cache_salt=cache_salt) if hashes is None else list(hashes)

    def run(hs, stop=True):
        out = []
        for h in hs:
            if h in cached:
                out.append(cached[h])
            elif stop:
                break
        return out

    if not isinstance(got, list) and isinstance(got, (tuple, range)) and list(got) == want:
        return LISTS.format(type(got).__name__)
    if not isinstance(got, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in got):
        if isinstance(got, (list, tuple)) and got and all(isinstance(b, bytes) for b in got):
            return "return the block ids (cached[hash]), not the hashes"
        return "return a list of block ids (int), cached[hash] for each hit block, in order"
    if len(got) > limit and got == run(full):
        return (f"never the block holding the last token: at most (len(token_ids) - 1) // block_size = {limit} "
                "block(s), so that at least the last token is computed and gives the logits")
    if len(got) > len(want) and got[:len(want)] == want and set(got) <= set(cached.values()):
        if got == run(full[:limit], stop=False) or got == run(full, stop=False)[:limit]:
            return ("the run stops at the first block that is not cached: a later block's hash names a prefix "
                    "that includes the missing block, which this request would not have")
        return f"take at most (len(token_ids) - 1) // block_size = {limit} block(s), up to the first miss"
    if cache_salt is not None and got != want and got == run(block_hashes(token_ids, bs, limit)):
        return "look up with the request's salt: hash_chain(token_ids, block_size, cache_salt)"
    if len(got) < len(want) and got == want[:len(got)]:
        if want[len(got)] == 0 and got == list(itertools.takewhile(bool, (cached.get(h) for h in full[:limit]))):
            return ("block 0 is a block id like any other: a hit in block 0 is not a miss; test `h in cached` "
                    "(or `cached.get(h) is None`), not the truth of the id")
        if n % bs and len(got) == n // bs - 1:
            return (f"only the block holding the LAST token is left out: {n} tokens are {n // bs} full block(s) + "
                    f"{n % bs}, the last token is in the partial block, so all {limit} full block(s) can hit: "
                    "(len(token_ids) - 1) // block_size")
        return (f"the hit may be (len(token_ids) - 1) // block_size = {limit} block(s) long: stop only at the "
                "first hash not in cached")
    if sorted(got) == sorted(want):
        return "list the blocks in prefix order: block 0's id first"
    return ("the hit is cached[h] for the hashes of hash_chain(token_ids, block_size, cache_salt), in order, up to "
            "the first hash not in cached, at most (len(token_ids) - 1) // block_size blocks")


def _cache_lines(cached, names) -> list[str]:
    if not cached:
        return ["cached: nothing (an empty cache)"]
    items = [f"{names.get(h, _short(h))} in block {b}" for h, b in sorted(cached.items(), key=lambda kv: kv[1])]
    return ["cached (prefix -> block):"] + ["  " + ", ".join(items[k:k + 6]) for k in range(0, len(items), 6)]


def check_prefix(api, token_ids, block_size, cached, cache_salt=None, names=None, head=()):
    want = reference_lookup(token_ids, block_size, cached, cache_salt)
    got = api.longest_cached_prefix(list(token_ids), block_size, dict(cached), cache_salt)
    if not isinstance(got, list) or got != want:  # exactly as returned: a tuple is not the list asked for
        limit = max((len(token_ids) - 1) // block_size, 0)
        raise Mismatch(*head, *_cache_lines(cached, names or {}),
                       _call("longest_cached_prefix", token_ids, block_size, cache_salt, ", cached"),
                       f"  (its {len(token_ids)} tokens: at most {limit} block(s) may hit)",
                       *expected_got(want, got),
                       "hint: " + prefix_hint(token_ids, block_size, cached, cache_salt, want, got))


def make_cache(prompts, block_size, rng=None, drop=(), ids=None) -> tuple[dict, dict]:
    """Cache every full block of these (tokens, salt) prompts under random block ids (or under `ids`, in
    that order), less the (prompt index, block index) pairs in drop (evicted). Returns (cached, hash ->
    readable name)."""
    cached, names = {}, {}
    if ids is None:
        ids = list(range(100))
        rng.shuffle(ids)
    else:
        ids = list(reversed(ids))  # pop() hands them out in the order given
    for p, (tokens, salt) in enumerate(prompts):
        for i, h in enumerate(block_hashes(tokens, block_size, cache_salt=salt)):
            if h not in cached and (p, i) not in drop:
                cached[h] = ids.pop()
                names[h] = f"P{p}[:{(i + 1) * block_size}]" + ("" if salt is None else f" salt {salt!r}")
    return cached, names


# ----- random inputs (property cases) -----

SALTS = (None, "a", "b", "tenant-7", "café")


@st.composite
def chain_inputs(draw):
    """(token_ids, block_size, cache_salt): k full blocks and a partial tail of 0 .. block_size - 1 tokens,
    the tokens from 3 values, so that equal blocks (after equal or different prefixes) are common."""
    bs = draw(st.integers(1, 4))
    n = bs * draw(st.integers(0, 4)) + draw(st.integers(0, bs - 1))
    return draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), bs, draw(st.sampled_from(SALTS))


@st.composite
def lookup_inputs(draw):
    """(block_size, cached prompts [(tokens, salt)], evicted (prompt, block) pairs, block ids, query, salt).

    The prompts are the first 0 .. 4 blocks of one stock of tokens (less a few) and tokens of their own,
    so they share prefixes of every length, some under salts; a few of their blocks are evicted; the
    block ids are a permutation (shrinking towards 0, 1, 2, ... in the order the blocks were cached).
    The query is a cached prompt and more tokens, less a few at the end, with its own salt or another."""
    bs = draw(st.integers(1, 4))
    stock = draw(st.lists(st.integers(0, 2), min_size=4 * bs, max_size=4 * bs))
    prompts = [(stock[:4 * bs - short] + own, salt) for short, own, salt in draw(st.lists(
        st.tuples(st.integers(0, 4 * bs), st.lists(st.integers(3, 4), max_size=2 * bs), st.sampled_from(SALTS)),
        min_size=1, max_size=3))]
    prompts = [(tokens, salt) for tokens, salt in prompts if tokens] or [(stock, None)]
    drop = draw(st.sets(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=2))
    ids = draw(st.permutations(range(18)))
    base, own_salt = prompts[draw(st.integers(0, 2)) % len(prompts)]
    tokens = base + draw(st.lists(st.integers(3, 5), max_size=2 * bs))
    tokens = tokens[:max(len(tokens) - draw(st.integers(0, 2 * bs)), 1)]
    salt = draw(st.one_of(st.just(own_salt), st.sampled_from(SALTS)))
    return bs, prompts, sorted(drop), ids, tokens, salt


def check_random_lookup(api, value) -> None:
    bs, prompts, drop, ids, tokens, salt = value
    cached, names = make_cache(prompts, bs, drop=drop, ids=ids)
    gone = {}  # the prefixes not in the cache, by the first prompt that has them
    for p, (t, s) in enumerate(prompts):
        for i, h in enumerate(block_hashes(t, bs, cache_salt=s)):
            if h not in cached:
                gone.setdefault(h, f"P{p}[:{(i + 1) * bs}]")
    evicted = ", ".join(gone.values())
    head = [f"blocks of {bs} token(s); every full block of these prompts was cached"
            + (f", less the evicted {evicted}" if evicted else "") + f" (P0[:{2 * bs}] is P0's first {2 * bs} tokens):"]
    head += [f"  P{p} = {_tokens(t)}" + ("" if s is None else f", salt {s!r}") for p, (t, s) in enumerate(prompts)]
    check_prefix(api, tokens, bs, cached, salt, names, head=head)


# ----- the scheduler with the learner's functions -----

@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    step: int = 0  # added before this step's schedule()
    salt: str | None = None
    outputs: list[int] = field(default_factory=list)  # the tokens it will "sample" (no model)
    note: str = ""  # how its prompt was made, for the report


class _Hashes(list):
    """Hashes handed from the scheduler's hashes() to the pool's lookup(), with their request."""
    request = None


def learner_scheduler(api, log: list, block_size: int):
    """A Scheduler whose hashes come from api.hash_chain and whose lookups from api.longest_cached_prefix.

    The admission calls `pool.lookup(self.hashes(req, k))`: the hashes carry their request, and the
    pool asks the learner. Each lookup is checked against the pool's state as it happens; the first
    wrong one is logged and raised.
    """

    class LearnerHashing(Scheduler):
        def hashes(self, req, num_blocks):
            chain = api.hash_chain(list(req.all_token_ids), self.block_size, req.cache_salt)
            if not isinstance(chain, list) or not all(isinstance(h, bytes) for h in chain):  # as returned
                tokens = list(req.all_token_ids)
                want = block_hashes(tokens, self.block_size, cache_salt=req.cache_salt)
                raise Mismatch(_call("hash_chain", tokens, self.block_size, req.cache_salt)
                               + f" (the hashes of {req.request_id})", *expected_got(want, chain, _hashes),
                               "hint: " + chain_hint(tokens, self.block_size, req.cache_salt, want, chain))
            out = _Hashes(chain[:num_blocks])
            out.request = req
            return out

    class LearnerLookup(BlockPool):
        bs = block_size

        def lookup(self, hashes):
            req = getattr(hashes, "request", None)
            if req is None or not self.enable_prefix_caching:
                return super().lookup(hashes)
            tokens, cached = list(req.all_token_ids), dict(self.cached)
            got = api.longest_cached_prefix(tokens, self.bs, cached, req.cache_salt)
            mine = api.hash_chain(tokens, self.bs, req.cache_salt)  # a list: hashes() has checked it
            want = BlockPool.lookup(self, mine[:max((len(tokens) - 1) // self.bs, 0)])
            if not isinstance(got, list) or got != want:  # exactly as returned
                log.append((req, tokens, dict(self.cached), want, got, list(mine)))
                raise _WrongLookup()
            return got

    return LearnerHashing, LearnerLookup


class _WrongLookup(Exception):
    pass


@dataclass
class StepRecord:
    scheduled: list  # (rid, start, n)
    preempted: list
    tables: dict  # rid -> block table, for requests admitted in this step


def play(reqs: list[Req], block_size: int, num_blocks: int, budget: int, api=None, max_steps=500):
    """Run the requests through the scheduler (no model) the way the engine does; returns the steps,
    the requests by id and the log of wrong lookups (with api: the learner's functions in place)."""
    log: list = []
    if api is None:
        sched_cls, pool = Scheduler, BlockPool(num_blocks)
    else:
        sched_cls, pool_cls = learner_scheduler(api, log, block_size)
        pool = pool_cls(num_blocks)
    s = sched_cls(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), pool, block_size)
    made, steps = {}, []
    last = max(r.step for r in reqs)
    for t in range(max_steps):
        for r in reqs:
            if r.step == t:
                made[r.rid] = Request(r.rid, list(r.prompt), SamplingParams(max_tokens=r.max_tokens),
                                      arrival_time=float(len(made)), seq=len(made), cache_salt=r.salt)
                s.add_request(made[r.rid])
        if t > last and not s.has_unfinished():
            break
        before = {rid for rid, q in made.items() if q in s.running}
        try:
            out = s.schedule()
        except _WrongLookup:
            return steps, made, log, t
        steps.append(StepRecord([(c.request.request_id, c.start, c.n) for c in out.chunks],
                                [q.request_id for q in out.preempted],
                                {q.request_id: list(q.block_ids) for q in s.running if q.request_id not in before}))
        spec = {r.rid: r for r in reqs}
        for c in out.chunks:  # what the engine does after the forward pass
            q = c.request
            q.num_computed = c.start + c.n
            pool.cache_blocks(q.block_ids, s.hashes(q, q.num_computed // block_size), c.start // block_size)
            if q.num_computed == q.num_tokens:
                q.output_ids.append(spec[q.request_id].outputs[len(q.output_ids)])
                if len(q.output_ids) >= q.sampling_params.max_tokens:
                    s.finish(q, "length")
    return steps, made, log, None


def describe(reqs: list[Req], block_size, num_blocks, budget) -> list[str]:
    lines = [f"the scheduler (budget {budget} tokens) on {num_blocks} KV blocks of {block_size} tokens, requests:"]
    for r in reqs:
        salt = "" if r.salt is None else f", salt {r.salt!r}"
        at = f", arrives at step {r.step}" if r.step else ""
        lines.append(f"  {r.rid}: {len(r.prompt)} tokens ({r.note or 'its own'}){salt}, max_tokens {r.max_tokens}{at}")
    return lines


def _fmt(sched) -> str:
    return ", ".join(f"{rid} {start}..{start + n - 1}" for rid, start, n in sched) or "nothing"


def check_play(api, reqs: list[Req], block_size: int, num_blocks: int, budget: int, label: str = "") -> None:
    head = ([label] if label else []) + describe(reqs, block_size, num_blocks, budget)
    want_steps, want_reqs, _, _ = play(reqs, block_size, num_blocks, budget)
    got_steps, got_reqs, log, stopped = play(reqs, block_size, num_blocks, budget, api, max_steps=len(want_steps) + 1)
    if log:
        req, tokens, cached, want, got, mine = log[0]
        limit = max((len(tokens) - 1) // block_size, 0)
        raise Mismatch(*head, f"step {stopped}: admitting {req.request_id} ({len(tokens)} tokens"
                       + (f", {len(tokens) - req.num_prompt_tokens} of them its own output after a preemption"
                          if len(tokens) > req.num_prompt_tokens else "") + f"), the cache holds {len(cached)} blocks",
                       _call("longest_cached_prefix", tokens, block_size, req.cache_salt, ", cached"),
                       f"  (at most {limit} block(s) may hit)",
                       *expected_got(want, got),
                       "hint: " + prefix_hint(tokens, block_size, cached, req.cache_salt, want, got, mine))
    for k, (e, g) in enumerate(zip(want_steps, got_steps)):
        if (e.scheduled, e.preempted, e.tables) != (g.scheduled, g.preempted, g.tables):
            rows = [f"step {k}: scheduled (request first..last token)",
                    f"  expected  {_fmt(e.scheduled)}" + (f"; preempted {e.preempted}" if e.preempted else ""),
                    f"  got       {_fmt(g.scheduled)}" + (f"; preempted {g.preempted}" if g.preempted else "")]
            if e.tables != g.tables:
                rows += [f"  block tables of the admitted: expected {e.tables}", f"{' ' * 31}got      {g.tables}"]
            bad = next((r for r in reqs if block_hashes(r.prompt, block_size, cache_salt=r.salt)
                        != api.hash_chain(list(r.prompt), block_size, r.salt)), None)
            hint = (f"your lookups agree with the cache, but the cache named other blocks: hash_chain of {bad.rid}'s "
                    "prompt differs from the engine's block_hashes (see the hash_chain cases)" if bad else
                    "a request starts at its hit: len(longest_cached_prefix(...)) * block_size tokens")
            raise Mismatch(*head, *rows, "hint: " + hint)
    if len(got_steps) != len(want_steps):
        raise Mismatch(*head, f"the reference run took {len(want_steps)} steps, yours {len(got_steps)}",
                       "hint: a request starts at its hit, and every step computes at least its last token")
    hits = {rid: q.num_cached_tokens for rid, q in want_reqs.items()}
    got_hits = {rid: q.num_cached_tokens for rid, q in got_reqs.items()}
    if hits != got_hits:
        raise Mismatch(*head, "num_cached_tokens (the hit at first admission)", f"  expected  {hits}",
                       f"  got       {got_hits}", "hint: the hit is len(longest_cached_prefix(...)) * block_size")


# ----- workloads -----

def _outputs(rng, n) -> list[int]:
    return [rng.randrange(1, 60) for _ in range(n)]


def random_workload(seed: int, block_size: int, num_requests: int = 10) -> list[Req]:
    """System prompts (not block-aligned), exact repeats, multi-turn chats, salts, at random."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 4) * block_size + rng.randrange(block_size))]
               for _ in range(2)]
    reqs: list[Req] = []
    step = 0
    for i in range(num_requests):
        step += rng.randint(0, 3)
        roll, salt = rng.random(), rng.choice([None, None, "a", "b"])
        m = rng.randint(1, 2 * block_size + 1)
        if roll < 0.2 and reqs:  # the same prompt again
            src = rng.choice(reqs)
            prompt, note, salt = list(src.prompt), f"{src.rid}'s prompt again", rng.choice([src.salt, src.salt, "c"])
        elif roll < 0.4 and reqs:  # the next turn of a chat: the conversation so far, then the new message
            src = rng.choice(reqs)
            own = _outputs(rng, rng.randint(1, 2 * block_size))
            prompt = src.prompt + src.outputs + own
            note, salt = f"{src.rid}'s prompt + its {len(src.outputs)} outputs + {len(own)}", src.salt
        elif roll < 0.85:
            k = rng.randrange(2)
            own = _outputs(rng, rng.randint(0, 3 * block_size))
            prompt, note = systems[k] + own, f"system prompt S{k} ({len(systems[k])}) + {len(own)}"
            if not prompt:
                prompt, note = [1], "one token"
        else:
            prompt, note = _outputs(rng, rng.randint(1, 4 * block_size)), ""
        reqs.append(Req(f"r{i}", prompt, m, step=step, salt=salt, outputs=_outputs(rng, m), note=note))
    return reqs


# ----- the engine -----

def check_engine(api, seed: int, block_size: int = 4, num_blocks: int = 20, budget: int = 16) -> None:
    """The engine on the tiny model with the learner's hashing: outputs as generating alone, same
    steps and hits as with nano_engine's own. Prompts: a shared system prompt, a salted pair, a
    repeat, a second turn."""
    model = tiny_model(seed)
    rng = random.Random(seed)
    v = model.config.vocab_size
    system = [rng.randrange(1, v) for _ in range(3 * block_size + 2)]
    own = [[rng.randrange(1, v) for _ in range(rng.randint(1, 2 * block_size))] for _ in range(4)]
    first = system + own[0]
    turn2 = first + generate(model, first, 6) + own[3]
    # (prompt, max_tokens, arrival step, salt, note)
    work = [(first, 6, 0, None, "system prompt + own"), (system + own[1], 5, 0, None, "same system prompt + own"),
            (system + own[2], 5, 3, "alice", "same system prompt, salt 'alice'"),
            (system + own[2], 4, 9, "alice", "r2's prompt again, salt 'alice'"),
            (system + own[2], 4, 9, "bob", "r2's prompt again, salt 'bob'"),
            (list(first), 3, 12, None, "r0's prompt again"), (turn2, 4, 14, None, "r0's second turn"),
            (system[block_size:] + own[1], 4, 16, None, "the system prompt less its first block + own")]

    def run(with_learner: bool):
        settings = dict(max_num_batched_tokens=budget, num_blocks=num_blocks, block_size=block_size)
        log: list = []
        if with_learner:
            sched_cls, pool_cls = learner_scheduler(api, log, block_size)
        else:
            sched_cls, pool_cls = Scheduler, None
        engine = LLMEngine(model, scheduler_cls=sched_cls, block_pool_cls=pool_cls, **settings)
        pending, reqs = list(range(len(work))), {}
        while pending or engine.has_unfinished():
            while pending and work[pending[0]][2] <= engine.stats.steps:
                i = pending.pop(0)
                p, m, _, salt, _ = work[i]
                rid = engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), request_id=f"r{i}",
                                         cache_salt=salt)
                reqs[rid] = engine.requests[rid]
            if engine.stats.steps > 400:
                raise Mismatch("requests were still unfinished after 400 steps",
                               "hint: a request starts at its hit and computes at least its last token")
            try:
                engine.step()
            except _WrongLookup:
                req, tokens, cached, want, got, mine = log[0]
                raise Mismatch(f"the engine on a tiny model, step {engine.stats.steps}: admitting "
                               f"{req.request_id} ({len(tokens)} tokens)",
                               _call("longest_cached_prefix", tokens, block_size, req.cache_salt, ", cached"),
                               *expected_got(want, got),
                               "hint: " + prefix_hint(tokens, block_size, cached, req.cache_salt, want, got, mine))
        return reqs, [(r.step, r.scheduled, r.preempted) for r in engine.step_log]

    want_reqs, want_trace = run(False)
    got_reqs, got_trace = run(True)
    head = [f"the engine on a tiny model ({num_blocks} blocks of {block_size}, budget {budget}), requests:"] + [
        f"  r{i}: {len(p)} tokens ({note}), max_tokens {m}" + (f", arrives at step {t}" if t else "")
        for i, (p, m, t, _, note) in enumerate(work)]
    for i, (p, m, *_rest) in enumerate(work):
        want, got = generate(model, p, m), got_reqs[f"r{i}"].output_ids
        if got != want:
            raise Mismatch(*head, f"r{i} differs from generating it alone", f"  expected  {want}", f"  got       {got}",
                           "hint: a block was shared between prompts that differ before it: its KV was computed "
                           "after another prefix (hashes must be chained, and salted in the first block)")
    hits = {rid: q.num_cached_tokens for rid, q in want_reqs.items()}
    got_hits = {rid: q.num_cached_tokens for rid, q in got_reqs.items()}
    if hits != got_hits or want_trace != got_trace:
        raise Mismatch(*head, "prefix-cache hits (tokens) at admission", f"  expected  {hits}",
                       f"  got       {got_hits}",
                       "hint: outputs are right but the cache found other prefixes than the engine's own: compare "
                       "hash_chain with block_hashes (salt, chaining, full blocks only)")
