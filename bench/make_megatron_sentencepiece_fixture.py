"""What Megatron-LM's own `SentencePieceTokenizer` makes of test texts, for the tests of
`--tokenizer-type SentencePieceTokenizer` (crates/megatron-data/tests/sentencepiece_megatron.rs).

The reference is Megatron-LM's class itself: `_SentencePieceTokenizer` as it stood in
megatron/training/tokenizer/tokenizer.py before the 2025 move to megatron.core.tokenizers
(commit 32570939^), read out of a Megatron-LM clone with `ast` and run on the sentencepiece
library (its base class, which only records the constructor's arguments, is replaced by an empty
one; torch is not needed). It writes, beside each model in
crates/megatron-data/tests/fixtures/sentencepiece/, <model>-megatron.json: the vocabulary size,
the named special ids, the sentinel ids, the appended tokens' texts, and for each text the ids of
`tokenize` and the text of `detokenize`.

It also trains the T5-style model the other fixtures lack (pad 0, EOS 1, unknown 2, no BOS, as
Google's T5 vocabulary numbers them). Usage, from the repository root (sentencepiece installed):
python bench/make_megatron_sentencepiece_fixture.py MEGATRON_LM_GIT_DIR
"""
import ast, glob, json, os, re, subprocess, sys, tempfile
import sentencepiece as spm
import sentencepiece.sentencepiece_model_pb2 as pb

COMMIT = "32570939300c4377060bc8f13c90275ea7e649fe^"
megatron = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, "..", "crates", "megatron-data", "tests", "fixtures", "sentencepiece")

source = subprocess.run(["git", "-C", megatron, "show", COMMIT + ":megatron/training/tokenizer/tokenizer.py"],
                        capture_output=True, text=True, check=True).stdout
cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "_SentencePieceTokenizer")
namespace = {"MegatronLegacyTokenizer": type("MegatronLegacyTokenizer", (), {"__init__": lambda self, *a, **k: None})}
exec(compile(ast.Module(body=[cls], type_ignores=[]), "megatron/training/tokenizer/tokenizer.py", "exec"), namespace)
MegatronSentencePiece = namespace["_SentencePieceTokenizer"]

# The T5-style model: unigram, identity rules, pad/EOS/unknown at 0/1/2 and no BOS.
work = tempfile.mkdtemp()
corpus = os.path.join(work, "corpus.txt")
with open(corpus, "w", encoding="utf-8") as f:
    for t in sorted(glob.glob(os.path.join(here, "..", "examples", "sotu", "*.txt"))):
        f.write(re.sub(r"(?<=[.?!]) +", "\n", open(t, encoding="utf-8").read()))
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(work, "t5"), model_type="unigram", vocab_size=500,
    normalization_rule_name="identity", character_coverage=0.999, num_threads=1, minloglevel=2,
    pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
proto = pb.ModelProto()
proto.ParseFromString(open(os.path.join(work, "t5.model"), "rb").read())
proto.trainer_spec.ClearField("input"); proto.trainer_spec.ClearField("model_prefix")
open(os.path.join(root, "tiny-sotu-t5-unigram.model"), "wb").write(proto.SerializeToString())

sentences = open(corpus, encoding="utf-8").read().split("\n")
texts = ["", "plain text without specials", "<CLS> first <SEP> second <SEP>", "x<MASK>y<MASK><MASK>",
         "ends with <EOD>", "<EOD>", "<s> and </s> and <pad> and <unk>", "<PAD> <BOS> <EOS>",
         "<extra_id_1> and <extra_id_10> and <extra_id_0>", "<extra_id_99><extra_id_9>z", "<CLS<SEP>>",
         "Ünïcödé — “quotes” <MASK> 日本語, emoji 🦙!", "  spaces  <SEP>  around  "] + sentences[:3]
for model, extra in [("tiny-sotu-bpe.model", 0), ("tiny-sotu-unigram.model", 12), ("tiny-sotu-t5-unigram.model", 100)]:
    path = os.path.join(root, model)
    t = MegatronSentencePiece(path, vocab_extra_ids=extra)
    n = len(t.tokenizer)
    out = {
        "source": "Megatron-LM %s _SentencePieceTokenizer (vocab_extra_ids=%d) on sentencepiece %s"
                  % (COMMIT, extra, spm.__version__),
        "vocab_extra_ids": extra, "vocab_size": t.vocab_size,
        "appended": [t.inv_vocab[i] for i in range(n, t.vocab_size)],
        "cls": t.cls, "sep": t.sep, "eod": t.eod, "mask": t.mask, "pad": t.pad, "bos": t.bos, "eos": t.eos,
        "additional_special_tokens_ids": t.additional_special_tokens_ids,
        "cases": [{"text": s, "ids": t.tokenize(s), "decoded": t.detokenize(t.tokenize(s))} for s in texts],
    }
    dest = path[:-len(".model")] + "-megatron.json"
    with open(dest, "w", encoding="utf-8") as f:
        head = {k: v for k, v in out.items() if k != "cases"}
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in out["cases"]) + "\n]}\n")
    print("wrote", dest, len(out["cases"]), "cases, vocabulary", t.vocab_size)
