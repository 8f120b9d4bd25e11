"""Writes crates/megatron-data/tests/fixtures/blends.json: the samples megatron-core's
`BlendedMegatronDatasetBuilder` gives for blends of the two datasets of
crates/megatron-training/tests/fixtures/megatron_resume/data (the fixtures' and the second one
bench/make_full_validation_fixture.py writes), split 70/30/0, sequence length 16:

- `unweighted`: `--data-path A B`, whose weights megatron-core infers from the datasets'
  lengths (one epoch of each, blended in proportion, at most one epoch in all);
- `unweighted_full_validation`: the same with the validation split unsized (`--full-validation`:
  every sample of both, exhaustively blended);
- `weighted`: `--data-path 0.3 A 0.7 B`, and the same with `--mid-level-dataset-surplus 1.5`.

Each case records the requested sizes and, per split, every sample's tokens.

  PYTHONPATH=<Megatron-LM checkout> python bench/make_blend_fixture.py \\
      crates/megatron-training/tests/fixtures/megatron_resume/data \\
      crates/megatron-data/tests/fixtures/blends.json
(with megatron-core's compiled `helpers_cpp`, as for bench/make_megatron_optim_fixtures.py).
"""
import json
import os
import sys

from megatron.core.datasets.blended_megatron_dataset_builder import \
    BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


class Tok:
    """The NullTokenizer of vocabulary 100 the fixtures use: its EOD is 100."""
    eod = 100
    pad = 0
    unique_identifiers = {"class": "Tok"}
    vocab_size = 101


def samples(data, prefixes, weights, sizes, surplus=0.005):
    cfg = GPTDatasetConfig(random_seed=5, blend=(prefixes, weights), sequence_length=16,
                           split="70,30,0", tokenizer=Tok(), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None,
                           mid_level_dataset_surplus=surplus)
    splits = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    out = {}
    for name, ds in zip(["train", "valid", "test"], splits):
        if ds is not None:
            out[name] = [ds[i]["tokens"].tolist() + [int(ds[i]["labels"][-1])]
                         for i in range(len(ds))]
    return {"sizes": sizes, "samples": out}


def main(data, out):
    a = os.path.join(data, "tokens_text_document")
    b = os.path.join(data, "tokens_b_text_document")
    cases = {
        "unweighted": samples(data, [a, b], None, [40, 12, 0]),
        "unweighted_full_validation": samples(data, [a, b], None, [40, None, 0]),
        "weighted": samples(data, [a, b], [0.3, 0.7], [40, 12, 0]),
        # --mid-level-dataset-surplus 1.5: each dataset built for 2.5 times its share, which
        # changes its epochs and so its shuffle.
        "weighted_surplus_1.5": samples(data, [a, b], [0.3, 0.7], [40, 12, 0], 1.5),
    }
    with open(out, "w") as f:
        json.dump(cases, f)
    for k, v in cases.items():
        print(k, {s: len(x) for s, x in v["samples"].items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
