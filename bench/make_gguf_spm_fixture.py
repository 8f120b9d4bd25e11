"""A tiny Llama GGUF with a SentencePiece ("llama") vocabulary, and llama.cpp's own token ids for
test inputs, for the tests of `megatron convert --from gguf` / `--to gguf` on SPM vocabularies.

The vocabulary: a SentencePiece BPE model trained here on examples/sotu with Llama's options
(byte fallback, split digits, whitespace-only pieces, identity normalization, dummy prefix),
1,000 pieces, written as llama.cpp's convert_hf_to_gguf.py writes a tokenizer.model
(`_create_vocab_sentencepiece`: piece text, SentencePiece score, type UNKNOWN / CONTROL / UNUSED /
BYTE / NORMAL). The model around it: 1 layer, hidden 16, random f16 weights (only the vocabulary
is tested). The expected ids: llama.cpp's `llama-tokenize --ids --no-bos` on each input (special
tokens parsed, its default: control tokens in the text match, as in a Hugging Face tokenizer) (llama.cpp's own SPM test inputs, `models/ggml-vocab-llama-spm.gguf.inp`, plus
lines of the sotu corpus). Usage (from the repository root; numpy, gguf, sentencepiece):
python bench/make_gguf_spm_fixture.py LLAMA_CPP_DIR   (its build/bin/llama-tokenize and models/)

The same SentencePiece model is kept as megatron-data's `tiny-sotu-bpe.model` fixture (Megatron's
`--tokenizer-type Llama2Tokenizer / GPTSentencePieceTokenizer --tokenizer-model`), with what
the sentencepiece library itself makes of the same texts (`encode`, and `decode` of those ids).
"""
import glob, json, os, re, subprocess, sys, tempfile
import numpy as np
import gguf
import sentencepiece as spm

lcpp = sys.argv[1]
root = os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests", "fixtures", "gguf")
work = tempfile.mkdtemp()
texts = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "sotu", "*.txt")))
corpus = os.path.join(work, "corpus.txt")
with open(corpus, "w", encoding="utf-8") as f:
    for t in texts:
        # One sentence per line (the speeches are one line each; SentencePiece skips long lines).
        f.write(re.sub(r"(?<=[.?!]) +", "\n", open(t, encoding="utf-8").read()))
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "sp"), model_type="bpe", vocab_size=1000,
    byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
    character_coverage=0.999, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
sp = spm.SentencePieceProcessor(model_file=os.path.join(work, "sp.model"))
T = gguf.TokenType
tokens, scores, types = [], [], []
for i in range(sp.vocab_size()):
    tokens.append(sp.IdToPiece(i)); scores.append(sp.GetScore(i))
    types.append(T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i) else
                 T.UNUSED if sp.IsUnused(i) else T.BYTE if sp.IsByte(i) else T.NORMAL)
