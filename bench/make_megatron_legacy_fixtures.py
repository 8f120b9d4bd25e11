"""Writes tests/fixtures/megatron's legacy checkpoints: what Megatron-LM's own `save_checkpoint`
writes with `--ckpt-format torch` (one model_optim_rng.pt per model-parallel rank), for models
built by its argument parser and `gpt_builder` on CPU ranks over gloo. The same in-memory
models are saved again with `dist_checkpointing.save` (torch_dist), from which the reference
logits come, megatron-core loading them at TP 1 x PP 1 (a legacy checkpoint loads only in the
layout that saved it). Only the legacy checkpoint and the logits are committed.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/make_megatron_legacy_fixtures.py OUT
"""
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import make_megatron_dist_fixtures as fx

MODELS = {
    # Llama-style at TP 2 x PP 2 with two interleaved chunks per stage.
    "legacy_llama_tp2_pp2_vp2": (2, 2, [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--qk-layernorm",
        "--norm-epsilon", "1e-6", "--no-rope-fusion", "--num-layers-per-virtual-pipeline-stage",
        "1",
    ], 4),
    # Mixtral-style experts at TP 2 x EP 2 (the experts split over TP too).
    "legacy_mixtral_tp2_ep2": (2, 1, [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
        "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--num-experts", "4",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
        "--expert-model-parallel-size", "2", "--global-batch-size", "2",
    ], 4),
    # Multi-latent attention (YaRN, latent norms) with one MTP depth at TP 2: the local spec
    # splits the down projections over the TP ranks' files.
    "legacy_mla_mtp_tp2": (2, 1, fx.MLA_YARN + ["--mtp-num-layers", "1"], 2),
}


def save(rank, world, tp, pp, flags, out, port):
    fx.cpu_device_tensors()
    legacy = os.path.join(out, "legacy")
    args, models = fx.setup(rank, world, tp, pp, flags + [
        "--ckpt-format", "torch", "--save", legacy, "--save-interval", "10",
        "--no-save-optim", "--no-save-rng"], port)
    models = models if isinstance(models, list) else [models]
    from megatron.training.checkpointing import save_checkpoint
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    save_checkpoint(10, models, None, None, 0)
    # The same weights as torch_dist, for the reference.
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 10}
    for i, m in enumerate(models):
        state["model" if len(models) == 1 else f"model{i}"] = m.sharded_state_dict()
    name = os.path.join(out, "dist", "iter_0000010")
    if rank == 0:
        os.makedirs(name, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, name, TorchDistSaveShardedStrategy())
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "dist", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("10")


if __name__ == "__main__":
    root = sys.argv[1]
    port = 29800
    for name in sys.argv[2:] or list(MODELS):
        tp, pp, flags, world = MODELS[name]
        out = os.path.join(root, name)
        mp.spawn(save, args=(world, tp, pp, flags, out, port), nprocs=world)
        port += 1
        p = mp.Process(target=fx.reference, args=(os.path.join(out, "dist"), flags, port))
        p.start(); p.join()
        assert p.exitcode == 0
        port += 1
        # Committed: the legacy checkpoint and the logits.
        shutil.move(os.path.join(out, "dist", "reference.safetensors"),
                    os.path.join(out, "legacy", "reference.safetensors"))
        shutil.rmtree(os.path.join(out, "dist"))
