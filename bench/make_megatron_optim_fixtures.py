"""Writes tests/fixtures/megatron_resume: Megatron-LM runs stopped mid-way, with what a resume
needs — the weights, the optimizer's state (Adam's moments, the fp32 main parameters of a bf16
run, the step), the learning-rate scheduler, the iteration and the samples consumed — saved by
Megatron-LM's own `save_checkpoint` in `--ckpt-format torch_dist` (and, for the `legacy_`
runs, `--ckpt-format torch`), and the losses Megatron-LM
logs for the iterations after the save when it simply goes on.

Each run: Megatron-LM's parser, `gpt_builder`, `get_model` (DDP, Float16Module), the optimizer
of `get_megatron_optimizer` (torch's AdamW here: no apex or Transformer Engine on CPU), its
`OptimizerParamScheduler`, `forward_backward_func` with pretrain_gpt's `loss_func` and
`finalize_model_grads`, and batches from megatron-core's own GPTDataset over a small
`.bin/.idx` it writes with its `IndexedDatasetBuilder`, read in `MegatronPretrainingSampler`'s
order. CPU ranks over gloo.

Run (nothing here runs in CI; the outputs are committed):
  PYTHONPATH=<Megatron-LM checkout, HEAD d98e8a6>:bench python bench/make_megatron_optim_fixtures.py OUT
(the environment of bench/make_megatron_dist_fixtures.py, with megatron-core's compiled
`helpers_cpp` beside Megatron-LM's `megatron/core/datasets/helpers.py`).
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import make_megatron_dist_fixtures as fx

SAVE_AT = 3
TOTAL = 6
DATA = [
    "--split", "100,0,0", "--eval-iters", "0", "--train-iters", str(TOTAL),
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1",
    "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--adam-beta2", "0.95", "--no-create-attention-mask-in-dataloader",
]
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--norm-epsilon",
         "1e-6", "--no-rope-fusion"]
LEGACY = ["--ckpt-format", "torch"]
MLA = fx.MLA_YARN
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"]
# gpt-oss's shape at toy size (megatron-core's gpt-oss flags, Megatron-LM's examples/gptoss):
# learned attention sinks, Quick-GEGLU with the linear offset 1 and a clamp (at 1.0 here, so
# it acts on a model this small), a 3-key sliding window on every other layer, YaRN, and
# biases everywhere: q/k/v and output projections, router, experts. The unfused activation
# (--no-bias-gelu-fusion, as the example passes) clamps after fc1's bias, as Hugging Face does.
GPT_OSS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
           "--normalization", "RMSNorm", "--quick-geglu", "--glu-linear-offset", "1.0",
           "--activation-func-clamp-value", "1.0", "--no-bias-gelu-fusion",
           "--softmax-type", "learnable", "--window-size", "3,0", "--window-attn-skip-freq", "2",
           "--position-embedding-type", "yarn", "--rotary-base", "10000",
           "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
           "--yarn-beta-fast", "32", "--yarn-beta-slow", "1", "--mscale", "1.0",
           "--mscale-all-dim", "0.0", "--no-yarn-correction-range-round-to-int",
           "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-5", "--no-rope-fusion",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
           "--moe-router-dtype", "fp32"]
# Megatron's cyclic loader: batches from its own build_pretraining_data_loader under cyclic_iter.
CYCLIC = ["--dataloader-type", "cyclic", "--num-workers", "0"]
# name: (tp, pp, world, flags)
RUNS = {
    "gpt_adam": (1, 1, 1, GPT),
    "gpt_bf16_adam": (1, 1, 1, GPT + ["--bf16"]),
    "llama_distopt_tp2_dp2": (2, 1, 4, LLAMA + ["--use-distributed-optimizer",
                                                "--dist-ckpt-optim-fully-reshardable"]),
    # Pipeline stages holding the tied embedding twice (the last stage's output-layer copy).
    "gpt_pp2": (1, 2, 2, GPT),
    # The distributed optimizer's default checkpoint form (its gradient buckets).
    "llama_distopt_dp_reshardable": (1, 1, 2, LLAMA + ["--use-distributed-optimizer"]),
    # An fp16 run (its loss scaler's state is not imported: weights alone), kept small.
    "gpt_fp16_small": (1, 1, 1, ["--num-layers", "1", "--hidden-size", "16",
                                 "--num-attention-heads", "2", "--fp16",
                                 "--initial-loss-scale", "128"]),
    # Mixtral-style experts: Megatron-LM steps them with a second, chained optimizer.
    "mixtral_adam": (1, 1, 1, LLAMA + MOE),
    "mixtral_distopt_ep2": (1, 1, 2, LLAMA + MOE + ["--expert-model-parallel-size", "2",
                                                   "--use-distributed-optimizer"]),
    "mixtral_distopt_ep2_fully_reshardable": (1, 1, 2, LLAMA + MOE + [
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--dist-ckpt-optim-fully-reshardable"]),
    # The same in bf16 at TP 2 x DP 2: a bucket per tensor-parallel rank, of TP shards.
    "llama_bf16_distopt_dp_reshardable_tp2_dp2": (2, 1, 4, LLAMA + [
        "--use-distributed-optimizer", "--bf16"]),
    # The legacy format (--ckpt-format torch): the non-distributed optimizer's state by
    # parameter index in each rank's model_optim_rng.pt (bf16: its fp32 main copies by group),
    # or the distributed optimizer's gathered buffers in distrib_optim.pt.
    "legacy_gpt_bf16_tp2": (2, 1, 2, GPT + ["--bf16"] + LEGACY),
    "legacy_gpt_pp2": (1, 2, 2, GPT + LEGACY),
    "legacy_mixtral_adam": (1, 1, 1, LLAMA + MOE + LEGACY),
    "legacy_llama_distopt_tp2_dp2": (2, 1, 4, LLAMA + ["--use-distributed-optimizer"] + LEGACY),
    "legacy_llama_bf16_distopt_dp2": (1, 1, 2, LLAMA + ["--use-distributed-optimizer",
                                                       "--bf16"] + LEGACY),
    "legacy_mixtral_distopt_ep2": (1, 1, 2, LLAMA + MOE + [
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer"] + LEGACY),
    # The distributed optimizer's dp_zero_gather_scatter form (megatron-core 0.7-0.12 wrote it
    # where parallel save was off): each TP/PP domain's buffers gathered to DP rank 0 as one
    # ShardedObject. HEAD still writes it when asked to (DPZERO below).
    "dpzero_llama_tp2_dp2": (2, 1, 4, LLAMA + ["--use-distributed-optimizer"]),
    "dpzero_gpt_bf16_pp2_dp2": (1, 2, 4, GPT + ["--use-distributed-optimizer", "--bf16"]),
    # bf16 norms, equal on both TP ranks and rounding alike: found by elimination and order.
    "dpzero_llama_bf16_tp2_dp2": (2, 1, 4, LLAMA + ["--use-distributed-optimizer", "--bf16"]),
    "dpzero_mixtral_ep2": (1, 1, 2, LLAMA + MOE + ["--expert-model-parallel-size", "2",
                                                  "--use-distributed-optimizer"]),
    # DeepSeek's multi-latent attention (query and key/value latents with their norms, YaRN)
    # with the distributed optimizer at DP 2; and at TP 2 x DP 2, where megatron-core's local
    # spec splits the down projections over the TP ranks, in the bucket form and by name.
    # (At TP 2 the local spec's MLA logs another gradient norm than at TP 1 from the same
    # weights: 3.95059 against 4.03513 at iteration 1, loss 5.626132 both. The TP 2 runs are
    # read for their state, not continued against their log.)
    "mla_distopt_dp2": (1, 1, 2, MLA + ["--use-distributed-optimizer"]),
    "mla_distopt_tp2_dp2": (2, 1, 4, MLA + ["--use-distributed-optimizer"]),
    "mla_distopt_tp2_dp2_fully_reshardable": (2, 1, 4, MLA + [
        "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]),
    # Multi-token prediction (one depth, factor 0.3): the depth's gradient reaches the grad
    # norm, so the continued log checks it.
    "llama_mtp": (1, 1, 1, LLAMA + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]),
    # DeepSeek-V3's shape at toy size: MLA, a dense first layer then MoE (4 experts, top 2,
    # a shared expert, a sigmoid router with its expert bias, top-k scaling 2.5), one MTP
    # depth (an MoE layer, as the last decoder layer is).
    "deepseek_mla_moe_mtp": (1, 1, 1, MLA + MOE + [
        "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "32",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "2.5", "--mtp-num-layers", "1"]),
    # --dataloader-type cyclic at DP 2: each DP rank reads its own shuffled bucket (data
    # sharding), or its stride of one shuffle of the whole dataset (--no-data-sharding).
    "cyclic_gpt_dp2": (1, 1, 2, GPT + CYCLIC),
    "cyclic_llama_no_sharding_tp2_dp2": (2, 1, 4, LLAMA + CYCLIC + ["--no-data-sharding"]),
    # gpt-oss (above) at one rank, and at EP 2 (over the two data-parallel ranks) with the
    # distributed optimizer. Not at TP 2: megatron-core's MoE layer wants sequence parallelism
    # under TP, which the local spec's torch norms refuse; and not at ETP 2, where megatron-core
    # adds fc2's bias on every expert-tensor-parallel rank before the reduction (twice).
    "gpt_oss_adam": (1, 1, 1, GPT_OSS),
    "gpt_oss_distopt_ep2": (1, 1, 2, GPT_OSS + [
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
}
DPZERO = "dpzero_"


def write_data(prefix):
    """Documents of random token ids below the NullTokenizer's 100, ended by its EOD (100)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(11)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        n = int(rng.integers(5, 40))
        b.add_document(torch.from_numpy(np.append(rng.integers(0, 100, n), 100).astype(np.int64)),
                       [n + 1])
    b.finalize(prefix + ".idx")


