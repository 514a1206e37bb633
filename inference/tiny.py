"""Writes a tiny random-weight Llama in the real formats (GGUF with llama.cpp's Q/K permutation,
and an HF directory with the same weights) for fast tests: `python -m inference.tiny OUT_DIR`."""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from inference.loader import permute_qk
from inference.tokenizer import BYTE_OF_SYMBOL, bpe_from_gguf_vocab

TINY = dict(vocab=0, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, context=2048)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order."""
    return sorted(BYTE_OF_SYMBOL, key=BYTE_OF_SYMBOL.get)


def tiny_vocab():
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a"]
    tokens = SPECIALS + _byte_symbols() + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def tiny_weights(seed: int = 0, **shape) -> tuple[dict[str, np.ndarray], dict]:
    """`shape` overrides TINY's entries, e.g. kv_heads=4 for a multi-head (non-GQA) model."""
    tokens, _, _ = tiny_vocab()
    c = dict(TINY, vocab=len(tokens), **shape)
    rng = np.random.default_rng(seed)
    hd = c["hidden"] // c["heads"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(c["vocab"], c["hidden"]),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(c["heads"] * hd, c["hidden"])
        w[p + "self_attn.k_proj.weight"] = mat(c["kv_heads"] * hd, c["hidden"])
        w[p + "self_attn.v_proj.weight"] = mat(c["kv_heads"] * hd, c["hidden"])
        w[p + "self_attn.o_proj.weight"] = mat(c["hidden"], c["heads"] * hd)
        w[p + "mlp.gate_proj.weight"] = mat(c["intermediate"], c["hidden"])
        w[p + "mlp.up_proj.weight"] = mat(c["intermediate"], c["hidden"])
        w[p + "mlp.down_proj.weight"] = mat(c["hidden"], c["intermediate"])
    return w, c


_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path: Path, weights: dict[str, np.ndarray], c: dict, quant: str = "F32") -> Path:
    """`quant` applies to 2-D weights other than the embedding: F32, F16, Q8_0, Q4_0 or Q4_1."""
    import gguf

    tokens, types, merges = tiny_vocab()
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(c["layers"])
    wr.add_context_length(c["context"])
    wr.add_embedding_length(c["hidden"])
    wr.add_feed_forward_length(c["intermediate"])
    wr.add_head_count(c["heads"])
    wr.add_head_count_kv(c["kv_heads"])
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_chat_template(TEMPLATE)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, arr in weights.items():
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            kind = _GGUF[".".join(rest[:-1])]
            gname = f"blk.{i}.{kind}.weight"
            if kind == "attn_q":
                arr = permute_qk(arr, c["heads"])
            elif kind == "attn_k":
                arr = permute_qk(arr, c["kv_heads"])
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        if arr.ndim == 2 and gname != "token_embd.weight" and quant != "F32":
            if quant == "F16":
                wr.add_tensor(gname, arr.astype(np.float16))
            else:
                wr.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            wr.add_tensor(gname, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def write_hf_dir(path: Path, weights: dict[str, np.ndarray], c: dict) -> Path:
    tokens, types, merges = tiny_vocab()
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, str(path / "model.safetensors"))
    bpe_from_gguf_vocab(tokens, merges, types, "default").save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c["vocab"], hidden_size=c["hidden"],
        intermediate_size=c["intermediate"], num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=c["context"], tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )))
    return path


def write_tiny(out_dir) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights, c = tiny_weights()
    mha_weights, mha = tiny_weights(seed=1, kv_heads=TINY["heads"])
    return {"gguf": write_gguf(out / "tiny.gguf", weights, c),
            "gguf_q8": write_gguf(out / "tiny-q8_0.gguf", weights, c, "Q8_0"),
            "hf": write_hf_dir(out / "tiny-hf", weights, c),
            "hf_mha": write_hf_dir(out / "tiny-mha-hf", mha_weights, mha)}


if __name__ == "__main__":
    for kind, p in write_tiny(sys.argv[1] if len(sys.argv) > 1 else "tiny-model").items():
        print(kind, p)
