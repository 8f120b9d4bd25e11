"""Writes the `v012_*` runs of tests/fixtures/megatron_resume: runs stopped mid-way by
Megatron-LM core_v0.12.0 (May 2025), saved with `--ckpt-format torch_dist` and the distributed
optimizer. From megatron-core 0.9 to 0.12, `--ckpt-fully-parallel-save` was on by default, and
the distributed optimizer then saved its state as `fully_sharded_model_space`: each
parameter's main copy and moments as flattened slices of its tensor-parallel shard, stored
under a grid-shaped key, which Megatron-LM since 0.13 still loads but no longer writes.

The run is bench/make_megatron_optim_fixtures.py's (same data, flags, CPU shims and sample
order) on v0.12's own APIs: its argument parser, `pretrain_gpt.model_provider`, `get_model`,
`get_megatron_optimizer`, its scheduler, `forward_backward_func` with v0.12's `loss_func`,
`save_checkpoint` at iteration 3, and the losses it logs for iterations 4-6.

  PYTHONPATH=<Megatron-LM at core_v0.12.0>:bench python bench/make_megatron_v012_optim_fixtures.py OUT [runs]
(the environment of bench/make_megatron_optim_fixtures.py, plus six and regex; megatron-core's
compiled helpers_cpp beside v0.12's megatron/core/datasets/helpers.py).
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import make_megatron_dist_fixtures as fx
import make_megatron_optim_fixtures as opt

DISTOPT = ["--use-distributed-optimizer"]
RUNS = {
    "v012_llama_distopt_tp2_dp2": (2, 1, 4, opt.LLAMA + DISTOPT),
    "v012_gpt_bf16_distopt_dp2": (1, 1, 2, opt.GPT + DISTOPT + ["--bf16"]),
    "v012_gpt_distopt_pp2_dp2": (1, 2, 4, opt.GPT + DISTOPT),
}


def run(rank, world, tp, pp, flags, out, port):
    np.product = np.prod  # v0.12's checkpointing predates NumPy 2, which dropped the alias
    fx.cpu_device_tensors()
    import megatron.training.training  # noqa: F401
    opt.cpu_model_wrapping()
    prefix = os.path.join(os.path.dirname(out), "data", "tokens_text_document")
    flags = flags + opt.DATA + ["--data-path", prefix, "--data-cache-path",
                                os.path.join(out, "cache"), "--save", out,
                                "--save-interval", str(opt.SAVE_AT)]
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.argv = ["pretrain_gpt.py"] + fx.COMMON + flags + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.core import parallel_state as mpu
    args = parse_args()
    validate_args(args)
    set_global_variables(args)
    mpu.initialize_model_parallel(tp, pp)
    import dataclasses
    from functools import partial
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import get_model, get_optimizer_param_scheduler
    import contextlib
    import pretrain_gpt
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # v0.12's distributed optimizer quantizes FP8 parameter shards after each step through
    # Transformer Engine, failing without it even where there are none.
    import megatron.core.fp8_utils as fp8_utils
    fp8_utils._quantize_param_shard_impl = lambda *a, **k: None
    # v0.12's writer calls torch's DCP `_write_item` without the serialization format torch
    # 2.15 asks for (the torch.save format it wrote then).
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    from torch.distributed.checkpoint import filesystem as dcp_fs
    write_item = fs_async._write_item
    fs_async._write_item = lambda *a: write_item(
        *a, dcp_fs.SerializationFormat.TORCH_SAVE)

    torch.manual_seed(args.seed)
    model = get_model(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig)
              if hasattr(args, f.name)}
    optimizer = get_megatron_optimizer(OptimizerConfig(**kwargs), model)
    scheduler = get_optimizer_param_scheduler(optimizer)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    ds_config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [opt.TOTAL * args.global_batch_size, 0, 0], lambda: True, ds_config).build()
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    n_micro = gbs // (mbs * dp)

    def batches(it):
        return opt.sampler_batches(train_ds, it, gbs, mbs, dp, dp_rank)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return output, partial(pretrain_gpt.loss_func, b["loss_mask"].float())

    losses = []
    for it in range(opt.TOTAL):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches(it), model=model,
            num_microbatches=n_micro, seq_length=args.seq_length, micro_batch_size=mbs,
            decoder_seq_length=args.seq_length, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        scheduler.step(increment=gbs)
        args.consumed_train_samples += gbs
        if mpu.is_pipeline_last_stage():
            # v0.12 reports (loss sum, tokens) as a tuple.
            s = torch.stack([torch.stack([torch.as_tensor(x, dtype=torch.float32).reshape(())
                                          for x in r["lm loss"]]) for r in reduced]).sum(0)
            dist.all_reduce(s, group=mpu.get_data_parallel_group())
            losses.append({"iteration": it + 1, "lm_loss": (s[0] / s[1]).item(),
                           "grad_norm": float(grad_norm)})
        if it + 1 == opt.SAVE_AT:
            save_checkpoint(it + 1, model, optimizer, scheduler, 0)
    if rank == world - 1:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f, indent=1)


if __name__ == "__main__":
    root = sys.argv[1]
    only = sys.argv[2:] or list(RUNS)
    port = 29950
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    opt.write_data(os.path.join(root, "data", "tokens_text_document"))
    for name in only:
        tp, pp, world, flags = RUNS[name]
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        mp.spawn(run, args=(world, tp, pp, flags, out, port), nprocs=world)
        port += 1
