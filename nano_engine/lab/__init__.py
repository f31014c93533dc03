"""What the chapters and bench/ run on top of the engine: the chapters' experiments
(experiments.py), timing with spreads (measure.py), step timelines (timeline.py), and the map of
our settings to vLLM's (vllm_bridge.py).
"""
