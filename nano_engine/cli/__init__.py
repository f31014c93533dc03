"""The command line, `python -m nano_engine ...`: the top layer, which may import every other.

main.py: the identity check (no subcommand) and the dispatch; serve.py: the OpenAI-compatible
server; bench_serve.py: the load generator; vllm_args.py: the vLLM command with the same settings;
common.py: what they share (argument types, one-line errors and exit statuses).
"""
