"""Kernels below the model, each giving a row the same bits in any batch: the matmul (linear.py:
weights prepacked for our AVX-512 and AMX kernels, oneDNN elsewhere), the paged attention
(paged_attention.py), RMSNorm (alone or with the residual add), SwiGLU's middle and the rotary
embedding (fused.py); and decoder.py, which runs a prepacked model's layers, all of them, in one
call of these kernels per engine step. The C++ sources
are in csrc/ (simd.h: the 16-lane arithmetic they share), built for this CPU on first use by
build.py. They import nothing from the rest of nano_engine.
"""
