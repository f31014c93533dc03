"""Tiny model files for the loading and CLI tests, written in milliseconds: a Hugging Face
folder (config.json, safetensors, a word-level tokenizer with a chat template) and a GGUF file
written the way llama.cpp's converter writes one.

The GGUF tensor names are spelled out here from llama.cpp's naming convention
(gguf-py/gguf/constants.py, TENSOR_NAMES), not taken from the loader's table, so that a wrong
entry in the loader's table fails the round trip instead of being copied into the expectation.
"""

import gguf
import numpy as np
import torch
import transformers

# Hugging Face module name -> llama.cpp tensor name (inside model.layers.N -> blk.N).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
CONFIG_CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_hf_model(config_class=transformers.LlamaConfig, **extra):
    """A 2-layer transformers model with random weights (vocabulary 96, hidden 64)."""
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def save_tokenizer(folder):
    """A word-level tokenizer (ids 0-14, inside the tiny vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<user>", "<assistant>"] + [f"w{i}" for i in range(10)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template=CHAT_TEMPLATE).save_pretrained(folder)


def save_hf_folder(folder, config_class=transformers.LlamaConfig, tokenizer=True, **extra):
    """A complete model folder: config.json, model.safetensors and (by default) a tokenizer."""
    model = tiny_hf_model(config_class, **extra)
    model.save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder)
    return model


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face parameter, e.g. model.layers.1.mlp.up_proj.weight ->
    blk.1.ffn_up.weight."""
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
    return f"{GGUF_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"


def llama_cpp_permute(w, n_head):
    # convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch="llama"):
    """A float32 GGUF file of a tiny model, as llama.cpp's converter writes it (no tokenizer);
    returns the Hugging Face state dict it holds, as numpy arrays."""
    # Llama untied with an explicit head_dim, Qwen3 tied, Qwen2 with q/k/v biases.
    extra = {"head_dim": 32, "tie_word_embeddings": arch == "qwen3"} if arch != "qwen2" else {}
    model = tiny_hf_model(CONFIG_CLASSES[arch], **extra)
    hf = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # llama.cpp writes no output.weight then
        hf.pop("lm_head.weight")
    writer = gguf.GGUFWriter(path, arch)
    head_dim = extra.get("head_dim", 16)
    for add, value in [("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 2),
                       ("key_length", head_dim), ("value_length", head_dim), ("vocab_size", 96),
                       ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 1e4),
                       ("bos_token_id", 1), ("eos_token_id", 2)]:
        getattr(writer, f"add_{add}")(value)
    for name, w in hf.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, 4 if "q_proj" in name else 2)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file(), writer.write_kv_data_to_file()
    writer.write_tensors_to_file(), writer.close()
    return hf
