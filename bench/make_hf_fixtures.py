"""Tiny random Hugging Face models and their reference logits, for `megatron convert` tests.

Writes crates/megatron-training/tests/fixtures/hf/<arch>/{config.json, model.safetensors,
reference.safetensors} with transformers (offline, fixed seeds; runs are byte-identical), so CI
needs no torch: GPT-2 (learned positions, fused Conv1D QKV, tied), Llama (GQA 4/2, untied, RoPE
base 10000), Llama with linear RoPE interpolation, Qwen2 (GQA, q/k/v biases, tied). reference.safetensors holds input_ids (2 x 16) and
the fp32 logits.  Usage: .venv-ref/bin/python bench/make_hf_fixtures.py [OUT_DIR [CASE...]]
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
cases = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64,
                                               vocab_size=V, bos_token_id=0, eos_token_id=0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, hidden_size=32,
                                                  intermediate_size=48, vocab_size=V,
                                                  max_position_embeddings=64, rms_norm_eps=1e-6,
                                                  tie_word_embeddings=False)),
    # Linear position interpolation (rope_type "linear", factor 4): every frequency / 4.
    "llama_linear_rope": lambda: LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, hidden_size=32,
                                                  intermediate_size=48, vocab_size=V,
                                                  max_position_embeddings=64, rms_norm_eps=1e-6,
                                                  tie_word_embeddings=True)),
}
only = sys.argv[2:]  # optional: the cases to write (default all)
cases = {k: v for k, v in cases.items() if not only or k in only}
for name, make in cases.items():
    torch.manual_seed(0)
    model = make().eval()
    # Random init leaves biases and norms at 0 / 1: perturb every tensor so the mapping of each
    # one is visible in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    d = os.path.join(out, name)
    model.save_pretrained(d)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    save_file({"input_ids": ids, "logits": logits}, os.path.join(d, "reference.safetensors"))
    print(name, tuple(logits.shape), float(logits.abs().max()))
