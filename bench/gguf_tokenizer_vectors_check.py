"""llama.cpp's own tokenizer test vectors against the tokenizer.json `megatron convert --from gguf`
writes, for the byte-level vocabularies llama.cpp ships (`models/ggml-vocab-{gpt-2,qwen2,
llama-bpe}.gguf`) and its SentencePiece one (Llama 2's 32,000 pieces, `ggml-vocab-llama-spm.gguf`),
with `.inp` inputs and `.out` ids, in the PyPI sdist llama-cpp-python==0.3.36.

Each vocabulary is put beside a tiny random Llama (gguf-py) so that `convert --from gguf` reads
it; the tokenizer.json it writes encodes every input (no special tokens added, as llama.cpp's
test does) and must give llama.cpp's ids. Then `convert --to gguf` must write back every
`tokenizer.*` key of the vocabulary file unchanged, but for SentencePiece's scores, which come
back as merge ranks: with LLAMA_TOKENIZE (llama.cpp's `llama-tokenize`, built from the same
sdist) given, llama.cpp itself tokenizes every input with the exported vocabulary and must give
the same ids. One JSON line per vocabulary; exits non-zero on a mismatch.
Usage: python bench/gguf_tokenizer_vectors_check.py LLAMA_CPP_PYTHON_SDIST.tar.gz [work dir [LLAMA_TOKENIZE]]
(from the repository root, after `cargo build --release`; needs numpy, gguf, tokenizers)
"""
import json, os, subprocess, sys, tarfile, tempfile
import numpy as np
import gguf
from tokenizers import Tokenizer

work = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
os.makedirs(work, exist_ok=True)
BIN = os.path.abspath("target/release/megatron")
VOCABS = ["gpt-2", "qwen2", "llama-bpe", "llama-spm"]
LLAMA_TOKENIZE = sys.argv[3] if len(sys.argv) > 3 else None
with tarfile.open(sys.argv[1]) as t:
    members = [m for m in t.getmembers()
               if any(m.name.endswith(f"models/ggml-vocab-{v}.gguf{s}") for v in VOCABS for s in ("", ".inp", ".out"))]
    t.extractall(work, members)
    base = os.path.join(work, os.path.dirname(members[0].name))

def fields(path):
    r = gguf.GGUFReader(path)
    return r, {k: f for k, f in r.fields.items() if k.startswith("tokenizer.")}

ok = True
for v in VOCABS:
    src = os.path.join(base, f"ggml-vocab-{v}.gguf")
    r, tok = fields(src)
    n = len(tok["tokenizer.ggml.tokens"].contents())
    model = os.path.join(work, f"{v}-model.gguf")
    w = gguf.GGUFWriter(model, "llama")
    h, layers = 32, 1
    w.add_block_count(layers); w.add_context_length(64); w.add_embedding_length(h)
    w.add_feed_forward_length(32); w.add_head_count(4); w.add_head_count_kv(4)
    w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(n)
    for k, f in tok.items():
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    rand = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)
    w.add_tensor("token_embd.weight", rand(n, h)); w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for l in range(layers):
        for name, shape in [("attn_norm", (h,)), ("ffn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (h, h)),
                            ("attn_v", (h, h)), ("attn_output", (h, h)), ("ffn_gate", (32, h)),
                            ("ffn_up", (32, h)), ("ffn_down", (h, 32))]:
            w.add_tensor(f"blk.{l}.{name}.weight", np.ones(shape, np.float32) if len(shape) == 1 else rand(*shape))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    save = os.path.join(work, f"{v}-save")
    res = subprocess.run([BIN, "convert", "--from", "gguf", "--input", model, "--output", save],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(json.dumps({"vocab": v, "error": res.stderr.strip()})); ok = False; continue
    t = Tokenizer.from_file(os.path.join(save, "tokenizer.json"))
    inputs = open(src + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    expected = open(src + ".out", encoding="utf-8").read().split("\n")
    wrong = []
    for i, (text, ids) in enumerate(zip(inputs, expected)):
        want = [int(x) for x in ids.split()]
        got = t.encode(text, add_special_tokens=False).ids
        if got != want:
            wrong.append({"input": text, "llama.cpp": want, "ours": got})
    back = os.path.join(work, f"{v}-back.gguf")
    subprocess.run([BIN, "convert", "--to", "gguf", "--input", save, "--output", back], check=True, capture_output=True)
    _, again = fields(back)
    differ = sorted(k for k in set(tok) | set(again)
                    if k not in tok or k not in again or tok[k].contents() != again[k].contents())
    exported_wrong = None
    if tok["tokenizer.ggml.model"].contents() == "llama":
        # SentencePiece scores are written as merge ranks: judged by llama.cpp's ids, not bytes.
        differ.remove("tokenizer.ggml.scores")
        if LLAMA_TOKENIZE:
            exported_wrong = 0
            for text, ids in zip(inputs, expected):
                p = os.path.join(work, "in.txt")
                open(p, "w", encoding="utf-8").write(text)
                out = subprocess.run([LLAMA_TOKENIZE, "-m", back, "-f", p, "--ids", "--no-bos", "--no-escape",
                                      "--log-disable"], capture_output=True, text=True, check=True)
                exported_wrong += json.loads(out.stdout.strip().splitlines()[-1]) != [int(x) for x in ids.split()]
    good = not wrong and not differ and not exported_wrong
    ok &= good
    print(json.dumps({"vocab": v, "pre": tok["tokenizer.ggml.pre"].contents(), "vectors": len(expected),
                      "mismatches": wrong[:3], "mismatch_count": len(wrong), "keys_changed_by_round_trip": differ,
                      "llama_tokenize_mismatches_on_export": exported_wrong,
                      "ok": good}, ensure_ascii=False), flush=True)
sys.exit(0 if ok else 1)
