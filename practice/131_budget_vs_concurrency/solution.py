"""Exercise 131: budget vs concurrency. Edit this file, then run

    python practice/judge.py 131

Answer with formulas; the statement is in README.md. The judge runs the real engine (on a tiny
model) for several settings and compares what it measures with what your functions say.

The workload, unless a function says otherwise: `num_requests` requests, each with a 1-token
prompt and `max_tokens` new tokens (ignore_eos), all added before the first step; the engine's
other settings are its defaults (256 KV blocks of 16 tokens: memory is never short).
"""


def max_decodes_per_step(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most requests that decode (get one new token each) in a single step, when many wait."""
    raise NotImplementedError


def steps_to_finish(num_requests: int, max_tokens: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many engine steps it takes until every request of the workload has finished."""
    raise NotImplementedError


def prefill_tokens(num_decoding: int, prompt_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Prompt tokens a newcomer gets in its first step, while num_decoding requests decode.

    num_decoding requests (1-token prompts) were admitted in the step before, so they all decode
    now (num_decoding <= min(max_num_seqs, max_num_batched_tokens)). A request with a
    prompt_len-token prompt has just arrived. How many of its prompt tokens does this step compute?
    """
    raise NotImplementedError


def check_config(max_num_seqs: int, max_num_batched_tokens: int) -> str | None:
    """A warning (naming both numbers) if this configuration cannot decode max_num_seqs requests
    in one step, else None."""
    raise NotImplementedError
