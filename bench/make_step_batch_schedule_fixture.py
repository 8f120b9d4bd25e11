"""Writes crates/megatron-training/tests/fixtures/step_batch_size_schedule.json: the global batch
size of each iteration megatron-core's `StepBatchsizeNumMicroBatchesCalculator` gives for a few
`--step-batch-size-schedule` strings (thresholds in tokens, as Megatron-LM's training passes the
sequence length), stepping the consumed samples by each batch, and the iterations
`update_train_iters` counts for `--train-samples` training.

  PYTHONPATH=<Megatron-LM checkout> python bench/make_step_batch_schedule_fixture.py OUT.json
"""
import json
import sys

from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

# (schedule, sequence length, micro-batch size, data-parallel size, train samples)
CASES = [
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048, 1, 16, 40_000_000),
    ("0:4, 256:8 1K:12", 16, 2, 2, 200),
    ("1.5k:8 0:2 0.2K:4", 8, 1, 2, 120),
]


def main(out):
    result = []
    for schedule, seq, mbs, dp, samples in CASES:
        c = StepBatchsizeNumMicroBatchesCalculator(mbs, dp, False, 1, schedule, seq)
        consumed, sizes = 0, []
        while consumed < samples:
            c.update(consumed, consistency_check=False)
            b = c.get_current_global_batch_size()
            sizes.append(b)
            consumed += b
        result.append({"schedule": schedule, "seq_length": seq, "micro_batch_size": mbs,
                       "data_parallel_size": dp, "train_samples": samples,
                       "steps": c.schedule, "train_iters": len(sizes),
                       "first_sizes": sizes[:64], "last_sizes": sizes[-8:]})
        print(schedule, c.schedule, len(sizes))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
