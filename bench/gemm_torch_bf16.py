"""PyTorch's bf16 matmul (oneDNN; on AMX CPUs its AMX brgemm) on the three GEMMs of a linear
layer, printed like `megatron bench gemm`: bf16 tensors, and f32 tensors cast to bf16 per call
(what autocast pays, and what our kernel's packing includes)."""
import argparse, statistics, time
import torch

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=2048)
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--ffn", type=int, default=3072)
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
n, h, f = a.tokens, a.hidden, a.ffn
# (label, a shape, b shape, product, m, n, k)
cases = [("fwd   x[N,h]·W[f,h]^T", (n, h), (f, h), lambda x, w: x @ w.T, n, f, h),
         ("dgrad dy[N,f]·W[f,h]", (n, f), (f, h), lambda x, w: x @ w, n, h, f),
         ("wgrad dy[N,f]^T·x[N,h]", (n, f), (n, h), lambda x, w: x.T @ w, f, h, n)]
print(f"torch {torch.__version__} bf16 matmul, {a.threads} threads, median of {a.repeats} calls")
for label, sa, sb, fn, m_, n_, k_ in cases:
    x32, w32 = torch.randn(sa), torch.randn(sb)
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    runs = {"bf16": lambda: fn(x16, w16), "cast": lambda: fn(x32.bfloat16(), w32.bfloat16())}
    for r in runs.values():
        r()
    ts = {k: [] for k in runs}
    for _ in range(a.repeats):
        for k, r in runs.items():
            t = time.perf_counter(); r(); ts[k].append(time.perf_counter() - t)
    gf = {k: 2.0 * m_ * n_ * k_ / statistics.median(v) / 1e9 for k, v in ts.items()}
    print(f"{label:<26} {m_}x{n_}x{k_}: torch bf16 {gf['bf16']:.1f} / with f32->bf16 casts {gf['cast']:.1f} GFLOP/s")
