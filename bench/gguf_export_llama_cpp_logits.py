"""llama.cpp running `megatron convert --to gguf` exports of the tiny Hugging Face fixtures:
its logits against transformers' (the fixtures' reference.safetensors, both batch rows).

Compiles bench/llama_cpp_logits.c against a llama.cpp build tree, converts each fixture with
`convert --from hf`, exports it at f32, and prints one JSON line per fixture with the max |diff|;
exits non-zero if one exceeds its tolerance (1e-5; GPT-2 1e-3: llama.cpp evaluates GELU through
an f16 table).
Usage: LLAMA_CPP=/path/to/llama.cpp python bench/gguf_export_llama_cpp_logits.py [work dir]
(from the repository root, after `cargo build --release` and llama.cpp's cmake build)
"""
import json, os, subprocess, sys, tempfile
import numpy as np
from safetensors.numpy import load_file

lc = os.environ["LLAMA_CPP"]
work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
os.makedirs(work, exist_ok=True)
exe = os.path.join(work, "llama_cpp_logits")
subprocess.run(["cc", "-O2", "bench/llama_cpp_logits.c", f"-I{lc}/include", f"-I{lc}/ggml/include",
                f"-L{lc}/build/bin", "-lllama", f"-Wl,-rpath,{lc}/build/bin", "-o", exe], check=True)
BIN = os.path.abspath("target/release/megatron")
root = "crates/megatron-training/tests/fixtures/hf"
ok = True
for fixture in ["gpt2", "llama", "llama_linear_rope", "qwen2", "qwen3_yarn", "mixtral", "qwen2_moe",
                "qwen3_moe_all"]:
    save, out = os.path.join(work, fixture), os.path.join(work, f"{fixture}.gguf")
    subprocess.run([BIN, "convert", "--from", "hf", "--input", os.path.join(root, fixture), "--output", save],
                   check=True, capture_output=True)
    subprocess.run([BIN, "convert", "--to", "gguf", "--input", save, "--output", out], check=True,
                   capture_output=True)
    ref = load_file(os.path.join(root, fixture, "reference.safetensors"))
    diff = 0.0
    for row, ids in enumerate(ref["input_ids"]):
        text = subprocess.run([exe, out, *map(str, ids.tolist())], check=True, capture_output=True,
                              text=True).stdout
        got = np.array([[float(x) for x in line.split()] for line in text.strip().splitlines()])
        diff = max(diff, float(np.abs(got - ref["logits"][row]).max()))
    tol = 1e-3 if fixture == "gpt2" else 1e-5
    ok &= diff <= tol
    print(json.dumps({"fixture": fixture, "max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol}), flush=True)
sys.exit(0 if ok else 1)
