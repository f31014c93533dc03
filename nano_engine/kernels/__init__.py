"""Kernels below the model: the matmul (linear.py: oneDNN, prepacked weights, batch-invariant row
rules) and the compiled paged attention (paged_attention.py, csrc/). They import nothing from
the rest of nano_engine.
"""
