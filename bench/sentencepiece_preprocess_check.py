"""`megatron preprocess --tokenizer-type GPTSentencePieceTokenizer` on Llama 2's vocabulary against
the sentencepiece library: ids and speed on examples/sotu.

Llama 2's tokenizer.model is not redistributable offline; llama.cpp ships its vocabulary
(`models/ggml-vocab-llama-spm.gguf` in the PyPI sdist llama-cpp-python==0.3.36: the 32,000
pieces with their scores and types). This rebuilds a sentencepiece ModelProto from it with
Llama 2's settings (BPE, byte fallback, identity normalization, dummy prefix, whitespace kept),
checks that sentencepiece gives Llama 2's known ids for "Hello world" (15043 3186), then runs
our preprocess (1 and 2 workers) and sentencepiece (one thread, alternating) and compares every id.
Usage (from the repository root, after `cargo build --release`; needs gguf, sentencepiece, protobuf):
python bench/sentencepiece_preprocess_check.py LLAMA_CPP_PYTHON_SDIST.tar.gz
"""
import glob, json, os, re, subprocess, sys, tarfile, tempfile, time
import numpy as np
import gguf
import sentencepiece as spm
import sentencepiece.sentencepiece_model_pb2 as pb

work = tempfile.mkdtemp()
with tarfile.open(sys.argv[1]) as t:
    m = [x for x in t.getmembers() if x.name.endswith("models/ggml-vocab-llama-spm.gguf")]
    t.extractall(work, m)
r = gguf.GGUFReader(os.path.join(work, m[0].name))
f = r.fields
proto = pb.ModelProto()
for tok, score, ty in zip(f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.scores"].contents(),
                          f["tokenizer.ggml.token_type"].contents()):
    p = proto.pieces.add(); p.piece = tok; p.score = score; p.type = ty
ts, ns = proto.trainer_spec, proto.normalizer_spec
ts.model_type = 2; ts.byte_fallback = True; ts.unk_id = 0; ts.bos_id = 1; ts.eos_id = 2; ts.pad_id = -1
ns.name = "identity"; ns.add_dummy_prefix = True; ns.remove_extra_whitespaces = False; ns.escape_whitespaces = True
model = os.path.join(work, "llama2.model")
open(model, "wb").write(proto.SerializeToString())
sp = spm.SentencePieceProcessor(model_file=model)
assert sp.encode("Hello world") == [15043, 3186], "not Llama 2's tokenizer"

files = sorted(glob.glob("examples/sotu/*.txt"))
docs = [open(p, encoding="utf-8").read() for p in files]
mb = sum(len(d.encode()) for d in docs) / 1e6
rows = []
for rnd in range(3):
    t = time.time(); want = np.concatenate([np.array(sp.encode(d), dtype=np.uint16) for d in docs])
    rows.append({"impl": "sentencepiece", "workers": 1, "mb_per_s": mb / (time.time() - t)})
    for w in (1, 2):
        out = subprocess.run(["target/release/megatron", "preprocess", "--input", "examples/sotu", "--output-prefix",
                              os.path.join(work, f"ours{w}"), "--tokenizer-type", "GPTSentencePieceTokenizer",
                              "--tokenizer-model", model, "--workers", str(w)], check=True, capture_output=True, text=True)
        speed = float(re.search(r"([\d.]+) MB/s", out.stdout + out.stderr).group(1))
        got = np.fromfile(os.path.join(work, f"ours{w}_text_document.bin"), dtype=np.uint16)
        same = len(got) == len(want) and bool((got == want).all())
        rows.append({"impl": "megatron-rs", "workers": w, "mb_per_s": speed, "ids_identical": same})
        if not same:
            print(json.dumps(rows[-1])); sys.exit(1)
for row in rows:
    print(json.dumps(row))
med = lambda impl, w: float(np.median([x["mb_per_s"] for x in rows if x["impl"] == impl and x["workers"] == w]))
print(json.dumps({"corpus_mb": round(mb, 2), "tokens": int(len(want)), "sentencepiece_1": med("sentencepiece", 1),
                  "megatron_rs_1": med("megatron-rs", 1), "megatron_rs_2": med("megatron-rs", 2)}))
