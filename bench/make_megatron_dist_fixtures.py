"""Writes the torch_dist checkpoints of tests/fixtures/megatron: what Megatron-LM's own
`save_checkpoint` writes with `--ckpt-format torch_dist` (its `generate_state_dict`: args,
checkpoint_version, iteration, the model's sharded state dict, saved by
`dist_checkpointing.save` with `TorchDistSaveShardedStrategy`), for tiny GPT and Llama-style
models built by Megatron-LM's argument parser and `gpt_builder`, on CPU ranks over gloo, at
one rank and at TP 2 x PP 2. The reference logits come from megatron-core itself: the
checkpoint loaded back at TP 1 x PP 1 with `dist_checkpointing.load` and run forward.

Run (nothing here runs in CI; the outputs are committed):
  PYTHONPATH=<a Megatron-LM checkout, HEAD d98e8a6> python bench/make_megatron_dist_fixtures.py OUT
with torch (2.15.0, CPU), typing_extensions and Megatron-LM's requirements. On Python 3.11,
Megatron-LM's `from typing import override` needs typing_extensions' instead.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COMMON = [
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "10", "--lr", "1e-4",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    "--make-vocab-size-divisible-by", "32", "--ckpt-format", "torch_dist",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--init-method-std", "0.2", "--seed", "5", "--no-persist-layer-norm",
]
# DeepSeek's multi-latent attention at toy size: query latent 16, key/value latent 12 with
# their RMSNorms, heads of 8 + 4 rotary features, values of 6, YaRN from rope_type.
MLA_YARN = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
    "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48",
    "--position-embedding-type", "rope", "--rope-type", "yarn",
    "--rotary-scaling-factor", "4", "--mscale", "0.7", "--mscale-all-dim", "0.5",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-rope-fusion",
]
MODELS = {
    # Megatron's GPT: LayerNorm, GELU, learned positions, biases, tied output layer.
    "gpt": (1, 1, ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"], 1),
    # Llama-style at TP 2 x PP 2: RMSNorm, SwiGLU, RoPE, 4 heads in 2 groups, no biases,
    # query/key norms, untied output layer.
    "llama_tp2_pp2": (2, 2, [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--rotary-base", "10000", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--qk-layernorm", "--norm-epsilon", "1e-6", "--no-rope-fusion",
    ], 4),
    # Megatron's GPT trained in bf16 (the parameters saved are bf16) at TP 2 x DP 2.
    "gpt_bf16_tp2_dp2": (2, 1, ["--num-layers", "2", "--hidden-size", "32",
                                "--num-attention-heads", "4", "--bf16",
                                "--global-batch-size", "2"], 4),
    # Mixtral-style experts (4, top 2, SwiGLU) at expert-parallel 2.
    "mixtral_ep2": (1, 1, [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
        "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
        "--expert-model-parallel-size", "2", "--global-batch-size", "2",
    ], 2),
    # DeepSeek-style MoE at PP 2: a dense first layer, a shared expert, a sigmoid router with
    # its expert bias and top-k scaling.
    "deepseek_moe_pp2": (1, 2, [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-rope-fusion",
        "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
    ], 2),
    # DeepSeek's multi-latent attention at TP 2 (the local spec's down projections are
    # column-parallel there): query and key/value latents with their RMSNorms, YaRN.
    "mla_yarn_tp2": (2, 1, MLA_YARN, 2),
    # MLA without a query latent or latent norms, plain RoPE, at PP 2.
    "mla_rope_pp2": (1, 2, [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
        "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--normalization", "RMSNorm",
        "--swiglu", "--position-embedding-type", "rope", "--rope-type", "rope",
        "--rotary-base", "500", "--disable-bias-linear", "--no-rope-fusion",
        "--untie-embeddings-and-output-weights",
    ], 2),
}


def cpu_device_tensors():
    """CPU ranks: Megatron-LM's checkpointing makes a few small control tensors on the CUDA
    device (the tracker's iteration, all-reduced) and reads the CUDA RNG state even with
    --no-save-rng; both stay on the CPU here."""
    make = torch.tensor
    torch.tensor = lambda *a, **k: make(*a, **{**k, "device": "cpu"} if str(
        k.get("device", "")).startswith("cuda") else k)
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)


class MLACoreAttention(torch.nn.Module):
    """Causal attention for the local spec's MLA: megatron-core's local DotProductAttention takes
    no `k_channels`/`v_channels` at HEAD (its MLA layers do not build), and Transformer Engine's,
    which MLA runs on, is not on CPU. The same computation: per head softmax(scale q kᵀ) v with
    MLA's softmax scale, in fp32, [s, b, heads x v] out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        q, k, v = (x.permute(1, 2, 0, 3).float() for x in (query, key, value))
        s = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1),
                                    float("-inf"))
        out = scores.softmax(-1) @ v
        return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1).to(query.dtype)


