"""Writes tests/fixtures/megatron_resume/full_validation.json: Megatron-LM's `--full-validation`
losses for the weights of the `gpt_adam` run (bench/make_megatron_optim_fixtures.py, loaded with
`--finetune`), on the fixtures' dataset split 70/30/0, for three validations in a row; and, with `--multiple-validation-sets`, two datasets of
`--valid-data-path` (the fixtures' and a second one this script writes beside it) scored apart. Each comes
from Megatron-LM's own `build_train_valid_test_data_iterators` (the one-epoch validation split,
`MegatronFullValidationSampler`, its `cyclic_iter`, the evaluation-iteration count all-reduced
over data-parallel ranks) and its own `evaluate`, at DP 1 and DP 2 and with evaluation batch
sizes of their own: where the data-parallel size does not divide the split or an iteration takes
several micro-batches, its cyclic iterators read some samples twice and go on from one
validation to the next, and the three losses differ.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/make_full_validation_fixture.py \\
      crates/megatron-training/tests/fixtures/megatron_resume
(the environment of bench/make_megatron_optim_fixtures.py).
"""
import contextlib
import json
import os
import sys
from functools import partial

import torch
import torch.multiprocessing as mp

import make_megatron_dist_fixtures as fx
import make_megatron_optim_fixtures as opt

EVALUATIONS = 3
# name: (data-parallel size, batch flags)
FULL = ["--full-validation"]
CASES = {
    "dp1_two_micro_batches": (1, FULL + ["--micro-batch-size", "1", "--global-batch-size", "2"]),
    "dp2": (2, FULL + ["--micro-batch-size", "1", "--global-batch-size", "2"]),
    "dp2_eval_batches": (2, FULL + ["--micro-batch-size", "2", "--global-batch-size", "4",
                                    "--eval-micro-batch-size", "1",
                                    "--eval-global-batch-size", "4"]),
    # --multiple-validation-sets: the two datasets of --valid-data-path scored apart, each with
    # its own iterators (`validation-main`, `validation-other`).
    "dp2_two_sets": (2, FULL + ["--micro-batch-size", "1", "--global-batch-size", "2",
                                "--multiple-validation-sets", "--validation-set-names", "main",
                                "other"]),
    # Not full: --eval-iters 2 evaluation batches of 6 in micro-batches of 1, the validation
    # iterator going on from one validation to the next (the split sized for them).
    "dp2_eval_batches_not_full": (2, ["--micro-batch-size", "2", "--global-batch-size", "4",
                                      "--eval-micro-batch-size", "1",
                                      "--eval-global-batch-size", "6", "--eval-iters", "2"]),
}
SECOND = "tokens_b_text_document"


def write_second(prefix):
    """A second small dataset for the sets: documents of random ids below 100, ended by 100."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(12)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(16):
        n = int(rng.integers(5, 40))
        b.add_document(torch.from_numpy(np.append(rng.integers(0, 100, n), 100).astype(np.int64)),
                       [n + 1])
    b.finalize(prefix + ".idx")
FLAGS = ["--split", "70,30,0", "--eval-interval", "1", "--lr", "0", "--min-lr", "0",
         "--train-iters", "2", "--finetune", "--no-load-rng", "--num-workers", "0"]


def run(rank, world, flags, out, port, fixtures):
    fx.cpu_device_tensors()
    import megatron.training.training  # noqa: F401
    opt.cpu_model_wrapping()
    prefix = os.path.join(fixtures, "data", "tokens_text_document")
    if "--multiple-validation-sets" in flags:
        data = ["--train-data-path", prefix, "--valid-data-path", prefix,
                os.path.join(fixtures, "data", SECOND)]
    else:
        data = ["--data-path", prefix]
    flags = opt.GPT + opt.DATA + ["--eval-iters", "1"] + FLAGS + flags + data + [
        "--data-cache-path", os.path.join(out, "cache"),
        "--load", os.path.join(fixtures, "gpt_adam")]
    if "--train-data-path" in flags:
        # Per-split paths take no --split (Megatron-LM asserts they are incompatible).
        at = [i for i, f in enumerate(flags) if f == "--split"]
        flags = [f for i, f in enumerate(flags) if i not in at and i - 1 not in at]
    args, _ = fx.setup(rank, world, 1, 1, flags, port)
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import (build_train_valid_test_data_iterators, evaluate,
                                            get_model)
    import pretrain_gpt
    from gpt_builders import gpt_builder
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(args.seed)
    model = get_model(partial(pretrain_gpt.model_provider, gpt_builder),
                      ModelType.encoder_or_decoder)
    args.iteration, _ = load_checkpoint(model, None, None)
    config = get_model_config(model[0])
    provider = pretrain_gpt.train_valid_test_datasets_provider
    provider.is_distributed = True
    _, valid, _ = build_train_valid_test_data_iterators(provider)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return output, partial(pretrain_gpt.loss_func, b["loss_mask"].float(), model=model)

    losses = []
    sets = valid if args.multiple_validation_sets else [valid]
    eval_iters = args.eval_iters if args.multiple_validation_sets else [args.eval_iters]
    for _ in range(EVALUATIONS):
        # One validation: each set in order, as evaluate_and_print_results scores them.
        for it, n in zip(sets, eval_iters):
            total, _, _ = evaluate(forward_step, it, model, None, config, eval_iters=n)
            losses.append(total["lm loss"].item())
    if rank == world - 1:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "eval_iters": args.eval_iters}, f)


if __name__ == "__main__":
    import tempfile
    fixtures = os.path.abspath(sys.argv[1])
    second = os.path.join(fixtures, "data", SECOND)
    if not os.path.exists(second + ".idx"):
        write_second(second)
    result, port = {}, 29980
    for name, (world, flags) in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(run, args=(world, flags, out, port, fixtures), nprocs=world)
            port += 1
            result[name] = json.load(open(os.path.join(out, "losses.json")))
            print(name, result[name], flush=True)
    with open(os.path.join(fixtures, "full_validation.json"), "w") as f:
        json.dump(result, f, indent=1)