n, h, ff = len(tokens), 16, 32
path = os.path.join(root, "tiny-llama-spm.gguf")
w = gguf.GGUFWriter(path, "llama")
w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(h); w.add_feed_forward_length(ff)
w.add_head_count(2); w.add_head_count_kv(2); w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(n)
w.add_tokenizer_model("llama"); w.add_tokenizer_pre("default")
w.add_token_list(tokens); w.add_token_scores(scores); w.add_token_types(types)
w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
w.add_add_bos_token(True); w.add_add_eos_token(False)
rng = np.random.default_rng(0)
rand = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float16)
w.add_tensor("token_embd.weight", rand(n, h)); w.add_tensor("output_norm.weight", np.ones(h, np.float32))
for name, shape in [("attn_norm", (h,)), ("ffn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (h, h)),
                    ("attn_v", (h, h)), ("attn_output", (h, h)), ("ffn_gate", (ff, h)), ("ffn_up", (ff, h)),
                    ("ffn_down", (h, ff))]:
    w.add_tensor(f"blk.0.{name}.weight", np.ones(shape, np.float32) if len(shape) == 1 else rand(*shape))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

inputs = open(os.path.join(lcpp, "models", "ggml-vocab-llama-spm.gguf.inp"), encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
sentences = open(corpus, encoding="utf-8").read().split("\n")
inputs += sentences[:3] + [" ".join(sentences[3:12])] + ["Ünïcödé — “quotes” and 日本語, emoji 🦙!", "<s> literal </s> and <0x41>"]
cases = []
for text in inputs:
    p = os.path.join(work, "in.txt")
    open(p, "w", encoding="utf-8").write(text)
    out = subprocess.run([os.path.join(lcpp, "build", "bin", "llama-tokenize"), "-m", path, "-f", p, "--ids",
                          "--no-bos", "--no-escape", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    cases.append({"text": text, "ids": json.loads(out)})
source = "llama.cpp llama-tokenize --ids --no-bos (special tokens parsed) on tiny-llama-spm.gguf"
with open(os.path.join(root, "tiny-llama-spm-vectors.json"), "w", encoding="utf-8") as f:
    f.write('{"source": %s, "cases": [\n' % json.dumps(source))
    f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]}\n")
print("wrote", path, os.path.getsize(path), "bytes;", len(cases), "cases")

# The SentencePiece model itself, and the sentencepiece library's own ids for the same texts.
import shutil
sp_root = os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-data", "tests", "fixtures", "sentencepiece")
os.makedirs(sp_root, exist_ok=True)
import sentencepiece.sentencepiece_model_pb2 as pb
def without_paths(path):
    """The model with the trainer's temporary input and output paths blanked (so the file is
    the same on every run)."""
    proto = pb.ModelProto()
    proto.ParseFromString(open(path, "rb").read())
    proto.trainer_spec.ClearField("input"); proto.trainer_spec.ClearField("model_prefix")
    return proto


def write_vectors(model, texts, source):
    """What the sentencepiece library makes of `texts` with `model` (`encode`, and `decode` of
    those ids), written beside it as <model>-vectors.json, one case per line."""
    p = spm.SentencePieceProcessor(model_file=model)
    cases = [{"text": t, "ids": p.encode(t), "decoded": p.decode(p.encode(t))} for t in texts]
    with open(model[:-len(".model")] + "-vectors.json", "w", encoding="utf-8") as f:
        f.write('{"source": %s, "cases": [\n' % json.dumps(source, ensure_ascii=False))
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]}\n")
    print("wrote", model, os.path.getsize(model), "bytes;", len(cases), "cases")


open(os.path.join(sp_root, "tiny-sotu-bpe.model"), "wb").write(without_paths(os.path.join(work, "sp.model")).SerializeToString())
write_vectors(os.path.join(sp_root, "tiny-sotu-bpe.model"), inputs,
              "sentencepiece %s SentencePieceProcessor.encode / decode on tiny-sotu-bpe.model" % spm.__version__)

# A second model for what the first lacks: user-defined pieces (kept whole), pieces of type
# UNUSED (sentencepiece merges into them, then splits them back) and no byte fallback (runs of
# unknown characters become one unknown id).
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "sp2"), model_type="bpe", vocab_size=800,
    byte_fallback=False, split_digits=True, allow_whitespace_only_pieces=True,
    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
    character_coverage=0.999, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "America", "\u2581\u2581\u2581\u2581", "foo"])
proto = without_paths(os.path.join(work, "sp2.model"))
unused = ["\u2581the", "ing", "\u2581and"]
for p in proto.pieces:
    if p.piece in unused:
        p.type = pb.ModelProto.SentencePiece.UNUSED
special = os.path.join(sp_root, "tiny-sotu-bpe-special.model")
open(special, "wb").write(proto.SerializeToString())
texts2 = ["<start_of_turn>user\nHello America, the foo bar<end_of_turn>", "    indented    text",
          "America America", "xfoo fooAmerica", " America", "The United States of America and     more.",
          "the thing and the sing, nothing and anything", "Ünïcödé — “quotes” and 日本語, emoji 🦙!",
          "<s> literal </s>"] + sentences[:3]
write_vectors(special, texts2,
              "sentencepiece %s on tiny-sotu-bpe-special.model (user-defined %s; unused %s; no byte fallback)"
              % (spm.__version__, json.dumps(proto.trainer_spec.user_defined_symbols[:], ensure_ascii=False).replace('"', "'"), json.dumps(unused, ensure_ascii=False).replace('"', "'")))

