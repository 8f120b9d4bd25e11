"""Time megatron-core's GPTDataset index build (document, sample and shuffle indices; no cache)
for N samples over a dataset prefix, for comparison with `megatron bench index`.
Usage: index_build_megatron.py PREFIX [--num-samples 10000000] [--seq-length 1024]"""
import argparse, time
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split
import numpy


class Tok:
    eod = 50256
    pad = 0
    unique_identifiers = {"class": "Tok"}
    vocab_size = 50257


p = argparse.ArgumentParser()
p.add_argument("prefix")
p.add_argument("--num-samples", type=int, default=10_000_000)
p.add_argument("--seq-length", type=int, default=1024)
a = p.parse_args()
ds = IndexedDataset(a.prefix)
cfg = GPTDatasetConfig(random_seed=1234, blend=([a.prefix], None), sequence_length=a.seq_length, split="1",
                       tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                       path_to_cache=None)
t = time.time()
g = GPTDataset(ds, a.prefix, numpy.arange(len(ds), dtype=numpy.int32), a.num_samples, Split.train, cfg)
print(f"megatron-core GPTDataset indices for {a.num_samples} samples (seq {a.seq_length}): {time.time() - t:.2f} s, len {len(g)}")
