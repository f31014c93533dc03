"""A prepacked model's layers in one compiled call per step (csrc/decoder.cpp), where they would
otherwise be about nine kernel calls per layer from Python.

The C code calls the same kernels as the layer-by-layer path (mini_llm.Block.step on a prepacked
model with attention_backend="c"), with the same arguments in the same order, so every row gets the
same bits; it only removes the Python between them (argument checks, ctypes calls and tensor
allocations: about 3 ms of a 9 ms batch-1 decode step of the embedded model in bfloat16).

It runs when all of this holds, and the layer-by-layer path runs otherwise, with the same result:
the engine's step (the runner's attention, with attention_backend="c"), a prepacked model (Llama,
Qwen2 or Qwen3) with its fused kernels, whose matmuls run on our kernels ("f32", "bf16_dot", or
"amx" with no padding of K), no gradient, and no torch.profiler running (under the profiler the
layers run one by one, so that it sees each kernel).

The plan (every layer's weight addresses) is made once per model and made again after `prepack`,
`unpack`, `.to()` or an in-place change of any weight it reads (each weight's version counter is
compared at every step). Replacing a parameter by another tensor after `prepack` is not seen: call
`prepack()` again, as for the packed weights themselves.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from . import build, fused
from . import linear as _linear
from . import paged_attention as attention_kernel

SOURCE = build.CSRC / "decoder.cpp"
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class Kernels(ctypes.Structure):
    _fields_ = [(name, P) for name in ("gemm", "norm", "add_norm", "silu_mul", "rope", "qk_norm_rope", "attention",
                                       "leaf_sum", "gemm_leaves")]


class Shape(ctypes.Structure):
    _fields_ = [("layers", I), ("hidden", I), ("inter", I), ("nh", I), ("nkv", I), ("hd", I), ("elem", I),
                ("leaves", I), ("eps", F), ("scale", F), ("final_norm", P)]


class Layer(ctypes.Structure):
    _fields_ = [(name, P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias",
                                       "q_norm", "k_norm")]


class Step(ctypes.Structure):
    _fields_ = [("tokens", I), ("cos", P), ("sin", P), ("slots", P), ("query_start", P), ("num_cached", P),
                ("tables", P), ("num_seqs", I), ("max_blocks", I), ("block_size", I), ("k_caches", P),
                ("v_caches", P), ("work", P), ("threads", I)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decoder_workspace.argtypes = [ctypes.POINTER(Shape), I]
    lib.decoder_workspace.restype = L
    lib.decoder_forward.argtypes = [ctypes.POINTER(Kernels), ctypes.POINTER(Shape), ctypes.POINTER(Layer),
                                    ctypes.POINTER(Step), P, P]
    lib.decoder_forward.restype = None


@functools.cache
def library() -> ctypes.CDLL | None:
    return build.load_if(SOURCE, (), _declare)


def _address(fn) -> int:
    return ctypes.cast(fn, P).value


# PackedWeight.kind -> the library, the function its gemm calls (PackedWeight.gemm's) and the one that
# takes all of a row-parallel layer's leaves (PackedLeaves.gemm's; None: a call per leaf, then leaf_sum).
GEMMS = {"f32": (_linear.f32_library, "gemm_f32", "gemm_leaves_f32"),
         "bf16_dot": (_linear.bf16_dot_library, "gemm_bf16_dot", "gemm_leaves_bf16_dot"),
         "amx": (_linear.amx_library, "gemm_bf16", None)}


# quantization.QuantizedWeight's kinds: gemm_f32.cpp's gemm_quant_layer_<dtype> (the packed argument a
# QuantLayer) and gemm_leaves_quant_<dtype> (a row-parallel layer's parts, each a QuantPack).
QUANTIZED = ("int8", "int4")


def _quantized(pack) -> bool:
    return getattr(pack, "kind", None) in QUANTIZED


def _kernels(dtype: torch.dtype, kind: str) -> Kernels:
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    if kind in QUANTIZED:  # (make_plan checked that the library runs the dtype)
        library_of, function, leaves_function = _linear.f32_library, f"gemm_quant_layer_{name}", f"gemm_leaves_quant_{name}"
    else:
        library_of, function, leaves_function = GEMMS[kind]
    gemm = getattr(library_of(), function)
    gemm_leaves = _address(getattr(library_of(), leaves_function)) if leaves_function else None
    f, a = fused.library(), attention_kernel.library()
    return Kernels(_address(gemm), _address(getattr(f, f"rms_norm_{name}")), _address(getattr(f, f"add_rms_norm_{name}")),
                   _address(getattr(f, f"silu_mul_{name}")), _address(getattr(f, f"rope_{name}")),
                   _address(getattr(f, f"qk_norm_rope_{name}")), _address(getattr(a, f"paged_attention_{name}")),
                   _address(getattr(f, f"leaf_sum_{name}")), gemm_leaves)


class Plan:
    """Everything decoder_forward reads that stays from step to step: the kernels' addresses, the
    shapes, and each layer's weights (held here, so that no address outlives its tensor)."""

    def __init__(self, kernels: Kernels, shape: Shape, layers, held: list[torch.Tensor], watched):
        self.kernels, self.shape, self.held, self.watched = kernels, shape, held, watched
        self.layers = (Layer * len(layers))(*layers)
        self.versions = self._versions()
        self.local = threading.local()  # each thread's workspace (a step's buffers)

    def _versions(self) -> list[int]:
        return [t._version for t in self.watched]

    def current(self) -> bool:
        return self._versions() == self.versions

    def workspace(self, tokens: int) -> torch.Tensor:
        need = library().decoder_workspace(ctypes.byref(self.shape), tokens)
        work = getattr(self.local, "work", None)
        if work is None or work.numel() < need:
            self.local.work = work = torch.empty(need, dtype=torch.uint8)  # as large as the largest step so far
        return work


