"""Model files: a Hugging Face folder or a GGUF file checked, read and turned into a config dict
and a state dict (loading.py, gguf.py, files.py), and the tokenizer. Below the model: they import
nothing from nano_engine but checks.
"""
