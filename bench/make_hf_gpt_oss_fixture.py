"""A tiny random Hugging Face gpt-oss (`GptOssForCausalLM`) and its reference logits, for the
`megatron convert` test (as make_hf_moe_fixtures.py does for Mixtral and Qwen2-MoE).

Writes crates/megatron-training/tests/fixtures/hf/gpt_oss/{config.json, model.safetensors,
reference.safetensors}: 2 layers (sliding window 4 then full attention), 4 heads in 2 KV
groups with q/k/v/o biases and learned attention sinks, YaRN (factor 4 over 8 positions,
unrounded correction range), 4 experts top-2 with router and expert biases, the clamped
Quick-GEGLU (limit 1.5, chosen so that some but not all of the activations are clamped:
the script prints the fractions), untied output layer.
reference.safetensors holds input_ids (2 x 16), the fp32 logits (eager attention) and greedy
(the first row's 5-token prompt and transformers' 11 greedy tokens after it).
Usage: .venv-ref/bin/python bench/make_hf_gpt_oss_fixture.py [OUT_DIR]
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
LIMIT = 1.5
cfg = GptOssConfig(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
    head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
    vocab_size=V, max_position_embeddings=32, rms_norm_eps=1e-5, sliding_window=4,
    swiglu_limit=LIMIT, tie_word_embeddings=False, attention_bias=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 8},
    attn_implementation="eager")
torch.manual_seed(0)
model = GptOssForCausalLM(cfg).eval()
# Random init leaves biases, sinks and norms at 0 / 1 and the router at 0: perturb every
# tensor so the mapping of each one is visible in the logits.
with torch.no_grad():
    for n, p in model.named_parameters():
        p.add_(torch.randn_like(p) * 0.05)
        if n.endswith("router.weight"):
            p.mul_(20.0)  # routers far from ties: top-k is decided, not a coin flip
        if n.endswith("gate_up_proj"):
            p.mul_(4.0)
        if n.endswith("down_proj"):
            p.mul_(10.0)
        if n.endswith("sinks"):
            p.add_(torch.randn_like(p))  # sinks of either sign, about one logit
seen = {"gate": [], "up": []}
def watch(mod, args, _out):
    h, idx = args[0], args[1]
    gu = h @ mod.gate_up_proj[0] + mod.gate_up_proj_bias[0]
    seen["gate"].append((gu[..., ::2] > LIMIT).float().mean().item())
    seen["up"].append((gu[..., 1::2].abs() > LIMIT).float().mean().item())
for layer in model.model.layers:
    layer.mlp.experts.register_forward_hook(watch)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, V, (2, 16), generator=g)
with torch.no_grad():
    logits = model(input_ids=ids).logits.float().contiguous()
print("clamped fractions (expert 0, all tokens):", {k: [round(x, 3) for x in v] for k, v in seen.items()})
# Greedy decoding through transformers' KV cache: a 5-token prompt and 11 new tokens, past the
# 4-token window.
with torch.no_grad():
    greedy = model.generate(ids[:1, :5], max_new_tokens=11, do_sample=False, min_new_tokens=11,
                            pad_token_id=0)
d = os.path.join(out, "gpt_oss")
model.save_pretrained(d)
p = os.path.join(d, "generation_config.json")
if os.path.exists(p):
    os.remove(p)
save_file({"input_ids": ids, "logits": logits, "greedy": greedy.contiguous()},
          os.path.join(d, "reference.safetensors"))
print("gpt_oss", tuple(logits.shape), float(logits.abs().max()))

# gpt_oss_mxfp4: the experts stored as the released checkpoints store them (MXFP4:
# `*_blocks` of 32 four-bit E2M1 codes in 16 bytes, low nibble first, and `*_scales`, one E8M0
# exponent per block, over the contraction dimension; intermediate_size 32 so that down_proj's
# rows are whole blocks) and `quantization_config.quant_method: mxfp4`. The blocks and scales
# come from rounding the perturbed f32 experts to the nearest code under a power-of-two scale;
# the reference logits are transformers' own dequantized reading of them
# (`Mxfp4Config(dequantize=True)`).
from transformers import Mxfp4Config
from safetensors.torch import load_file
import json
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4(w):
    """[E, rows, cols] (cols the contraction dimension) -> blocks [E, rows, cols/32, 16], scales."""
    e_, r_, c_ = w.shape
    b = w.reshape(e_, r_, c_ // 32, 32)
    amax = b.abs().amax(-1).clamp_min(1e-30)
    e = torch.floor(torch.log2(amax / 6.0)).clamp(-127, 127)
    idx = ((b / torch.pow(2.0, e)[..., None])[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    return (idx[..., 0::2] | (idx[..., 1::2] << 4)).contiguous(), (e + 127).to(torch.uint8).contiguous()


cfg.intermediate_size = 32
torch.manual_seed(2)
model = GptOssForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.add_(torch.randn_like(p) * 0.05)
        if n.endswith("router.weight"):
            p.mul_(20.0)
        if n.endswith("gate_up_proj"):
            p.mul_(4.0)
        if n.endswith("down_proj"):
            p.mul_(10.0)
        if n.endswith("sinks"):
            p.add_(torch.randn_like(p))
d = os.path.join(out, "gpt_oss_mxfp4")
model.save_pretrained(d)
for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(d, extra)):
        os.remove(os.path.join(d, extra))
t = load_file(os.path.join(d, "model.safetensors"))
packed = {}
for k, v in t.items():
    if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
        # Stored [E, in, out]; the blocks run along `in` for each output row.
        packed[k + "_blocks"], packed[k + "_scales"] = mxfp4(v.transpose(1, 2).contiguous())
    else:
        packed[k] = v
save_file(packed, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
c = json.load(open(os.path.join(d, "config.json")))
c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
json.dump(c, open(os.path.join(d, "config.json"), "w"), indent=2)
model = GptOssForCausalLM.from_pretrained(d, quantization_config=Mxfp4Config(dequantize=True),
                                          dtype=torch.float32, attn_implementation="eager").eval()
with torch.no_grad():
    logits = model(input_ids=ids).logits.float().contiguous()
save_file({"input_ids": ids, "logits": logits}, os.path.join(d, "reference.safetensors"))
print("gpt_oss_mxfp4", tuple(logits.shape), float(logits.abs().max()))
