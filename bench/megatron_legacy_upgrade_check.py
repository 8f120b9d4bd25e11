"""A legacy `--ckpt-format torch` run moved to another layout through megatron-rs, checked by
Megatron-LM itself: each `legacy_*` run of bench/make_megatron_optim_fixtures.py (stopped by
Megatron-LM at iteration 3, its losses for 4-6 logged when it went on uninterrupted) is
converted here with its optimizer state (`convert --from torch`), exported as torch_dist
(`convert --to torch_dist`), and loaded by Megatron-LM's own `load_checkpoint` into its
distributed optimizer at another TP/DP/EP layout than the one that saved it, which Megatron-LM
cannot do with a legacy checkpoint's optimizer state; it trains on to iteration 6, and its
losses must follow its own uninterrupted run's.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/megatron_legacy_upgrade_check.py \\
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

FP32, BF16 = (2e-6, 2e-6), (1e-3, 1e-2)
EP2 = ["--expert-model-parallel-size", "2"]
# name: [(tp, world, layout flags) Megatron-LM continues at], tolerances.
CASES = {
    "legacy_gpt_bf16_tp2": ([(1, 2, [])], BF16),
    "legacy_gpt_pp2": ([(2, 2, [])], FP32),
    "legacy_mixtral_adam": ([(1, 2, EP2)], FP32),
    "legacy_llama_distopt_tp2_dp2": ([(1, 1, []), (2, 2, [])], FP32),
    "legacy_llama_bf16_distopt_dp2": ([(2, 2, [])], BF16),
    # (Megatron-LM wants sequence parallelism beside TP for MoE layers, which its local
    # spec's norms do not support: DP 2 with the experts in the one optimizer instead.)
    "legacy_mixtral_distopt_ep2": ([(1, 1, []), (1, 2, [])], FP32),
}
SAVED_LAYOUT = {"--ckpt-format": 1, "--expert-model-parallel-size": 1,
                "--use-distributed-optimizer": 0}


def model_flags(name):
    """The run's flags without its checkpoint format, optimizer sharding and expert layout."""
    flags, out, i = opt.RUNS[name][3], [], 0
    while i < len(flags):
        if flags[i] in SAVED_LAYOUT:
            i += 1 + SAVED_LAYOUT[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def main(binary, fixtures):
    fixtures = os.path.abspath(fixtures)
    failures, port = 0, 29900
    for name, (layouts, tol) in CASES.items():
        if len(sys.argv) > 3 and name not in sys.argv[3:]:
            continue
        want = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                for r in json.load(open(os.path.join(fixtures, name, "losses.json")))
                if r["iteration"] > opt.SAVE_AT}
        with tempfile.TemporaryDirectory() as tmp:
            os.symlink(os.path.join(fixtures, "data"), os.path.join(tmp, "data"))
            ours = os.path.join(tmp, "ours")
            subprocess.run([binary, "convert", "--from", "torch", "--input",
                            os.path.join(fixtures, name), "--output", ours], check=True)
            for tp, world, layout in layouts:
                ep = (layout[layout.index(EP2[0]) + 1] if EP2[0] in layout else "1")
                export = os.path.join(tmp, f"export_ep{ep}")
                if not os.path.exists(export):
                    subprocess.run([binary, "convert", "--to", "torch_dist", "--input", ours,
                                    "--output", export, "--expert-model-parallel-size", ep],
                                   check=True)
                out = os.path.join(tmp, f"mlm_tp{tp}_w{world}")
                os.makedirs(out)
                flags = model_flags(name) + layout + ["--use-distributed-optimizer"]
                mp.spawn(opt.run, args=(world, tp, 1, flags, out, port, export), nprocs=world)
                port += 1
                got = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                       for r in json.load(open(os.path.join(out, "losses.json")))}
                worst = [max(abs(got[i][k] - want[i][k]) / want[i][k] for i in want)
                         for k in (0, 1)]
                ok = sorted(got) == sorted(want) and all(w <= t for w, t in zip(worst, tol))
                failures += not ok
                tp_saved, pp_saved, world_saved = opt.RUNS[name][:3]
                print(f"{name} (saved at TP {tp_saved} x PP {pp_saved}, {world_saved} ranks) -> "
                      f"Megatron-LM at TP {tp}, {world} ranks {' '.join(layout)}: largest "
                      f"relative difference from its uninterrupted run: losses {worst[0]:.2e}, "
                      f"gradient norms {worst[1]:.2e} (tolerances {tol[0]:g}, {tol[1]:g}): "
                      f"{'ok' if ok else 'FAILED'}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # further arguments: only those cases
