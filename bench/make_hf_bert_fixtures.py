"""Tiny random Hugging Face BERTs and their reference outputs, for `megatron convert` tests.

Writes crates/megatron-training/tests/fixtures/hf/<name>/{config.json, model.safetensors,
reference.safetensors} with transformers (offline, fixed seeds), so CI needs no torch:
  bert_pretraining: BertForPreTraining (post-LN, exact GELU, MLM head + next-sentence head),
  bert_model:       BertModel (encoder + pooler only, as sentence encoders ship).
reference.safetensors holds input_ids, token_type_ids and attention_mask (2 x 16, the second
sequence padded after 11 tokens), the last hidden state, and for the pre-training model the
MLM labels (-100 where unmasked), the next-sentence labels and transformers' total loss (mean
MLM cross-entropy over the labelled tokens + next-sentence cross-entropy).
Usage: .venv-ref/bin/python bench/make_hf_bert_fixtures.py
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForPreTraining, BertModel

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "hf")
V = 96
cfg = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=48,
           vocab_size=V, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu")
cases = {
    "bert_pretraining": lambda: BertForPreTraining(BertConfig(**cfg)),
    "bert_model": lambda: BertModel(BertConfig(**cfg)),
}
for name, make in cases.items():
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 11:] = 0
    ids[1, 11:] = 0
    types = torch.zeros(2, 16, dtype=torch.int64)
    types[:, 8:] = 1
    types[1, 11:] = 0
    t = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    with torch.no_grad():
        if name == "bert_pretraining":
            labels = torch.full((2, 16), -100, dtype=torch.int64)
            for b, p in [(0, 1), (0, 5), (0, 12), (1, 3), (1, 9)]:
                labels[b, p] = int(torch.randint(0, V, (1,), generator=g))
            nsp = torch.tensor([0, 1])
            o = model(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels,
                      next_sentence_label=nsp, output_hidden_states=True)
            t.update(labels=labels, next_sentence_label=nsp, loss=o.loss.reshape(1),
                     last_hidden_state=o.hidden_states[-1].contiguous())
        else:
            o = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
            t.update(last_hidden_state=o.last_hidden_state.contiguous())
    d = os.path.join(out, name)
    model.save_pretrained(d)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    save_file(t, os.path.join(d, "reference.safetensors"))
    print(name, {k: tuple(v.shape) for k, v in t.items()}, float(t.get("loss", torch.zeros(1))[0]))
