"""Two more tiny random Hugging Face T5s for the `megatron convert` test, beside
make_hf_t5_fixture.py's: `t5_relu` (the original T5's ReLU `DenseReluDense`, tied, rescaled
output) and `t5_gated` (T5 v1.1 / Flan-T5: gated GELU `wi_0`/`wi_1`, an untied `lm_head`, no
rescaling). transformers 5 always ties T5's `lm_head` to `shared`, so the untied one is made by
giving the module its own `lm_head` parameter and written as transformers 4 saved T5 v1.1
(`lm_head.weight` in the file, `tie_word_embeddings: false`). Each directory gets config.json,
model.safetensors and reference.safetensors (inputs, logits, loss). 2 + 1 layers, d_model 32.
Usage: .venv-ref/bin/python bench/make_hf_t5_variant_fixtures.py
"""
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import T5Config, T5ForConditionalGeneration
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
for name, proj, tied in [("t5_relu", "relu", True), ("t5_gated", "gated-gelu", False)]:
    torch.manual_seed(0)
    cfg = T5Config(num_layers=2, num_decoder_layers=1, num_heads=4, d_model=32, d_kv=8, d_ff=48,
                   vocab_size=V, feed_forward_proj=proj, relative_attention_num_buckets=8,
                   relative_attention_max_distance=20, dropout_rate=0.1, layer_norm_epsilon=1e-6,
                   tie_word_embeddings=tied, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    m = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        if not tied:
            m.lm_head.weight = torch.nn.Parameter(torch.randn(V, 32) * 0.5)
    assert m.config.scale_decoder_outputs == tied
    assert (m.lm_head.weight.data_ptr() == m.shared.weight.data_ptr()) == tied
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, V, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.int64); mask[1, 9:] = 0; enc[1, 9:] = 0
    dec = torch.randint(2, V, (2, 7), generator=g)
    labels = torch.randint(2, V, (2, 7), generator=g); labels[1, 6] = -100
    with torch.no_grad():
        o = m(input_ids=enc, attention_mask=mask, decoder_input_ids=dec, labels=labels)
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    if tied:
        m.save_pretrained(d)
        p = os.path.join(d, "generation_config.json")
        if os.path.exists(p): os.remove(p)
    else:
        skip = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
        sd = {k: v.contiguous() for k, v in m.state_dict().items() if k not in skip}
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        c = m.config.to_dict()
        c.pop("scale_decoder_outputs", None)
        c["tie_word_embeddings"] = False
        c["architectures"] = ["T5ForConditionalGeneration"]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
    save_file({"input_ids": enc, "attention_mask": mask, "decoder_input_ids": dec, "labels": labels,
               "logits": o.logits.contiguous(), "loss": o.loss.reshape(1)},
              os.path.join(d, "reference.safetensors"))
    print(name, float(o.loss), tuple(o.logits.shape))
