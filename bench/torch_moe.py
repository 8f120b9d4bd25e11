"""PyTorch side of the MoE layer benchmark: transformers' MixtralSparseMoeBlock (router, top-k,
per-expert SwiGLU MLPs) and a LlamaMLP with the same active parameters, forward + backward of
[tokens, hidden] in fp32 on --threads threads; prints the median ms of each.
Usage: .venv-ref/bin/python bench/torch_moe.py TOKENS HIDDEN EXPERTS TOPK MOE_FFN THREADS REPEATS
"""
import os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import LlamaConfig, MixtralConfig
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

n, h, e, k, f, threads, repeats = map(int, sys.argv[1:8])
torch.set_num_threads(threads)
torch.manual_seed(0)
moe = MixtralSparseMoeBlock(MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e,
                                          num_experts_per_tok=k))
mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=k * f, mlp_bias=False))
for m in (moe, mlp):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
x = torch.randn(1, n, h)


def step(m):
    xi = x.clone().requires_grad_(True)
    t = time.perf_counter()
    y = m(xi)
    y.backward(y.detach())
    return time.perf_counter() - t


for m in (mlp, moe):
    step(m)
td, tm = [], []
for _ in range(repeats):
    td.append(step(mlp))
    tm.append(step(moe))
med = lambda v: sorted(v)[len(v) // 2] * 1e3
print(f"torch dense MLP ms {med(td):.1f}")
print(f"torch MoE block ms {med(tm):.1f}")
