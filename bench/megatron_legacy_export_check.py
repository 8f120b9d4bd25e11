"""`convert --to torch` checked by Megatron-LM itself: runs of bench/make_megatron_optim_fixtures.py
(saved in torch_dist or the legacy format, stopped at iteration 3, with the losses of iterations
4-6 logged when they went on uninterrupted) are converted here with their optimizer state,
exported as legacy `--ckpt-format torch` checkpoints at another layout than the one that saved
them (`convert --to torch --tensor-model-parallel-size ... --pipeline-model-parallel-size ...
--expert-model-parallel-size ...`), and loaded by Megatron-LM's own `load_checkpoint` at that
layout, into its non-distributed optimizer (`--no-load-rng`: no torch RNG state is exported).
Each trains on to iteration 6; its losses and gradient norms must follow its own uninterrupted
run's. Megatron-LM itself loads a legacy checkpoint only at the layout that saved it.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/megatron_legacy_export_check.py \\
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
import megatron_upgrade_check as up

FP32, BF16, FP16 = (2e-6, 2e-6), (1e-3, 1e-2), (1e-4, 1e-3)
# name: [(tp, pp, ep, world)] Megatron-LM continues at, tolerances.
CASES = {
    "gpt_adam": ([(2, 1, 1, 2), (1, 2, 1, 2)], FP32),
    "gpt_bf16_adam": ([(2, 1, 1, 2)], BF16),
    "gpt_fp16_small": ([(2, 1, 1, 2)], FP16),
    # A legacy checkpoint moved to another layout (TP 1 x PP 2 -> TP 2).
    "legacy_gpt_pp2": ([(2, 1, 1, 2)], FP32),
    # The distributed optimizer's buckets, read here, handed on as the non-distributed state.
    "legacy_llama_distopt_tp2_dp2": ([(1, 2, 1, 2), (2, 1, 1, 2)], FP32),
    # Experts: in the one optimizer at EP 1, chained at EP 2 (each expert rank's own file).
    "mixtral_adam": ([(1, 1, 2, 2)], FP32),
    "legacy_mixtral_distopt_ep2": ([(1, 1, 1, 1)], FP32),
    # Multi-token prediction at TP 2 (its depth on the last stage).
    "llama_mtp": ([(2, 1, 1, 2)], FP32),
    # DeepSeek-V3's shape at EP 2 (MLA at TP 1: see megatron_upgrade_check.py).
    "deepseek_mla_moe_mtp": ([(1, 1, 2, 2)], FP32),
    # gpt-oss saved at EP 2 by the distributed optimizer, to one rank and to EP 2.
    "gpt_oss_distopt_ep2": ([(1, 1, 1, 1), (1, 1, 2, 2)], FP32),
}


def main(binary, fixtures):
    fixtures = os.path.abspath(fixtures)
    failures, port = 0, 29950
    for name, (layouts, tol) in CASES.items():
        if len(sys.argv) > 3 and name not in sys.argv[3:]:
            continue
        want = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                for r in json.load(open(os.path.join(fixtures, name, "losses.json")))
                if r["iteration"] > opt.SAVE_AT}
        with tempfile.TemporaryDirectory() as tmp:
            os.symlink(os.path.join(fixtures, "data"), os.path.join(tmp, "data"))
            ours = os.path.join(tmp, "ours")
            fmt = "torch" if name.startswith("legacy_") else "torch_dist"
            subprocess.run([binary, "convert", "--from", fmt, "--input",
                            os.path.join(fixtures, name), "--output", ours], check=True)
            for tp, pp, ep, world in layouts:
                export = os.path.join(tmp, f"export_tp{tp}_pp{pp}_ep{ep}")
                subprocess.run([binary, "convert", "--to", "torch", "--input", ours,
                                "--output", export, "--transformer-impl", "local",
                                "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp),
                                "--expert-model-parallel-size", str(ep)], check=True)
                out = os.path.join(tmp, f"mlm_tp{tp}_pp{pp}_ep{ep}")
                os.makedirs(out)
                flags = up.model_flags(name) + [
                    "--ckpt-format", "torch", "--no-load-rng",
                    "--expert-model-parallel-size", str(ep)]
                mp.spawn(opt.run, args=(world, tp, pp, flags, out, port, export), nprocs=world)
                port += 1
                got = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                       for r in json.load(open(os.path.join(out, "losses.json")))}
                worst = [max(abs(got[i][k] - want[i][k]) / want[i][k] for i in want)
                         for k in (0, 1)]
                ok = sorted(got) == sorted(want) and all(w <= t for w, t in zip(worst, tol))
                failures += not ok
                tp_saved, pp_saved, world_saved = up.RUNS[name][:3]
                print(f"{name} (saved at TP {tp_saved} x PP {pp_saved}, {world_saved} ranks) -> "
                      f"legacy export, Megatron-LM at TP {tp} x PP {pp} x EP {ep}, {world} ranks: "
                      f"largest relative difference from its uninterrupted run: losses "
                      f"{worst[0]:.2e}, gradient norms {worst[1]:.2e} (tolerances {tol[0]:g}, "
                      f"{tol[1]:g}): {'ok' if ok else 'FAILED'}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # further arguments: only those cases
