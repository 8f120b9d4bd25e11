"""Tiny random Hugging Face models with the MLP activations of `--squared-relu` and
`--quick-geglu` (and the exact GELU of `--no-bias-gelu-fusion`), for the `megatron convert`
tests, beside make_hf_fixtures.py's: `gpt2_gelu` (`activation_function: gelu`), `gpt2_relu2`
(GPT-2 with `activation_function: relu2`, transformers' squared ReLU), `llama_quick_gelu`
(Llama's gated MLP with `hidden_act: quick_gelu`, x * sigmoid(1.702 x)), and the T5 MLPs
`t5_relu2` (`feed_forward_proj: relu2`) and `t5_quick_geglu` (`gated-quick_gelu`), both tied.
Same recipe as the others (offline, fixed seeds, every tensor perturbed so each mapping shows in
the logits); reference.safetensors holds the inputs and fp32 logits (and T5's loss).
Usage: .venv-ref/bin/python bench/make_hf_activation_fixtures.py
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config,
                          T5ForConditionalGeneration)

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96


def save(model, d, tensors):
    model.save_pretrained(d)
    p = os.path.join(d, "generation_config.json")
    if os.path.exists(p):
        os.remove(p)
    save_file(tensors, os.path.join(d, "reference.safetensors"))


decoders = {
    "gpt2_gelu": lambda: GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=V, bos_token_id=0,
        eos_token_id=0, activation_function="gelu")),
    "gpt2_relu2": lambda: GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=V, bos_token_id=0,
        eos_token_id=0, activation_function="relu2")),
    "llama_quick_gelu": lambda: LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=48, vocab_size=V, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="quick_gelu")),
}
for name, make in decoders.items():
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    save(model, os.path.join(out, name), {"input_ids": ids, "logits": logits})
    print(name, tuple(logits.shape), float(logits.abs().max()))

for name, proj in [("t5_relu2", "relu2"), ("t5_quick_geglu", "gated-quick_gelu")]:
    torch.manual_seed(0)
    cfg = T5Config(num_layers=2, num_decoder_layers=1, num_heads=4, d_model=32, d_kv=8, d_ff=48,
                   vocab_size=V, feed_forward_proj=proj, relative_attention_num_buckets=8,
                   relative_attention_max_distance=20, dropout_rate=0.1, layer_norm_epsilon=1e-6,
                   tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    m = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, V, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.int64); mask[1, 9:] = 0; enc[1, 9:] = 0
    dec = torch.randint(2, V, (2, 7), generator=g)
    labels = torch.randint(2, V, (2, 7), generator=g); labels[1, 6] = -100
    with torch.no_grad():
        o = m(input_ids=enc, attention_mask=mask, decoder_input_ids=dec, labels=labels)
    save(m, os.path.join(out, name),
         {"input_ids": enc, "attention_mask": mask, "decoder_input_ids": dec, "labels": labels,
          "logits": o.logits.contiguous(), "loss": o.loss.reshape(1)})
    print(name, float(o.loss), tuple(o.logits.shape), m.config.dense_act_fn, m.config.is_gated_act)