def sampler_batches(train_ds, it, gbs, mbs, dp, dp_rank):
    """Iteration `it`'s micro-batches for DP rank `dp_rank`, as MegatronPretrainingSampler reads
    them: each global batch's samples in order, DP rank r holding micro-batch rows r*mbs.. of
    each mbs*dp block."""
    start = it * gbs
    for m in range(gbs // (mbs * dp)):
        base = start + m * mbs * dp + dp_rank * mbs
        rows = [train_ds[base + j] for j in range(mbs)]
        yield {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in
               ("tokens", "labels", "loss_mask", "position_ids")}


def cpu_model_wrapping():
    """`get_model` moves chunks to the GPU and builds DDP on a side CUDA stream: here, no-ops."""
    import contextlib
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self

    class Stream:
        def wait_stream(self, *a):
            pass
    torch.cuda.Stream = lambda *a, **k: Stream()
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # The optimizers assert that parameters and main grads are CUDA tensors by type name.
    type_of = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (
        type_of(self).replace("torch.", "torch.cuda.", 1) if not a and not k
        else type_of(self, *a, **k))
    # The schedules count tokens and sum losses in small tensors made on "cuda".
    for name in ("zeros", "ones", "empty", "full"):
        make = getattr(torch, name)
        setattr(torch, name, lambda *a, _make=make, **k: _make(*a, **{
            **k, "device": "cpu"} if str(k.get("device", "")).startswith("cuda") else k))


def run(rank, world, tp, pp, flags, out, port, load=None):
    """Trains to iteration TOTAL, saving at SAVE_AT; or, from checkpoint `load` (its own
    iteration on), without saving. Iteration losses and gradient norms go to out/losses.json."""
    fx.cpu_device_tensors()
    # Megatron-LM's modules first (their annotations use torch.cuda.Stream), then the CPU shims
    # (the tied output layer of a last pipeline stage moves itself to the GPU when built).
    import megatron.training.training  # noqa: F401
    cpu_model_wrapping()
    prefix = os.path.join(os.path.dirname(out), "data", "tokens_text_document")
    flags = flags + DATA + ["--data-path", prefix, "--data-cache-path",
                            os.path.join(out, "cache")]
    flags += ["--load", load] if load else ["--save", out, "--save-interval", str(SAVE_AT)]
    args, _ = fx.setup(rank, world, tp, pp, flags, port)
    from functools import partial
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import save_checkpoint
    if os.path.basename(out).startswith(DPZERO):
        import megatron.training.checkpointing as ckpt
        build = ckpt._build_sharded_state_dict_metadata
        ckpt._build_sharded_state_dict_metadata = lambda *a, **k: {
            **build(*a, **k), "distrib_optim_sharding_type": "dp_zero_gather_scatter"}
    from megatron.training.training import (get_megatron_optimizer_config, get_model,
                                            get_optimizer_param_scheduler)
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    import contextlib
    import pretrain_gpt
    from gpt_builders import gpt_builder
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # An expert with biases at one rank: megatron-core's MLP adds fc2's bias in place to what
    # the single-rank all-reduce handed back as-is from its autograd Function, which autograd
    # forbids; a copy of that output (the same values) lets the run go on.
    import megatron.core.tensor_parallel.layers as tp_layers
    reduce_tp = tp_layers.reduce_from_tensor_model_parallel_region
    tp_layers.reduce_from_tensor_model_parallel_region = (
        lambda x, *a, **k: reduce_tp(x, *a, **k).clone())

    torch.manual_seed(args.seed)
    model = get_model(partial(pretrain_gpt.model_provider, gpt_builder),
                      ModelType.encoder_or_decoder)
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    ds_config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [TOTAL * args.global_batch_size, 0, 0], lambda: True, ds_config).build()
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    n_micro = gbs // (mbs * dp)

    cyclic = None

    def batches(it):
        if cyclic is not None:
            return cyclic
        return sampler_batches(train_ds, it, gbs, mbs, dp, dp_rank)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return output, partial(pretrain_gpt.loss_func, b["loss_mask"].float(), model=model)

    start = 0
    if load:
        from megatron.training.checkpointing import load_checkpoint
        if args.use_distributed_optimizer:
            # torch's Adam (no Transformer Engine or apex here) makes its state at the first
            # step, and the distributed optimizer's state_dict reads the step from it before
            # loading: give it zero state, which the load overwrites (TE's Adam keeps the step
            # in its parameter groups instead).
            inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
            for group in (g for o in inner for g in o.param_groups):
                for p in group["params"]:
                    state_of = next(o.state for o in inner if any(
                        p is q for g in o.param_groups for q in g["params"]))
                    state_of[p] = {
                        "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
            # The same: copying the loaded tensors in, it also looks for a loaded "step"
            # tensor, which the fully_reshardable form keeps in the groups.
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO
            set_states = DO._set_main_param_and_optimizer_states

            def without_step(self, model_param, tensors):
                g, o = self.model_param_group_index_map[model_param]
                state = self.optimizer.state[self.optimizer.param_groups[g]["params"][o]]
                step = state.pop("step", None)
                set_states(self, model_param, tensors)
                if step is not None:
                    state["step"] = step
            DO._set_main_param_and_optimizer_states = without_step
        start, _ = load_checkpoint(model, optimizer, scheduler)
        assert start > 0, "nothing loaded"
        if args.use_distributed_optimizer:
            # The torch-Adam path hands every parameter's state one shared step tensor, which
            # torch's Adam then advances once per parameter: each its own, as a step kept per
            # group (TE's Adam) behaves.
            for o in getattr(optimizer, "chained_optimizers", [optimizer]):
                for state in o.optimizer.state.values():
                    state["step"] = state["step"].clone()
    if args.dataloader_type == "cyclic":
        # Megatron-LM's own loader and iterator, from the consumed samples the load restored.
        from megatron.training.datasets.data_samplers import build_pretraining_data_loader
        from megatron.training.training import cyclic_iter
        cyclic = iter(cyclic_iter(build_pretraining_data_loader(
            train_ds, args.consumed_train_samples)))
    losses = []
    for it in range(start, TOTAL):
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
            s = torch.stack([r["lm loss"] for r in reduced]).sum(0)
            dist.all_reduce(s, group=mpu.get_data_parallel_group())
            losses.append({"iteration": it + 1, "lm_loss": (s[0] / s[1]).item(),
                           "grad_norm": float(grad_norm)})
        if it + 1 == SAVE_AT and not load:
            save_checkpoint(it + 1, model, optimizer, scheduler, 0)
    if rank == world - 1:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f, indent=1)


if __name__ == "__main__":
    root = sys.argv[1]
    only = sys.argv[2:] or list(RUNS)
    port = 29700
    # One dataset for every run.
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    write_data(os.path.join(root, "data", "tokens_text_document"))
    for name in only:
        tp, pp, world, flags = RUNS[name]
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        mp.spawn(run, args=(world, tp, pp, flags, out, port), nprocs=world)
        port += 1
