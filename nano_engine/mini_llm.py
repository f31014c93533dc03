"""mini_llm: a decoder-only Transformer for the Llama, Qwen2 and Qwen3 families, from scratch.

The whole model in one file, in reading order: config, RMSNorm, rotary embedding, grouped-query
attention, SwiGLU MLP, the block, the model, and `generate`, the single-request reference that
every engine result is compared with, token for token.

Tokens are flat, as in vLLM: a forward pass takes `input_ids` of shape (T,) and their `positions`
(T,), never a padded (B, T) batch. Attention is the only place where tokens of different requests
must not mix, so the model does not decide how it is done: the caller passes an `attend` function
(layer, q, k, v) -> out. `generate` passes one over a contiguous per-request KV cache; the engine's
runner (runner.py) passes one over the paged KV cache. The weights and every other op are shared.

Papers: Llama (arXiv:2302.13971), RoPE (arXiv:2104.09864), GQA (arXiv:2305.13245),
SwiGLU (arXiv:2002.05202), RMSNorm (arXiv:1910.07467). Qwen3 = Llama + RMSNorm on each head of q
and k + an explicit head_dim; Qwen2 = Llama + a bias on q, k and v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .kernels import decoder, fused
from .kernels import paged_attention as attention_kernel
from .kernels.linear import NEEDS, PackedLeaves, PackedWeight, can_prepack, linear, packed_kind
from .parallel.split import Tree, bounds
from .quantization import METHODS as QUANTIZATION_METHODS
from .quantization import DEFAULT_GROUP_SIZE, QuantizedWeight, dequantize, quantize

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear through `linear` above.

    A row-parallel layer (o_proj, down_proj: the ones tensor parallelism splits along K) has
    `leaves`, the K bounds of its parts, one per KV head (parallel/split.py): its output is the sum
    of the parts' products in one fixed tree, in float32 at least, rounded once to the dtype, so
    that ranks holding some of the leaves each can give the same bits as one process holding all.
    With one KV head there is one leaf: the plain product. Where the CPU has a kernel of ours
    (kernels/linear.py), the leaves run on it, packed once (`_leaf_packs`), and all of them with
    their tree sum in one call (`PackedLeaves.gemm`), so that the tree costs one process next to
    nothing. On a tensor-parallel rank (tensor_parallel.py) the layer holds the leaves of `node`
    only, and `reduce` turns its subtree's sum into the whole layer's, with the other ranks' sums."""

    packed: PackedWeight | PackedLeaves | QuantizedWeight | None = None  # Transformer.prepack / quantize
    leaves: tuple[int, ...] | None = None  # K bounds: the layer's leaf i is columns leaves[i] .. leaves[i + 1] - 1
    node: Tree | None = None  # which leaves of the whole layer's tree these are (None: all of them)
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # this node's sum -> the root's (unrounded)

    @property
    def root(self) -> Tree:
        """The node of the tree this layer holds: all of it, except on a tensor-parallel rank."""
        return self.node or Tree(0, len(self.leaves) - 1)

    def forward(self, x):
        if self.leaves is None:
            return linear(x, self.weight, self.bias, self.packed)
        if self.reduce is None and self.node is None and (y := self._one_call(x)) is not None:
            return y
        node = self.root
        parts = self.leaf_products(x, node)
        if self.reduce is not None:  # a rank: its subtree, then the levels above it, with the others
            return self.reduce(leaf_sum(parts, node)).to(x.dtype)
        if fused.available(x.dtype) and (y := fused.leaf_sum(parts)) is not None:  # the same additions, compiled
            return y
        return leaf_sum(parts, node).to(x.dtype)

    def _one_call(self, x: torch.Tensor) -> torch.Tensor | None:
        """All the leaves and their tree sum in one kernel call, where the kernel of the leaves'
        packs takes them (PackedLeaves.gemm): the bits of the leaves one by one, without a call each."""
        if self.bias is not None or x.dim() != 2 or x.dtype != self.weight.dtype or self._grad():
            return None
        if isinstance(self.packed, QuantizedWeight) and self.packed.matches(self.weight):
            return self.packed.gemm(x)  # its integers, its leaves and their tree in one call (quantization.py)
        packs = self._leaf_packs()
        return packs.gemm(x) if isinstance(packs, PackedLeaves) else None

    def _grad(self) -> bool:
        return torch.is_grad_enabled() and self.weight.requires_grad

    def leaf_products(self, x: torch.Tensor, node: Tree) -> list[torch.Tensor]:
        """The products of the leaves of `node` (within this layer's root), each in x's dtype
        (x: all the layer's K columns)."""
        if self.bias is not None:
            raise ValueError("a row-parallel layer with a bias is not supported (vLLM adds it on one rank only)")
        base = self.root.lo  # the layer's leaf i - base is the tree's leaf i
        cols = {i - base: slice(self.leaves[i - base], self.leaves[i - base + 1]) for i in range(node.lo, node.hi)}
        if self._grad():  # slices of the parameter itself, for backward
            return [F.linear(x[:, c], self.weight[:, c]) for c in cols.values()]
        packs = self._leaf_packs()
        if isinstance(packs, PackedLeaves):
            return [linear(x[:, c], self.weight[:, c], None, packs.packs[i]) for i, c in cols.items()]
        return [linear(x[:, c], packs[i]) for i, c in cols.items()]

    def _leaf_packs(self) -> PackedLeaves | list[torch.Tensor]:
        """The leaves' weights as the kernels take them. Transformer.prepack's while current; on the
        plain path, made here once per weight: packed for a kernel of ours where the CPU has one (then
        a rank's leaves and one process's run the same chains, all leaves in one call where the
        kernel takes that: the tree costs a process next to nothing), else each leaf's columns as a
        contiguous copy (oneDNN takes its slow reference kernel for a weight with gaps between its
        rows). Either holds as many numbers as the weight."""
        if isinstance(self.packed, PackedLeaves) and self.packed.matches(self.weight):
            return self.packed
        w = self.weight
        key = (w.data_ptr(), w.dtype, w._version)
        if getattr(self, "_plain_leaves", (None,))[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # usable in and out of inference mode
                w = w.detach()
                if packed_kind(w.dtype) in ("f32", "bf16_dot", "amx"):
                    leaves = PackedLeaves(w, self.leaves)
                else:
                    leaves = [w[:, a:b].contiguous() for a, b in zip(self.leaves, self.leaves[1:])]
                self._plain_leaves = (key, leaves)
        return self._plain_leaves[1]


def leaf_sum(parts: list[torch.Tensor], node: Tree) -> torch.Tensor:
    """The tree's sum of the products of node's leaves, in float32 at least (not rounded back)."""
    work = torch.promote_types(parts[0].dtype, torch.float32)
    return node.sum({(node.lo + i, node.lo + i + 1): p.to(work) for i, p in enumerate(parts)})


def fuse_weights(modules: list[nn.Linear], owner: nn.Module, name: str) -> None:
    """Stack the weights of linear layers that read the same input into one matrix, so that they
    run as one matmul (vLLM's QKVParallelLinear and MergedColumnParallelLinear). The stacked
    weight is a non-persistent buffer of `owner` (it follows .to(), stays out of state_dict), and
    each layer's own weight becomes a view of its rows: no memory is doubled."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if modules[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in modules])
    owner.register_buffer(f"{name}_weight", weight, persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)
    rows = 0
    for m in modules:
        n = m.out_features
        m.weight = nn.Parameter(weight[rows:rows + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[rows:rows + n], requires_grad=False)
        rows += n


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Read a Hugging Face config.json (as a dict)."""
        kind = cfg.get("model_type", "llama")
        if kind not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"model_type {kind!r} is not supported (llama, mistral, qwen2, qwen3)")
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", kind == "qwen2"),
            qk_norm=kind == "qwen3",
            eos_token_id=cfg.get("eos_token_id"),
            model_type=kind,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "fused", False) and (y := fused.rms_norm(x, self.weight, self.eps)) is not None:
            return y  # the prepacked fast path: one compiled pass (kernels/fused.py)
        # x * rsqrt(mean(x^2) + eps) in float32 at least, as Hugging Face does, then cast back and
        # scale; PyTorch's fused rms_norm does the first part in one op instead of five.
        dt = x.dtype
        if dt in (torch.float32, torch.float64):  # no casts to dispatch: fewer ops per layer
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        x = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * x.to(dt)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): the residual stream after a sublayer, and the next
        sublayer's input; one compiled pass on the prepacked fast path, with the same bits."""
        if getattr(self, "fused", False) and (pair := fused.add_rms_norm(x, delta, self.weight, self.eps)) is not None:
            return pair
        x = x + delta
        return x, self(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation frequencies (head_dim/2,), with Llama 3's long-context rescaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc or sc.get("rope_type", sc.get("type")) in (None, "default"):
        return inv
    if sc.get("rope_type", sc.get("type")) != "llama3":
        raise ValueError(f"rope_scaling {sc} is not supported (default or llama3)")
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of each position's angles, (T, head_dim), computed in float32 like HF."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + hd/2) of each head. x: (T, nh, hd); cos, sin: (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if self.nkv > 1:  # leaf i: the query heads that share KV head i
            self.o_proj.leaves = tuple(bounds(self.nh * self.hd, self.nkv))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """q, k and v projections as one matmul (see fuse_weights)."""
        fuse_weights([self.q_proj, self.k_proj, self.v_proj], self, "qkv")

    def forward(self, x, cos, sin, attend: Attend) -> torch.Tensor:
        T, nh, nkv, hd = x.shape[0], self.nh, self.nkv, self.hd
        if getattr(self, "qkv_weight", None) is not None:  # fused: one matmul, one rotation for q and k
            y = linear(x, self.qkv_weight, self.qkv_bias, getattr(self, "qkv_packed", None))
            qk, v = y[:, :(nh + nkv) * hd].view(T, nh + nkv, hd), y[:, (nh + nkv) * hd:].view(T, nkv, hd)
            if not hasattr(self, "q_norm"):
                if not (getattr(self, "fused", False) and fused.rope_(qk, cos, sin)):  # in place, compiled
                    qk = apply_rope(qk, cos, sin)
                q, k = qk[:, :nh], qk[:, nh:]
            elif getattr(self, "fused", False) and fused.qk_norm_rope_(qk, nh, self.q_norm.weight, self.k_norm.weight,
                                                                      self.q_norm.eps, cos, sin):
                q, k = qk[:, :nh], qk[:, nh:]  # each head normalised, then rotated, in place, compiled
            else:
                q, k = apply_rope(self.q_norm(qk[:, :nh]), cos, sin), apply_rope(self.k_norm(qk[:, nh:]), cos, sin)
        else:
            q = self.q_proj(x).view(T, nh, hd)
            k = self.k_proj(x).view(T, nkv, hd)
            v = self.v_proj(x).view(T, nkv, hd)
            if hasattr(self, "q_norm"):  # Qwen3: normalise each head before the rotation
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(self.layer_idx, q, k, v)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.num_key_value_heads > 1:  # as many near-equal leaves as o_proj has
            self.down_proj.leaves = tuple(bounds(cfg.intermediate_size, cfg.num_key_value_heads))

    def fuse(self) -> None:
        """gate and up projections as one matmul (see fuse_weights)."""
        fuse_weights([self.gate_proj, self.up_proj], self, "gate_up")

    def forward(self, x):
        if getattr(self, "gate_up_weight", None) is not None:
            gate_up = linear(x, self.gate_up_weight, packed=getattr(self, "gate_up_packed", None))
            if getattr(self, "fused", False) and (h := fused.silu_mul(gate_up)) is not None:
                return self.down_proj(h)  # the prepacked fast path: one compiled pass (kernels/fused.py)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(silu(gate) * up)
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


SILU_PIECE = 16384  # elements per F.silu call in `silu`: below PyTorch's grain of 32,768, a multiple of 128


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu, with bits that depend on each value only, not on where it sits or on the thread count.

    PyTorch's element-wise loops run vector code over pairs of SIMD registers and scalar code over
    what is left at the end of a call; the two compute exp with different roundings. So a column of
    F.silu(gate) changes its last bit with the width of gate, the number of rows, and the threads
    (which cut the call into pieces, each with its own end): a tensor-parallel rank holding some of
    the MLP's columns, or a request in another batch, would get other bits. Here every value goes
    through the vector code: the flat tensor padded to a multiple of 128 (two registers of any
    dtype), in pieces that one thread runs whole. kernels/fused.py's SwiGLU does the same in one pass."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-n // 128) * 128, dtype=x.dtype)
    padded[:n] = flat
    for a in range(0, len(padded), SILU_PIECE):
        F.silu(padded[a:a + SILU_PIECE], inplace=True)
    return padded[:n].view(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attend: Attend):
        x, delta = self.step(x, None, cos, sin, attend)
        return x + delta

    def step(self, x, pending, cos, sin, attend: Attend):
        """forward, with the residual add at the end left to the caller: (x, delta) for x + delta.
        `pending` is the previous block's delta (None: x is whole), added here together with this
        block's first norm, as vLLM's layers hand each other (hidden_states, residual); on the
        prepacked fast path each add and the norm after it are one compiled pass, same bits."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add(x, pending)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, cos, sin, attend))
        return x, self.mlp(h)


class _Decoder(nn.Module):  # named `model` inside Transformer so HF checkpoint names load as they are
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    _decoder: "decoder.Plan | bool | None" = None  # the one-call path's plan; False: it cannot run; None: not made

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = rope_inv_freq(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend | None = None):
        """Hidden states (T, hidden) after the final norm; `attend` defaults to causal self-attention."""
        attend = attend or causal_attend
        x = self.model.embed_tokens(input_ids)  # (T, D)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if (plan := self._one_call(attend)) is not None:  # the engine's fast path: the same kernels, one call
            paged = attend.plan
            return decoder.forward(plan, x, cos, sin, paged.slot_mapping, attend.cache.k, attend.cache.v, paged.kernel)
        delta = None  # the last block's output not yet added to x (Block.step): x + delta, then the norm
        for block in self.model.layers:
            x, delta = block.step(x, delta, cos, sin, attend)
        return self.model.norm(x) if delta is None else self.model.norm.add(x, delta)[1]

    def _one_call(self, attend) -> "decoder.Plan | None":
        """The plan for running every layer in one compiled call (kernels/decoder.py), where this
        step allows it: the engine's attention with its compiled kernel (attention_backend="c"), no
        gradient, no profiler; None otherwise (and where the model cannot)."""
        if (getattr(getattr(attend, "plan", None), "kernel", None) is None or torch.is_grad_enabled()
                or torch.autograd.profiler._is_profiler_enabled or self._decoder is False):
            return None
        if self._decoder is None or not self._decoder.current():
            self._decoder = decoder.make_plan(self) or False
        return self._decoder or None

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), ...: new tensors, a new plan
        self._decoder = None
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (rows, vocab)

    @classmethod
    def from_pretrained(cls, path=None, dtype: torch.dtype | str = torch.float32,
                        prepack: bool = False) -> "Transformer":
        """Load a Hugging Face folder or a GGUF file; None means $NANO_ENGINE_MODEL or the embedded
        model. `dtype`: torch.float32 / bfloat16 / float16 / float64, or a name ("bf16", ...).
        `prepack`: pack the matmul weights once for their fast kernel (see `prepack`)."""
        from .models.loading import check_weights, load_checkpoint, resolve_dtype, resolve_model_path

        dtype = resolve_dtype(dtype)  # before the load: a wrong dtype must not cost seconds
        if checks.flag("prepack", prepack) and not can_prepack(dtype):
            raise ValueError(f"prepack=True has no kernel for dtype {dtype} on this machine: {NEEDS}")
        path = resolve_model_path(path)
        hf_config, state = load_checkpoint(path)
        cfg = ModelConfig.from_hf(hf_config)
        with torch.device("meta"):
            model = cls(cfg)
        # A tied model's lm_head.weight is the embedding: load_checkpoint leaves it out of `state`.
        check_weights(path, {k: tuple(v.shape) for k, v in model.state_dict().items()
                             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}, state)
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg)
        model.name_or_path = str(path)
        model = model.to(dtype).eval().requires_grad_(False)  # for inference
        model.fuse()
        if prepack:
            model.prepack()
        return model

    def fuse(self) -> "Transformer":
        """Run q/k/v and gate/up as one matmul each: 4 matmuls per layer instead of 7, which
        saves about a fifth of a small batch's matmul time on this CPU."""
        for block in self.model.layers:
            block.self_attn.fuse()
            block.mlp.fuse()
        return self

    def linear_sites(self):
        """(owner, attribute of its packed weight, the weight) for every matmul of a forward pass:
        the fused q/k/v and gate/up where fused, else each projection, and the head."""
        for block in self.model.layers:
            for owner, fused, parts in ((block.self_attn, "qkv", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                        (block.mlp, "gate_up", ("gate_proj", "up_proj", "down_proj"))):
                weight = getattr(owner, f"{fused}_weight", None)
                if weight is not None:
                    yield owner, f"{fused}_packed", weight
                    parts = parts[-1:]
                for name in parts:
                    yield getattr(owner, name), "packed", getattr(owner, name).weight
        if self.lm_head is not None:  # a pipeline stage before the last has none
            yield self.lm_head, "packed", self.lm_head.weight

    @property
    def prepacked(self) -> bool:
        """True when every matmul of a forward pass reads a packed weight that is still current."""
        return all(isinstance(p := getattr(o, a, None), (PackedWeight, PackedLeaves, QuantizedWeight)) and p.matches(w)
                   for o, a, w in self.linear_sites())

    @property
    def quantization(self) -> str | None:
        """The method of the model's quantized weights (Transformer.quantize), or None."""
        kinds = {p.kind for o, a, _ in self.linear_sites() if isinstance(p := getattr(o, a, None), QuantizedWeight)}
        return kinds.pop() if len(kinds) == 1 else None

    def quantize(self, method: str, group_size: int = DEFAULT_GROUP_SIZE) -> "Transformer":
        """Weight-only quantization (quantization.py): every layer's matmul weight stored as "int8"
        (a scale per output row) or "int4" (a scale per group_size columns of a row), dequantized
        inside the matmul kernel, so that a step reads a quarter or an eighth of float32's weight
        bytes. The LM head (the embedding, where tied) keeps its dtype, prepacked where it can be.

        The float weights are replaced by the dequantized ones, rounded to the model's dtype (exact
        in float32), and stay, for the plain path (`unpack`) and for copies of the model; a layer
        reads its integers while its float weight is unchanged. Where the kernels run, the products
        are then those of gemm_f32.cpp's packed kernels on those weights, to the bit, in either dtype
        (in bfloat16 the weights are fl(q * scale) rounded to bfloat16, as stored): the prepacked
        model's, on a CPU without AMX. Irreversible: quantize a copy to keep the original."""
        method = checks.choice("quantization", method, QUANTIZATION_METHODS)
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"quantization runs float32 and bfloat16 models, not {str(self.dtype).removeprefix('torch.')}")
        if self.quantization is not None:
            raise ValueError(f"the model is already quantized ({self.quantization}): quantize the original")
        with torch.no_grad():
            for owner, attr, weight in self.linear_sites():
                if owner is self.lm_head:
                    continue
                qt = quantize(weight, method, group_size)
                weight.copy_(dequantize(qt).to(weight.dtype))
                leaves = getattr(owner, "leaves", None) if attr == "packed" else None
                setattr(owner, attr, QuantizedWeight(qt, weight, leaves))
        if self.lm_head is not None and can_prepack(self.dtype):
            self.lm_head.packed = PackedWeight(self.lm_head.weight)
        self._fuse(fused.available(self.dtype))
        return self

    def prepack(self) -> "Transformer":
        """The fast path (a setting, off by default): pack each matmul's weight once for its kernel,
        as vLLM does on CPU, so that no step pays for it. float32 on a CPU with AVX-512: panels for
        csrc/gemm_f32.cpp, elsewhere oneDNN's blocked layout; bfloat16 on a CPU with AMX: tiles for
        csrc/gemm_amx.cpp, else with AVX512_BF16 panels for gemm_f32.cpp's bfloat16 twin. Our
        kernels give a row the same bits at every row count. Costs a second copy of the matmul
        weights. With them, RMSNorm (with the residual add before it), SwiGLU's silu(gate) * up and
        the rotary embedding run as one compiled pass each (kernels/fused.py), where they can be built.
        The plain path stays the reference: our kernels round otherwise than PyTorch's, and the
        tests check that the engine on packed weights gives the tokens `generate` gives on them."""
        if not can_prepack(self.dtype):
            raise ValueError(f"prepack has no kernel for a {str(self.dtype).removeprefix('torch.')} model on this "
                             f"machine: {NEEDS}")
        for owner, attr, weight in self.linear_sites():
            leaves = getattr(owner, "leaves", None) if attr == "packed" else None
            setattr(owner, attr, PackedWeight(weight) if leaves is None else PackedLeaves(weight, leaves))
        self._fuse(fused.available(self.dtype))
        return self

    def _fuse(self, on: bool) -> None:
        self._decoder = None  # made again at the next step, for the new weights
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = on

    def unpack(self) -> "Transformer":
        """Drop the packed weights and the fused kernels: every layer takes the plain path again."""
        for owner, attr, _ in self.linear_sites():
            setattr(owner, attr, None)
        self._fuse(False)
        return self


ATTENTION_BLOCK = 128  # query rows per block of `attention`


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention scores are computed in.

    float32 and wider: float32 at least, as PyTorch's kernels do. bfloat16 and float16: float64.
    A product of two such numbers is exact in float64 and so, for any realistic spread of
    magnitudes, is a sum of head_dim of them; then no matrix-multiply blocking can change a bit of
    a score. In float32 a score's last bits depend on how many keys share the call (measured here:
    oneDNN takes other code paths at other widths), and after rounding to bfloat16 that can change
    a token. The same holds for probabilities x V, a sum over the keys: a bfloat16 matmul
    accumulates it in float32 in an order that, on CPUs without native bfloat16 (AVX2), depends on
    the padded number of keys, so it too runs in this dtype (the probabilities are rounded to the
    model's dtype first, as PyTorch's kernels would).
    """
    return torch.float64 if dtype in (torch.bfloat16, torch.float16) else torch.promote_types(dtype, torch.float32)


ATTENTION_BACKENDS = ("torch", "c")


def attention(q, k, v, num_cached: int, backend: str = "torch") -> torch.Tensor:
    """Causal attention of q's T new tokens over k, v's L = num_cached + T tokens.

    q: (T, nh, hd); k, v: (L, nkv, hd). Query i sits at position num_cached + i and sees keys 0..that.
    backend "c": the compiled kernel the engine runs with attention_backend="c"
    (kernels/paged_attention.py), over this context as one block: the same bits per row as there.
    The rest of this docstring is about the PyTorch code below.

    Written out rather than PyTorch's scaled_dot_product_attention, for two reasons. Exactness:
    the engine computes a token's attention in different company than `generate` does (a prefill
    cut in chunks, a decode padded into a batch, a recompute after preemption), and the result
    must be the same. In bfloat16 and float16 this formulation gives every query row the same bits
    whatever rows share the call and however many masked keys follow its last visible one (scores
    in float64, see score_dtype), and the engine's batched decode (attention.py) is the same
    sequence of operations; in float32, rows agree to rounding noise (tests/test_attention.py).
    Speed: with a mask (needed as soon as num_cached > 0), SDPA on CPU falls back to its math path
    over the full T x L square. Here queries go in blocks of ATTENTION_BLOCK rows, each against
    the keys it can see only, which skips most of the masked half.

    Precision as in PyTorch's kernels or better: scores and softmax in float32 at least, then the
    probabilities rounded to the model's dtype times V, accumulated in score_dtype.
    Grouped-query attention: the nh / nkv query heads that share a KV head are stacked as rows of
    one matmul against that head's keys, so K and V are never repeated.
    """
    if backend == "c":
        return attention_kernel.contiguous_attention(q, k, v, num_cached)
    T, nh, hd = q.shape
    L, nkv, _ = k.shape
    g, dtype = nh // nkv, q.dtype
    sd, work = score_dtype(dtype), torch.promote_types(dtype, torch.float32)
    qh = q.to(sd).view(T, nkv, g, hd).transpose(0, 1)  # (nkv, T, g, hd)
    kh = torch.empty(nkv, L, hd, dtype=sd).copy_(k.transpose(0, 1))  # head-major, contiguous
    vh = torch.empty(nkv, L, hd, dtype=sd).copy_(v.transpose(0, 1))
    out = torch.empty(T, nh, hd, dtype=dtype)
    for a in range(0, T, ATTENTION_BLOCK):
        b = min(T, a + ATTENTION_BLOCK)
        n, end = b - a, num_cached + b  # rows in the block; keys its last row can see
        scores = torch.bmm(qh[:, a:b].reshape(nkv, n * g, hd), kh[:, :end].transpose(1, 2)).mul_(hd ** -0.5)
        scores = scores.to(work).view(nkv, n, g, end)
        if n > 1:  # row i of the block sees keys 0..num_cached + a + i
            hidden = torch.arange(end)[None, :] > torch.arange(num_cached + a, end)[:, None]  # (n, end)
            scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(dtype).to(sd).view(nkv, n * g, end)
        out[a:b] = torch.bmm(probs, vh[:, :end]).view(nkv, n, g, hd).transpose(0, 1).reshape(n, nh, hd)
    return out


def causal_attend(layer: int, q, k, v):
    return attention(q, k, v, 0)


class ContiguousKVCache:
    """One request's K and V per layer, grown by concatenation: the simple cache `generate` uses."""

    def __init__(self, attention_backend: str = "torch"):
        self.backend = attention_backend
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __len__(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens' K and V (a draft model forgets its refused drafts)."""
        self.k = [t[:length] for t in self.k]
        self.v = [t[:length] for t in self.v]

    def attend(self, layer: int, q, k, v):
        if layer == len(self.k):
            self.k.append(k), self.v.append(v)
        else:
            self.k[layer] = torch.cat((self.k[layer], k))
            self.v[layer] = torch.cat((self.v[layer], v))
        cached = self.k[layer].shape[0] - q.shape[0]
        if self.backend == "c":
            return attention_kernel.contiguous_attention(q, self.k[layer], self.v[layer], cached)
        return attention(q, self.k[layer], self.v[layer], cached)  # the chapters' (an exercise may swap it in)


@torch.inference_mode()
def generate(model: Transformer, input_ids, max_new_tokens: int, eos_token_id=None,
             attention_backend: str = "torch") -> list[int]:
    """Greedy decoding of one request: the reference the engine must equal token for token.

    Returns the new tokens only; stops after eos_token_id (an int or a collection of ints).
    attention_backend: the engine's setting of the same name, to compare with an engine that runs it
    ("auto" resolves as the engine resolves it).
    """
    attention_backend = checks.choice("attention_backend", attention_backend, ("auto", *ATTENTION_BACKENDS))
    attention_backend = attention_kernel.resolve_backend(attention_backend, model.dtype)
    if attention_backend == "c":
        attention_kernel.check_dtype(model.dtype)
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    cache, out = ContiguousKVCache(attention_backend), []
    step = torch.tensor(ids)
    for _ in range(max_new_tokens):
        # Prefill the whole prompt on the first pass, then one token per pass over the cache.
        positions = torch.arange(len(cache), len(cache) + len(step))
        hidden = model(step, positions, cache.attend)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in stop:
            break
        step = torch.tensor([token])
    return out
