"""transformers loads `megatron convert --to hf`'s gpt-oss export and gives the fixture's
logits: the config.json it writes is one GptOssConfig takes, and the tensors are where
GptOssForCausalLM reads them (the Rust test checks the bytes; this checks transformers reads them).

Usage (after `megatron convert --from hf --input crates/megatron-training/tests/fixtures/hf/gpt_oss
--output M && megatron convert --to hf --input M --output HF`):
  .venv-ref/bin/python bench/hf_gpt_oss_export_check.py HF
"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ref = load_file(os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training",
                             "tests", "fixtures", "hf", "gpt_oss", "reference.safetensors"))
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,
                                         attn_implementation="eager").eval()
with torch.no_grad():
    logits = m(input_ids=ref["input_ids"]).logits
d = (logits - ref["logits"]).abs().max().item()
print(type(m).__name__, "max |logit difference| vs the fixture:", d)
sys.exit(0 if d <= 1e-5 else 1)
