"""A tiny Llama GGUF for `megatron convert --from gguf` tests, made with gguf-py from the HF llama
fixture: Q/K rows permuted as llama.cpp's convert_hf_to_gguf.py does, tensors stored as F32, F16,
Q8_0, Q4_0 and Q4_1. Also writes the Hugging Face tensors the conversion must give back:
gguf-py's own dequantization, permutation undone. Usage: .venv-ref/bin/python bench/make_gguf_fixture.py
"""
import os
import numpy as np
import gguf
from gguf.quants import quantize, dequantize
from safetensors.numpy import load_file, save_file

root = os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures")
hf = load_file(os.path.join(root, "hf", "llama", "model.safetensors"))
heads, kv, hd = 4, 2, 8

def permute(w, n):  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

def unpermute(w, n):
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

T = gguf.GGMLQuantizationType
names = {"model.embed_tokens.weight": ("token_embd.weight", T.Q8_0), "model.norm.weight": ("output_norm.weight", T.F32),
         "lm_head.weight": ("output.weight", T.F16)}
for l in range(2):
    for a, b, q in [("input_layernorm.weight", "attn_norm.weight", T.F32),
                    ("post_attention_layernorm.weight", "ffn_norm.weight", T.F32),
                    ("self_attn.q_proj.weight", "attn_q.weight", T.Q4_1), ("self_attn.k_proj.weight", "attn_k.weight", T.Q4_0),
                    ("self_attn.v_proj.weight", "attn_v.weight", T.Q8_0), ("self_attn.o_proj.weight", "attn_output.weight", T.Q4_1),
                    ("mlp.gate_proj.weight", "ffn_gate.weight", T.Q4_1), ("mlp.up_proj.weight", "ffn_up.weight", T.Q4_0),
                    ("mlp.down_proj.weight", "ffn_down.weight", T.F16)]:
        names[f"model.layers.{l}.{a}"] = (f"blk.{l}.{b}", q)
os.makedirs(os.path.join(root, "gguf"), exist_ok=True)
w = gguf.GGUFWriter(os.path.join(root, "gguf", "tiny-llama.gguf"), "llama")
w.add_block_count(2); w.add_context_length(64); w.add_embedding_length(32); w.add_feed_forward_length(48)
w.add_head_count(heads); w.add_head_count_kv(kv); w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-6)
w.add_vocab_size(96)
expected = {}
for name, (gname, qt) in names.items():
    x = hf[name].astype(np.float32)
    if name.endswith("q_proj.weight"):
        x = permute(x, heads)
    elif name.endswith("k_proj.weight"):
        x = permute(x, kv)
    if qt == T.F32:
        w.add_tensor(gname, x); back = x
    elif qt == T.F16:
        h = x.astype(np.float16); w.add_tensor(gname, h); back = h.astype(np.float32)
    else:
        qd = quantize(x, qt); w.add_tensor(gname, qd, raw_dtype=qt); back = dequantize(qd, qt).reshape(x.shape)
    if name.endswith("q_proj.weight"):
        back = unpermute(back, heads)
    elif name.endswith("k_proj.weight"):
        back = unpermute(back, kv)
    expected[name] = np.ascontiguousarray(back.astype(np.float32))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
save_file(expected, os.path.join(root, "gguf", "tiny-llama-expected.safetensors"))
print("wrote", len(expected), "tensors")
