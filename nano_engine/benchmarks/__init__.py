"""The load generator, after vllm/benchmarks/: requests over HTTP to any OpenAI-compatible
server (serve.py), the datasets (datasets.py), the metrics and their definitions (metrics.py),
and the sweep report (sweep.py). It talks to a server, never to the engine.
"""
