"""`megatron preprocess --tokenizer-type TikTokenizer` on a real vocabulary against Megatron-LM's
own CustomTikTokenizer: o200k_base (GPT-4o's BPE, 200k ranks; the bytes moved to ranks 0-255 as
Megatron's format requires) written as Megatron's JSON list, Megatron's defaults (vocabulary
2^17, 1,000 special tokens, pattern v2), every speech of examples/sotu as one document with EOD
appended. Prints whether every id agrees, and both sides' time.

Usage, from the repository root (tiktoken installed; `cargo build --release` first):
python bench/tiktoken_preprocess_check.py MEGATRON_LM_GIT_DIR [O200K_BASE_TIKTOKEN_FILE]
"""
import glob, json, os, subprocess, sys, tempfile, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiktoken_fixture as fx  # noqa: E402  (its main part runs only as a script)

work = tempfile.mkdtemp()
vocab = os.path.join(work, "o200k.json")
fx.write_megatron_vocab(fx.o200k, vocab)
ns = fx.megatron_tiktokenizer(fx.megatron)
t = ns["CustomTikTokenizer"](path=vocab, pattern=ns["PATTERN_TIKTOKEN_V2"], vocab_size=None,
                             num_special_tokens=1000, special_tokens=None)
here = os.path.dirname(os.path.abspath(__file__))
docs = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(here, "..", "examples", "sotu", "*.txt")))]
jsonl = os.path.join(work, "sotu.jsonl")
with open(jsonl, "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
start = time.perf_counter()
want = [i for d in docs for i in t.tokenize(d) + [t.eod]]
megatron_s = time.perf_counter() - start
start = time.perf_counter()
subprocess.run([os.path.join(here, "..", "target", "release", "megatron"), "preprocess", "--input", jsonl,
                "--output-prefix", os.path.join(work, "tk"), "--tokenizer-type", "TikTokenizer",
                "--tokenizer-model", vocab, "--tiktoken-pattern", "v2", "--append-eod", "--workers", "1"],
               check=True, capture_output=True)
ours_s = time.perf_counter() - start
got = np.fromfile(os.path.join(work, "tk_text_document.bin"), dtype=np.int32).tolist()
mb = sum(len(d.encode()) for d in docs) / 1e6
same = got == want
print(json.dumps({"documents": len(docs), "ids": len(want), "identical": same,
                  "first_difference": None if same else next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))),
                  "megatron_tiktoken_s": round(megatron_s, 2), "megatron_rs_preprocess_s_1_worker": round(ours_s, 2),
                  "megabytes": round(mb, 2)}))
sys.exit(0 if same else 1)
