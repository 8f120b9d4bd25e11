"""Writes crates/megatron-data/tests/fixtures/cyclic_sampler.json: the micro-batches Megatron-LM's
own `MegatronPretrainingRandomSampler` (`--dataloader-type cyclic`) hands each data-parallel rank,
iterated as `cyclic_iter` does (a new `__iter__` when an epoch is spent), from a given consumed-
samples count, over several epochs, with and without data sharding.

Run (needs torch; nothing here runs in CI, the output is committed):
  PYTHONPATH=<Megatron-LM checkout, HEAD d98e8a6> python bench/make_cyclic_sampler_fixture.py OUT.json
"""
import json
import sys

from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler

# (total samples, micro-batch size, data-parallel size, data sharding, consumed at start)
CASES = [
    (10, 2, 1, True, 0),
    (23, 2, 2, True, 0),
    (23, 2, 2, False, 0),
    # total % (mbs * dp) >= mbs: the unsharded permutation is longer than an epoch.
    (30, 3, 3, False, 0),
    (50, 1, 4, True, 28),
    (1000, 4, 2, True, 984),
    (1000, 4, 2, False, 1976),
]


def micro_batches(total, mbs, dp, sharding, consumed, rank, count):
    s = MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, sharding)
    out = []
    while len(out) < count:
        for b in s:
            out.append(b)
            if len(out) == count:
                break
    return out


def main(path):
    cases = []
    for total, mbs, dp, sharding, consumed in CASES:
        epoch = (total - total % (mbs * dp)) // (mbs * dp)
        count = min(3 * epoch, 40)
        ranks = [micro_batches(total, mbs, dp, sharding, consumed, r, count) for r in range(dp)]
        cases.append(dict(total=total, mbs=mbs, dp=dp, data_sharding=sharding,
                          consumed=consumed, ranks=ranks))
    with open(path, "w") as f:
        json.dump(cases, f)


if __name__ == "__main__":
    main(sys.argv[1])