MAX_LEAVES = 64  # decoder.cpp's


def _leaves(pack) -> int:
    if _quantized(pack):
        return len(pack.leaves) - 1
    return len(pack.packs) if isinstance(pack, _linear.PackedLeaves) else 1


def _padded(pack) -> bool:  # K padded to AMX's slices of 32: the C code passes none
    return pack.padded if isinstance(pack, _linear.PackedLeaves) else getattr(pack, "kp", pack.k) != pack.k


def _product(pack, held: list) -> int:
    """What the decoder's gemm takes for a weight of one part: the packed tensor's address, or a
    quantized weight's QuantLayer (held, with what it points to, as long as the plan)."""
    if _quantized(pack):
        layer, keep = pack.c_layer()
        held += [layer, keep]
        return ctypes.addressof(layer)
    held.append(pack.tensor)
    return pack.tensor.data_ptr()


def _leaf_array(pack):
    """The packed tensors' addresses of a row-parallel layer, leaf by leaf (one for a plain weight);
    the PackedWeights stay held by the model, whose watched weights make a stale plan. Quantized:
    the parts' QuantPacks (for gemm_leaves), or one QuantLayer (one part, for gemm)."""
    if _quantized(pack):
        if len(pack.leaves) > 2:
            addresses, bounds, packs = pack.c_packs()
            addresses.keep = (bounds, packs)
            return addresses
        array = (P * 1)(_product(pack, keep := []))
        array.keep = keep
        return array
    tensors = [p.tensor for p in pack.packs] if isinstance(pack, _linear.PackedLeaves) else [pack.tensor]
    array = (P * len(tensors))(*(t.data_ptr() for t in tensors))
    array.tensors = tensors  # hold them as long as the array
    return array


