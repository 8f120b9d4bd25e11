"""A run saved in a form Megatron-LM cannot reshard, moved to another layout through
megatron-rs, checked by Megatron-LM itself: each `legacy_*` run of
bench/make_megatron_optim_fixtures.py (`--ckpt-format torch`), each `dpzero_*` run (the
distributed optimizer's `dp_zero_gather_scatter` torch_dist form) and each `v012_*` run of
bench/make_megatron_v012_optim_fixtures.py (megatron-core 0.12's `fully_sharded_model_space`),
stopped at iteration 3 with its losses for 4-6 logged when it went on uninterrupted, is
converted here with its optimizer state (`convert --from torch` / `--from torch_dist`),
exported as torch_dist (`convert --to torch_dist`), and loaded by Megatron-LM's own
`load_checkpoint` into its distributed optimizer at another TP/DP/EP layout than the one that
saved it; it trains on to iteration 6, and its losses must follow its own uninterrupted run's.
Megatron-LM itself refuses to change the layout of a legacy checkpoint's or a
dp_zero_gather_scatter checkpoint's optimizer state.

  PYTHONPATH=<Megatron-LM checkout>:bench python bench/megatron_upgrade_check.py \\
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
import make_megatron_v012_optim_fixtures as v012

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
    "dpzero_llama_tp2_dp2": ([(1, 2, [])], FP32),
    "dpzero_gpt_bf16_pp2_dp2": ([(2, 2, [])], BF16),
    "dpzero_mixtral_ep2": ([(1, 1, [])], FP32),
    "v012_llama_distopt_tp2_dp2": ([(1, 1, [])], FP32),
    "v012_gpt_distopt_pp2_dp2": ([(2, 2, [])], FP32),
    "v012_gpt_bf16_distopt_dp2": ([(2, 2, [])], BF16),
    # Multi-latent attention (saved at DP 2), exported with its state, continued at one rank
    # (not at TP 2: there the local spec's MLA logs other gradient norms than at TP 1).
    "mla_distopt_dp2": ([(1, 1, [])], FP32),
    # One multi-token-prediction depth, continued by Megatron-LM at one rank and at TP 2.
    "llama_mtp": ([(1, 1, []), (2, 2, [])], FP32),
    # DeepSeek-V3's shape (MLA, MoE with a shared expert and a sigmoid router's expert bias,
    # an MTP depth): at one rank and at EP 2 (its chained expert optimizer).
    "deepseek_mla_moe_mtp": ([(1, 1, []), (1, 2, EP2)], FP32),
}
# Runs of Megatron-LM's non-distributed optimizer, exported in its form
# (`--non-distributed-optimizer`) and continued by it at another layout.
NON_DISTRIBUTED = {
    "gpt_adam": ([(2, 2, [])], FP32),
    "gpt_bf16_adam": ([(2, 2, [])], BF16),
    "gpt_fp16_small": ([(2, 2, [])], (1e-4, 1e-3)),
    "mixtral_adam": ([(1, 1, []), (1, 2, EP2)], FP32),
}
RUNS = {**opt.RUNS, **v012.RUNS}
SAVED_LAYOUT = {"--ckpt-format": 1, "--expert-model-parallel-size": 1,
                "--use-distributed-optimizer": 0}


def model_flags(name):
    """The run's flags without its checkpoint format, optimizer sharding and expert layout."""
    flags, out, i = RUNS[name][3], [], 0
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
    cases = [(name, layouts, tol, False) for name, (layouts, tol) in CASES.items()]
    cases += [(name, layouts, tol, True) for name, (layouts, tol) in NON_DISTRIBUTED.items()]
    for name, layouts, tol, non_distributed in cases:
        label = name + (" (non-distributed optimizer)" if non_distributed else "")
        if len(sys.argv) > 3 and name not in sys.argv[3:] and label not in sys.argv[3:]:
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
            for tp, world, layout in layouts:
                ep = (layout[layout.index(EP2[0]) + 1] if EP2[0] in layout else "1")
                export = os.path.join(tmp, f"export_ep{ep}")
                if not os.path.exists(export):
                    subprocess.run([binary, "convert", "--to", "torch_dist", "--input", ours,
                                    "--output", export, "--expert-model-parallel-size", ep,
                                    # The fixtures' Megatron-LM runs build the local spec.
                                    "--transformer-impl", "local"]
                                   + (["--non-distributed-optimizer"] if non_distributed else []),
                                   check=True)
                out = os.path.join(tmp, f"mlm_tp{tp}_w{world}")
                os.makedirs(out)
                flags = model_flags(name) + layout
                flags += [] if non_distributed else ["--use-distributed-optimizer"]
                mp.spawn(opt.run, args=(world, tp, 1, flags, out, port, export), nprocs=world)
                port += 1
                got = {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                       for r in json.load(open(os.path.join(out, "losses.json")))}
                worst = [max(abs(got[i][k] - want[i][k]) / want[i][k] for i in want)
                         for k in (0, 1)]
                ok = sorted(got) == sorted(want) and all(w <= t for w, t in zip(worst, tol))
                failures += not ok
                tp_saved, pp_saved, world_saved = RUNS[name][:3]
                print(f"{label} (saved at TP {tp_saved} x PP {pp_saved}, {world_saved} ranks) -> "
                      f"Megatron-LM at TP {tp}, {world} ranks {' '.join(layout)}: largest "
                      f"relative difference from its uninterrupted run: losses {worst[0]:.2e}, "
                      f"gradient norms {worst[1]:.2e} (tolerances {tol[0]:g}, {tol[1]:g}): "
                      f"{'ok' if ok else 'FAILED'}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # further arguments: only those cases
