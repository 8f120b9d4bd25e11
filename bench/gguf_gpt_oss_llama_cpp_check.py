"""llama.cpp running `megatron convert --to gguf`'s gpt-oss export, against transformers.

The tiny gpt-oss fixture with llama.cpp's built-in clamp (swiglu_limit 7) is converted with
`convert --from hf`, exported at f32 and run by llama.cpp (bench/llama_cpp_logits.c: f32 KV
cache, flash attention off) on both rows of the fixture's input ids; its logits are compared with
transformers' GptOssForCausalLM (eager) on the same config — as the config says (YaRN with
`truncate: false`, gpt-oss's) and with `truncate: true`, which is what llama.cpp computes (its
YaRN rounds the correction range; on this fixture's YaRN both give the same frequencies, which
is why `convert --to gguf` exports it). Prints one JSON line per comparison; exits non-zero
unless llama.cpp matches both within 1e-5.

Usage: LLAMA_CPP=/path/to/llama.cpp PYTHON=... python bench/gguf_gpt_oss_llama_cpp_check.py [work dir]
(from the repository root, after `cargo build --release` and llama.cpp's cmake build of
llama-simple; the Python needs torch and transformers).
"""
import json, os, shutil, subprocess, sys, tempfile
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import GptOssForCausalLM

lc = os.environ["LLAMA_CPP"]
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
os.makedirs(work, exist_ok=True)
exe = os.path.join(work, "llama_cpp_logits")
subprocess.run(["cc", "-O2", "bench/llama_cpp_logits.c", f"-I{lc}/include", f"-I{lc}/ggml/include",
                f"-L{lc}/build/bin", "-lllama", f"-Wl,-rpath,{lc}/build/bin", "-o", exe], check=True)
BIN = os.path.abspath("target/release/megatron")
src = "crates/megatron-training/tests/fixtures/hf/gpt_oss"
hf = os.path.join(work, "hf")
shutil.rmtree(hf, ignore_errors=True)
shutil.copytree(src, hf)
cfg = json.load(open(os.path.join(hf, "config.json")))
cfg["swiglu_limit"] = 7.0
json.dump(cfg, open(os.path.join(hf, "config.json"), "w"), indent=2)
save, out = os.path.join(work, "m"), os.path.join(work, "gpt_oss.gguf")
shutil.rmtree(save, ignore_errors=True)
subprocess.run([BIN, "convert", "--from", "hf", "--input", hf, "--output", save], check=True,
               capture_output=True)
if os.path.exists(out):
    os.remove(out)
subprocess.run([BIN, "convert", "--to", "gguf", "--input", save, "--output", out], check=True,
               capture_output=True)
ids = load_file(os.path.join(src, "reference.safetensors"))["input_ids"]
got = []
for row in ids:
    text = subprocess.run([exe, out, *map(str, row.tolist())], check=True, capture_output=True,
                          text=True).stdout
    got.append(np.array([[float(x) for x in line.split()] for line in text.strip().splitlines()]))
got = np.stack(got)
ok = True
for truncate in (False, True):
    model = GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    model.config.rope_parameters["truncate"] = truncate
    model.model.rotary_emb.__init__(model.config)  # the rotary tables from the edited setting
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    diff = float(np.abs(got - ref).max())
    ok &= diff <= 1e-5
    print(json.dumps({"transformers_yarn_truncate": truncate, "max_abs_diff": diff,
                      "max_abs_logit": float(np.abs(ref).max())}), flush=True)
sys.exit(0 if ok else 1)