def setup(rank, world, tp, pp, flags, port):
    # CPU ranks: the writer's preload waits for CUDA copies (there are none), and its small
    # control tensors (the failure flags all-reduced after the write) go to the current device.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    sys.argv = ["pretrain_gpt.py"] + COMMON + flags + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.core import parallel_state as mpu
    import megatron.training.arguments as arguments
    # validate_args asks the GPU's architecture under TP (Hopper's rules: CUDA_DEVICE_MAX_CONNECTIONS=1).
    arguments.get_device_arch_version = lambda: 9
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    args = parse_args()
    validate_args(args)
    set_global_variables(args)
    vp = args.virtual_pipeline_model_parallel_size
    mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    torch.manual_seed(args.seed)
    if args.multi_latent_attention:
        from megatron.core.models.backends import LocalSpecProvider
        LocalSpecProvider.core_attention = lambda self: MLACoreAttention
    if args.mtp_num_layers:
        # Its check for Transformer Engine's inference linears asks isinstance of None
        # without Transformer Engine: none here.
        import megatron.core.transformer.multi_token_prediction as mtp
        mtp.is_inference_column_parallel_linear = lambda module: False
    from gpt_builders import gpt_builder
    if vp is None:
        return args, gpt_builder(args, mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage())
    # Interleaved stages: one model chunk per virtual stage.
    return args, [gpt_builder(args, mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                              mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                              vp_stage=i) for i in range(vp)]


def save(rank, world, tp, pp, flags, out, port):
    args, model = setup(rank, world, tp, pp, flags, port)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.training.checkpointing import get_checkpoint_name
    iteration = 10
    # A trained router's expert bias is not zero: give it values, the same on every rank.
    for buf_name, buf in model.named_buffers():
        if buf_name.endswith("expert_bias"):
            buf.copy_(torch.linspace(-0.5, 0.5, buf.numel()).view_as(buf))
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                  "model": model.sharded_state_dict(),
                  "num_floating_point_operations_so_far": 0}
    name = get_checkpoint_name(out, iteration, release=False, return_base_dir=True)
    if rank == 0:
        os.makedirs(name, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state_dict, name, TorchDistSaveShardedStrategy())
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def one_rank(flags):
    """The flags of the same model in fp32 at one rank (a bf16 checkpoint's values load widened,
    exactly): no --bf16, no expert or virtual pipeline parallelism."""
    layout = ("--expert-model-parallel-size", "--num-layers-per-virtual-pipeline-stage")
    return [f for i, f in enumerate(flags)
            if f != "--bf16" and f not in layout and (i == 0 or flags[i - 1] not in layout)]


def reference(out, flags, port):
    args, model = setup(0, 1, 1, 1, one_rank(flags), port)
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file
    sd = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                 os.path.join(out, "iter_0000010"))
    model.load_state_dict(sd["model"])
    model.eval()
    # Attention forks the CUDA RNG tracker for dropout, which eval mode does not draw from.
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1).view(1, 1, 16, 16)
    with torch.no_grad():
        logits = model(ids, pos, mask)
    # [b, s, padded vocab]; the reference keeps the tokenizer's 101 ids.
    save_file({"input_ids": ids.contiguous(), "logits": logits[:, :, :101].float().contiguous()},
              os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    root = sys.argv[1]
    port = 29600
    only = sys.argv[2:] or list(MODELS)
    for name in only:
        tp, pp, flags, world = MODELS[name]
        out = os.path.join(root, name)
        mp.spawn(save, args=(world, tp, pp, flags, out, port), nprocs=world)
        port += 1
        p = mp.Process(target=reference, args=(out, flags, port))
        p.start(); p.join()
        assert p.exitcode == 0
        port += 1
