"""A learner-style solution of exercise 131, written from the statement alone: it passes every case.

The mutants next to it reuse three functions and break the fourth.
"""


def max_decodes_per_step(max_num_seqs, max_num_batched_tokens):
    return min(max_num_seqs, max_num_batched_tokens)  # a decode costs one token of the budget


def steps_to_finish(num_requests, max_tokens, max_num_seqs, max_num_batched_tokens):
    wave = min(max_num_seqs, max_num_batched_tokens)
    waves = -(-num_requests // wave)
    return waves * max_tokens  # the 1-token prefill samples the first token: max_tokens steps a wave


def prefill_tokens(num_decoding, prompt_len, max_num_seqs, max_num_batched_tokens):
    if num_decoding >= max_num_seqs:
        return 0  # no room to admit it
    return min(prompt_len, max_num_batched_tokens - num_decoding)  # decodes first, the rest chunked


def check_config(max_num_seqs, max_num_batched_tokens):
    if max_num_batched_tokens >= max_num_seqs:
        return None
    return (f"max_num_batched_tokens={max_num_batched_tokens} is below max_num_seqs={max_num_seqs}: "
            f"at most {max_num_batched_tokens} requests decode per step")
