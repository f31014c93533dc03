"""mini_llm against Hugging Face transformers on tiny random Llama, Qwen2 and Qwen3 checkpoints."""

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from nano_engine import mini_llm
from nano_engine.models.loading import ModelLoadError
from nano_engine.mini_llm import (ModelConfig, PackedWeight, RMSNorm, Transformer, generate, linear,
                                  rope_inv_freq)
from nano_engine.tiny import tiny_model

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=True),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # larger weights than the default init, so greedy tokens vary
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf = hf.to(torch.float64).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = Transformer.from_pretrained(folder, dtype=torch.float64)
    return hf, ours


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    mine = ours.compute_logits(ours(ids, torch.arange(40)))
    # cos/sin are computed in float32 on both sides, so agreement is ~1e-7, not 1e-15.
    assert torch.allclose(mine, ref, rtol=1e-5, atol=1e-5), (mine - ref).abs().max()


def test_greedy_tokens_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(2))
    ref = hf.generate(ids[None], attention_mask=torch.ones(1, 11, dtype=torch.long), max_new_tokens=16,
                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, 11:]
    assert torch.equal(torch.tensor(generate(ours, ids, 16)), ref)


def test_kv_cache_decode_equals_full_recompute(tiny):
    """generate's cached decode gives the logits of a full forward pass over the whole sequence."""
    ids = torch.randint(1, 64, (9,), generator=torch.Generator().manual_seed(3))
    out = generate(tiny, ids, 6)
    full = torch.cat((ids, torch.tensor(out[:-1])))
    logits = tiny.compute_logits(tiny(full, torch.arange(len(full))))
    assert logits[len(ids) - 1:].argmax(-1).tolist() == out


def test_generate_stops_at_eos(tiny):
    ids = [5, 6, 7]
    first = generate(tiny, ids, 1)[0]
    assert generate(tiny, ids, 10, eos_token_id=first) == [first]
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, [], 4)


@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (1536, 576), (1152, 576)])
def test_bfloat16_linear_gives_each_row_the_bits_it_gets_alone(shape):
    """The property the engine's bfloat16 identity rests on: a row's product does not depend on
    how many rows share the call (oneDNN's one-row kernel rounds differently, so mini_llm.linear
    never calls it)."""
    from nano_engine.mini_llm import linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen).bfloat16()
    x = torch.randn(100, shape[1], generator=gen).bfloat16()
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(len(x))])
    for rows in (2, 3, 17, 32, 33, 40, 65, 100):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead", [(1,), (5,), (40,), (1, 3), (2, 3)])
def test_linear_is_x_times_w_transposed_plus_the_bias(dtype, lead):
    """Every path of `linear` (oneDNN for float32, one row as two and chunks of HALF_ROWS for the
    half types, F.linear for the rest and for 3-d inputs) against float64 arithmetic, bias included."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(*lead, 16, generator=gen)
    w, b, x = w.to(dtype), b.to(dtype), x.to(dtype)
    want = (x.double() @ w.double().T + b.double()).to(dtype)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    for bias in (b, None):
        got = linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (*lead, 24)
        ref = want if bias is not None else (x.double() @ w.double().T).to(dtype)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linear_never_runs_one_row_or_more_than_half_rows(dtype, monkeypatch):
    """The rule behind the test above it, seen directly: on a CPU where oneDNN's one-row and
    many-row kernels happen to round alike, the bits alone cannot show it is kept."""
    rows, real = [], torch.nn.functional.linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    w = torch.ones(8, 4, dtype=dtype)
    for n, calls in ((1, [2]), (2, [2]), (32, [32]), (33, [32, 2]), (70, [32, 32, 6])):
        rows.clear()
        linear(torch.ones(n, 4, dtype=dtype), w)
        assert rows == calls, n


def test_linear_keeps_the_gradient_when_one_is_wanted():
    """oneDNN's float32 op has no backward: with a weight that wants a gradient, F.linear runs."""
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(6, 4))


# ----- the parts a forward pass does not show: config reading, loading, fusing, packing -----

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_from_hf_fills_in_what_a_config_leaves_out():
    cfg = ModelConfig.from_hf(BASE)
    assert cfg == ModelConfig(97, 64, 128, 2, 4, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6,
                              rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192,
                              tie_word_embeddings=False, attention_bias=False, qk_norm=False, eos_token_id=None,
                              model_type="llama")
    assert type(cfg.head_dim) is int  # hidden_size // heads: a float head_dim breaks every reshape