# A third model with sentencepiece's default whitespace handling (`remove_extra_whitespaces`:
# spaces at the ends dropped, runs of them made one), user-defined pieces with spaces in them.
user_defined3 = ["United States", " Congress", "\u2581\u2581"]
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "sp3"), model_type="bpe", vocab_size=600,
    byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=True,
    add_dummy_prefix=True, character_coverage=0.999, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    num_threads=1, minloglevel=2, user_defined_symbols=user_defined3)
collapsing = os.path.join(sp_root, "tiny-sotu-bpe-collapsing.model")
open(collapsing, "wb").write(without_paths(os.path.join(work, "sp3.model")).SerializeToString())
texts3 = ["", " ", "   ", "  Hello   world  ", "\tHello\n", "Hello\u2581\u2581", "\u2581\u2581",
          " \u2581 a", "the  United States   Congress", "a  Congress", "x \u2581\u2581  y",
          "Ünïcödé — “quotes” and 日本語,  emoji 🦙! "] + sentences[:2]
write_vectors(collapsing, texts3,
              "sentencepiece %s on tiny-sotu-bpe-collapsing.model (remove_extra_whitespaces; user-defined %s)"
              % (spm.__version__, json.dumps(user_defined3, ensure_ascii=False).replace('"', "'")))

# A fourth model with all of sentencepiece's normalization defaults (`nmt_nfkc` rules compiled
# into the model, whitespace collapsed), what `spm_train --model_type=bpe` writes.
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "sp4"), model_type="bpe", vocab_size=600,
    character_coverage=0.999, num_threads=1, minloglevel=2)
nfkc = os.path.join(sp_root, "tiny-sotu-bpe-nfkc.model")
open(nfkc, "wb").write(without_paths(os.path.join(work, "sp4.model")).SerializeToString())
texts4 = ["ＡＢＣ１２３ full width", "ﬁne ﬂour", "① ② ½ ™", "ｶﾀｶﾅ and ｶﾞ", "A\u030a vs \u00c5",
          "a\u3000b\u00a0c", "\tTabs\tand\nlines\r\n", "  Hello   world  ", "Ｈｅｌｌｏ，　ｗｏｒｌｄ！",
          "\u2126 Ohm, \u212b Angstrom", "x\u200by zero width", "Ünïcödé — “quotes” and 日本語, emoji 🦙!",
          "㍻ ㎏ ㈱", "\u1100\u1161 jamo"] + sentences[:2]
write_vectors(nfkc, texts4,
              "sentencepiece %s on tiny-sotu-bpe-nfkc.model (nmt_nfkc, remove_extra_whitespaces, no byte fallback)"
              % spm.__version__)

# A fifth model, unigram (T5's and ALBERT's kind, sentencepiece's default model type), with
# identity rules, user-defined pieces, three pieces made UNUSED and no byte fallback.
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "sp5"), model_type="unigram", vocab_size=700,
    normalization_rule_name="identity", character_coverage=0.999, num_threads=1, minloglevel=2,
    user_defined_symbols=["<extra_id_0>", "America", "\u2581\u2581"])
proto = without_paths(os.path.join(work, "sp5.model"))
unused5 = [p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL][40:43]
for p in proto.pieces:
    if p.piece in unused5:
        p.type = pb.ModelProto.SentencePiece.UNUSED
unigram = os.path.join(sp_root, "tiny-sotu-unigram.model")
open(unigram, "wb").write(proto.SerializeToString())
texts5 = ["", "  Hello   world  ", "<extra_id_0> the America  of Americans", "x▁▁y", "Ünïcödé — “quotes” and 日本語, emoji 🦙!",
          " ".join(unused5) + " " + "".join(unused5), "\tTabs\tand\nlines"] + sentences[:4]
write_vectors(unigram, texts5,
              "sentencepiece %s on tiny-sotu-unigram.model (unigram; identity; user-defined; unused %s; no byte fallback)"
              % (spm.__version__, json.dumps(unused5, ensure_ascii=False).replace('"', "'")))

