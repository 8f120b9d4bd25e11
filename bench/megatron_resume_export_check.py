"""`megatron convert --to torch_dist` with the optimizer state, checked by Megatron-LM itself:
a run trained here to iteration 3 (`megatron train --save`) is exported, and Megatron-LM's
own `load_checkpoint` loads it into its distributed optimizer (at one rank, and at TP 2 /
DP 2 on CPU ranks) and trains on to iteration 6 with the run's flags, through the same code as
bench/make_megatron_optim_fixtures.py; its losses must follow the ones `megatron train` logs
when it goes on from its own checkpoint.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/megatron_resume_export_check.py \\
      target/release/megatron crates/megatron-training/tests/fixtures/megatron_resume
(the environment of bench/make_megatron_optim_fixtures.py).
"""
import json
import os
import subprocess
import sys
import tempfile

import torch.multiprocessing as mp

import make_megatron_optim_fixtures as opt

# name: (model flags, precision flags, [(tp, world), ...] Megatron-LM continues at, relative
# tolerances of the losses and of the gradient norms). bf16: Megatron-LM's own runs at TP 1 and
# TP 2 differ by as much (PyTorch's bf16 CPU GEMMs round per product tile, ours per panel).
EP2 = ["--expert-model-parallel-size", "2"]
CASES = {
    "gpt_fp32": (opt.GPT, [], [(1, 1, []), (2, 2, []), (1, 2, [])], (2e-6, 2e-6)),
    "llama_bf16": (opt.LLAMA, ["--bf16"], [(1, 1, []), (2, 4, [])], (1e-3, 1e-2)),
    # fp16: the dynamic loss scaler's scale and trackers go too.
    "gpt_fp16": (opt.GPT, ["--fp16", "--initial-loss-scale", "128"], [(1, 1, []), (2, 2, [])],
                 (1e-4, 1e-3)),
    # Experts: Megatron-LM's second, chained optimizer for them, at EP 1 and EP 2.
    "mixtral_fp32": (opt.LLAMA + opt.MOE, [], [(1, 1, []), (1, 2, EP2)], (2e-6, 2e-6)),
    # gpt-oss: sinks, clamped Quick-GEGLU, windows, YaRN, router and expert biases.
    "gpt_oss_fp32": (opt.GPT_OSS, [], [(1, 1, []), (1, 2, EP2)], (2e-6, 2e-6)),
}
OURS = [
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--make-vocab-size-divisible-by",
    "32", "--seq-length", "16", "--max-position-embeddings", "16", "--init-method-std", "0.2",
    "--seed", "5", "--num-threads", "1", "--no-progress-bar", "--log-interval", "1",
]


def ours(binary, flags, out, extra):
    cmd = [binary, "train"] + flags + extra + ["--metrics-file", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, open(out))
            if "lm_loss" in r}


def main(binary, fixtures):
    data = os.path.join(os.path.abspath(fixtures), "data", "tokens_text_document")
    failures = 0
    port = 29800
    for name, (model, precision, layouts, tol) in CASES.items():
        if len(sys.argv) > 3 and name not in sys.argv[3:]:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            base = (OURS + opt.DATA + model + precision
                    + ["--data-path", data, "--data-cache-path", os.path.join(tmp, "cache")])
            save = os.path.join(tmp, "save")
            # opt.run reads the dataset beside its output directories.
            os.symlink(os.path.dirname(data), os.path.join(tmp, "data"))
            # Ours: 3 iterations, saved; then on to 6 from that checkpoint.
            ours(binary, base, os.path.join(tmp, "first.jsonl"),
                 ["--save", save, "--save-interval", str(opt.SAVE_AT),
                  "--exit-interval", str(opt.SAVE_AT)])
            want = ours(binary, base, os.path.join(tmp, "ours.jsonl"), ["--load", save])
            for tp, world, layout in layouts:
                # The export for the expert-parallel size Megatron-LM loads at.
                export = os.path.join(tmp, f"export_tp{tp}_w{world}")
                ep = layout[layout.index("--expert-model-parallel-size") + 1] if layout else "1"
                subprocess.run([binary, "convert", "--from", "megatron", "--to", "torch_dist",
                                "--input", save, "--output", export,
                                "--expert-model-parallel-size", ep,
                                # Megatron-LM builds the local spec here.
                                "--transformer-impl", "local"], check=True)
                out = os.path.join(tmp, f"mlm_tp{tp}_w{world}")
                os.makedirs(out)
                flags = model + precision + layout + ["--use-distributed-optimizer"]
                # The fixture script's flags, with Megatron-LM's own seed (the same as ours).
                mp.spawn(opt.run, args=(world, tp, 1, flags, out, port, export), nprocs=world)
                port += 1
                got = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                       for r in json.load(open(os.path.join(out, "losses.json")))}
                worst = [max(abs(got[i][k] - want[i][k]) / want[i][k] for i in want)
                         for k in (0, 1)]
                ok = sorted(got) == sorted(want) and all(w <= t for w, t in zip(worst, tol))
                failures += not ok
                print(f"{name} Megatron-LM at TP {tp}, {world} ranks {' '.join(layout)}: iterations "
                      f"{sorted(got)}, largest relative difference of the losses "
                      f"{worst[0]:.2e}, of the gradient norms {worst[1]:.2e} (tolerances "
                      f"{tol[0]:g}, {tol[1]:g}): {'ok' if ok else 'FAILED'}", flush=True)
                for i in sorted(want):
                    print(f"  {i}: ours {want[i][0]:.7f} / {want[i][1]:.6f}  Megatron-LM "
                          f"{got[i][0]:.7f} / {got[i][1]:.6f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # further arguments: only those cases
