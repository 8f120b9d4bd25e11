"""`megatron convert --to torch_dist` checked by Megatron-LM itself.

1. Each committed fixture (tests/fixtures/megatron, saved by Megatron-LM's code) is converted to
   megatron-rs and exported back; Megatron-LM's own `load_checkpoint`
   (megatron/training/checkpointing.py) loads the export into a model its argument parser and
   `gpt_builder` build from the fixture's flags, at one rank and at TP 2 (DCP resharding the
   TP 1 export); megatron-core's logits must equal the fixture's reference logits.
2. Models trained by megatron-rs (`megatron train` with Megatron's flags, a few steps), exported:
   Megatron-LM, given the same model flags, loads them and its logits must equal
   `megatron generate --logits-out`'s on the same ids.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/megatron_dist_export_check.py target/release/megatron
(the same Python environment as bench/make_megatron_dist_fixtures.py).
"""
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import make_megatron_dist_fixtures as fx

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "crates", "megatron-training", "tests",
                        "fixtures", "megatron")


TRAINED = {
    "gpt": ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"],
    "llama": ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48",
              "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--qk-layernorm",
              "--norm-epsilon", "1e-6", "--no-rope-fusion"],
    "moe": ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-rope-fusion",
            "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0]*1+[1]*2",
            "--moe-shared-expert-intermediate-size", "16", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.1"],
}
TRAIN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--make-vocab-size-divisible-by", "32", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "4", "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-iters", "0",
         "--init-method-std", "0.2", "--num-threads", "1"]


def check(rank, world, tp, flags, export, reference, port, results):
    fx.cpu_device_tensors()
    flags = fx.one_rank(flags) + ["--load", export]
    args, model = fx.setup(rank, world, tp, 1, flags, port)
    from megatron.training.checkpointing import load_checkpoint
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core import tensor_parallel
    iteration, _ = load_checkpoint([model], None, None)
    model.eval()
    get_cuda_rng_tracker().fork = lambda *a, **k: fx.contextlib.nullcontext()
    ref = load_file(reference)
    ids = ref["input_ids"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1).view(
        1, 1, ids.shape[1], ids.shape[1])
    with torch.no_grad():
        logits = model(ids, pos, mask)
        if tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    want = ref["logits"]
    diff = (logits[:, :want.shape[1], :want.shape[2]].float() - want).abs().max().item()
    if rank == 0:
        results.put((iteration, diff))


def main():
    binary = os.path.abspath(sys.argv[1])
    port = 29700
    failed = False
    for name, (_, _, flags, _) in fx.MODELS.items():
        fixture = os.path.join(FIXTURES, name)
        with tempfile.TemporaryDirectory() as tmp:
            ours, export = os.path.join(tmp, "ours"), os.path.join(tmp, "export")
            subprocess.run([binary, "convert", "--from", "torch_dist", "--input", fixture,
                            "--output", ours], check=True, capture_output=True)
            # Megatron-LM builds the local spec here (no Transformer Engine on CPU).
            subprocess.run([binary, "convert", "--to", "torch_dist", "--input", ours,
                            "--output", export, "--transformer-impl", "local"], check=True,
                           capture_output=True)
            for tp in (1, 2):
                q = mp.get_context("spawn").SimpleQueue()
                mp.spawn(check, args=(tp, tp, flags, export,
                                      os.path.join(fixture, "reference.safetensors"), port, q),
                         nprocs=tp)
                port += 1
                iteration, diff = q.get()
                ok = diff <= 1e-5 and iteration == 0
                failed |= not ok
                print(f"{name}: Megatron-LM load_checkpoint at TP {tp}: iteration {iteration}, "
                      f"max |logit difference| against the original's {diff:.3e} "
                      f"{'ok' if ok else 'FAILED'}", flush=True)
    for name, model in TRAINED.items():
        with tempfile.TemporaryDirectory() as tmp:
            save, export = os.path.join(tmp, "save"), os.path.join(tmp, "export")
            subprocess.run([binary, "train", *TRAIN, *model, "--save", save, "--save-interval",
                            "4"], check=True, capture_output=True)
            subprocess.run([binary, "convert", "--to", "torch_dist", "--input", save,
                            "--output", export, "--transformer-impl", "local"], check=True,
                           capture_output=True)
            # 15 ids: generate keeps a position free for the token it generates.
            ids = torch.randint(0, 100, (1, 15), generator=torch.Generator().manual_seed(3))
            logits = os.path.join(tmp, "ours.safetensors")
            subprocess.run([binary, "generate", "--load", save, "--prompt-ids",
                            " ".join(str(i) for i in ids[0].tolist()), "--max-new-tokens", "1",
                            "--greedy", "--logits-out", logits], check=True, capture_output=True)
            # [prompt positions, vocabulary rows].
            ours = next(iter(load_file(logits).values()))
            reference = os.path.join(tmp, "reference.safetensors")
            from safetensors.torch import save_file
            save_file({"input_ids": ids, "logits": ours[:, :101].unsqueeze(0).contiguous()},
                      reference)
            for tp in (1, 2):
                q = mp.get_context("spawn").SimpleQueue()
                mp.spawn(check, args=(tp, tp, model, export, reference, port, q), nprocs=tp)
                port += 1
                iteration, diff = q.get()
                # The export carries the run's optimizer state, so Megatron-LM resumes at the
                # iteration trained here.
                ok = diff <= 1e-5 and iteration == 4
                failed |= not ok
                print(f"trained here, {name}: Megatron-LM load_checkpoint at TP {tp}: iteration "
                      f"{iteration}, max |logit difference| against megatron generate's "
                      f"{diff:.3e} {'ok' if ok else 'FAILED'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
