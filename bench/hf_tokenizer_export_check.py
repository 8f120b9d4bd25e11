"""`megatron convert --to hf` tokenizers against transformers' AutoTokenizer: a tiny model trained
with Megatron's Llama2Tokenizer on the sentencepiece fixture (and one with GPT2BPETokenizer) is
exported, and AutoTokenizer on the exported directory must give what the sentencepiece library
gives (BOS, then `encode`'s ids; `decode` back) for the fixture's texts (control tokens written
in the text aside: a Hugging Face tokenizer reads them as those tokens), and GPT-2's real ids.
One JSON line per tokenizer; exits non-zero on a mismatch.
Usage (from the repository root, after `cargo build --release`; needs transformers, sentencepiece):
HF_HUB_OFFLINE=1 python bench/hf_tokenizer_export_check.py
"""
import json, os, subprocess, sys, tempfile
import sentencepiece as spm
from transformers import AutoTokenizer

BIN = os.path.abspath("target/release/megatron")
FX = "crates/megatron-data/tests/fixtures"
work = tempfile.mkdtemp()
model = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "0"]

def exported(name, tokenizer):
    save, hf = os.path.join(work, name), os.path.join(work, name + "-hf")
    subprocess.run([BIN, "train", *model, *tokenizer, "--save", save], check=True, capture_output=True)
    subprocess.run([BIN, "convert", "--to", "hf", "--input", save, "--output", hf], check=True, capture_output=True)
    return hf

ok = True
sp_model = os.path.abspath(f"{FX}/sentencepiece/tiny-sotu-bpe.model")
hf = exported("llama2", ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model])
sp = spm.SentencePieceProcessor(model_file=sp_model)
tok = AutoTokenizer.from_pretrained(hf)
cases = json.load(open(f"{FX}/sentencepiece/tiny-sotu-bpe-vectors.json", encoding="utf-8"))["cases"]
texts = [c["text"] for c in cases if "<s>" not in c["text"]]
wrong = [t for t in texts if tok(t)["input_ids"] != [sp.bos_id()] + sp.encode(t)]
undecoded = [t for t in texts if tok.decode(tok(t)["input_ids"], skip_special_tokens=True) != sp.decode(sp.encode(t))]
good = not wrong and not undecoded
ok &= good
print(json.dumps({"tokenizer": "Llama2Tokenizer", "class": type(tok).__name__, "texts": len(texts),
                  "id_mismatches": wrong[:3], "decode_mismatches": undecoded[:3], "ok": good}, ensure_ascii=False))

gpt2 = os.path.abspath(f"{FX}/gpt2")
hf = exported("gpt2", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{gpt2}/vocab.json",
                       "--merge-file", f"{gpt2}/merges.txt"])
tok = AutoTokenizer.from_pretrained(hf)
ids = tok("Hello world, the State of the Union")["input_ids"]
good = ids == [15496, 995, 11, 262, 1812, 286, 262, 4479]  # GPT-2's own ids for this text
ok &= good
print(json.dumps({"tokenizer": "GPT2BPETokenizer", "class": type(tok).__name__, "ids": ids, "ok": good}))
sys.exit(0 if ok else 1)
