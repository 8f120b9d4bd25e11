"""What Megatron's tools/preprocess_data.py does, as a baseline for `megatron preprocess`: a
multiprocessing pool of the same Hugging Face byte-level BPE (GPT-2 vocab.json/merges.txt, no
prefix space) encoding JSON lines (`imap` with chunksize 25, as Megatron does), written through
megatron-core's IndexedDatasetBuilder, with --append-eod. Prints MB/s and peak RSS.

    python bench/preprocess_megatron_baseline.py --input X.jsonl --output-prefix out \
        --vocab-file vocab.json --merge-file merges.txt --workers 2
"""
import argparse, json, multiprocessing, resource, time
import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TOK = None


def init(vocab, merges):
    global TOK
    TOK = Tokenizer(models.BPE.from_file(vocab, merges))
    TOK.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    TOK.decoder = decoders.ByteLevel()


def encode(line):
    text = json.loads(line)["text"]
    ids = TOK.encode(text).ids
    if ids:
        ids.append(50256)
    return ids, len(line)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--input", required=True)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--vocab-file", required=True)
    p.add_argument("--merge-file", required=True)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    t0 = time.time()
    pool = multiprocessing.Pool(a.workers, initializer=init, initargs=(a.vocab_file, a.merge_file))
    builder = IndexedDatasetBuilder(a.output_prefix + "_text_document.bin", dtype=numpy.uint16)
    total = docs = 0
    with open(a.input, encoding="utf-8") as f:
        for ids, n in pool.imap(encode, f, 25):
            total += n
            if ids:
                builder.add_item(torch.IntTensor(ids))
                builder.end_document()
                docs += 1
    builder.finalize(a.output_prefix + "_text_document.idx")
    pool.close()
    dt = time.time() - t0
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"impl": "python-megatron-preprocess", "workers": a.workers, "documents": docs,
                      "mb": total / 1e6, "seconds": dt, "mb_per_s": total / 1e6 / dt,
                      "peak_rss_main_mb": rss_self / 1024, "peak_rss_largest_worker_mb": rss_children / 1024}))


if __name__ == "__main__":
    main()
