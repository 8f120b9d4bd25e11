"""A tiny random Hugging Face T5 (T5ForConditionalGeneration: 2 + 2 layers, d_model 32, 4 heads,
d_kv 8, d_ff 48, non-gated GELU(tanh) ("gelu_new"), 8 relative buckets up to distance 20,
tied embeddings, vocabulary 96) and its reference outputs, for the `megatron convert` test:
writes crates/megatron-training/tests/fixtures/hf/t5/{config.json, model.safetensors,
reference.safetensors} (encoder ids with padding and its attention mask, decoder ids, labels
with one -100, logits, loss, and `generate`'s greedy output: 6 new tokens after the
decoder start token). Usage: .venv-ref/bin/python bench/make_hf_t5_fixture.py
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import T5Config, T5ForConditionalGeneration
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
torch.manual_seed(0)
m = T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=2, num_heads=4, d_model=32, d_kv=8,
        d_ff=48, vocab_size=V, feed_forward_proj="gelu_new", relative_attention_num_buckets=8,
        relative_attention_max_distance=20, dropout_rate=0.1, layer_norm_epsilon=1e-6,
        tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
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
d = os.path.join(out, "t5")
m.save_pretrained(d)
p = os.path.join(d, "generation_config.json")
if os.path.exists(p): os.remove(p)
with torch.no_grad():
    greedy = m.generate(input_ids=enc, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1)
save_file({"input_ids": enc, "attention_mask": mask, "decoder_input_ids": dec, "labels": labels,
           "logits": o.logits.contiguous(), "loss": o.loss.reshape(1), "greedy": greedy.contiguous()},
          os.path.join(d, "reference.safetensors"))
print("greedy", greedy.tolist())
print(float(o.loss), tuple(o.logits.shape))
