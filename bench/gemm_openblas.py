"""OpenBLAS (numpy's bundled build) on the three GEMMs of a linear layer, printed like
`megatron bench gemm`. Run with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset to let OpenBLAS pick
its AVX-512 kernel; the kernel it chose is printed (threadpoolctl)."""
import argparse, time
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--ffn", type=int, default=3072)
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
n, h, f = a.tokens, a.hidden, a.ffn
cases = [("fwd   x[N,h]·W[f,h]^T", (n, h), (f, h), lambda x, w: x @ w.T),
         ("dgrad dy[N,f]·W[f,h]", (n, f), (f, h), lambda x, w: x @ w),
         ("wgrad dy[N,f]^T·x[N,h]", (n, f), (n, h), lambda x, w: x.T @ w)]
with threadpool_limits(limits=a.threads):
    info = [i for i in threadpool_info() if i.get("internal_api") == "openblas"]
    print(f"numpy {np.__version__} OpenBLAS {info[0].get('version')} kernel {info[0].get('architecture')}, {a.threads} threads, median of {a.repeats} calls")
    for label, sa, sb, fn in cases:
        x = np.full(sa, 0.5, dtype=np.float32); w = np.full(sb, 0.25, dtype=np.float32)
        fn(x, w)
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter(); fn(x, w); ts.append(time.perf_counter() - t)
        ts.sort()
        m_, n_ = (n, f) if label.startswith("fwd") else ((n, h) if label.startswith("dgrad") else (f, h))
        k_ = h if label.startswith("fwd") else (f if label.startswith("dgrad") else n)
        print(f"{label:<26} {m_}x{n_}x{k_}: {2*m_*n_*k_/ts[len(ts)//2]/1e9:.1f} GFLOP/s")