def test_from_hf_reads_each_field_it_is_given():
    given = dict(BASE, model_type="qwen2", num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=5e5,
                 max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False, eos_token_id=[1, 2])
    assert ModelConfig.from_hf(given) == ModelConfig(
        97, 64, 128, 2, 4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None,
        max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        eos_token_id=[1, 2], model_type="qwen2")
    # q/k/v biases: Qwen2's default, anyone's when asked for
    kinds = {kind: ModelConfig.from_hf(dict(BASE, model_type=kind)) for kind in ("llama", "qwen2", "qwen3", "mistral")}
    assert {k: (c.model_type, c.attention_bias, c.qk_norm) for k, c in kinds.items()} == {
        "llama": ("llama", False, False), "qwen2": ("qwen2", True, False), "qwen3": ("qwen3", False, True),
        "mistral": ("mistral", False, False)}
    assert ModelConfig.from_hf(dict(BASE, attention_bias=True)).attention_bias is True
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(dict(BASE, model_type="gpt2"))
    assert str(e.value) == "model_type 'gpt2' is not supported (llama, mistral, qwen2, qwen3)"


@pytest.mark.parametrize("fields, theta, scaling", [
    ({"rope_theta": 5e5}, 5e5, None),
    ({"rope_scaling": LLAMA3}, 10000.0, LLAMA3),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, 5e5, LLAMA3),
    # transformers 5 writes rope_parameters: the theta, and the scaling unless it is the default
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None),
    ({"rope_parameters": {"rope_theta": 1e6}}, 1e6, None),
    ({"rope_parameters": {**LLAMA3, "rope_theta": 5e5}}, 5e5, {**LLAMA3, "rope_theta": 5e5}),
])
def test_from_hf_reads_rope_from_either_place(fields, theta, scaling):
    cfg = ModelConfig.from_hf(dict(BASE, **fields))
    assert (cfg.rope_theta, cfg.rope_scaling) == (theta, scaling)


def test_rope_scaling_of_the_default_type_under_either_key_is_no_scaling():
    plain = rope_inv_freq(ModelConfig.from_hf(BASE))
    for sc in ({"type": "default"}, {"rope_type": "default"}, {"type": None}, {}):
        cfg = ModelConfig.from_hf(BASE)
        cfg.rope_scaling = sc
        assert torch.equal(rope_inv_freq(cfg), plain), sc
    cfg.rope_scaling = {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
    assert not torch.equal(rope_inv_freq(cfg), plain)  # the old key still names the type
    cfg.rope_scaling = {"type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling .* is not supported"):
        rope_inv_freq(cfg)


ROPE_FIELDS = dict(BASE, hidden_size=256, rope_theta=5e5)  # head_dim 64: wavelengths 6.3 to 2.3e5


def llama3_pair(scaling):
    """rope_inv_freq and transformers' own llama3 frequencies for ROPE_FIELDS with this scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = transformers.LlamaConfig(**ROPE_FIELDS, rope_parameters={**scaling, "rope_theta": 5e5})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    return rope_inv_freq(ModelConfig.from_hf(dict(ROPE_FIELDS, rope_scaling=scaling))), want.float()


@pytest.mark.parametrize("lo, hi", [(1.0, 4.0), (2.0, 8.0), (0.5, 3.0)])
def test_llama3_rope_frequencies_are_transformers(lo, hi):
    """Llama 3's rescaling against transformers' own, with factors other than Llama 3.1's 1 and 4."""
    ours, want = llama3_pair(dict(LLAMA3, low_freq_factor=lo, high_freq_factor=hi))
    wavelen = 2 * math.pi / rope_inv_freq(ModelConfig.from_hf(ROPE_FIELDS))  # before the rescaling
    assert ((wavelen > 64 / hi) & (wavelen < 64 / lo)).any()  # some frequencies are in the smoothed band
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)


def test_llama3_rope_at_the_band_edges_is_transformers():
    """Factors chosen so that two wavelengths fall exactly on the smoothed band's edges: the edge
    at old_len / low_freq_factor belongs to the band (where the smoothing meets inv / factor)."""
    plain = rope_inv_freq(ModelConfig.from_hf(ROPE_FIELDS))
    wavelen = 2 * math.pi / plain
    ours, want = llama3_pair(dict(LLAMA3, low_freq_factor=64 / float(wavelen[10]),
                                  high_freq_factor=64 / float(wavelen[3])))
    assert ours[10] == plain[10] / 8 and ours[3] == plain[3]  # the edges: inv / factor, inv
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)


