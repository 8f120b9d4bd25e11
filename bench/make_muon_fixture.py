"""What megatron-core's Muon (or adaptive Muon) does to a few matrices over three steps, for the
tests of `--optimizer muon` (crates/megatron-core/tests/optimizer_muon.rs) and `--optimizer
adaptive_muon` (crates/megatron-core/tests/optimizer_adaptive_muon.rs).

The reference is megatron-core's `TensorParallelMuon` itself, or `TensorParallelAdaptiveMuon`
derived from it (megatron/core/optimizer/emerging_optimizers.py of a Megatron-LM clone, commit
MEGATRON_COMMIT below), read out with `ast` and run on NVIDIA's emerging-optimizers 0.3.0 (its
`OrthogonalizedOptimizer`, `AdaptiveMuon`, `newton_schulz`, `get_muon_scale_factor`) and torch on
the CPU, with no process groups: the single-rank path, the one every tensor-parallel mode must
reproduce. emerging-optimizers declares Python >= 3.12 only
for `typing.override`, which is stubbed here for 3.11.

Each case fixes the Muon settings (coefficients, steps, precision, scale mode, Nesterov, QKV
split) and steps a QKV weight (GQA: 2 groups of 2 query heads, head size 2, hidden 8), a wide and
a tall matrix from the same start with three rounds of gradients; it writes the start, the
gradients and the parameters after each step to
crates/megatron-core/tests/fixtures/muon_reference.json, or with `adaptive_muon`
adaptive_muon_reference.json (moment2_method "adamuon", beta2 0.95, eps 1e-8: Megatron's
defaults, which its command line cannot change).

Usage, from the repository root (torch, absl-py installed; the emerging-optimizers wheel unpacked
in EO_DIR):
python bench/make_muon_fixture.py MEGATRON_LM_GIT_DIR EO_DIR [muon|adaptive_muon]
"""
import ast, json, logging, os, subprocess, sys, typing

typing.override = getattr(typing, "override", lambda f: f)
megatron, eo_dir = sys.argv[1], sys.argv[2]
KIND = sys.argv[3] if len(sys.argv) > 3 else "muon"
assert KIND in ("muon", "adaptive_muon"), KIND
sys.path.insert(0, eo_dir)
import torch
from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer, get_muon_scale_factor
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp

MEGATRON_COMMIT = subprocess.run(["git", "-C", megatron, "rev-parse", "HEAD"], capture_output=True,
                                 text=True, check=True).stdout.strip()
PATH = "megatron/core/optimizer/emerging_optimizers.py"
source = subprocess.run(["git", "-C", megatron, "show", f"{MEGATRON_COMMIT}:{PATH}"],
                        capture_output=True, text=True, check=True).stdout
classes = [n for n in ast.parse(source).body
           if isinstance(n, ast.ClassDef) and n.name in ("TensorParallelMuon", "TensorParallelAdaptiveMuon")]
namespace = dict(
    torch=torch, logging=logging, logger=logging.getLogger("muon"), Any=typing.Any,
    Callable=typing.Callable, Literal=typing.Literal, Optional=typing.Optional, ParamsT=typing.Any,
    ProcessGroupCollection=object, OrthogonalizedOptimizer=OrthogonalizedOptimizer,
    get_muon_scale_factor=get_muon_scale_factor, newton_schulz_tp=newton_schulz_tp,
    log_single_rank=lambda *a, **k: None, get_pg_size=lambda g: 1, get_pg_rank=lambda g: 0,
    is_emerging_optimizers_min_version=lambda v: False, get_emerging_optimizers_version=lambda: "0.3.0",
    _SYRK_MIN_EO_VERSION="0.4.0", AdaptiveMuon=AdaptiveMuon,
)
exec(compile(ast.Module(body=classes, type_ignores=[]), PATH, "exec"), namespace)
if KIND == "muon":
    Optimizer, extra, seed = namespace["TensorParallelMuon"], {}, 1234
else:
    Optimizer, seed = namespace["TensorParallelAdaptiveMuon"], 4321
    extra = dict(moment2_method="adamuon", beta2=0.95, eps=1e-8)

QKV_SPLIT = [4, 2, 2]  # per group: 2 query heads x head size 2, one key and one value head
SHAPES = [("qkv", [16, 8]), ("wide", [6, 10]), ("tall", [12, 5])]
CASES = [
    # megatron's defaults (--muon-momentum 0.9; bf16 products under "medium")
    dict(name="defaults", coefficient_type="quintic", num_ns_steps=5, fp32_matmul_prec="medium",
         scale_mode="spectral", extra_scale_factor=1.0, nesterov=False, momentum=0.9,
         split_qkv=True, lr=0.02, weight_decay=0.1),
    dict(name="f32_nesterov_polar_express", coefficient_type="polar_express", num_ns_steps=10,
         fp32_matmul_prec="high", scale_mode="unit_rms_norm", extra_scale_factor=0.5, nesterov=True,
         momentum=0.95, split_qkv=False, lr=0.05, weight_decay=0.0),
    dict(name="f32_aol_cycled_shape_scaling", coefficient_type="aol", num_ns_steps=6,
         fp32_matmul_prec="high", scale_mode="shape_scaling", extra_scale_factor=1.0, nesterov=False,
         momentum=0.8, split_qkv=True, lr=0.03, weight_decay=0.01),
    dict(name="f32_simple_three_steps", coefficient_type="simple", num_ns_steps=3,
         fp32_matmul_prec="high", scale_mode="spectral", extra_scale_factor=2.0, nesterov=True,
         momentum=0.9, split_qkv=True, lr=0.01, weight_decay=0.0),
]

gen = torch.Generator().manual_seed(seed)
out = {"megatron_commit": MEGATRON_COMMIT, "qkv_split_shapes": QKV_SPLIT, "cases": []}
for case in CASES:
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.3) for _, s in SHAPES]
    params[0].is_qkv = True
    start = [p.detach().clone() for p in params]
    opt = Optimizer(
        params, lr=case["lr"], momentum=case["momentum"], nesterov=case["nesterov"],
        weight_decay=case["weight_decay"], split_qkv=case["split_qkv"],
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=QKV_SPLIT,
        fp32_matmul_prec=case["fp32_matmul_prec"], coefficient_type=case["coefficient_type"],
        num_ns_steps=case["num_ns_steps"], scale_mode=case["scale_mode"],
        extra_scale_factor=case["extra_scale_factor"], pg_collection=None, tp_mode="duplicated", **extra)
    steps = []
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        steps.append({"grads": [g.flatten().tolist() for g in grads],
                      "params": [p.detach().flatten().tolist() for p in params]})
    out["cases"].append({**case, "shapes": [s for _, s in SHAPES], "start": [s.flatten().tolist() for s in start],
                         "steps": steps})

dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "megatron-core", "tests",
                    "fixtures", f"{KIND}_reference.json")
with open(dest, "w") as f:
    json.dump(out, f)
print("wrote", dest, os.path.getsize(dest), "bytes")
