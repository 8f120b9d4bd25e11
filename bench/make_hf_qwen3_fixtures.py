"""Tiny random Qwen3 and Qwen3-MoE models and their reference logits, for `megatron convert`
tests (as make_hf_fixtures.py does for Llama and Qwen2).

Writes crates/megatron-training/tests/fixtures/hf/<case>/{config.json, model.safetensors,
reference.safetensors}:
- qwen3: GQA 4/2 with head_dim 16 != hidden 48 / 4 heads (megatron's --kv-channels), per-head
  q_norm/k_norm, tied embeddings, a sliding window on layer 1 only (layer_types).
- qwen3_moe: 4 experts top-2 renormalized (norm_topk_prob), mlp_only_layers [0] (a dense first
  layer), untied.
- qwen3_moe_all: as qwen3_moe with experts on every layer (llama.cpp's qwen3moe has no dense
  layers; the GGUF export tests use it).
- qwen3_yarn: YaRN rope (factor 4 over 256 original positions: frequencies 0-3 of 8 on the
  ramp between kept and interpolated), tied.
reference.safetensors holds input_ids (2 x 16) and the fp32 logits.
Usage: .venv-ref/bin/python bench/make_hf_qwen3_fixtures.py [OUT_DIR [CASE...]]
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
cases = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=48,
        head_dim=16, intermediate_size=40, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, attention_bias=False)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False)),
    "qwen3_moe_all": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        head_dim=8, intermediate_size=48, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False)),
    "qwen3_yarn": lambda: Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=48,
        head_dim=16, intermediate_size=40, vocab_size=V, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256},
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)),
}
only = sys.argv[2:]  # optional: the cases to write (default all)
cases = {k: v for k, v in cases.items() if not only or k in only}
for name, make in cases.items():
    torch.manual_seed(0)
    model = make().eval()
    # Random init leaves norms at 1 and the router at 0: perturb every tensor so the mapping
    # of each one (the q/k norms above all) is visible in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, p in model.named_parameters():
            if n.endswith("_norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("mlp.gate.weight"):
                p.mul_(20.0)  # routers far from ties: top-k is decided, not a coin flip
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    d = os.path.join(out, name)
    model.save_pretrained(d)
    p = os.path.join(d, "generation_config.json")
    if os.path.exists(p):
        os.remove(p)
    save_file({"input_ids": ids, "logits": logits}, os.path.join(d, "reference.safetensors"))
    print(name, tuple(logits.shape), float(logits.abs().max()))
