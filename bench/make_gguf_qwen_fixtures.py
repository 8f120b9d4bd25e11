"""Tiny Qwen2, Qwen3 and Llama GGUFs for `megatron convert --from gguf` tests, with transformers'
logits.

Each model is a random transformers Qwen2ForCausalLM (q/k/v biases, tied embeddings) or
Qwen3ForCausalLM (q_norm/k_norm, head_dim 16 apart from hidden 48 / 4 heads, untied), written as
llama.cpp's convert_hf_to_gguf.py writes these architectures: tensor names from gguf-py's own
TensorNameMap, no Q/K row permutation (only its LlamaModel permutes), the hyperparameters its
TextModel.set_gguf_parameters writes (key_length/value_length where config.json has head_dim).
Tensors are F32 except the embedding (F16, so a dequantization is on the path) and the logits
are transformers' own on the F16-rounded embedding.
Also a Qwen3 with YaRN (the rope.scaling.* keys llama.cpp writes) and a Llama with Llama 3.1's
rope scaling (llama.cpp's rope_freqs tensor of per-frequency divisors, Q/K rows permuted).
Writes crates/megatron-training/tests/fixtures/gguf/tiny-{qwen2,qwen3,qwen3_yarn,llama3_rope}.gguf and
qwen_reference.safetensors (input_ids and each model's fp32 logits).
Usage: .venv-ref/bin/python bench/make_gguf_qwen_fixtures.py   (needs torch, transformers, gguf)
"""
import math, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import numpy as np
import torch
import gguf
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

root = os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "gguf")
V = 96
cases = {
    "qwen2": (gguf.MODEL_ARCH.QWEN2, Qwen2ForCausalLM(Qwen2Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False))),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=48,
        head_dim=16, intermediate_size=40, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        use_sliding_window=False, attention_bias=False))),
    # YaRN as llama.cpp's TextModel writes it: rope.scaling.type/factor/original_context_length.
    "qwen3_yarn": (gguf.MODEL_ARCH.QWEN3, Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=48,
        head_dim=16, intermediate_size=40, vocab_size=V, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256},
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False))),
    # Llama 3.1's scaling as llama.cpp's LlamaModel writes it: a rope_freqs tensor of
    # per-frequency divisors (and Q/K rows permuted).
    "llama3_rope": (gguf.MODEL_ARCH.LLAMA, LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}))),
}
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, V, (2, 16), generator=g)
reference = {"input_ids": ids}
os.makedirs(root, exist_ok=True)
for name, (arch, model) in cases.items():
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
        emb = model.model.embed_tokens.weight
        emb.copy_(emb.half().float())  # the GGUF stores it as F16
        reference[f"{name}.logits"] = model(input_ids=ids).logits.float().contiguous()
    cfg = model.config
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(os.path.join(root, f"tiny-{name}.gguf"), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if name.startswith("qwen3"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    rp = cfg.rope_parameters
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if rp.get("rope_type") == "llama3":
        # LlamaModel.generate_extra_tensors: each frequency's divisor under Llama 3.1 scaling.
        hd = cfg.hidden_size // cfg.num_attention_heads
        freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        lo_wl, hi_wl = 8192 / rp["low_freq_factor"], 8192 / rp["high_freq_factor"]
        divisors = []
        for f in freqs.tolist():
            wl = 2 * math.pi / f
            if wl < hi_wl:
                divisors.append(1.0)
            elif wl > lo_wl:
                divisors.append(rp["factor"])
            else:
                smooth = (8192 / wl - rp["low_freq_factor"]) / (rp["high_freq_factor"] - rp["low_freq_factor"])
                divisors.append(1 / ((1 - smooth) / rp["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
    w.add_vocab_size(V)
    state = model.state_dict()
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        x = t.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and gname.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg.num_attention_heads if gname.endswith("attn_q.weight") else cfg.num_key_value_heads
            x = x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        if gname == "token_embd.weight":
            w.add_tensor(gname, x.astype(np.float16))
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    print(name, tuple(reference[f"{name}.logits"].shape))
save_file(reference, os.path.join(root, "qwen_reference.safetensors"))
