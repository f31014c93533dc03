"""Serving the engine: the async engine thread (async_llm.py), the OpenAI-compatible HTTP server
(server.py, protocol.py), its Prometheus metrics (metrics.py) and a launcher that starts and stops
a server process (launcher.py). After vllm/v1/engine/async_llm.py and vllm/entrypoints/openai/.
"""