def test_llama3_rope_factors_left_out_are_llama_3_1s():
    omitted = {k: v for k, v in LLAMA3.items() if not k.endswith("_freq_factor")}
    cfgs = [ModelConfig.from_hf(dict(BASE, rope_scaling=sc)) for sc in (omitted, LLAMA3)]
    assert torch.equal(rope_inv_freq(cfgs[0]), rope_inv_freq(cfgs[1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_divides_by_the_root_mean_square_plus_its_eps(dtype):
    """Over the last dimension only (Qwen3's q/k norms get (T, heads, head_dim)), in either path:
    float32 and wider in one fused op, the half types through float32 and back."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -1.0, 2.0]]], dtype=torch.float64)  # (1, 2, 4)
    norm = RMSNorm(4, eps=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    norm = norm.to(dtype)
    assert norm.eps == 0.5
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 0.5) * norm.weight.double()
    got = norm(x.to(dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, want", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                         (torch.bfloat16, torch.float64), (torch.float16, torch.float64)])
def test_attention_scores_are_float32_at_least_and_float64_for_the_half_types(dtype, want):
    assert mini_llm.score_dtype(dtype) == want


def test_the_contiguous_cache_length_is_the_tokens_it_holds():
    cache = mini_llm.ContiguousKVCache()
    assert len(cache) == 0
    kv = torch.zeros(3, 2, 4)
    cache.attend(0, kv[:, :1].repeat(1, 2, 1), kv, kv)  # one layer: the length is layer 0's
    assert len(cache) == 3
    cache.attend(0, kv[:1].repeat(1, 2, 1), kv[:1], kv[:1])
    assert len(cache) == 4


SMALL = dict(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=4)


def small_config(**kw):
    return ModelConfig(**SMALL, **kw)


def test_every_norm_has_the_configs_eps():
    """A norm left at torch's own eps (rms_norm's eps=None) moves the logits by less than any
    tolerance; only the eps itself shows it."""
    model = Transformer(small_config(rms_norm_eps=0.25, qk_norm=True))
    norms = {name: m.eps for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 2 * 4 + 1 and set(norms.values()) == {0.25}, norms


@pytest.mark.parametrize("bias, qk_norm", [(False, False), (True, False), (False, True)])
def test_fuse_stacks_the_weights_in_buffers_and_keeps_each_weight_a_view(bias, qk_norm):
    """The unfused model is the reference here: the fused one, which is what from_pretrained
    gives, is checked against transformers above."""
    torch.manual_seed(0)
    model = Transformer(small_config(attention_bias=bias, qk_norm=qk_norm)).double().eval().requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([3, 1, 4, 1, 5])
    plain = model.compute_logits(model(ids, torch.arange(5)))
    model.fuse()
    for i, block in enumerate(model.model.layers):
        for owner, fused, parts in ((block.self_attn, "qkv", ("q_proj", "k_proj", "v_proj")),
                                    (block.mlp, "gate_up", ("gate_proj", "up_proj"))):
            prefix = f"model.layers.{i}.{'self_attn' if fused == 'qkv' else 'mlp'}"
            stacked = getattr(owner, f"{fused}_weight")
            assert torch.equal(stacked, torch.cat([before[f"{prefix}.{p}.weight"] for p in parts]))
            stacked_bias = getattr(owner, f"{fused}_bias")
            if bias and fused == "qkv":
                assert torch.equal(stacked_bias, torch.cat([before[f"{prefix}.{p}.bias"] for p in parts]))
            else:
                assert stacked_bias is None
            for p in parts:  # each projection's weight reads the stacked rows: no second copy
                for kind, whole in (("weight", stacked), ("bias", stacked_bias)):
                    t = getattr(getattr(owner, p), kind)
                    if t is None:
                        continue
                    assert isinstance(t, nn.Parameter) and not t.requires_grad
                    assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                    assert torch.equal(t, before[f"{prefix}.{p}.{kind}"]), (prefix, p, kind)
    # The stacked buffers stay out of the state dict, which keeps Hugging Face's names and values
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.allclose(model.compute_logits(model(ids, torch.arange(5))), plain, rtol=1e-12, atol=1e-12)


def test_onednn_linear_is_there_on_this_torch_and_is_checked_before_use(monkeypatch):
    """The pinned torch CPU wheel ships oneDNN: float32 takes its path (kernels/linear.py). A build
    whose oneDNN op is missing, fails or disagrees with F.linear gets the plain path."""
    from nano_engine.kernels import linear as kernels_linear

    assert kernels_linear._has_onednn_linear() is True and kernels_linear.ONEDNN_FP32 is True
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *rest: real(x, w, *rest) + 1)
    assert kernels_linear._has_onednn_linear() is False

    def fails(*args):
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fails)
    assert kernels_linear._has_onednn_linear() is False
    monkeypatch.setattr(torch, "ops", SimpleNamespace(mkldnn=SimpleNamespace()))
    assert kernels_linear._has_onednn_linear() is False


def test_linear_sites_are_every_matmul_of_a_forward_pass():
    model = tiny_model(seed=1, dtype=torch.float32)
    want = []
    for b in model.model.layers:
        a, m = b.self_attn, b.mlp
        want += [(getattr(a, n), "packed", getattr(a, n).weight) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        want += [(getattr(m, n), "packed", getattr(m, n).weight) for n in ("gate_proj", "up_proj", "down_proj")]
    want.append((model.lm_head, "packed", model.lm_head.weight))

    def same(got, expected):
        return len(got) == len(expected) and all(o is o2 and a == a2 and w is w2
                                                 for (o, a, w), (o2, a2, w2) in zip(got, expected))

    assert same(list(model.linear_sites()), want)
    model.fuse()
    want = []
    for b in model.model.layers:
        a, m = b.self_attn, b.mlp
        want += [(a, "qkv_packed", a.qkv_weight), (a.o_proj, "packed", a.o_proj.weight),
                 (m, "gate_up_packed", m.gate_up_weight), (m.down_proj, "packed", m.down_proj.weight)]
    want.append((model.lm_head, "packed", model.lm_head.weight))
    assert same(list(model.linear_sites()), want)


@pytest.mark.parametrize("fused", [False, True])
def test_prepack_packs_every_site_keeps_the_tokens_and_unpack_drops_them(fused, monkeypatch):
    model = tiny_model(seed=1, dtype=torch.float32)
    if fused:
        model.fuse()
    ids = [5, 6, 7, 8]
    plain = generate(model, ids, 12)
    assert not model.prepacked
    assert model.prepack() is model and model.prepacked
    for owner, attr, weight in model.linear_sites():
        packed = getattr(owner, attr)
        assert isinstance(packed, PackedWeight) and packed.matches(weight)
    calls, real = [], mini_llm.linear

    def spy(x, weight, bias=None, packed=None):
        calls.append((weight, packed))
        return real(x, weight, bias, packed)

    monkeypatch.setattr(mini_llm, "linear", spy)
    assert generate(model, ids, 12) == plain
    # each matmul ran as the sites say (fused q/k/v and gate/up where fused), on its packed weight
    sites = [w for _, _, w in model.linear_sites()]
    first = [w for w, _ in calls[:len(sites)]]  # the prompt's forward pass, in order
    assert len(first) == len(sites) and all(a is b for a, b in zip(first, sites))
    assert all(isinstance(p, PackedWeight) and p.matches(w) for w, p in calls)
    monkeypatch.undo()
    assert model.unpack() is model and not model.prepacked
    assert all(getattr(owner, attr) is None for owner, attr, _ in model.linear_sites())
    assert generate(model, ids, 12) == plain
    with pytest.raises(ValueError) as e:
        tiny_model(dtype=torch.float64).prepack()
    assert str(e.value).startswith("prepack needs a float32 model; this one is torch.float64 ")


def test_a_packed_weight_is_used_only_while_its_weight_is_unchanged():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=gen)
    packed = PackedWeight(w)
    assert packed.matches(w) and not packed.matches(w.clone())
    assert not packed.matches(w.double()) and not packed.matches(w[:12])
    x = torch.randn(3, 16, generator=gen)
    assert torch.allclose(linear(x, w, packed=packed), x @ w.T, rtol=1e-5, atol=1e-5)
    w.mul_(2)  # in place: same storage and shape, a new version
    assert not packed.matches(w)
    assert torch.allclose(linear(x, w, packed=packed), x @ w.T, rtol=1e-5, atol=1e-5)  # the stale one is not read
    model = tiny_model(seed=1, dtype=torch.float32).prepack()
    with torch.no_grad():
        model.lm_head.weight.add_(0)
    assert not model.prepacked  # one stale site is enough


def write_folder(folder, cfg_fields, state):
    import json

    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_fields))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def small_checkpoint(**fields):
    cfg = dict(model_type="llama", **SMALL, **fields)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(cfg))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    return cfg, state


def test_from_pretrained_loads_an_inference_model_fused_and_named(tmp_path):
    cfg, state = small_checkpoint()
    folder = write_folder(tmp_path / "m", cfg, state)
    model = Transformer.from_pretrained(folder, dtype=torch.float64)
    assert model.name_or_path == str(folder) and model.dtype == torch.float64 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.layers[0].self_attn.qkv_weight is not None and not model.prepacked
    assert all(torch.equal(model.state_dict()[k], v.double()) for k, v in state.items())
    assert Transformer.from_pretrained(folder, prepack=True).prepacked
    with pytest.raises(ValueError) as e:
        Transformer.from_pretrained(folder, dtype="bf16", prepack=True)
    assert str(e.value) == "prepack=True needs dtype float32, got torch.bfloat16"
    with pytest.raises(TypeError) as e:
        Transformer.from_pretrained(folder, prepack="yes")
    assert str(e.value) == "prepack='yes' must be True or False, got str"


def test_a_tied_checkpoint_loads_with_or_without_a_head_of_its_own(tmp_path):
    cfg, state = small_checkpoint(tie_word_embeddings=True)
    for name, extra in (("bare", {}), ("with_head", {"lm_head.weight": torch.zeros(16, 8)})):
        model = Transformer.from_pretrained(write_folder(tmp_path / name, cfg, {**state, **extra}))
        assert model.lm_head.weight is model.model.embed_tokens.weight, name
        assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"]), name


@pytest.mark.parametrize("edit, says", [
    (lambda s: [s.pop(f"model.layers.{i}.self_attn.q_proj.weight") for i in (0, 1)],
     "missing model.layers.0.self_attn.q_proj.weight, model.layers.1.self_attn.q_proj.weight"),
    (lambda s: [s.pop(k) for k in ("model.norm.weight", "model.layers.1.mlp.up_proj.weight",
                                   "model.layers.0.mlp.up_proj.weight")],
     "missing model.layers.0.mlp.up_proj.weight, model.layers.1.mlp.up_proj.weight, ..."),
    (lambda s: s.update({"extra.weight": torch.zeros(2)}), "unexpected extra.weight"),
    (lambda s: s.update({"model.norm.weight": torch.ones(9)}), "model.norm.weight is (9,), the config says (8,)"),
    (lambda s: (s.pop("model.norm.weight"), s.update({"a.weight": torch.zeros(1), "b.weight": torch.zeros(1),
                                                       "c.weight": torch.zeros(1)})),
     "missing model.norm.weight; unexpected a.weight, b.weight, ..."),
])
def test_weights_that_do_not_match_the_config_are_named(tmp_path, monkeypatch, edit, says):
    cfg, state = small_checkpoint()
    edit(state)
    folder = write_folder(tmp_path / "m", cfg, state)
    with pytest.raises(ModelLoadError) as e:
        Transformer.from_pretrained(folder)
    assert str(e.value) == f"{folder}: the weights do not match config.json: {says}"
    # A GGUF file's config is its metadata
    from nano_engine.models import loading
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(loading, "resolve_model_path", lambda path: gguf)
    monkeypatch.setattr(loading, "load_checkpoint", lambda path: (cfg, dict(state)))
    with pytest.raises(ModelLoadError) as e:
        Transformer.from_pretrained(gguf)
    assert str(e.value) == f"{gguf}: the weights do not match the GGUF metadata: {says}"


def test_prepack_without_onednn_says_so(monkeypatch):
    monkeypatch.setattr(mini_llm, "ONEDNN_FP32", False)
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(RuntimeError) as e:
        model.prepack()
    assert str(e.value) == "prepack needs PyTorch's oneDNN (torch.backends.mkldnn), which this build lacks"
    assert not model.prepacked
