"""Tiny random DeepseekV3ForCausalLM (and DeepseekV2ForCausalLM) models and their reference logits, for `megatron convert`'s
multi-latent attention and DeepSeek MoE tests.

Writes crates/megatron-training/tests/fixtures/hf/<case>/{config.json, model.safetensors,
reference.safetensors} with transformers (offline, fixed seeds), as bench/make_hf_fixtures.py
does for the other families:
  deepseek_v3       query latent 16, key/value latent 12, heads of 8 content + 4 rotary
                    features and values of 6; layer 0 dense, layer 1 DeepSeek's MoE (4 experts
                    in 2 groups, top-2 from 1 group, sigmoid scores with a correction bias,
                    renormalized, scaled by 2.5, one shared expert).
  deepseek_v3_yarn  no query latent (q_proj, DeepSeek-V2-Lite's form), YaRN with
                    mscale = mscale_all_dim = 1 (DeepSeek-V3's), both layers dense.
  deepseek_v3_mtp   deepseek_v3 with DeepSeek's released MTP layer added (transformers drops it).
  deepseek_v2       DeepseekV2ForCausalLM: no query latent, a softmax router (top-k kept as they
                    are, scaled by 1.5, group_limited_greedy over 4 groups), a shared expert.
Every parameter and the routers' correction biases are perturbed, so each mapping shows in the
logits.  Usage: python bench/make_hf_deepseek_fixtures.py [OUT_DIR]
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=16,
              n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
cases = {
    "deepseek_v3": dict(common, q_lora_rank=16, first_k_dense_replace=1),
    "deepseek_v3_yarn": dict(common, q_lora_rank=None, first_k_dense_replace=2,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "mscale": 1.0, "mscale_all_dim": 1.0,
                                              "rope_theta": 10000.0}),
}
for name, kw in cases.items():
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw)).eval()
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in n or "original_inv_freq" in n:
                continue
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

# deepseek_v3_mtp: deepseek_v3 saved as DeepSeek releases its checkpoints, with the
# multi-token-prediction module as layer num_hidden_layers (enorm, hnorm, eh_proj,
# shared_head.norm, copies of embed_tokens and shared_head.head, and a decoder layer like the
# last one, here layer 1's tensors perturbed). transformers drops that layer, so the reference
# logits are deepseek_v3's.
import shutil
from safetensors.torch import load_file
src = os.path.join(out, "deepseek_v3")
dst = os.path.join(out, "deepseek_v3_mtp")
os.makedirs(dst, exist_ok=True)
t = load_file(os.path.join(src, "model.safetensors"))
g = torch.Generator().manual_seed(2)
mtp = {}
for k, v in t.items():
    if k.startswith("model.layers.1."):
        mtp[k.replace("model.layers.1.", "model.layers.2.")] = v + torch.randn(v.shape, generator=g) * 0.05
h = t["model.norm.weight"].shape[0]
mtp["model.layers.2.enorm.weight"] = 1 + torch.randn(h, generator=g) * 0.05
mtp["model.layers.2.hnorm.weight"] = 1 + torch.randn(h, generator=g) * 0.05
mtp["model.layers.2.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
mtp["model.layers.2.shared_head.norm.weight"] = 1 + torch.randn(h, generator=g) * 0.05
mtp["model.layers.2.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
mtp["model.layers.2.shared_head.head.weight"] = t["lm_head.weight"].clone()
t.update(mtp)
save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(dst, "model.safetensors"),
          metadata={"format": "pt"})
shutil.copy(os.path.join(src, "config.json"), dst)
shutil.copy(os.path.join(src, "reference.safetensors"), dst)
print("deepseek_v3_mtp", len(mtp), "MTP tensors")

# deepseek_v2: DeepseekV2ForCausalLM (V2-Lite's form: no query latent) with a softmax router
# that keeps its top-k probabilities as they are, scaled by 1.5, group-limited
# (topk_method group_limited_greedy: 4 experts in 4 groups, 2 groups, top-2), one shared expert;
# layer 0 dense.
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
torch.manual_seed(0)
v2 = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=None,
          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
          rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=16,
          n_routed_experts=4, num_experts_per_tok=2, n_group=4, topk_group=2,
          topk_method="group_limited_greedy", n_shared_experts=1, routed_scaling_factor=1.5,
          first_k_dense_replace=1)
model = DeepseekV2ForCausalLM(DeepseekV2Config(**v2)).eval()
with torch.no_grad():
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in n:
            continue
        p.add_(torch.randn_like(p) * 0.05)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, V, (2, 16), generator=g)
with torch.no_grad():
    logits = model(input_ids=ids).logits.float().contiguous()
d = os.path.join(out, "deepseek_v2")
model.save_pretrained(d)
p = os.path.join(d, "generation_config.json")
if os.path.exists(p):
    os.remove(p)
save_file({"input_ids": ids, "logits": logits}, os.path.join(d, "reference.safetensors"))
print("deepseek_v2", tuple(logits.shape), float(logits.abs().max()))
