"""Tiny random Hugging Face mixture-of-experts models and their reference logits, for
`megatron convert` tests (as make_hf_fixtures.py does for dense ones).

Writes crates/megatron-training/tests/fixtures/hf/<arch>/{config.json, model.safetensors,
reference.safetensors}: Mixtral (4 experts, top-2, renormalized, GQA 4/2, untied) and Qwen2-MoE
(4 experts, top-2 without renormalization, a gated shared expert, q/k/v biases, tied), and
Qwen2-MoE with dense layers (4 layers, decoder_sparse_step 2 and mlp_only_layers [3]: experts on
layer 1 only, the others the plain intermediate_size MLP).
reference.safetensors holds input_ids (2 x 16) and the fp32 logits.
Usage: .venv-ref/bin/python bench/make_hf_moe_fixtures.py [OUT_DIR [CASE...]]
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
cases = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, vocab_size=V,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        sliding_window=None)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False)),
    "qwen2_moe_dense": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[3], vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False)),
}
only = sys.argv[2:]  # optional: the cases to write (default all)
cases = {k: v for k, v in cases.items() if not only or k in only}
for name, make in cases.items():
    torch.manual_seed(0)
    model = make().eval()
    # Random init leaves biases and norms at 0 / 1 and the router at 0: perturb every tensor
    # so the mapping of each one is visible in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.mul_(20.0)  # routers far from ties: top-k is decided, not a coin flip
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