def make_plan(model) -> Plan | None:
    """The model's plan, or None where the layers cannot run in one call (see the module docstring)."""
    cfg, dtype = model.config, model.dtype
    if (dtype not in (torch.float32, torch.bfloat16) or cfg.head_dim % 2 or library() is None
            or cfg.head_dim > attention_kernel.MAX_HEAD_DIM or cfg.num_attention_heads % cfg.num_key_value_heads):
        return None  # (the layer-by-layer path refuses a head_dim over the kernel's by name)
    if not fused.available(dtype) or not model.prepacked:
        return None
    leaves = cfg.num_key_value_heads
    if leaves > MAX_LEAVES:
        return None
    kinds = set()
    layers, held, watched = [], [], []
    eps = {model.model.norm.eps}
    for block in model.model.layers:
        a, m = block.self_attn, block.mlp
        packs = [getattr(a, "qkv_packed", None), a.o_proj.packed, getattr(m, "gate_up_packed", None), m.down_proj.packed]
        if any(p is None or not p.own or _padded(p) for p in packs) or {_leaves(packs[1]), _leaves(packs[3])} != {leaves}:
            return None
        if not all(getattr(mod, "fused", False) for mod in (a, m, block.input_layernorm, block.post_attention_layernorm)):
            return None
        kinds |= {p.kind for p in packs}
        if not kinds <= GEMMS.keys() | set(QUANTIZED):  # a weight no gemm here takes: layer by layer
            return None
        if kinds & set(QUANTIZED) and _linear.chain_library(dtype) is None:  # QuantizedWeight.gemm's kernels
            return None
        eps |= {block.input_layernorm.eps, block.post_attention_layernorm.eps}
        bias = None
        if a.qkv_bias is not None:
            if dtype == torch.float32 or _quantized(packs[0]):  # (quantized: a float32 bias in both dtypes)
                bias = a.qkv_bias.detach().float().contiguous()
            address = bias.data_ptr() if bias is not None else packs[0]._bias_f32(a.qkv_bias)
            held.append(bias if bias is not None else packs[0]._bias[2])
            watched.append(a.qkv_bias)
        norms = [block.input_layernorm.weight, block.post_attention_layernorm.weight]
        head_norms = [a.q_norm.weight, a.k_norm.weight] if cfg.qk_norm else []
        if cfg.qk_norm:
            eps |= {a.q_norm.eps, a.k_norm.eps}
        if not all(w.is_contiguous() for w in norms + head_norms):
            return None
        leaf_packs = [_leaf_array(packs[1]), _leaf_array(packs[3])]  # the packed weight of each leaf
        held += norms + head_norms + leaf_packs
        watched += norms + head_norms + [a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight]
        layers.append(Layer(*(t.data_ptr() for t in norms), _product(packs[0], held), ctypes.addressof(leaf_packs[0]),
                            _product(packs[2], held), ctypes.addressof(leaf_packs[1]),
                            address if a.qkv_bias is not None else None,
                            *(t.data_ptr() for t in head_norms)))
    final = model.model.norm.weight
    if len(kinds) != 1 or len(eps) != 1 or not final.is_contiguous():
        return None
    held.append(final)
    watched.append(final)
    shape = Shape(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                  cfg.num_key_value_heads, cfg.head_dim, torch.finfo(dtype).bits // 8, leaves, eps.pop(),
                  cfg.head_dim ** -0.5, final.data_ptr())
    return Plan(_kernels(dtype, kinds.pop()), shape, layers, held, watched)


def forward(plan: Plan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            k_caches, v_caches, batch) -> torch.Tensor:
    """The hidden states after the final norm, (T, hidden), for embeddings x (T, hidden) of a step
    whose attention is `batch` (kernels.paged_attention.kernel_batch, checked when it was made)
    over the paged caches (one (slots, nkv, hd) tensor per layer for K and for V)."""
    T, s = x.shape[0], plan.shape
    if len(k_caches) != s.layers or len(v_caches) != s.layers:
        raise ValueError(f"{len(k_caches)} and {len(v_caches)} layers of K and V cache for a model of {s.layers} layers")
    # What the layer-by-layer path checks at each layer, once: the caches of a step are alike (PagedKVCache).
    attention_kernel.check_call((T, s.nh, s.hd), x.dtype, k_caches[0], v_caches[0], batch)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    work = plan.workspace(T)
    pointers = ctypes.c_void_p * s.layers
    ks, vs = pointers(*(t.data_ptr() for t in k_caches)), pointers(*(t.data_ptr() for t in v_caches))  # live past the call
    step = Step(T, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), batch.query_start.data_ptr(),
                batch.num_cached.data_ptr(), batch.block_tables.data_ptr(), len(batch.num_cached),
                batch.block_tables.shape[1], batch.block_size, ctypes.addressof(ks), ctypes.addressof(vs),
                work.data_ptr(), torch.get_num_threads())
    library().decoder_forward(ctypes.byref(plan.kernels), ctypes.byref(plan.shape), plan.layers, ctypes.byref(step),
                              x.data_ptr(), out.data_ptr())
    return out
